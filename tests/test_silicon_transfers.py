"""Silicon prices ops the tables did not measure by moving a measured curve with a roofline
ratio (an expert shape or dtype, MLA's prefill form, another GPU's links), and counts it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim.sim.silicon import cost_columns, resolve_cost_model, roofline_reliance_warning, tables
from pdsim.sim.silicon.ops import MLA_TABLE_DIMS, OpTables
from pdsim.specs import load_hardware_spec, load_model_spec
from pdsim.specs.precision import Precision

# Loads several GPUs' kernel tables (H200, GB200, B200: ~15 s)
pytestmark = pytest.mark.slow

needs_tables = pytest.mark.skipif(tables.systems_dir() is None,
                                  reason="aiconfigurator-core not installed")


def _dep(n: int) -> Parallelism:
    """Wide EP as SGLang runs it: DP attention on every GPU, DeepEP, EP over all GPUs."""
    return Parallelism(tp=n, dp_attention=n, ep=n, moe_a2a="deepep", dp_lm_head=True)


def _experts_s(cost_model: str, model, hw, ep: int, shape: BatchShape, role: str) -> float:
    """The routed experts' time at the mean EP rank: the tables' pricing alone (the busiest
    rank's extra load, which grows with EP, is tests/test_expert_load.py's)."""
    cost = make_cost_model(cost_model, model, hw, _dep(ep), role=role, expert_imbalance=False)
    return cost.step_breakdown_s([shape] * ep)["moe_experts"]


@needs_tables
def test_kimi_k2_wide_ep_prefill_experts_are_near_the_roofline_and_fall_with_ep():
    """H200 DEP32 prefill of 8,192 tokens a rank: Kimi-K2's 384 experts were priced from the
    fused-MoE table at 2,229 ms against DeepSeek-V3's 407 ms (roofline 347 / 334 ms)."""
    h200, kimi = load_hardware_spec("h200"), load_model_spec("kimi-k2")
    total = 32 * 8192
    prefill = BatchShape(8192, extend_attn_pairs(8192, 0))
    silicon = _experts_s("silicon", kimi, h200, 32, prefill, "prefill")
    roofline = _experts_s("roofline", kimi, h200, 32, prefill, "prefill")
    assert 0.5 < silicon / roofline < 3.0, (silicon, roofline)
    deepseek = _experts_s("silicon", load_model_spec("deepseek-v3"), h200, 32, prefill, "prefill")
    assert silicon / deepseek < 1.5  # 1.5x the experts, the same pairs per GPU
    # a fixed total batch over more GPUs: never slower
    by_ep = []
    for ep in (8, 16, 32, 64):
        tokens = total // ep
        by_ep.append(_experts_s("silicon", kimi, h200, ep,
                                BatchShape(tokens, extend_attn_pairs(tokens, 0)), "prefill"))
    assert all(b <= a for a, b in zip(by_ep, by_ep[1:])), by_ep


@needs_tables
def test_nvfp4_wide_ep_decode_experts_are_near_the_roofline_and_fall_with_ep():
    """GB200 DEP48 decode, 256 requests a rank: NVFP4 experts were priced at 94 ms against
    FP8's 7.8 ms, and rose with EP at a fixed total batch."""
    gb200 = load_hardware_spec("gb200")
    fp8 = load_model_spec("deepseek-v3")
    fp4 = fp8.model_copy(update={"precision": Precision(attention="fp8", dense_mlp="fp8",
                                                        moe_experts="nvfp4")})
    total = 48 * 256

    def decode(ep: int) -> BatchShape:
        reqs = total // ep
        return BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * 2048)

    silicon = _experts_s("silicon", fp4, gb200, 48, decode(48), "decode")
    roofline = _experts_s("roofline", fp4, gb200, 48, decode(48), "decode")
    assert 0.5 < silicon / roofline < 3.0, (silicon, roofline)
    # half the weight bytes and twice the tensor-core peak of FP8: faster than FP8, not slower
    assert silicon < _experts_s("silicon", fp8, gb200, 48, decode(48), "decode")
    by_ep = [_experts_s("silicon", fp4, gb200, ep, decode(ep), "decode")
             for ep in (8, 16, 32, 48, 64)]
    assert all(b <= a for a, b in zip(by_ep, by_ep[1:])), by_ep


@needs_tables
def test_a_transferred_expert_curve_grows_with_tokens_where_the_measured_one_is_flat():
    """The wide-EP tables route each token's top-k to distinct experts spread over all of
    them, so DeepSeek-V3's 256 experts are all busy from 32 tokens on and its curve is flat
    beyond (EP 16, H100: 159 µs at 16 tokens, 275-279 µs from 32 to 2,048). Qwen3-235B's 128
    experts are all busy from 16 tokens on. Moved at equal tokens by a roofline that routed
    tokens at random, its curve fell from 160 µs at 16 tokens to 118 µs at 128."""
    ops = OpTables("h100_sxm", "sglang", "current", load_hardware_spec("h100"))
    qwen = load_model_spec("qwen3-235b-a22b")
    curve = ops.wideep_moe("generation", qwen.hidden_size, qwen.moe_intermediate_size,
                           qwen.experts_per_token, qwen.num_experts, 16,
                           qwen.precision.moe_experts, "balanced")
    to_random = ops.random_routing(qwen.hidden_size, qwen.moe_intermediate_size,
                                   qwen.experts_per_token, qwen.num_experts, 1, 16,
                                   qwen.precision.moe_experts, False)
    seconds = [curve(tokens) / to_random(tokens) for tokens in (16, 32, 64, 128, 256, 512)]
    # every expert busy at each of them with the tables' balanced routing: weight-bound, flat
    # within the tables' own noise (the move to random routing apart: it reaches fewer)
    assert max(seconds) < 1.02 * min(seconds), seconds


@needs_tables
def test_wide_ep_decode_experts_grow_with_the_experts_random_routing_reaches():
    """The wide-EP decode table's uniform rows give each local expert the same tokens: at EP 8
    DeepSeek-V3's 32 local experts are all busy from 32 tokens on (8 x 4 requests), 131 µs at
    8 tokens, 211 at 16, 382-385 from 32 to 1,024 (H200). Routed at random, 8 ranks' tokens
    reach 32 (1 - (1 - 8/256)^T) of a rank's experts, 7.2, 12.7, 20.4 and 27.8 at 8, 16, 32
    and 64 tokens: the curve grows through 32 and 64 tokens, it does not step to the full
    weight read at 32."""
    ops = OpTables("h200_sxm", "sglang", "current", load_hardware_spec("h200"))
    dsv3 = load_model_spec("deepseek-v3")
    curve = ops.wideep_moe("generation", dsv3.hidden_size, dsv3.moe_intermediate_size,
                           dsv3.experts_per_token, dsv3.num_experts, 8,
                           dsv3.precision.moe_experts, "balanced")
    assert not curve.transferred
    seconds = [curve(tokens) for tokens in (8, 16, 24, 32, 64, 128)]
    assert all(b > 1.05 * a for a, b in zip(seconds[:-1], seconds[1:])), seconds
    assert seconds[3] < 0.85 * seconds[-1], seconds  # 20 of 32 experts at 32 tokens


@needs_tables
def test_expert_curves_moved_from_the_measured_shape_count_as_transferred():
    h200 = load_hardware_spec("h200")
    ranks = [BatchShape(decode_reqs=32, decode_context_tokens=32 * 2048)] * 8
    deepseek = make_cost_model("silicon", load_model_spec("deepseek-v3"), h200, _dep(8),
                               role="decode")
    deepseek.step_time_s(ranks)
    assert deepseek.transferred_lookups == 0  # DeepSeek-V3's experts at EP 8: measured
    kimi = make_cost_model("silicon", load_model_spec("kimi-k2"), h200, _dep(8), role="decode")
    kimi.step_time_s(ranks)
    # the routed experts of Kimi-K2's 60 MoE layers, plus MLA at its 64 heads (8 a rank)
    assert kimi.transferred_lookups >= 1
    columns = cost_columns("silicon", [deepseek, kimi])
    shares = [columns[f"cost_{k}_frac"] for k in ("interpolated", "transferred", "extrapolated")]
    assert sum(shares) == pytest.approx(1.0) and shares[1] > 0


@needs_tables
@pytest.mark.parametrize("system,hardware", [("h200_sxm", "h200"), ("b200_sxm", "b200")])
def test_mla_prefill_attention_runs_at_a_plausible_share_of_the_bf16_peak(system, hardware):
    """An 8,192-token DeepSeek prefill at TP8 (16 heads a GPU) as SGLang runs it: MHA over
    up-projected K/V, 2 · heads · (192 + 128) FLOPs per causal (query, key) pair. Hopper's
    table timed the absorbed form (576 / 512 dims: 3.4x the FLOPs) and read as it was gave
    173 TFLOP/s on H200, 17 % of the peak."""
    hw = load_hardware_spec(hardware)
    ops = OpTables(system, "sglang", "current", hw)
    heads, seq = 128 // 8, 8192
    _, rope, nope, v = MLA_TABLE_DIMS
    flops = 2.0 * heads * (nope + rope + v) * seq * (seq + 1) / 2
    for kv_bytes in (1, 2):
        seconds, extrapolated = ops.mla_context(heads, MLA_TABLE_DIMS, kv_bytes).at(1, seq)
        assert not extrapolated
        achieved = flops / seconds / 1e12
        assert 0.25 * hw.bf16_tflops < achieved < hw.bf16_tflops, achieved
    # Hopper's rows are moved to the MHA form (counted); Blackwell's are that form already
    assert ops.mla_context(heads, MLA_TABLE_DIMS, 2).transferred == (hardware == "h200")


@needs_tables
def test_h800_prices_compute_from_h100_tables_and_collectives_at_its_own_links():
    h100, h800 = load_hardware_spec("h100"), load_hardware_spec("h800")
    assert h800.silicon_base == "h100" and resolve_cost_model("auto", h800) == "silicon"
    model = load_model_spec("llama-3.1-70b")
    prefill = [BatchShape(8192, extend_attn_pairs(8192, 0))]
    parts = {hw.name: make_cost_model("silicon", model, hw, Parallelism(tp=8))
             .step_breakdown_s(prefill) for hw in (h100, h800)}
    assert parts["h800"]["dense_mlp"] == parts["h100"]["dense_mlp"]  # the same GEMM tables
    assert parts["h800"]["lm_head"] == parts["h100"]["lm_head"]
    # 8,192 x 8,192 BF16 (128 MiB) all-reduced over NVLink: bandwidth-bound, so slower by
    # nearly the link ratio 450 / 200 GB/s
    link_ratio = h100.nvlink_gb_per_s / h800.nvlink_gb_per_s
    ratio = parts["h800"]["dense_comm"] / parts["h100"]["dense_comm"]
    assert 0.9 * link_ratio < ratio <= link_ratio, ratio
    with pytest.raises(ValueError, match="silicon_base 'h900' is not a hardware preset"):
        load_hardware_spec({"base": "h100", "name": "h900-ish", "silicon_base": "h900"})


@needs_tables
def test_h20_moves_h100_tables_by_the_roofline_ratio_of_the_two_gpus():
    """The H20 is the H100's die at 148 of its 989 BF16 TFLOPS, its kernels streaming at 2.8
    TB/s (of 4.0) to the H100's 3.35: a weight-bound GEMM runs at the memory ratio, a
    compute-bound one at the FLOP ratio, but no worse than the share of its roofline the H20's
    kernels are measured at."""
    h100, h20 = load_hardware_spec("h100"), load_hardware_spec("h20")
    assert h20.silicon_base == "h100" and resolve_cost_model("auto", h20) == "silicon"
    measured = OpTables("h100_sxm", "sglang", "current", h100)
    moved = OpTables("h100_sxm", "sglang", "current", h20, h100)
    gemm, on_h20 = measured.gemm(8192, 8192, "bf16"), moved.gemm(8192, 8192, "bf16")
    assert on_h20.transferred and not gemm.transferred
    assert on_h20(1) / gemm(1) == pytest.approx(3350 / 2800, rel=0.01)
    # compute-bound: the share of the peak the H100 ran it at, or the H20's, whichever is more
    for m in (8192, 16384):
        flops = 2 * m * 8192 * 8192
        share = max(flops / (989e12 * gemm(m)), h20.roofline_share)
        assert on_h20(m) == pytest.approx(flops / (148e12 * share), rel=0.01)
        assert on_h20(m) / gemm(m) <= 989 / 148 * 1.001
    # causal FlashAttention-3, 2 x 2,048 tokens of 16 heads of 128: the H100's table runs it
    # at 35 % of its peak; the H20 measured 0.319 ms (73 %). The FLOP ratio alone carried the
    # H100's 35 % over (0.66 ms); at the H20's share it is the H20's own kernel.
    fa3 = 4 * 2 * 2048 * 2049 / 2 * 16 * 128
    h100_s = measured.context_attention(16, 16, 128, 2, False).at(2, 2048)[0]
    assert fa3 / (989e12 * h100_s) < 0.4
    attention = moved.context_attention(16, 16, 128, 2, False)
    seconds, _ = attention.at(2, 2048)
    assert attention.transferred
    assert seconds == pytest.approx(fa3 / (148e12 * h20.roofline_share), rel=0.01)
    assert seconds == pytest.approx(0.319e-3, rel=0.1)
    ratio_only = OpTables("h100_sxm", "sglang", "current",
                          h20.model_copy(update={"roofline_share": None}), h100)
    assert ratio_only.context_attention(16, 16, 128, 2, False).at(2, 2048)[0] > 1.9 * 0.319e-3
    # never faster than the base GPU ran it at the H20's memory rate
    assert min(on_h20(m) / gemm(m) for m in (1, 64, 1024)) >= 3350 / 2800 * 0.999
    # FlashMLA decode, 128 requests of 4,096 keys, 16 heads (DeepSeek at tp 8): 0.601 ms on
    # an H20, as much as 64 heads compute (its 64-row query block); the H100 reads it in 0.2
    mla = moved.mla_generation(16, MLA_TABLE_DIMS, 2).at(128, 4096)[0]
    assert mla == pytest.approx(0.601e-3, rel=0.1)
    assert measured.mla_generation(16, MLA_TABLE_DIMS, 2).at(128, 4096)[0] < 0.4 * mla
    # a same-peak base (H800 <- H100) reads the tables as they are
    assert OpTables("h100_sxm", "sglang", "current", load_hardware_spec("h800"),
                    h100).gemm(8192, 8192, "bf16")(1) == gemm(1)
    with pytest.raises(ValueError, match="roofline_share applies to ops moved from a "
                                         "silicon_base"):
        load_hardware_spec({"base": "h100", "name": "h100-ish", "roofline_share": 0.8})


def test_the_run_warning_names_points_that_rest_mostly_on_roofline_ratios():
    rows = [{"point": 0, "label": "ep=8", "cost_transferred_frac": 0.3,
             "cost_extrapolated_frac": 0.1},
            {"point": 1, "label": "ep=72", "cost_transferred_frac": 0.45,
             "cost_extrapolated_frac": 0.2},
            {"point": 2, "label": "roofline", "cost_transferred_frac": math.nan,
             "cost_extrapolated_frac": math.nan}]
    warning = roofline_reliance_warning(rows)
    assert warning is not None and "\n" not in warning
    assert "ep=72 (65%)" in warning and "ep=8" not in warning and "1 point(s)" in warning
    assert roofline_reliance_warning(rows[:1]) is None


EXPERIMENT = """\
name: transferred
model: {base: tiny-mla, precision: {attention: w4a16, dense_mlp: w4a16, moe_experts: w4a16}}
hardware: h800
cost_model: {name: silicon}
cluster:
  prefill: {instances: 1, tp: 2}
  decode: {instances: 1, tp: 2}
workload:
  num_requests: 8
  seed: 0
  arrival: {process: poisson, rate_rps: 10}
  input_len: {dist: fixed, value: 512}
  output_len: {dist: fixed, value: 4}
"""


@needs_tables
def test_pdsim_run_reports_coverage_and_warns_when_transfers_dominate(tmp_path):
    """W4A16 GEMMs (the tables time BF16 and FP8 only), tiny-mla's MLA dimensions (not
    DeepSeek-V3's) and the H800's all-reduces (the H100's moved to its NVLink): most lookups
    rest on roofline ratios."""
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    done = subprocess.run([sys.executable, "-m", "pdsim.cli", "run", str(path), "--out",
                           str(tmp_path / "out"), "--quiet"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    row = pd.read_csv(tmp_path / "out" / "summary.csv").iloc[0]
    shares = [row[f"cost_{k}_frac"] for k in ("interpolated", "transferred", "extrapolated")]
    assert sum(shares) == pytest.approx(1.0)
    assert row["cost_transferred_frac"] + row["cost_extrapolated_frac"] > 0.5
    lines = [line for line in done.stdout.splitlines() if "rest mostly on roofline" in line]
    assert len(lines) == 1 and "transferred + extrapolated > 50%" in lines[0]


def _deepseek_config(**quant) -> dict:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "vocab_size": 1000, "torch_dtype": "bfloat16",
    }
    if quant:
        config["quantization_config"] = quant
    return config


NVFP4 = Precision(attention="bf16", dense_mlp="nvfp4", moe_experts="nvfp4", lm_head="bf16")


@pytest.mark.parametrize("quant", [
    {"quant_method": "modelopt_fp4", "exclude_modules": ["lm_head", "*self_attn*"]},
    {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4", "group_size": 16,
     "exclude_modules": ["lm_head", "*self_attn*"]},
    {"quant_method": "modelopt", "producer": {"name": "modelopt"},
     "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                      "exclude_modules": ["lm_head", "*self_attn*"]}},
])
def test_modelopt_nvfp4_in_config_json_is_read_as_nvfp4(tmp_path, quant):
    (tmp_path / "config.json").write_text(json.dumps(_deepseek_config(**quant)))
    assert load_model_spec(tmp_path).precision == NVFP4


def test_modelopt_nvfp4_hf_quant_config_beside_config_json_is_read_as_nvfp4(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_deepseek_config()))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"}, "quant_method": "modelopt_fp4",
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]},
    }))
    assert load_model_spec(tmp_path).precision == NVFP4
    # a method that names one format and an algorithm that names another is an error
    (tmp_path / "config.json").write_text(json.dumps(_deepseek_config(
        quant_method="modelopt_fp4", quant_algo="FP8")))
    with pytest.raises(ValueError, match="modelopt_fp4 with quant_algo 'FP8'"):
        load_model_spec(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text("[1, 2]")
    (tmp_path / "config.json").write_text(json.dumps(_deepseek_config()))
    with pytest.raises(ValueError, match="hf_quant_config.json"):
        load_model_spec(tmp_path)


@needs_tables
def test_deepep_tables_count_the_measured_machines_nodes():
    """aiconfigurator's DeepEP collectors run on every GPU of one node: 4 on a GB200 tray, 8
    on an HGX board (their system files' node.num_gpus_per_node)."""
    assert tables.gpus_per_node("gb200") == tables.gpus_per_node("gb300") == 4
    assert tables.gpus_per_node("h200_sxm") == tables.gpus_per_node("b200_sxm") == 8


@needs_tables
def test_gb200_low_latency_dispatch_grows_with_ep_inside_the_nvl72_domain():
    """GB200's low-latency table ran on 4 GPUs; inside the 72-GPU NVLink domain every EP size
    read it unchanged (128 tokens a GPU: 63 us at EP 8 and at EP 72). Priced at 8 GPUs it
    lands on B200's measured 8-GPU table (the same NVLink rate) within a few percent where
    the links carry the time, and more GPUs send more of each token off the GPU."""
    gb200, b200 = load_hardware_spec("gb200"), load_hardware_spec("b200")
    source = OpTables("gb200", "sglang", "current", gb200)
    truth = OpTables("b200_sxm", "sglang", "current", b200)
    want, got = truth.deepep("low_latency", 7168, 8, 256, 8), source.deepep(
        "low_latency", 7168, 8, 256, 8)
    for tokens in (256, 512, 1024):
        assert got(tokens) == pytest.approx(want(tokens), rel=0.06), tokens
    by_ep = [source.deepep("low_latency", 7168, 8, 256, ep)(128) for ep in (4, 8, 16, 48, 72)]
    assert all(b > a for a, b in zip(by_ep, by_ep[1:])), by_ep
    assert got.transferred and not source.deepep("low_latency", 7168, 8, 256, 4).transferred


@needs_tables
def test_normal_mode_keeps_its_measured_group_inside_one_nvlink_domain():
    """Normal-mode kernels are held by their 20 SMs, not the links: B200's 8-GPU table is within
    a quarter of GB200's 4-GPU one where the link roofline would put 8 GPUs 1.6x above. Inside
    one domain the measured curve stands; across nodes the measured node counts and the link
    roofline move it."""
    gb200, h200 = load_hardware_spec("gb200"), load_hardware_spec("h200")
    source = OpTables("gb200", "sglang", "current", gb200)
    four = source.deepep("normal", 7168, 8, 256, 4)
    for ep in (8, 48, 72):
        assert source.deepep("normal", 7168, 8, 256, ep)(4096) == four(4096)
    hopper = OpTables("h200_sxm", "sglang", "current", h200)
    assert hopper.deepep("normal", 7168, 8, 256, 32)(4096) > 3 * hopper.deepep(
        "normal", 7168, 8, 256, 8)(4096)  # RDMA between four nodes


@needs_tables
@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_a_gpu_measured_on_one_node_prices_several_from_a_multi_node_measurement(mode):
    """B200's DeepEP tables ran on one 8-GPU node; across nodes the 400 Gb/s NICs, the same as
    on an H200 board, carry the traffic. The one-node curve moved there by the link roofline
    keeps its NVLink pace: B200 came out 1.5x (low latency) to 2.5x (normal) slower than
    H200 at EP 32. The H200's measured 4-node curve moved to B200's links stands instead:
    within a few percent of H200's, and no slower; on H200 itself the move from a measured
    multi-node curve lands within 5 % where the one-node curve lands 30 % off (median,
    benchmarks/fidelity_components.py). It keeps B200's own one-node floor (its curve at one
    token sits above H200's), so it is no slower than H200's by more than that difference."""
    b200, h200 = load_hardware_spec("b200"), load_hardware_spec("h200")
    blackwell = OpTables("b200_sxm", "sglang", "current", b200)
    hopper = OpTables("h200_sxm", "sglang", "current", h200)
    tokens = 128 if mode == "low_latency" else 4096
    across, within = (blackwell.deepep(mode, 7168, 8, 256, ep) for ep in (32, 8))
    measured = hopper.deepep(mode, 7168, 8, 256, 32)
    assert across.transferred and not within.transferred
    floors = within(1) - hopper.deepep(mode, 7168, 8, 256, 8)(1)
    assert 0.8 * measured(tokens) <= across(tokens) <= 1.01 * (measured(tokens) + max(floors, 0))
    assert across(tokens) > 2 * within(tokens)  # the NICs, not NVLink, between four nodes
    assert not measured.transferred  # H200 reads its own 4-node rows


@needs_tables
@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_deepep_moved_across_gpu_families_keeps_the_destinations_floor_and_grows_with_ep(mode):
    """B200 has DeepEP tables for one node only; EP 16 and up is moved from H200's multi-node
    ones, whose one-token floor (H200's one node: 19-25 us low latency) lies below B200's own
    (33-46 us). Moved by the link roofline alone, Qwen3-sized dispatch + combine read 35 us at
    EP 8 and 24 us at EP 16 (one token). The move adds the two GPUs' one-node difference at one
    token and never undercuts B200's own node: EP 16 over two nodes' RDMA costs at least EP 8
    over NVLink, and the inter-node increment stays the one H200 measured."""
    b200, h200 = load_hardware_spec("b200"), load_hardware_spec("h200")
    blackwell = OpTables("b200_sxm", "sglang", "current", b200)
    hopper = OpTables("h200_sxm", "sglang", "current", h200)
    for hidden, experts in ((7168, 256), (7168, 384), (4096, 128), (2048, 128)):
        eight, sixteen = (blackwell.deepep(mode, hidden, 8, experts, ep) for ep in (8, 16))
        for tokens in (1, 8, 32, 128):
            assert sixteen(tokens) >= eight(tokens), (hidden, experts, tokens)
    eight, sixteen = (blackwell.deepep(mode, 7168, 8, 256, ep)(1) for ep in (8, 16))
    h8, h16 = (hopper.deepep(mode, 7168, 8, 256, ep)(1) for ep in (8, 16))
    assert sixteen - eight == pytest.approx(h16 - h8, rel=0.25)
