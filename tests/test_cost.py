"""The roofline cost model: behaves like a GPU (monotone, bandwidth- or compute-bound where it
should be, TP and DP attention priced as SGLang runs them) and the registry holds its rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsim.config import expand_sweep, load_experiment, parse_experiment
from pdsim.core.batch import BatchShape, extend_shape, extend_attn_pairs
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import (
    CostModel,
    Parallelism,
    RooflineCostModel,
    RooflineParams,
    cost_model_names,
    gemm_time_s,
    kv_capacity_tokens,
    make_cost_model,
    micro_batches,
    overlapped_layers_s,
    register_cost_model,
    weight_bytes_per_gpu,
)
from pdsim.sim.moe_comm import (
    LinkBytes,
    combine_bytes_per_copy,
    deepep_traffic,
    dispatch_bytes_per_copy,
)
from pdsim.sim.silicon import tables
from pdsim.specs import load_hardware_spec, model_preset
from pdsim.specs.precision import DTYPES, Precision, compute_on, gemm_peak_tflops

H100 = load_hardware_spec("h100")
LLAMA_8B = model_preset("llama-3.1-8b")
DSV3 = model_preset("deepseek-v3")
H200 = load_hardware_spec("h200")
NO_OVERHEADS = dict(step_overhead_s=0.0, extend_overhead_s=0.0, layer_overhead_s=0.0,
                    gemm_floor_s=0.0, attn_floor_s=0.0, moe_floor_s=0.0, decode_attn_req_s=0.0,
                    eager_overhead=False)


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
    # The kernels grow with every token; an eager prefill of a few tokens is launch-bound,
    # so its step stays at the launches' time until the kernels outlast them.
    tokens = (1, 16, 256, 1024, 4096, 16384)
    kernels = [roofline(eager_overhead=False).step_time_s([prefill(n)]) for n in tokens]
    assert kernels == sorted(kernels) and len(set(kernels)) == len(kernels)
    times = [cost.step_time_s([prefill(n)]) for n in tokens]
    assert times == sorted(times) and times[0] == times[1] < times[2]
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
    weights_s = read / (H100.hbm_gb_per_s * 1e9 * cost.params.bw_efficiency)
    t1 = cost.step_time_s([decode(1, 512)])
    assert t1 == pytest.approx(weights_s, rel=0.03)
    # Eight times the requests cost almost nothing more: the weights are read once.
    assert cost.step_time_s([decode(8, 512)]) < 1.05 * t1
    # The default fixed costs add, per layer, the floors of four GEMM kernels (QKV, O,
    # gate_up, down), of the attention kernel and its one request, and the elementwise
    # kernels; per step the LM head GEMM's floor and the step overhead.
    p = RooflineParams()
    per_layer = 4 * p.gemm_floor_s + p.attn_floor_s + p.decode_attn_req_s + p.layer_overhead_s
    fixed = LLAMA_8B.num_layers * per_layer + p.gemm_floor_s + p.step_overhead_s
    assert roofline().step_time_s([decode(1, 512)]) == pytest.approx(t1 + fixed, rel=1e-9)
    assert fixed < 0.35 * weights_s


def test_decode_kv_reads_are_bandwidth_priced() -> None:
    cost = roofline()
    rate = H100.hbm_gb_per_s * 1e9 * cost.params.bw_efficiency
    extra_tokens = 64 * 8192
    grown = cost.step_time_s([decode(64, 8192 + 1024)]) - cost.step_time_s([decode(64, 1024)])
    assert grown == pytest.approx(extra_tokens * LLAMA_8B.kv_bytes_per_token() / rate, rel=0.01)


def test_tp2_speeds_up_a_big_prefill() -> None:
    t1 = roofline(tp=1).step_time_s([prefill(8192)])
    t2 = roofline(tp=2).step_time_s([prefill(8192)])
    assert 0.5 * t1 < t2 < 0.65 * t1  # half the FLOPs per GPU, plus all-reduces


def test_all_reduce_only_with_tp() -> None:
    fast_link = H100.model_copy(update={"nvlink_gb_per_s": 1e9})
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
    # Tokens from every rank pass through the shared MoE layers. Run eagerly, a lone busy rank
    # gathers only its own tokens (SUM_LEN); replayed as a graph, every rank runs its padded
    # batch (MAX_LEN, pdsim.sim.forward_shape), so idle ranks cost as much as busy ones.
    eager = roofline(model_preset("deepseek-v3"), load_hardware_spec("h200"), tp=8,
                     dp_attention=8, ep=8, cuda_graph_max_bs=0, eager_overhead=False)
    assert eager.step_time_s([short_ctx] * 8) > eager.step_time_s(
        [short_ctx] + [BatchShape()] * 7)
    assert cost.step_time_s([short_ctx] * 8) == pytest.approx(
        cost.step_time_s([short_ctx] + [BatchShape()] * 7))


def test_speculative_query_tokens_are_gemm_rows_and_attention_queries() -> None:
    cost = roofline(**NO_OVERHEADS)
    # 64 requests verifying 3 drafts each: 256 rows through every GEMM and the LM head, like
    # 256 one-token requests (without context, attention adds only their KV writes).
    verify = BatchShape(decode_reqs=64, decode_query_len=4)
    assert cost.step_time_s([verify]) == pytest.approx(
        cost.step_time_s([BatchShape(decode_reqs=256)]), rel=1e-12)
    # GQA decode attention is memory-bound: the context is read once for all 4 queries, and
    # only the 3 extra query tokens' KV entries are written.
    shape = BatchShape(decode_reqs=8, decode_context_tokens=8 * 4096, decode_query_len=4)
    one = BatchShape(decode_reqs=8, decode_context_tokens=8 * 4096)
    kv_layer = LLAMA_8B.kv_bytes_per_token() / LLAMA_8B.num_layers
    rate = H100.hbm_gb_per_s * 1e9 * cost.params.bw_efficiency
    assert cost.attention_kernels_s(shape) - cost.attention_kernels_s(one) == pytest.approx(
        8 * 3 * kv_layer / rate, rel=1e-9)
    # MLA's absorbed decode attention over all 128 heads (DP attention) is compute-bound: 3
    # queries a request take 3 times as long.
    mla = roofline(DSV3, H200, tp=8, dp_attention=8, ep=8, **NO_OVERHEADS)
    ctx = 8 * 4096
    t1 = mla.attention_kernels_s(BatchShape(decode_reqs=8, decode_context_tokens=ctx))
    t3 = mla.attention_kernels_s(BatchShape(decode_reqs=8, decode_context_tokens=ctx,
                                            decode_query_len=3))
    assert t3 == pytest.approx(3 * t1, rel=1e-9)


def test_mla_decode_computes_whole_64_row_query_blocks() -> None:
    """FlashMLA on an H20 takes as long for 16 heads as for 64, and for 1 to 4 queries a request
    at 16 heads (its 64-row query block); where the H20 computes rather than reads, so does the
    roofline."""
    h20 = load_hardware_spec("h20")
    shape = dict(decode_reqs=128, decode_context_tokens=128 * 4096)
    tp8 = roofline(DSV3, h20, tp=8, **NO_OVERHEADS)  # 16 heads a GPU
    one = tp8.attention_kernels_s(BatchShape(**shape))
    assert tp8.attention_kernels_s(BatchShape(**shape, decode_query_len=4)) == \
        pytest.approx(one, rel=1e-9)
    assert tp8.attention_kernels_s(BatchShape(**shape, decode_query_len=5)) == \
        pytest.approx(2 * one, rel=1e-9)
    tp2 = roofline(DSV3, h20, tp=2, **NO_OVERHEADS)  # 64 heads
    assert tp2.attention_kernels_s(BatchShape(**shape)) == pytest.approx(one, rel=1e-9)


def test_the_h20_computes_at_15_percent_and_streams_at_its_sms_rate() -> None:
    """The H20's 78 SMs stream at ~2.8 TB/s (measured kernels), not its HBM's 4.0: a decode
    step reads at that rate; a prefill computes at 148 of the H100's 989 TFLOPS."""
    h20 = load_hardware_spec("h20")
    assert h20.stream_gb_per_s == pytest.approx(2800)
    assert roofline(hardware=h20).step_time_s([prefill(4096)]) > 4 * roofline().step_time_s(
        [prefill(4096)]
    )
    no_overheads = dict(scheduler_overhead=False, eager_overhead=False)
    ratio = (roofline(hardware=h20, **no_overheads).step_time_s([decode(8, 2048)])
             / roofline(**no_overheads).step_time_s([decode(8, 2048)]))
    assert 1.0 < ratio <= 3350 / 2800 * 1.001, ratio
    # at the datasheet's 4.0 TB/s it would decode faster than the H100
    datasheet = h20.model_copy(update={"hbm_share": 1.0})
    assert roofline(hardware=datasheet, **no_overheads).step_time_s([decode(8, 2048)]) < \
        roofline(**no_overheads).step_time_s([decode(8, 2048)])


def test_fp8_weights_use_fp8_peak_and_half_the_bytes() -> None:
    all_fp8 = Precision(attention="fp8", dense_mlp="fp8", moe_experts="fp8", lm_head="fp8")
    fp8 = LLAMA_8B.model_copy(update={"precision": all_fp8})
    big = [prefill(8192)]
    # FP8 GEMMs reach a smaller share (fp8_gemm_mfu) of a peak twice as high.
    assert roofline(fp8, **NO_OVERHEADS).step_time_s(big) < 0.75 * roofline(
        **NO_OVERHEADS
    ).step_time_s(big)
    small = [decode(1, 512)]
    assert roofline(fp8, **NO_OVERHEADS).step_time_s(small) == pytest.approx(
        0.5 * roofline(**NO_OVERHEADS).step_time_s(small), rel=0.03
    )


def test_overheads_are_params() -> None:
    base = roofline(**NO_OVERHEADS)
    slow = roofline(**{**NO_OVERHEADS, "step_overhead_s": 0.01, "extend_overhead_s": 0.02})
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


# ----- DeepEP and two-batch overlap -----------------------------------------------------------


def deepep(ep=8, hardware=H200, tbo=False, role="decode", model=DSV3, dense_tp=None,
           dp_lm_head=False, **params):
    """A large-EP roofline; routing uniform (no expert imbalance) unless params say so."""
    parallel = Parallelism(tp=ep, dp_attention=ep, ep=ep, moe_a2a="deepep",
                           two_batch_overlap=tbo, moe_dense_tp=dense_tp, dp_lm_head=dp_lm_head)
    params.setdefault("expert_imbalance", False)
    return make_cost_model("roofline", model, hardware, parallel, role=role, **params)


def test_deepep_bytes_for_deepseek_v3_match_the_hand_computation() -> None:
    # DeepSeek-V3: hidden 7168, top-8 of 256 experts. A dispatched copy is 7168 FP8 bytes plus
    # 7168 / 128 = 56 float32 scales (224 B) = 7392 B; a combined copy is 7168 BF16 = 14336 B.
    assert dispatch_bytes_per_copy(7168) == 7392 and combine_bytes_per_copy(7168) == 14336
    # 128 tokens on one GPU, EP 16 over two 8-GPU nodes, low-latency mode: of each token's 8
    # copies, 8/16 stay on the GPU, 8 * 7/16 = 3.5 cross NVLink and 8 * 8/16 = 4 cross RDMA.
    ll = deepep_traffic(128, 7168, 8, ep=16, gpus_per_node=8, mode="low_latency")
    assert ll.dispatch == LinkBytes(nvlink_bytes=128 * 3.5 * 7392, rdma_bytes=128 * 4 * 7392)
    assert ll.combine == LinkBytes(nvlink_bytes=128 * 3.5 * 14336, rdma_bytes=128 * 4 * 14336)
    assert ll.dispatch.rdma_bytes == 3_784_704 and ll.combine.nvlink_bytes == 6_422_528
    # Normal mode sends a token once per GPU it reaches in the node (each GPU is hit with
    # probability 1 - (15/16)^8) and once to the other node (hit with probability 1 - (1/2)^8).
    normal = deepep_traffic(128, 7168, 8, ep=16, gpus_per_node=8, mode="normal")
    gpu_hit, node_hit = 1 - (15 / 16) ** 8, 1 - 0.5**8
    assert normal.dispatch.nvlink_bytes == pytest.approx(128 * 7 * gpu_hit * 7392)
    assert normal.dispatch.rdma_bytes == pytest.approx(128 * 1 * node_hit * 7392)
    assert normal.combine.rdma_bytes == pytest.approx(128 * node_hit * 14336)


def test_deepep_switches_from_nvlink_to_rdma_beyond_one_node() -> None:
    inside = deepep_traffic(64, 7168, 8, ep=8, gpus_per_node=8, mode="low_latency")
    assert inside.dispatch.rdma_bytes == 0 and inside.dispatch.nvlink_bytes > 0
    across = deepep_traffic(64, 7168, 8, ep=16, gpus_per_node=8, mode="low_latency")
    assert across.dispatch.rdma_bytes > 0
    rack = deepep_traffic(64, 7168, 8, ep=72, gpus_per_node=72, mode="normal")
    assert rack.dispatch.rdma_bytes == rack.combine.rdma_bytes == 0
    # The same EP 16 step (128 tokens per GPU, low-latency mode) when all 16 GPUs share one
    # NVLink domain and when they sit in two 8-GPU nodes. Per token and call, in one domain
    # 8 * 15/16 = 7.5 copies cross NVLink at half of 450 GB/s; in two nodes 3.5 cross
    # NVLink and 4 cross the 50 GB/s NIC at 90 %, which then sets the time, and each call pays
    # the RDMA latency too. The dense layers and the LM head run data-parallel
    # (moe_dense_tp=1, dp_lm_head), so DeepEP is the only collective.
    p, shapes = RooflineParams(), [decode(128, 2048)] * 16
    nvlink, nic = 450e9 * p.deepep_ll_nvlink_efficiency, 50e9 * p.deepep_rdma_efficiency
    one_domain_s = 128 * 7.5 * (7392 + 14336) / nvlink
    two_nodes_s = 128 * 4 * (7392 + 14336) / nic + 2 * p.deepep_rdma_latency_s
    one_domain = H200.model_copy(update={"gpus_per_node": 16})
    grown = (deepep(16, dense_tp=1, dp_lm_head=True).step_time_s(shapes)
             - deepep(16, one_domain, dense_tp=1, dp_lm_head=True).step_time_s(shapes))
    assert grown == pytest.approx(DSV3.num_moe_layers * (two_nodes_s - one_domain_s), rel=1e-9)


def test_deepep_per_gpu_volume_shrinks_with_ep_size_for_a_fixed_batch() -> None:
    # 4096 decode tokens over the instance: each GPU dispatches 4096 / ep of them. The gather
    # the default path prices moves every token to every GPU, so its volume does not shrink.
    sent = []
    for ep in (8, 16, 32, 72):
        t = deepep_traffic(4096 / ep, 7168, 8, ep, 8, "low_latency")
        sent.append(t.dispatch.nvlink_bytes + t.dispatch.rdma_bytes)
    assert sent == sorted(sent, reverse=True) and sent[-1] < 0.15 * sent[0]


def test_low_latency_mode_for_decode_and_normal_mode_for_prefill() -> None:
    p = RooflineParams()
    shapes = [decode(64, 1024)] * 8
    tokens = 64  # per GPU (attention TP 1)
    moe_layers = DSV3.num_moe_layers
    # Hand computation, EP 8 in one node: LL moves 8 * 7/8 = 7 copies a token at half of
    # NVLink's 450 GB/s; normal mode 7 * (1 - (7/8)^8) copies at 65 % of it.
    ll_s = 2 * p.deepep_ll_latency_s + tokens * 7 * (7392 + 14336) / (450e9 * 0.5)
    normal_copies = 7 * (1 - (7 / 8) ** 8)
    normal_s = 2 * p.deepep_normal_latency_s + tokens * normal_copies * (7392 + 14336) / (
        450e9 * 0.65
    )
    as_decode = deepep(8, role="decode").step_time_s(shapes)
    as_prefill = deepep(8, role="prefill").step_time_s(shapes)
    assert as_prefill - as_decode == pytest.approx(moe_layers * (normal_s - ll_s), rel=1e-9)
    # Colocated instances pick the mode per step, as SGLang's `--deepep-mode auto` does.
    colocated = deepep(8, role="colocated")
    assert colocated.step_time_s(shapes) == pytest.approx(as_decode)
    mixed = [BatchShape(prefill_tokens=512, prefill_attn_pairs=extend_attn_pairs(512, 0))] * 8
    assert colocated.step_time_s(mixed) == pytest.approx(
        deepep(8, role="prefill").step_time_s(mixed)
    )


def test_two_batch_overlap_hides_communication_but_never_beats_its_parts() -> None:
    free_links = dict(deepep_ll_latency_s=0.0, deepep_rdma_latency_s=0.0)
    fast = H200.model_copy(update={"nvlink_gb_per_s": 1e9, "rdma_gb_per_s": 1e9})
    for ep, batch in ((8, 4), (16, 128), (32, 256), (72, 256)):
        shapes = [decode(batch, 2048)] * ep
        # (the LM head per DP rank, as large-EP deployments run it: no logits gather over
        # the nodes, which overlap could not hide)
        plain = deepep(ep, dp_lm_head=True).step_time_s(shapes)
        tbo = deepep(ep, tbo=True, dp_lm_head=True).step_time_s(shapes)
        compute = deepep(ep, hardware=fast, dp_lm_head=True, **free_links).step_time_s(shapes)
        comm = plain - compute
        assert tbo >= max(compute, comm), (ep, batch)
        if ep >= 32:
            # Communication is over 40 % of the step and each GPU holds few experts, so
            # reading them once per micro-batch costs little: the overlap pays off.
            assert comm > 0.4 * plain and tbo < 0.8 * plain, (ep, batch)
    # At small EP each micro-batch re-reads most of the GPU's 32 experts: overlap costs more
    # than it hides (SGLang enables it for large EP).
    shapes = [decode(4, 2048)] * 8
    assert deepep(8, tbo=True).step_time_s(shapes) > deepep(8).step_time_s(shapes)


def test_micro_batches_cut_each_rank_as_sglang_does() -> None:
    first, second = micro_batches([decode(1, 100), decode(3, 100), prefill(5), BatchShape()])
    assert [s.decode_reqs for s in first] == [0, 1, 0, 0]
    assert [s.decode_reqs for s in second] == [1, 2, 0, 0]
    assert [s.decode_context_tokens for s in first + second] == [0, 100, 0, 0, 100, 200, 0, 0]
    assert (first[2].prefill_tokens, second[2].prefill_tokens) == (2, 3)
    assert first[2].prefill_attn_pairs + second[2].prefill_attn_pairs == prefill(5).prefill_attn_pairs
    # both halves of a chunk after a cached prefix attend over it (MLA's form follows it)
    halves = micro_batches([extend_shape(1024, 2048)])
    assert [h[0].prefill_prefix_tokens for h in halves] == [2048, 2048]


def test_two_batch_overlap_with_one_request_per_rank_leaves_a_micro_batch_empty() -> None:
    """SGLang cuts a rank's decode batch at n // 2 requests: with one request per rank the
    first micro-batch is empty (only its dispatch and combine run), so overlap changes the
    step little; with two per rank each micro-batch reads the rank's weights."""
    for ep in (8, 32, 72):
        one = [decode(1, 2048)] * ep
        plain, tbo = deepep(ep).step_time_s(one), deepep(ep, tbo=True).step_time_s(one)
        assert plain <= tbo < 1.05 * plain, ep
        two = [decode(2, 2048)] * ep
        assert deepep(ep, tbo=True).step_time_s(two) > 1.3 * deepep(ep).step_time_s(two), ep


def test_deepep_and_two_batch_overlap_rules() -> None:
    with pytest.raises(ValueError, match="moe_a2a='deepep'.*ep = tp > 1, got ep=1, tp=8"):
        Parallelism(tp=8, dp_attention=8, moe_a2a="deepep")
    with pytest.raises(ValueError, match="ep = tp > 1, got ep=4, tp=8"):
        Parallelism(tp=8, ep=4, moe_a2a="deepep")
    with pytest.raises(ValueError, match="two_batch_overlap.*needs moe_a2a='deepep'"):
        Parallelism(tp=8, ep=8, two_batch_overlap=True)
    with pytest.raises(ValueError, match="needs a MoE model; llama-3.1-8b is dense"):
        deepep(8, model=LLAMA_8B)
    with pytest.raises(ValueError, match="role"):
        deepep(8, role="router")


WORKLOAD = {"num_requests": 1, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
            "input_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": 4}}


def test_role_and_deepep_reach_the_cost_model_from_an_experiment() -> None:
    cfg = parse_experiment({
        "name": "deepep", "model": "deepseek-v3", "hardware": "h200",
        "cost_model": {"name": "roofline"},
        "cluster": {"prefill": {"tp": 8, "ep": 8, "dp_attention": 8, "moe_a2a": "deepep"},
                    "decode": {"tp": 16, "ep": 16, "dp_attention": 16, "moe_a2a": "deepep",
                               "two_batch_overlap": True}},
        "workload": WORKLOAD,
    })
    cluster = build_cluster(cfg)
    cost = cluster.decode.cost()
    assert cost.params.role == "decode" and cost.parallel.two_batch_overlap
    assert cluster.prefill.cost().params.role == "prefill"
    with pytest.raises(ValueError, match="cluster.decode.*two_batch_overlap.*needs moe_a2a"):
        parse_experiment({"name": "x", "cluster": {"decode": {"tp": 2, "ep": 2,
                          "two_batch_overlap": True}}, "workload": WORKLOAD})
    dense = parse_experiment({"name": "x", "cluster": {"decode": {
        "tp": 2, "ep": 2, "moe_a2a": "deepep"}}, "workload": WORKLOAD})
    with pytest.raises(ValueError, match="cluster.decode: ep=2 needs a MoE model; "
                                         "llama-3.1-8b is dense: drop ep \\(1\\)$"):
        build_cluster(dense)  # the whole message: no advice on memory it does not need


@pytest.mark.parametrize("tp", [3, 64])
def test_attention_that_does_not_split_evenly_is_refused_as_sglang_refuses_it(tp) -> None:
    """32 query and 8 KV heads split over 1, 2, 4, 8 (KV heads divide) or 16, 32 GPUs (they
    replicate); 3 and 64 were priced (64 divided by zero in the silicon tables)."""
    cfg = parse_experiment({"name": "x", "cluster": {"prefill": {"tp": tp}, "decode": {}},
                            "workload": WORKLOAD})
    with pytest.raises(ValueError, match=f"cluster.prefill: attention tp={tp} .* does not split "
                       "llama-3.1-8b's 32 query heads and 8 KV heads evenly, as SGLang "
                       "requires; allowed: 1, 2, 4, 8, 16, 32"):
        build_cluster(cfg)
    mla = model_preset("deepseek-v3")
    assert mla.split_error(16) is None and "allowed: 1, 2, 4, 8, 16, 32, 64, 128" in (
        mla.split_error(3) or "")


def test_block_fp8_weights_that_split_into_partial_scale_blocks_are_refused_and_not_planned():
    """SGLang loads block-FP8 MLP weights only when each GPU's slice holds whole 128-wide scale
    blocks: DeepSeek-V3's dense MLP (18,432) over 32 GPUs leaves 576 a GPU, its experts (2,048)
    over 32 leave 64; moe_dense_tp 1 and ep lift the splits. A BF16 model splits freely."""
    from pdsim.planning import PlanConfig
    from pdsim.planning.candidates import role_shapes

    ds = model_preset("deepseek-v3")
    assert "leave 576 a GPU" in ds.block_fp8_error(32, 32)
    # the fix named is one the config takes: moe_dense_tp only takes 1 (SGLang's flag too)
    assert ds.block_fp8_error(32, 32).endswith(
        "set moe_dense_tp: 1 (SGLang's --moe-dense-tp-size 1: each GPU runs the dense MLP whole "
        "on its own tokens; needs dp_attention > 1), or use a tp of 1, 2, 4, 8 or 16")
    assert ds.block_fp8_error(32, 32, dense_tp=1) is None
    assert "leave 64 a GPU" in ds.block_fp8_error(32, 1, dense_tp=1)
    assert ds.block_fp8_error(32, 1, dense_tp=1).endswith(
        "raise ep (SGLang's --ep-size) so that tp / ep is 1, 2, 4, 8 or 16 (now 32 / 1)")
    assert model_preset("qwen3-235b-a22b").block_fp8_error(8, 1) is None  # BF16 experts
    big = {"tp": 32, "dp_attention": 32, "ep": 32, "moe_a2a": "deepep",
           "scheduler": {"mem_fraction_static": 0.85}}
    cfg = {"name": "x", "model": "deepseek-v3", "hardware": "h200", "workload": WORKLOAD,
           "cluster": {"prefill": big, "decode": {**big, "moe_dense_tp": 1}}}
    with pytest.raises(ValueError, match=r"cluster.prefill: deepseek-v3's block-FP8 dense MLP "
                                         r"weights \(18432 wide\) split over 32 GPUs leave 576"):
        build_cluster(parse_experiment(cfg))
    ok = {**cfg, "cluster": {"prefill": {**big, "moe_dense_tp": 1}, "decode": cfg["cluster"]["decode"]}}
    assert build_cluster(parse_experiment(ok)).prefill.scheduler.num_pages > 0
    plan = PlanConfig.model_validate({
        "name": "p", "model": "deepseek-v3", "hardware": "h200", "max_gpus": 32,
        "slo": {"ttft_p90_s": 2.0},
        "workload": WORKLOAD, "search": {"tp": [32], "dp_attention": [32], "ep": [32],
                                         "moe_a2a": ["deepep"], "moe_dense_tp": [None, 1]}})
    shapes = role_shapes(plan, ds, 32)
    assert shapes and all(shape.dense_dp for shape in shapes)


# ----- precisions ------------------------------------------------------------------------------


def test_nvfp4_gemms_run_at_the_fp4_peak() -> None:
    h100_fp4 = H100.model_copy(update={"fp4_tflops": 4 * H100.bf16_tflops})
    bf16 = roofline(hardware=h100_fp4, **NO_OVERHEADS)
    fp4_model = LLAMA_8B.model_copy(update={"precision": Precision.uniform("nvfp4")})
    fp4 = roofline(fp4_model, hardware=h100_fp4, **NO_OVERHEADS)
    big = [prefill(16384)]
    # Attention and MLP GEMMs are compute-bound at 16k tokens: they take a quarter of the BF16
    # time; the attention kernel, elementwise kernels and the BF16 LM head are unchanged.
    gemm_params = LLAMA_8B.num_layers * (LLAMA_8B.attn_params_per_layer + LLAMA_8B.dense_mlp_params)
    bf16_gemm_s = 2 * gemm_params * 16384 / (H100.bf16_tflops * 1e12 * bf16.params.gemm_mfu)
    # FP4 GEMMs run at fp4_gemm_mfu of a peak four times BF16's.
    fp4_gemm_s = bf16_gemm_s * bf16.params.gemm_mfu / (4 * bf16.params.fp4_gemm_mfu)
    saved = bf16.step_time_s(big) - fp4.step_time_s(big)
    assert saved == pytest.approx(bf16_gemm_s - fp4_gemm_s, rel=1e-6)
    with pytest.raises(ValueError, match="precision.attention: nvfp4 weights need FP4"):
        roofline(fp4_model)  # H100 has no FP4 tensor cores


def test_mxfp4_experts_run_weight_only_in_bf16_where_there_are_no_fp4_tensor_cores() -> None:
    """gpt-oss on an H100, as SGLang serves it: MXFP4's bytes, BF16's arithmetic (its MoE
    kernels upcast the weights); on a B200 the FP4 peak."""
    oss = model_preset("gpt-oss-120b")
    assert oss.precision.moe_experts == "mxfp4"
    assert compute_on("mxfp4", H100) == "bf16" and compute_on("nvfp4", H100) == "fp4"
    assert compute_on("mxfp4", load_hardware_spec("b200")) == "fp4"
    assert gemm_peak_tflops("mxfp4", H100) == H100.bf16_tflops
    w4a16 = oss.model_copy(update={"precision": oss.precision.model_copy(
        update={"moe_experts": "w4a16"})})
    shapes = ([decode(1, 1024)], [prefill(8192)])
    # weight-bound decode reads 0.53 B a weight (w4a16: 0.52); a long prefill computes as BF16
    for shape in shapes:
        got = roofline(oss, **NO_OVERHEADS).step_time_s(shape)
        assert got == pytest.approx(roofline(w4a16, **NO_OVERHEADS).step_time_s(shape), rel=0.02)
    with pytest.raises(ValueError, match="nvfp4 weights need FP4 tensor cores, which h100 "
                                         "lacks; use a format it supports .*mxfp4"):
        gemm_peak_tflops("nvfp4", H100)


def test_w4a16_reads_half_a_byte_and_computes_in_bf16() -> None:
    w4 = LLAMA_8B.model_copy(update={"precision": Precision.uniform("w4a16")})
    big = [prefill(8192)]
    assert roofline(w4, **NO_OVERHEADS).step_time_s(big) == pytest.approx(
        roofline(**NO_OVERHEADS).step_time_s(big), rel=1e-9
    )
    # One-request decode reads the weights: int4 blocks at 0.5 + 1/64 B, the LM head in BF16.
    blocks = LLAMA_8B.num_layers * (LLAMA_8B.attn_params_per_layer + LLAMA_8B.dense_mlp_params)
    saved_bytes = blocks * (2 - DTYPES["w4a16"].weight_bytes)
    rate = H100.hbm_gb_per_s * 1e9 * RooflineParams().bw_efficiency
    small = [decode(1, 512)]
    saved = roofline(**NO_OVERHEADS).step_time_s(small) - roofline(
        w4, **NO_OVERHEADS).step_time_s(small)
    assert saved == pytest.approx(saved_bytes / rate, rel=0.01)


def test_fp8_on_a100_is_a_clear_error() -> None:
    a100 = load_hardware_spec("a100")
    fp8 = LLAMA_8B.model_copy(update={"precision": Precision.uniform("fp8")})
    with pytest.raises(ValueError, match="precision.attention: fp8 weights need FP8 tensor "
                                         "cores, which a100 lacks"):
        roofline(fp8, hardware=a100)
    fp8_attention = LLAMA_8B.model_copy(update={"precision": Precision(attention_compute="fp8")})
    with pytest.raises(ValueError, match="precision.attention_compute: .*a100 lacks"):
        roofline(fp8_attention, hardware=a100)
    # On Hopper FP8 attention runs its kernel at fp8_attn_mfu of the FP8 peak: a long
    # prefill's attention kernel gets faster by exactly that ratio.
    p, n = RooflineParams(), 32768
    work = (extend_attn_pairs(n, 0) + n * p.prefill_attn_extra_keys) * 4 * 32 * 128
    kernel_s = LLAMA_8B.num_layers * work / (H100.bf16_tflops * 1e12 * p.attn_mfu)
    fp8_kernel_s = LLAMA_8B.num_layers * work / (H100.fp8_tflops * 1e12 * p.fp8_attn_mfu)
    saved = roofline().step_time_s([prefill(n)]) - roofline(fp8_attention).step_time_s(
        [prefill(n)])
    assert saved == pytest.approx(kernel_s - fp8_kernel_s, rel=1e-6) and saved > 0


@pytest.mark.slow
def test_ep_scaling_experiment_builds_every_point() -> None:
    path = Path(__file__).parent.parent / "experiments" / "ep_scaling.yaml"
    cfg, raw = load_experiment(path)
    points = expand_sweep(cfg, raw, str(path))
    seen = set()
    for swept, point in points:
        role = build_cluster(point, str(path.parent)).decode
        par = role.cost().parallel
        assert par.moe_a2a == "deepep" and par.tp == par.ep == par.dp_attention
        assert par.moe_dense_tp == 1 and par.dp_lm_head
        seen.add((par.ep, par.two_batch_overlap))
        # 256 clients per decode GPU, each DP rank allowed 256 running requests ...
        assert point.workload.arrival.concurrency == 256 * par.ep
        assert point.cluster.decode.scheduler.max_running_requests == 256 * par.ep
        # ... so that the KV pool (a mean prompt plus the reserved decode tokens a request)
        # bounds the batch at EP 8 and the clients from EP 16 on, as the YAML's comment says.
        per_request = (1024 + 3072) / 2 + point.cluster.decode.scheduler.num_reserved_decode_tokens
        fit = role.scheduler.num_pages * role.scheduler.page_size / per_request
        assert (fit < 256) == (par.ep == 8)
    assert seen == {(ep, tbo) for ep in (8, 16, 32, 72) for tbo in (False, True)}


# ----- dense MLP and LM head under DP attention, per-op breakdown ----------------------------


def test_moe_dense_tp_and_dp_lm_head_need_dp_attention_and_take_sglangs_values() -> None:
    with pytest.raises(ValueError, match="moe_dense_tp=1 .* dp_attention > 1"):
        Parallelism(tp=8, ep=8, moe_dense_tp=1)
    with pytest.raises(ValueError, match="dp_lm_head .* dp_attention > 1"):
        Parallelism(tp=8, dp_lm_head=True)
    with pytest.raises(ValueError, match="moe_dense_tp"):
        Parallelism(tp=8, dp_attention=8, moe_dense_tp=2)


def test_weights_per_gpu_follow_deepep_dense_tp_and_dp_lm_head() -> None:
    # EP 16 over 16 GPUs, DP attention 16. DeepEP replicates the shared expert (FP8: 1 B a
    # weight), moe_dense_tp=1 the dense MLPs (FP8), dp_lm_head the embedding and LM head (BF16).
    base = Parallelism(tp=16, dp_attention=16, ep=16)
    deep = base.model_copy(update={"moe_a2a": "deepep"})
    full = deep.model_copy(update={"moe_dense_tp": 1, "dp_lm_head": True})
    shared = DSV3.num_moe_layers * DSV3.expert_params
    dense = DSV3.num_dense_layers * DSV3.dense_mlp_params
    head = (DSV3.embedding_params + DSV3.lm_head_params) * 2
    w = {name: weight_bytes_per_gpu(DSV3, par) for name, par in
         (("base", base), ("deep", deep), ("full", full))}
    assert w["deep"] - w["base"] == pytest.approx(shared * 15 / 16, abs=2)
    assert w["full"] - w["deep"] == pytest.approx((dense + head) * 15 / 16, abs=2)
    # ... and the KV pool shrinks by exactly those bytes (per-token bytes: one MLA latent).
    per_token = DSV3.kv_bytes_per_token_per_rank(1, 2)
    lost = kv_capacity_tokens(DSV3, H200, base) - kv_capacity_tokens(DSV3, H200, full)
    assert lost == pytest.approx((w["full"] - w["base"]) / per_token, abs=1)


def test_breakdown_adds_up_to_the_step_time() -> None:
    shapes = [decode(100, 1000)] * 15 + [BatchShape(prefill_tokens=512,
                                                     prefill_attn_pairs=512 * 513 // 2)]
    for cost in (deepep(16, tbo=True, role="colocated"), deepep(16, dense_tp=1),
                 roofline(DSV3, H200, tp=8, dp_attention=4, ep=8), roofline()):
        parts = cost.step_breakdown_s(shapes[:cost.parallel.dp_attention])
        assert sum(parts.values()) == pytest.approx(cost.step_time_s(
            shapes[:cost.parallel.dp_attention]), rel=1e-12)
        assert parts["attention"] > 0 and parts["lm_head"] > 0 and parts["overhead"] > 0


def test_dense_mlp_data_parallel_has_no_collective_and_prices_one_gpus_tokens() -> None:
    shapes = [decode(104, 1000)] * 16
    tp_dense = deepep(16).step_breakdown_s(shapes)
    dp_dense = deepep(16, dense_tp=1).step_breakdown_s(shapes)
    assert tp_dense["dense_comm"] > 0 and dp_dense["dense_comm"] == 0
    # Whole dense MLP on 104 tokens per GPU (a captured graph size), at any EP size.
    assert dp_dense["dense_mlp"] == pytest.approx(
        deepep(72, dense_tp=1).step_breakdown_s([decode(104, 1000)] * 72)["dense_mlp"])
    p = RooflineParams()
    inter, h = DSV3.intermediate_size, DSV3.hidden_size
    mem = H200.hbm_gb_per_s * 1e9 * p.bw_efficiency
    one_layer = 2 * p.gemm_floor_s + 104 * 3 * inter * 2 / mem + max(
        2 * 104 * DSV3.dense_mlp_params / (H200.fp8_tflops * 1e12 * p.fp8_gemm_mfu),
        (DSV3.dense_mlp_params + 104 * (2 * h + 3 * inter) * 2) / mem)
    assert dp_dense["dense_mlp"] == pytest.approx(DSV3.num_dense_layers * one_layer)


def test_collectives_beyond_one_node_run_at_the_nodes_nics_together() -> None:
    # The dense layers' all-gather + reduce-scatter over 16 GPUs in two 8-GPU nodes: ring
    # bytes 2 (n - 1) / n per token; NCCL runs a ring per NIC, so the crossing moves at the
    # node's 8 NICs together (8 x 50 = 400 GB/s), not at one NIC's 50 nor NVLink's 450.
    shapes, p = [decode(104, 1000)] * 16, RooflineParams()
    tokens = 16 * 104
    ring_bytes = tokens * 2 * 15 / 16 * DSV3.hidden_size * 2
    two_nodes = deepep(16).step_breakdown_s(shapes)["dense_comm"]
    one_domain = deepep(16, H200.model_copy(update={"gpus_per_node": 16})).step_breakdown_s(
        shapes)["dense_comm"]
    nics = 8 * H200.rdma_gb_per_s
    per_layer = p.allreduce_latency_s + ring_bytes / (nics * 1e9 * p.comm_efficiency)
    assert two_nodes == pytest.approx(DSV3.num_dense_layers * per_layer)
    assert one_domain == pytest.approx(two_nodes * 400 / 450, rel=0.01)


@pytest.mark.parametrize("name", ["roofline", pytest.param("silicon", marks=pytest.mark.skipif(
    tables.systems_dir() is None, reason="aiconfigurator-core not installed"))])
def test_a_two_node_tensor_parallel_prefill_is_not_bound_by_one_nic(name: str) -> None:
    """Llama-3.1-70B at TP 16 over two H100 nodes: each all-reduce of an 8,192-token prefill
    (134 MB) crosses the nodes at their 8 NICs' 400 GB/s, so the step is faster than at TP 8
    (it was ~3x slower when one 50 GB/s NIC carried the ring)."""
    model, h100 = model_preset("llama-3.1-70b"), load_hardware_spec("h100")
    shape = [extend_shape(8192)]
    step = {tp: make_cost_model(name, model, h100, Parallelism(tp=tp), role="prefill"
                                ).step_time_s(shape) for tp in (8, 16)}
    assert step[16] < step[8]


def test_dp_lm_head_prices_the_slowest_ranks_rows_over_its_gpus() -> None:
    shapes = [decode(100, 1000)] * 7 + [decode(120, 1000)]
    par = Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep", dp_lm_head=True)
    cost = make_cost_model("roofline", DSV3, H200, par, role="decode")
    want = gemm_time_s(120, DSV3.vocab_size, DSV3.hidden_size, DSV3.precision.lm_head, H200,
                       RooflineParams())
    assert cost.step_breakdown_s(shapes)["lm_head"] == pytest.approx(want)
    # Without dp_lm_head the vocabulary splits over tp and every rank's rows are gathered,
    # each rank padded to the busiest's 120 (DP attention's MAX_LEN gather): 8 x 120 rows.
    assert deepep(8).step_breakdown_s(shapes)["lm_head"] == pytest.approx(gemm_time_s(
        960, DSV3.vocab_size / 8, DSV3.hidden_size, DSV3.precision.lm_head, H200,
        RooflineParams()))


def test_a_decode_step_priced_from_its_kept_fixed_parts_is_the_full_computation_bit_for_bit():
    """A decode-only step keeps what depends only on its batch size (`_decode_step_s`): the
    step time must still be exactly the sum of the parts computed in full, warm or cold."""
    import random

    rng = random.Random(7)
    for make in (roofline, lambda: roofline(DSV3, H200, tp=8, dp_attention=8, ep=8),
                 lambda: deepep(16), lambda: roofline(tp=4)):
        warm = make()
        for _ in range(300):
            reqs = rng.randint(1, 300)
            shape = BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * rng.randint(1, 9000),
                               decode_query_len=rng.choice((1, 1, 4)))
            full = sum(warm.step_breakdown_s([shape]).values())
            assert warm.step_time_s([shape]) == full == make().step_time_s([shape])


# ----- the embedding's and LM head's collectives ------------------------------------------------


def test_vocab_collectives_follow_sglang_logits_processor() -> None:
    """Plain TP all-reduces the embedding of every token and all-gathers each LM-head row's
    logits from the vocabulary shards; DP attention without dp_lm_head gathers every rank's
    rows and their logits over all tp GPUs; dp_lm_head keeps them on the rank."""
    p = RooflineParams()
    nvlink = H200.nvlink_gb_per_s * 1e9 * p.comm_efficiency
    nics = 8 * H200.rdma_gb_per_s * 1e9 * p.comm_efficiency  # a node's NICs: 400 GB/s
    h, vocab = DSV3.hidden_size, DSV3.vocab_size

    def vocab_comm(parallel: Parallelism, shapes: list[BatchShape]) -> float:
        cost = make_cost_model("roofline", DSV3, H200, parallel, role="decode")
        return cost.step_breakdown_s(shapes)["vocab_comm"]

    # TP 8, 64 requests: the embedding's all-reduce (64 rows of hidden) and the logits'
    # all-gather (64 rows of the vocabulary), each a ring with one latency.
    tp8 = vocab_comm(Parallelism(tp=8), [decode(64, 2048)])
    assert tp8 == pytest.approx(2 * p.allreduce_latency_s
                                + 2 * 7 / 8 * 64 * h * 2 / nvlink + 7 / 8 * 64 * vocab * 2 / nvlink,
                                rel=1e-12)
    # DP attention over 8 GPUs, 128 requests each: all 1,024 rows gathered to every GPU, then
    # their logits (265 MB) all-gathered: a sixth of a millisecond per 128 rows.
    dp8 = vocab_comm(Parallelism(tp=8, dp_attention=8, ep=8), [decode(128, 2048)] * 8)
    assert dp8 == pytest.approx(2 * p.allreduce_latency_s
                                + 7 / 8 * 1024 * (h + vocab) * 2 / nvlink, rel=1e-12)
    # over 32 GPUs (four nodes) the same gather of 4,096 rows crosses the nodes' NICs, ~4 ms
    dp32 = vocab_comm(Parallelism(tp=32, dp_attention=32, ep=32), [decode(128, 2048)] * 32)
    assert dp32 == pytest.approx(2 * p.allreduce_latency_s
                                 + 31 / 32 * 4096 * (h + vocab) * 2 / nics, rel=1e-12)
    assert dp32 > 3 * dp8
    # dp_lm_head: each GPU's rank computes its own rows' logits whole
    assert vocab_comm(Parallelism(tp=32, dp_attention=32, ep=32, moe_dense_tp=1,
                                  dp_lm_head=True), [decode(128, 2048)] * 32) == 0.0
    # ... and a rank of two GPUs gathers its own rows' logits over those two
    two = vocab_comm(Parallelism(tp=8, dp_attention=4, ep=8, dp_lm_head=True),
                     [decode(128, 2048)] * 4)
    assert two == pytest.approx(p.allreduce_latency_s + 1 / 2 * 128 * vocab * 2 / nvlink,
                                rel=1e-12)
    assert vocab_comm(Parallelism(tp=1), [decode(64, 2048)]) == 0.0


def test_silicon_prices_the_vocab_collectives_from_the_nccl_tables() -> None:
    parallel = Parallelism(tp=8, dp_attention=8, ep=8)
    shapes = [decode(128, 2048)] * 8
    silicon = make_cost_model("silicon", DSV3, H200, parallel, role="decode")
    parts = silicon.step_breakdown_s(shapes)
    roof = make_cost_model("roofline", DSV3, H200, parallel, role="decode")
    # the measured all-gathers of these sizes (NCCL, 8 H200s) move 0.69 of NVLink's rate,
    # as the roofline's comm_efficiency (0.7) has it
    ratio = parts["vocab_comm"] / roof.step_breakdown_s(shapes)["vocab_comm"]
    assert 0.85 < ratio < 1.15
    assert sum(parts.values()) == pytest.approx(silicon.step_time_s(shapes), rel=1e-12)
    lead = make_cost_model("silicon", DSV3, H200, Parallelism(tp=8, dp_attention=8, ep=8,
                                                              dp_lm_head=True), role="decode")
    assert lead.step_breakdown_s(shapes)["vocab_comm"] == 0.0


# ----- two-batch overlap beside DeepEP's normal-mode SMs --------------------------------------


def test_overlapped_compute_slows_by_the_sms_normal_mode_communication_holds() -> None:
    # compute-bound pair: 10 ms of compute beside 4 ms of communication holding 15 % of the
    # SMs finishes 0.15 * 4 ms later; a communication-bound pair is as long as its transfer
    assert overlapped_layers_s(1, (10, 4), (10, 4), 0.15) == pytest.approx(2 * 10.6 + 4)
    assert overlapped_layers_s(1, (10, 4), (10, 4)) == pytest.approx(2 * 10 + 4)
    assert overlapped_layers_s(1, (2, 10), (2, 10), 0.15) == pytest.approx(2 * 10 + 2)


def test_prefill_overlap_prices_deepep_normal_sms_and_decode_does_not() -> None:
    shapes_pf = [prefill(4096)] * 32
    shapes_dec = [decode(128, 2048)] * 32
    unknown = H200.model_copy(update={"sms": None})
    prefill_with = deepep(32, tbo=True, role="prefill").step_time_s(shapes_pf)
    prefill_without = deepep(32, unknown, tbo=True, role="prefill").step_time_s(shapes_pf)
    assert prefill_with > 1.05 * prefill_without  # 20 of 132 SMs communicate
    assert deepep(32, tbo=True, role="prefill", deepep_normal_sms=0).step_time_s(
        shapes_pf) == pytest.approx(prefill_without, rel=1e-12)
    # without overlap the communication runs alone; low-latency kernels hold no SMs
    assert deepep(32, role="prefill").step_time_s(shapes_pf) == pytest.approx(
        deepep(32, unknown, role="prefill").step_time_s(shapes_pf), rel=1e-12)
    assert deepep(32, tbo=True).step_time_s(shapes_dec) == pytest.approx(
        deepep(32, unknown, tbo=True).step_time_s(shapes_dec), rel=1e-12)
    with pytest.raises(ValueError, match="leaves none of the h200's 132 SMs.*allowed: 0 to 131"):
        deepep(32, tbo=True, role="prefill", deepep_normal_sms=132)
    # the silicon model overlaps its measured kernels the same way
    par = Parallelism(tp=32, dp_attention=32, ep=32, moe_a2a="deepep", two_batch_overlap=True)
    silicon = {hw.sms: make_cost_model("silicon", DSV3, hw, par, role="prefill",
                                       expert_imbalance=False).step_time_s(shapes_pf)
               for hw in (H200, unknown)}
    assert silicon[132] > 1.05 * silicon[None]


def test_kv_over_nvlink_needs_the_whole_deployment_in_one_domain() -> None:
    """network.intra_node moves the KV between any prefill and any decode instance over NVLink:
    2P + 2D of 8 H100s each cannot share an 8-GPU domain; on a GB200 NVL72 they can."""
    from pdsim.config import ConfigError

    def cluster(hardware: str, instances: int) -> dict:
        return {"name": "x", "model": "llama-3.1-70b", "hardware": hardware,
                "network": {"intra_node": True},
                "cluster": {"prefill": {"instances": instances, "tp": 8},
                            "decode": {"instances": instances, "tp": 8}},
                "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate_rps": 1},
                             "input_len": {"dist": "fixed", "value": 16},
                             "output_len": {"dist": "fixed", "value": 4}}}

    with pytest.raises(ConfigError, match="16 prefill and 16 decode GPUs do not fit h100's "
                                          "NVLink domain of 8"):
        build_cluster(parse_experiment(cluster("h100", 2)))
    build_cluster(parse_experiment(cluster("gb200", 2)))
