"""The silicon cost model: measured tables read, interpolated, extrapolated and counted."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim.sim.silicon import resolve_cost_model, tables
from pdsim.sim.silicon.interp import (
    Curve, Grid2, Stage, best_reference, leave_one_out, pchip, pchip_slopes,
)
from pdsim.sim.silicon.ops import OpTables, excess_row_ms, idle_rows
from pdsim.specs import load_hardware_spec, load_model_spec

needs_tables = pytest.mark.skipif(tables.systems_dir() is None,
                                  reason="aiconfigurator-core not installed")


def _linear_roofline(x):
    return np.asarray(x, dtype=float) * 1e-6 + 1e-6


def test_curve_is_exact_at_grid_points_and_monotone_between():
    xs = [1, 4, 16, 64, 256]
    ys = [1e-5, 1.2e-5, 2e-5, 6e-5, 2.3e-4]
    curve = Curve(xs, ys, _linear_roofline)
    for x, y in zip(xs, ys):
        assert curve(x) == pytest.approx(y, rel=1e-12)
        assert not curve.extrapolated(x)
    dense = [curve(x) for x in range(1, 257)]
    assert all(b >= a for a, b in zip(dense, dense[1:]))
    assert 1.2e-5 < curve(8) < 2e-5
    assert curve(8.5) == pytest.approx(curve.values(np.array([8.5]))[0])
    # where the data turns, the cubic stays between its two neighbours (no overshoot)
    bumpy = Curve([1, 2, 4, 8], [1e-5, 3e-5, 2e-5, 4e-5], _linear_roofline)
    between = bumpy.values(np.linspace(2, 4, 50))
    assert between.max() <= 3e-5 * (1 + 1e-12) and between.min() >= 2e-5 * (1 - 1e-12)
    assert all(b <= a + 1e-18 for a, b in zip(between, between[1:]))


def test_curve_extrapolates_by_the_roofline_ratio_and_says_so():
    curve = Curve([2, 8], [1e-5, 4e-5], _linear_roofline)
    assert curve.extrapolated(16) and curve.extrapolated(1) and not curve.extrapolated(5)
    assert curve(16) == pytest.approx(4e-5 * _linear_roofline(16) / _linear_roofline(8))
    assert curve(1) == pytest.approx(1e-5 * _linear_roofline(1) / _linear_roofline(2))
    stage = Stage([curve, curve.scaled(lambda x: 2.0)])
    seconds, transferred, extrapolated = stage.at(4)
    assert seconds == pytest.approx(3 * curve(4))
    assert (transferred, extrapolated) == (1, 0)  # the scaled copy stands in for a shape
    assert stage.at(16)[1:] == (0, 2)  # off the grid both are extrapolated, not transferred


def test_leave_one_out_is_the_cubic_through_the_other_points():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(3, 10))
        x = np.log(np.sort(rng.choice(np.arange(1, 300), n, replace=False)).astype(float))
        y = np.cumsum(rng.uniform(-0.3, 1.0, n)) if trial % 2 else rng.normal(size=n)
        hidden = leave_one_out(x, y)
        for i in range(1, n - 1):
            xr, yr = np.delete(x, i), np.delete(y, i)
            assert hidden[i - 1] == pytest.approx(pchip(xr, yr, pchip_slopes(xr, yr), x[i]),
                                                  abs=1e-12)


# the GEMM tables' row grid: 1-17, pairs around multiples of 16 up to 256, then of 256
TILE_GRID = np.array(sorted({*range(1, 18), *(b + d for b in range(32, 257, 16) for d in (0, 1)),
                             *(b + d for b in range(512, 4353, 256) for d in (0, 1)), 8192}),
                     dtype=float)


def _padded(tile):
    return lambda m: np.maximum(np.ceil(np.asarray(m, float) / tile) * tile * 1e-7, 4e-6)


def test_a_tile_reference_carries_the_step_the_plain_cubic_smooths_over():
    truth = _padded(256)  # whole 256-row tiles, above a 4 µs floor
    ys = truth(TILE_GRID) * (1 + 0.02 * np.sin(TILE_GRID))  # a little measurement noise
    curve = Curve(TILE_GRID, ys, _linear_roofline, reference=truth)
    assert np.allclose(curve.values(TILE_GRID), ys, rtol=1e-12)  # exact at grid points
    # hide m = 513, just past a tile boundary, and predict it from the rest
    i = int(np.flatnonzero(TILE_GRID == 513)[0])
    xs, seen = np.delete(TILE_GRID, i), np.delete(ys, i)
    candidates = (None, _padded(64), _padded(128), truth)
    chosen = best_reference(xs, seen, candidates)  # picked without the hidden point
    assert chosen is truth
    plain = Curve(xs, seen, _linear_roofline)(513)
    tiled = Curve(xs, seen, _linear_roofline, reference=chosen)(513)
    assert abs(plain / ys[i] - 1) > 0.2  # the cubic stays near 512's 1.5x smaller time
    assert abs(tiled / ys[i] - 1) < 0.05
    # smooth data keeps the plain cubic (the first candidate wins a tie)
    smooth = 1e-6 * TILE_GRID**0.8 + 4e-6
    assert best_reference(TILE_GRID, smooth, candidates) is None
    # copies and stand-ins keep the reference
    assert curve.times(2)(700) == pytest.approx(2 * curve(700))
    assert curve.scaled(lambda m: 3.0)(700) == pytest.approx(3 * curve(700))


def test_grid2_exact_at_points_monotone_and_marks_filled_cells():
    bs, ss = [1.0, 2.0, 4.0], [16.0, 64.0]
    z = np.array([[1e-5, 2e-5], [2e-5, 4e-5], [4e-5, np.nan]])
    grid = Grid2(bs, ss, z, lambda b, s: b * s * 1e-8)
    assert grid.at(2, 64) == (pytest.approx(4e-5), False)
    assert grid.at(1, 16) == (pytest.approx(1e-5), False)
    filled, extra = grid.at(4, 64)
    assert extra and filled == pytest.approx(4e-5 * 2)  # roofline doubles from batch 2
    along = [grid.at(1.0, s)[0] for s in np.linspace(16, 64, 20)]
    assert all(b >= a for a, b in zip(along, along[1:]))
    assert grid.at(1.5, 32)[1] is False
    assert grid.at(8, 16)[1] is True  # beyond the largest batch


@needs_tables
def test_gemm_matches_the_table_at_a_measured_point():
    hw = load_hardware_spec("h100")
    ops = OpTables("h100_sxm", "sglang", "current", hw)
    t = tables.read_table(tables.table_path("h100_sxm", "gemm", "sglang", ops.version,
                                            "gemm_perf.parquet"))
    row = t[(t.gemm_dtype == "bfloat16") & (t.n == 4096) & (t.k == 4096) & (t.m == 256)]
    measured_s = row.latency.min() * 1e-3
    curve = ops.gemm(4096, 4096, "bf16")
    assert curve(256) == pytest.approx(measured_s, rel=1e-9)
    assert not curve.extrapolated(256)
    # a width between grid points interpolates between its neighbours
    mid = ops.gemm(5000, 4096, "bf16")(256)
    assert curve(256) < mid < ops.gemm(5120, 4096, "bf16")(256)


@needs_tables
def test_collective_tables_count_elements_not_bytes():
    """aiconfigurator's collectors log a collective's size in elements (nccl-tests' bytes
    over the dtype's width; the all-reduced tensor's numel): a table row of m elements is
    m / hidden tokens. Read as bytes, every collective cost twice its measured time."""
    h200 = load_hardware_spec("h200")
    ops = OpTables("h200_sxm", "sglang", "current", h200)
    t = tables.read_table(tables.nccl_path("h200_sxm"))
    rows = t[(t.op_name == "all_gather") & (t.nccl_dtype == "half") & (t.num_gpus == 8)]
    measured = rows.groupby("message_size").latency.min() * 1e-3
    hidden, elements = 8192, 2**26  # 8192 tokens of Llama-70B's hidden size
    curve = ops.nccl("all_gather", 8, hidden)
    assert curve(elements / hidden) == pytest.approx(measured[elements], rel=1e-9)
    # the ring's bus bandwidth that implies: 7/8 of the 128 MiB in 0.38 ms, near NVLink's
    # 450 GB/s as NCCL reaches it, not half of it
    busbw = 7 / 8 * elements * 2 / measured[elements]
    assert 0.6 * h200.nvlink_gb_per_s * 1e9 < busbw <= h200.nvlink_gb_per_s * 1e9
    custom = tables.read_table(tables.table_path("h200_sxm", "comm", "sglang", ops.version,
                                                 "custom_allreduce_perf.parquet"))
    graph = custom[(custom.num_gpus == 8) & (custom.backend == "sglang_graph")]
    small = graph.message_size.min() * 64  # a custom all-reduce size: the custom kernel wins
    ar = ops.all_reduce(8, hidden)(small / hidden)
    assert ar <= graph.groupby("message_size").latency.min()[small] * 1e-3 * (1 + 1e-9)


@needs_tables
def test_wide_ep_context_experts_drop_the_rows_a_dispatch_never_delivers():
    """aiconfigurator's wide-EP prefill collector feeds each rank all tokens of the EP group,
    so at equal work per rank its times grow with EP (3.5x from EP 8 to EP 256 on H200);
    without the rows no local expert takes they are flat, as the grouped GEMM's work is."""
    ops = OpTables("h200_sxm", "sglang", "current", load_hardware_spec("h200"))
    t = tables.read_table(tables.table_path("h200_sxm", "moe", "sglang", ops.version,
                                            "wideep_context_moe_perf.parquet"))
    t = t[(t.moe_tp_size == 1) & (t.moe_dtype == "fp8_block") & (t.distribution == "uniform")]
    assert 5e-6 < excess_row_ms(t) < 9e-6  # ms a row: 5-9 ns

    def raw_ms(ep: int, tokens: int) -> float:
        return t[(t.moe_ep_size == ep) & (t.num_tokens == tokens)].latency.min()

    pairs = 16384  # per rank: 2,048 tokens a rank, top 8
    assert raw_ms(256, pairs // 8 * 256) > 3 * raw_ms(8, pairs // 8 * 8)
    at = {ep: ops.wideep_moe("context", 7168, 2048, 8, 256, ep, "fp8", "balanced")(
        pairs / 8 * ep) for ep in (8, 32, 256)}
    assert 0.9 < at[32] / at[8] < 1.1 and 0.9 < at[256] / at[8] < 1.2
    assert at[8] == pytest.approx(raw_ms(8, pairs) * 1e-3 - excess_row_ms(t) * 1e-3
                                  * idle_rows(np.array([pairs]), 8, 8)[0], rel=1e-9)
    for ep in (8, 64, 256):  # every point keeps a positive time
        curve = ops.wideep_moe("context", 7168, 2048, 8, 256, ep, "fp8", "balanced")
        assert curve.values(curve.grid).min() > 0
    # the decode table is measured on the rows a low-latency dispatch delivers: read as is
    decode = ops.wideep_moe("generation", 7168, 2048, 8, 256, 32, "fp8", "balanced")
    gen = tables.read_table(tables.table_path("h200_sxm", "moe", "sglang", ops.version,
                                              "wideep_generation_moe_perf.parquet"))
    gen = gen[(gen.moe_ep_size == 32) & (gen.moe_dtype == "fp8_block")
              & (gen.distribution == "uniform") & (gen.moe_tp_size == 1)]
    x = float(gen.num_tokens.iloc[len(gen) // 2])
    # (moved to random routing, which reaches every expert there)
    assert decode(x) == pytest.approx(gen[gen.num_tokens == x].latency.min() * 1e-3, rel=1e-6)


@needs_tables
def test_gemm_tile_reference_predicts_a_held_out_point_past_a_tile_boundary():
    ops = OpTables("h100_sxm", "sglang", "current", load_hardware_spec("h100"))
    ms, ys = ops._gemm_series["fp8"][(16384, 4096)]
    for m, plain_off in ((513, 0.4), (1025, 0.25)):
        i = int(np.flatnonzero(ms == m)[0])
        xs, seen = np.delete(ms, i), np.delete(ys, i)
        roof = ops.gemm_roofline(16384, 4096, "fp8")
        chosen = best_reference(xs, seen, ops.tile_references(16384, 4096, "fp8"))
        assert chosen is not None
        # measured: 55 µs at 512 rows, 109 µs at 513; 106 µs at 1024, 158 µs at 1025
        assert abs(Curve(xs, seen, roof)(m) / ys[i] - 1) > plain_off
        assert abs(Curve(xs, seen, roof, reference=chosen)(m) / ys[i] - 1) < 0.05
    # the model's own curve still returns the table at every grid point, and between the
    # measured 4,353 and 8,192 rows it steps at the 256-row boundary 4,608 | 4,609, which a
    # cubic through the same points passes smoothly
    curve = ops.gemm(16384, 4096, "fp8")
    block_ms, block_ys = ops._gemm_series["fp8_block"][(16384, 4096)]
    assert np.allclose(curve.values(block_ms), block_ys, rtol=1e-9)
    assert curve(4609) / curve(4608) > 1.02
    plain = Curve(block_ms, block_ys, roof)
    assert plain(4609) / plain(4608) < 1.001


@needs_tables
def test_per_tensor_fp8_reads_the_cutlass_rows_and_block_fp8_the_deepgemm_ones():
    ops = OpTables("h100_sxm", "sglang", "current", load_hardware_spec("h100"))
    for dtype, table in (("fp8_tensor", "fp8"), ("fp8", "fp8_block")):
        ms, ys = ops._gemm_series[table][(16384, 4096)]
        assert np.allclose(ops.gemm(16384, 4096, dtype).values(ms), ys, rtol=1e-9), dtype
    tensor, block = ops._gemm_series["fp8"][(16384, 4096)], ops._gemm_series["fp8_block"][(16384, 4096)]
    assert not np.allclose(np.interp(block[0], *tensor), block[1], rtol=0.05)  # they differ


@needs_tables
def test_silicon_step_times_are_within_a_sane_ratio_of_the_roofline():
    model, hw = load_model_spec("llama-3.1-8b"), load_hardware_spec("h100")
    silicon = make_cost_model("silicon", model, hw, Parallelism())
    roofline = make_cost_model("roofline", model, hw, Parallelism())
    shapes = [
        BatchShape(4096, extend_attn_pairs(4096, 0)),
        BatchShape(decode_reqs=1, decode_context_tokens=1024),
        BatchShape(decode_reqs=64, decode_context_tokens=64 * 2048),
    ]
    for shape in shapes:
        ratio = silicon.step_time_s([shape]) / roofline.step_time_s([shape])
        assert 0.5 < ratio < 2.0, (shape, ratio)
    # bigger batches take longer; an empty step is free
    small = silicon.step_time_s([BatchShape(decode_reqs=8, decode_context_tokens=8 * 2048)])
    assert small < silicon.step_time_s([shapes[2]])
    assert silicon.step_time_s([BatchShape()]) == 0.0
    assert silicon.lookups > 0


@needs_tables
def test_a_layers_untabled_kernels_are_each_priced_at_least_one_kernel_floor():
    """A one-request decode step's elementwise kernels sit at their floors: the two
    add+RMSNorms and the activation, plus the attention block's own as SGLang's layer code
    runs them (GQA: RoPE, the KV-cache store; MLA also the latent norms and the q/k concat),
    the same kernels the eager launch count has (tests/test_overheads.py)."""
    from pdsim.sim.overheads import attention_elementwise_kernels

    hw = load_hardware_spec("h200")
    for name, kernels in (("llama-3.1-8b", 5), ("deepseek-v3", 8)):
        model = load_model_spec(name)
        assert 3 + attention_elementwise_kernels(model) == kernels
        cost = make_cost_model("silicon", model, hw, Parallelism(tp=8))
        cost.trace = []
        cost.step_breakdown_s([BatchShape(decode_reqs=1, decode_context_tokens=1024)])
        (op,) = [op for op in cost.trace if op.name == "elementwise"]
        assert op.seconds == pytest.approx(kernels * cost.params.kernel_floor_s)


@needs_tables
def test_a_moe_layers_routed_activation_is_priced_once_inside_the_expert_table():
    """The fused-MoE and DeepEP MoE tables time the routed experts' SiLU-and-mul (and the
    Triton path its top-k), so the elementwise kernels outside them are the two add+RMSNorms
    (and the attention block's): a Qwen3-235B prefill at TP 8 on H20 moves over its norms,
    RoPE and KV store, not 8 x 1536 x 3 routed activation elements a token; under DeepEP the
    top-k kernel, outside the table, is one kernel more."""
    from pdsim.sim.overheads import attention_elementwise_kernels

    model, hw = load_model_spec("qwen3-235b-a22b"), load_hardware_spec("h20")
    h = model.hidden_size
    attn_kernels = attention_elementwise_kernels(model)
    for par, kernels in ((Parallelism(tp=8), 2 + attn_kernels),
                         (Parallelism(tp=8, ep=8, moe_a2a="deepep"), 3 + attn_kernels)):
        cost = make_cost_model("silicon", model, hw, par)
        cost.trace = []
        cost.step_breakdown_s([BatchShape(decode_reqs=1, decode_context_tokens=1024)])
        (op,) = [op for op in cost.trace if op.name == "elementwise"]
        assert op.seconds == pytest.approx(kernels * cost.params.kernel_floor_s)
    cost = make_cost_model("silicon", model, hw, Parallelism(tp=8))
    cost.trace = []
    tokens = 8192
    cost.step_breakdown_s([BatchShape(prefill_tokens=tokens, prefill_attn_pairs=
                                      extend_attn_pairs(0, tokens))])
    (op,) = [op for op in cost.trace if op.name == "elementwise"]
    heads, kvh = model.num_attention_heads // 8, model.kv_heads_per_rank(8)
    # two add+RMSNorms (read x and residual, write both), RoPE and the qk-norm on q and k
    elements = 8 * h + 4 * (heads + kvh) * model.head_dim
    rate = hw.stream_gb_per_s * 1e9 * cost.params.bw_efficiency
    assert op.seconds <= tokens * elements * 2 / rate * 1.01


@needs_tables
def test_extrapolated_lookups_are_counted():
    model, hw = load_model_spec("llama-3.1-8b"), load_hardware_spec("h100")
    cost = make_cost_model("silicon", model, hw, Parallelism())
    cost.step_time_s([BatchShape(decode_reqs=16, decode_context_tokens=16 * 1024)])
    assert cost.lookups > 0 and cost.extrapolated_lookups == 0
    before = cost.lookups
    # 40,000 prefill tokens: GEMMs beyond the largest measured m (32,768)
    cost.step_time_s([BatchShape(40_000, extend_attn_pairs(40_000, 0))])
    assert cost.lookups > before
    assert cost.extrapolated_lookups >= 4
    assert 0 < cost.extrapolated_frac < 1


@needs_tables
@pytest.mark.slow
def test_a_decode_step_from_its_kept_fixed_parts_is_the_full_computation_and_its_lookups():
    """A decode-only step keeps what depends only on its batch size (`_decode_step_s`); its
    time must be the sum of the parts computed in full, bit for bit, and it must count the
    same lookups and extrapolated lookups as the full computation does."""
    import random

    rng = random.Random(3)
    model, hw = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    wide_ep = Parallelism(tp=8, dp_attention=8, ep=8, dp_lm_head=True)
    for parallel in (Parallelism(tp=8), wide_ep):
        fast = make_cost_model("silicon", model, hw, parallel, role="decode")
        full = make_cost_model("silicon", model, hw, parallel, role="decode")
        for _ in range(200):
            reqs = rng.randint(1, 600)  # past the measured batch sizes too
            shape = BatchShape(decode_reqs=reqs,
                               decode_context_tokens=reqs * rng.randint(1, 9000),
                               decode_query_len=rng.choice((1, 1, 3)))
            assert fast.step_time_s([shape]) == sum(full.step_breakdown_s([shape]).values())
        counts = [(m.lookups, m.transferred_lookups, m.extrapolated_lookups)
                  for m in (fast, full)]
        assert counts[0] == counts[1]
        assert fast.transferred_lookups > 0  # the 3-query verify steps


@needs_tables
def test_auto_is_silicon_where_tables_exist_and_roofline_elsewhere():
    h100, a10 = load_hardware_spec("h100"), load_hardware_spec("a10")
    assert resolve_cost_model("auto", h100) == "silicon"
    assert resolve_cost_model("auto", a10) == "roofline"
    assert resolve_cost_model("auto", load_hardware_spec("h20")) == "silicon"  # H100's die
    inline = load_hardware_spec({"name": "my-gpu", "bf16_tflops": 100, "hbm_gib": 24,
                                 "hbm_gb_per_s": 900, "nvlink_gb_per_s": 32, "rdma_gb_per_s": 12.5})
    assert resolve_cost_model("auto", inline) == "roofline"
    model = load_model_spec("tiny-llama")
    assert type(make_cost_model("auto", model, h100, Parallelism())).__name__ == (
        "SiliconCostModel")
    assert type(make_cost_model("auto", model, inline, Parallelism())).__name__ == (
        "RooflineCostModel")
    with pytest.raises(ValueError, match="no measured tables for hardware 'my-gpu'"):
        make_cost_model("silicon", model, inline, Parallelism())


EXPERIMENT = """\
name: silicon_e2e
model: llama-3.1-8b
hardware: {hardware}
cost_model: {{name: {cost_model}}}
cluster:
  prefill: {{instances: 1}}
  decode: {{instances: 1}}
workload:
  num_requests: 40
  seed: 0
  arrival: {{process: poisson, rate_rps: 10}}
  input_len: {{dist: fixed, value: 40000}}
  output_len: {{dist: fixed, value: 8}}
"""


@needs_tables
@pytest.mark.parametrize("hardware,cost_model,resolved", [
    ("h100", "silicon", "silicon"), ("{base: h100, name: unmeasured}", "auto", "roofline")])
@pytest.mark.slow
def test_pdsim_run_end_to_end(tmp_path, hardware, cost_model, resolved):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.format(hardware=hardware, cost_model=cost_model))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "pdsim.cli", "run", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = pd.read_csv(out / "summary.csv").iloc[0]
    assert row["completed"] == 40 and row["cost_model"] == resolved
    if resolved == "silicon":
        # 40k-token prompts exceed the largest measured GEMM (32,768 rows): some lookups
        # rest on extrapolation, and the summary says how many
        assert 0 < row["cost_extrapolated_frac"] < 1
        assert row["ttft_p50_s"] > 0.5  # a 40k-token prefill of an 8B model on one H100
    else:
        assert math.isnan(row["cost_extrapolated_frac"])


@needs_tables
def test_each_table_comes_from_the_newest_version_at_or_below_the_chosen_one():
    gemm = tables.table_path("h100_sxm", "gemm", "sglang", "0.5.14", "gemm_perf.parquet")
    assert gemm.parent.name == "0.5.14"
    # 0.5.9 has no GEMM table of its own: the older 0.5.6.post2 one serves it
    older = tables.table_path("h100_sxm", "gemm", "sglang", "0.5.9", "gemm_perf.parquet")
    assert older.parent.name == "0.5.6.post2"
    deepep = tables.table_path("h100_sxm", "comm", "sglang", "0.5.14",
                               "wideep_deepep_ll_perf.parquet")
    assert deepep.parent.name == "0.5.12"
    assert tables.current_version("a100_sxm", "sglang") == "0.5.10"


@needs_tables
def test_deepseek_with_deepep_prices_measured_moe_and_dispatch():
    model, hw = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    par = Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep")
    decode = make_cost_model("silicon", model, hw, par, role="decode")
    ranks = [BatchShape(decode_reqs=32, decode_context_tokens=32 * 2048)] * 8
    step = decode.step_time_s(ranks)
    assert decode.extrapolated_lookups == 0  # MLA, DeepGEMM MoE, DeepEP LL all measured
    roofline = make_cost_model("roofline", model, hw, par, role="decode").step_time_s(ranks)
    assert 0.5 < step / roofline < 2.5
    # low-latency dispatch is per GPU: doubling every rank's batch less than doubles the step
    assert step < decode.step_time_s([BatchShape(decode_reqs=64,
                                                 decode_context_tokens=64 * 2048)] * 8) < 2 * step
    # two-batch overlap at a small batch only adds a micro-batch's compute: slower, as in SGLang
    tbo = par.model_copy(update={"two_batch_overlap": True})
    overlapped = make_cost_model("silicon", model, hw, tbo, role="decode")
    assert overlapped.step_time_s(ranks) > step
    # one request per rank: SGLang's first micro-batch is empty, so overlap changes little
    one = [BatchShape(decode_reqs=1, decode_context_tokens=2048)] * 8
    assert decode.step_time_s(one) <= overlapped.step_time_s(one) < 1.05 * decode.step_time_s(one)


@needs_tables
def test_speculative_verify_grows_attention_and_counts_as_extrapolated():
    model, hw = load_model_spec("llama-3.1-8b"), load_hardware_spec("h100")
    cost = make_cost_model("silicon", model, hw, Parallelism())
    one = cost.step_time_s([BatchShape(decode_reqs=32, decode_context_tokens=32 * 4096)])
    assert cost.extrapolated_lookups == 0
    four = cost.step_time_s([BatchShape(decode_reqs=32, decode_context_tokens=32 * 4096,
                                        decode_query_len=4)])
    assert one < four < 4 * one
    assert cost.extrapolated_lookups == 0
    assert cost.transferred_lookups == 1  # the 4-query attention lookup, moved from 1 query


@needs_tables
def test_mla_verify_attention_is_at_most_the_one_query_kernel_at_as_many_flops():
    """DP attention puts all 128 of DeepSeek-V3's heads on a rank, where FlashMLA's decode is
    compute-bound: 4 queries of 32 requests cost the FLOPs of 128 one-query requests, which
    the table measures faster than 4 times 32 (a larger batch's efficiency) while reading 4
    times the KV. The verify step is priced at most at that."""
    model, hw = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    cost = make_cost_model("silicon", model, hw,
                           Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep"))

    def kernel(reqs: int, q: int = 1) -> float:  # one layer's decode attention kernel
        shape = BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * 2048,
                           decode_query_len=q)
        return sum(s * share for *_, s, _, _, share in cost._generation_attention(shape, reqs))

    assert kernel(32, 4) == pytest.approx(kernel(128))
    assert kernel(32, 4) < 0.7 * 4 * kernel(32)  # the q-fold of a 32-request kernel


@needs_tables
def test_auto_falls_back_to_the_roofline_when_an_op_has_no_table():
    model = load_model_spec("deepseek-v3")
    par = Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep")
    l40s = load_hardware_spec("l40s")  # no DeepEP tables
    assert type(make_cost_model("auto", model, l40s, par)).__name__ == "RooflineCostModel"
    with pytest.raises(ValueError, match="no DeepEP tables"):
        make_cost_model("silicon", model, l40s, par)


def test_without_the_package_silicon_says_how_to_install_and_auto_uses_the_roofline(
        monkeypatch):
    monkeypatch.setattr(tables, "systems_dir", lambda: None)
    model, h100 = load_model_spec("tiny-llama"), load_hardware_spec("h100")
    with pytest.raises(ValueError, match=r"pip install 'pdsim\[silicon\]'"):
        make_cost_model("silicon", model, h100, Parallelism())
    assert resolve_cost_model("auto", h100) == "roofline"
    assert type(make_cost_model("auto", model, h100, Parallelism())).__name__ == (
        "RooflineCostModel")


@needs_tables
def test_silicon_breakdown_adds_up_and_dense_dp_drops_the_collective():
    model, h200 = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    shapes = [BatchShape(decode_reqs=100, decode_context_tokens=100_000)] * 16
    parts = {}
    for dense_tp in (None, 1):
        par = Parallelism(tp=16, dp_attention=16, ep=16, moe_a2a="deepep", two_batch_overlap=True,
                          moe_dense_tp=dense_tp, dp_lm_head=dense_tp == 1)
        cost = make_cost_model("silicon", model, h200, par, role="decode")
        parts[dense_tp] = cost.step_breakdown_s(shapes)
        assert sum(parts[dense_tp].values()) == pytest.approx(cost.step_time_s(shapes), rel=1e-12)
    # Over 16 GPUs in two nodes the gathered dense MLP pays an all-gather + reduce-scatter of
    # all 1600 tokens across the nodes, more than running the MLP whole on each GPU, which has
    # no collective; the MoE layers are alike.
    assert parts[None]["dense_comm"] > parts[1]["dense_mlp"] and parts[1]["dense_comm"] == 0
    assert parts[None]["moe_comm"] == parts[1]["moe_comm"]


@needs_tables
def test_mxfp4_experts_read_the_activations_sglang_gives_them():
    """gpt-oss's MXFP4 experts: MXFP8 activations on Blackwell's FP4 tensor cores (SGLang's
    trtllm-gen MoE at --flashinfer-mxfp4-moe-precision default), BF16 on Hopper (weight-only);
    a curve reads those rows as measured."""
    oss = load_model_spec("gpt-oss-120b")
    shape = (oss.hidden_size, oss.moe_intermediate_size, oss.experts_per_token, oss.num_experts)
    read = {}
    for system, gpu, dtype in (("b200_sxm", "b200", "w4a8_mxfp4_mxfp8"),
                               ("h200_sxm", "h200", "w4a16_mxfp4")):
        ops = OpTables(system, "sglang", "current", load_hardware_spec(gpu))
        t = tables.read_table(tables.table_path(system, "moe", "sglang", ops.version,
                                                "moe_perf.parquet"))
        rows = t[(t.moe_dtype == dtype) & (t.distribution == "power_law_1.2")
                 & (t.hidden_size == shape[0]) & (t.inter_size == shape[1]) & (t.topk == shape[2])
                 & (t.num_experts == shape[3]) & (t.moe_tp_size == 1) & (t.moe_ep_size == 1)
                 & (t.num_tokens == 8192)]
        read[gpu] = ops.moe(*shape, 1, 1, "mxfp4", "power_law_1.2")(8192)
        assert read[gpu] == pytest.approx(rows.latency.min() * 1e-3, rel=1e-9)
    assert read["b200"] < read["h200"] / 2  # the same layer with BF16 activations: 3.3x slower
