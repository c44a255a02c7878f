"""The roofline cost model: behaves like a GPU (monotone, bandwidth- or compute-bound where it
should be, TP and DP attention priced as SGLang runs them) and the registry holds its rules."""

from __future__ import annotations

import pytest

from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.cost import (
    CostModel,
    Parallelism,
    RooflineCostModel,
    cost_model_names,
    kv_capacity_tokens,
    make_cost_model,
    register_cost_model,
)
from pdsim.specs import load_hardware_spec, model_preset
from pdsim.specs.precision import Precision

H100 = load_hardware_spec("h100")
LLAMA_8B = model_preset("llama-3.1-8b")
NO_OVERHEADS = dict(step_overhead_s=0.0, extend_overhead_s=0.0, layer_overhead_s=0.0)


def roofline(model=LLAMA_8B, hardware=H100, tp=1, dp_attention=1, ep=1, **params):
    parallel = Parallelism(tp=tp, dp_attention=dp_attention, ep=ep)
    return make_cost_model("roofline", model, hardware, parallel, **params)


def prefill(tokens: int, cached: int = 0) -> BatchShape:
    return BatchShape(prefill_tokens=tokens, prefill_attn_pairs=extend_attn_pairs(tokens, cached))


def decode(reqs: int, context_each: int) -> BatchShape:
    return BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * context_each)


# ----- registry --------------------------------------------------------------------------------


def test_roofline_is_registered_and_satisfies_the_protocol() -> None:
    assert "roofline" in cost_model_names()
    cost = roofline()
    assert isinstance(cost, RooflineCostModel) and isinstance(cost, CostModel)


def test_registering_a_name_twice_raises() -> None:
    with pytest.raises(ValueError, match="'roofline' is already registered"):
        register_cost_model("roofline")(RooflineCostModel)


def test_unknown_cost_model_lists_registered() -> None:
    with pytest.raises(ValueError, match="'vidur'.*roofline"):
        make_cost_model("vidur", LLAMA_8B, H100, Parallelism())


def test_unknown_param_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="mfu.*allowed params:.*gemm_mfu"):
        roofline(mfu=0.5)
    with pytest.raises(ValueError, match="gemm_mfu"):
        roofline(gemm_mfu=1.5)


def test_parallelism_sizes_must_divide_tp() -> None:
    with pytest.raises(ValueError, match="dp_attention=3 must divide tp=4"):
        Parallelism(tp=4, dp_attention=3)
    with pytest.raises(ValueError, match="ep=3"):
        Parallelism(tp=4, ep=3)
    assert Parallelism(tp=8, dp_attention=4).attn_tp == 2
    with pytest.raises(ValueError, match="MoE"):
        roofline(tp=2, ep=2)  # Llama is dense


# ----- shape of the curve ----------------------------------------------------------------------


def test_empty_steps_cost_nothing() -> None:
    cost = roofline(tp=8, dp_attention=8)
    assert cost.step_time_s([]) == 0.0
    assert cost.step_time_s([BatchShape()] * 8) == 0.0


def test_cost_grows_with_tokens_and_context() -> None:
    cost = roofline()
    times = [cost.step_time_s([prefill(n)]) for n in (1, 16, 256, 1024, 4096, 16384)]
    assert times == sorted(times) and len(set(times)) == len(times)
    times = [cost.step_time_s([prefill(1024, cached=c)]) for c in (0, 1024, 8192, 65536)]
    assert times == sorted(times) and len(set(times)) == len(times)
    times = [cost.step_time_s([decode(b, 2048)]) for b in (1, 8, 64, 256, 1024)]
    assert times == sorted(times) and len(set(times)) == len(times)
    times = [cost.step_time_s([decode(64, c)]) for c in (128, 1024, 8192, 65536)]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_moe_cost_grows_with_tokens() -> None:
    cost = roofline(model_preset("deepseek-v3"), load_hardware_spec("h200"), tp=8, ep=8)
    times = [cost.step_time_s([decode(b, 1024)]) for b in (1, 4, 32, 256, 2048)]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_prefill_4096_llama_8b_h100_is_plausible() -> None:
    # Own arithmetic: 2 * 7.5e9 active params * 4096 tokens = 61 TFLOP of GEMMs plus 4.4 TFLOP
    # of causal attention. At the 989 TFLOPS peak that is >= 66 ms; at the GEMM efficiency
    # Vidur's A100 profile shows (~77 % of peak at 4096 tokens) about 85-95 ms, plus kernels and
    # overheads. The band allows GEMMs at 35-95 % of peak; docs/cost_model.md has the breakdown.
    t = roofline().step_time_s([prefill(4096)])
    peak_floor = 2 * LLAMA_8B.active_params_per_token * 4096 / (H100.bf16_tflops * 1e12)
    assert t > peak_floor
    assert 0.07 < t < 0.2


def test_small_decode_is_weight_bandwidth_bound() -> None:
    cost = roofline(**NO_OVERHEADS)
    # Every weight is read once per step except the embedding table (a lookup).
    read = LLAMA_8B.weight_bytes - LLAMA_8B.embedding_params * LLAMA_8B.weight_dtype_bytes
    weights_s = read / (H100.hbm_gbps * 1e9 * cost.params.bw_efficiency)
    t1 = cost.step_time_s([decode(1, 512)])
    assert t1 == pytest.approx(weights_s, rel=0.03)
    # Eight times the requests cost almost nothing more: the weights are read once.
    assert cost.step_time_s([decode(8, 512)]) < 1.05 * t1
    # With the default overheads a step stays within 20 % of reading the weights.
    assert weights_s < roofline().step_time_s([decode(1, 512)]) < 1.2 * weights_s


def test_decode_kv_reads_are_bandwidth_priced() -> None:
    cost = roofline()
    rate = H100.hbm_gbps * 1e9 * cost.params.bw_efficiency
    extra_tokens = 64 * 8192
    grown = cost.step_time_s([decode(64, 8192 + 1024)]) - cost.step_time_s([decode(64, 1024)])
    assert grown == pytest.approx(extra_tokens * LLAMA_8B.kv_bytes_per_token() / rate, rel=0.01)


def test_tp2_speeds_up_a_big_prefill() -> None:
    t1 = roofline(tp=1).step_time_s([prefill(8192)])
    t2 = roofline(tp=2).step_time_s([prefill(8192)])
    assert 0.5 * t1 < t2 < 0.65 * t1  # half the FLOPs per GPU, plus all-reduces


def test_all_reduce_only_with_tp() -> None:
    fast_link = H100.model_copy(update={"nvlink_gbps": 1e9})
    shape = [prefill(4096)]
    assert roofline(tp=1).step_time_s(shape) == roofline(hardware=fast_link).step_time_s(shape)
    assert roofline(tp=4).step_time_s(shape) > roofline(hardware=fast_link, tp=4).step_time_s(shape)


def test_dp_attention_waits_for_the_slowest_rank() -> None:
    cost = roofline(model_preset("deepseek-v3"), load_hardware_spec("h200"), tp=8,
                    dp_attention=8, ep=8)
    long_ctx, short_ctx = decode(32, 16384), decode(32, 256)
    slow = cost.step_time_s([long_ctx] + [short_ctx] * 7)
    # Same tokens through the MoE layers, same slowest rank: the same step time.
    assert slow == pytest.approx(cost.step_time_s([long_ctx] * 8))
    assert slow == pytest.approx(cost.step_time_s([short_ctx] * 7 + [long_ctx]))
    assert cost.step_time_s([short_ctx] * 8) < slow
    # Tokens from every rank pass through the shared MoE layers.
    assert cost.step_time_s([short_ctx] * 8) > cost.step_time_s([short_ctx] + [BatchShape()] * 7)


def test_h20_trades_compute_for_bandwidth() -> None:
    h20 = load_hardware_spec("h20")
    assert roofline(hardware=h20).step_time_s([prefill(4096)]) > 4 * roofline().step_time_s(
        [prefill(4096)]
    )
    assert roofline(hardware=h20).step_time_s([decode(8, 2048)]) < roofline().step_time_s(
        [decode(8, 2048)]
    )


def test_fp8_weights_use_fp8_peak_and_half_the_bytes() -> None:
    all_fp8 = Precision(attention="fp8", dense_mlp="fp8", moe_experts="fp8", lm_head="fp8")
    fp8 = LLAMA_8B.model_copy(update={"precision": all_fp8})
    big = [prefill(8192)]
    assert roofline(fp8, **NO_OVERHEADS).step_time_s(big) < 0.7 * roofline(
        **NO_OVERHEADS
    ).step_time_s(big)
    small = [decode(1, 512)]
    assert roofline(fp8, **NO_OVERHEADS).step_time_s(small) == pytest.approx(
        0.5 * roofline(**NO_OVERHEADS).step_time_s(small), rel=0.03
    )


def test_overheads_are_params() -> None:
    base = roofline(**NO_OVERHEADS)
    slow = roofline(step_overhead_s=0.01, extend_overhead_s=0.02, layer_overhead_s=0.0)
    assert slow.step_time_s([decode(4, 100)]) == pytest.approx(
        base.step_time_s([decode(4, 100)]) + 0.01
    )
    assert slow.step_time_s([prefill(100)]) == pytest.approx(
        base.step_time_s([prefill(100)]) + 0.03
    )


# ----- KV capacity -----------------------------------------------------------------------------


def test_kv_capacity_llama_8b_h100() -> None:
    one = kv_capacity_tokens(LLAMA_8B, H100, Parallelism(tp=1))
    free = 80 * 2**30 * 0.88 - LLAMA_8B.weight_bytes
    assert one == int(free // 131072)  # ~450k tokens
    # Two GPUs: half the weights each and half the heads per token: more than twice the tokens.
    assert kv_capacity_tokens(LLAMA_8B, H100, Parallelism(tp=2)) > 2 * one
    fp8_kv = kv_capacity_tokens(LLAMA_8B, H100, Parallelism(tp=1), kv_dtype_bytes=1)
    assert fp8_kv == pytest.approx(2 * one, abs=1)


def test_kv_capacity_with_dp_attention_mla() -> None:
    ds, h200 = model_preset("deepseek-v3"), load_hardware_spec("h200")
    plain = kv_capacity_tokens(ds, h200, Parallelism(tp=8, ep=8))
    dp = kv_capacity_tokens(ds, h200, Parallelism(tp=8, dp_attention=8, ep=8))
    # The latent is replicated either way; DP attention also replicates attention weights, so
    # each of its 8 pools is a little smaller than the single TP pool (but there are 8).
    assert 0.5 * plain < dp < plain


def test_kv_capacity_error_when_weights_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"llama-3\.1-70b does not fit on h100 at tp=1"):
        kv_capacity_tokens(model_preset("llama-3.1-70b"), H100, Parallelism(tp=1))
