"""The fused-MoE tables as the silicon model reads them: which measured rows time one rank's share
of a layer under expert parallelism without an all-to-all backend, the rows of other ranks'
experts SGLang's Triton kernel still moves, the rows that computed fewer experts than their
routing reaches, and the move from the tables' balanced routing to random routing."""

from __future__ import annotations

import pandas as pd
import pytest

from pdsim.core.batch import extend_shape
from pdsim.sim.cost import (
    ACT_BYTES, Parallelism, RooflineParams, make_cost_model, remote_row_bytes,
)
from pdsim.sim.silicon import tables
from pdsim.sim.silicon.ops import (
    EP_ROWS_MAX_SHARE, OpTables, underread_shapes, unshared_ep_shapes,
)
from pdsim.specs import load_hardware_spec, load_model_spec

needs_tables = pytest.mark.skipif(tables.systems_dir() is None,
                                  reason="aiconfigurator-core not installed")

DEEPSEEK = (7168, 2048, 8, 256)  # hidden, moe inter, top-k, experts


def _rows(shape: tuple, ep_share: dict[int, float], source: str = "sglang_fused_moe_triton"
          ) -> list[dict]:
    """A balanced table for one shape at moe_tp 1: 1 ms a token at EP 1, `ep_share[k]` of it
    at EP k."""
    h, i, k, e = shape
    return [dict(hidden_size=h, inter_size=i, topk=k, num_experts=e, moe_tp_size=1,
                 moe_ep_size=ep, num_tokens=n, latency=n * share, distribution="balanced",
                 kernel_source=source)
            for ep, share in ep_share.items() for n in (64, 1024, 16384)]


def test_ep_rows_that_take_as_long_as_ep_1_are_the_ones_not_read():
    shared = (6144, 2048, 8, 256)
    table = pd.DataFrame(_rows(shared, {1: 1.0, 2: 0.57, 8: 0.24})
                         + _rows(DEEPSEEK, {1: 1.0, 2: 1.0, 8: 0.66})
                         + _rows((4096, 1536, 8, 128), {1: 1.0}))  # no EP rows: no verdict
    assert unshared_ep_shapes(table) == {(*DEEPSEEK, 1)}
    # judged at the largest tokens both EP sizes measured, on the smallest EP size above 1
    edge = pd.DataFrame(_rows(shared, {1: 1.0, 4: EP_ROWS_MAX_SHARE + 0.01, 8: 0.2}))
    assert unshared_ep_shapes(edge) == {(*shared, 1)}


@needs_tables
def test_deepseek_v3_fused_experts_at_ep_price_a_ranks_share():
    """aiconfigurator's DeepSeek-V3 fused-MoE rows ran SGLang's own router (8 expert groups, top
    4) on logits whose group scores all tie, so EP 2 takes as long as EP 1 and EP 8 two thirds
    of it: pdsim reads them at EP 1 only and moves a shape measured per rank."""
    ops = OpTables("h200_sxm", "sglang", "current", load_hardware_spec("h200"))
    t = tables.read_table(tables.table_path("h200_sxm", "moe", "sglang", ops.version,
                                            "moe_perf.parquet"))
    t = t[t.moe_dtype == "fp8_block"]
    raw = t[(t.hidden_size == 7168) & (t.num_experts == 256) & (t.moe_tp_size == 1)
            & (t.distribution == "balanced") & (t.num_tokens == 16384)]
    by_ep = raw.groupby("moe_ep_size").latency.min()
    assert by_ep[2] == pytest.approx(by_ep[1], rel=0.02) and by_ep[8] > 0.6 * by_ep[1]
    assert (*DEEPSEEK, 1) in unshared_ep_shapes(t)
    assert (7168, 2048, 8, 384, 1) not in unshared_ep_shapes(t)  # Kimi-K2's shape halves

    at = {ep: ops.moe(*DEEPSEEK, 1, ep, "fp8", "balanced") for ep in (1, 2, 4, 8, 16, 32)}
    times = [at[ep](16384) for ep in sorted(at)]
    assert all(a > b for a, b in zip(times, times[1:]))
    assert times[1] < 0.65 * times[0] and times[3] < 0.35 * times[0]
    # its EP 1 rows are not read either (they compute half the experts: below)
    assert all(curve.transferred for curve in at.values())


@needs_tables
def test_a_rank_holding_one_expert_still_moves_every_tokens_rows():
    """At EP 256 a rank holds one of 256 experts and computes 1/256 of the pairs, yet SGLang's
    Triton kernel writes zeros for the other 255/256 rows of every token, the activation and
    the top-k sum pass over them: the measured row is that memory traffic."""
    ops = OpTables("h200_sxm", "sglang", "current", load_hardware_spec("h200"))
    t = tables.read_table(tables.table_path("h200_sxm", "moe", "sglang", ops.version,
                                            "moe_perf.parquet"))
    row = t[(t.moe_dtype == "fp8_block") & (t.hidden_size == 6144) & (t.inter_size == 2048)
            & (t.num_experts == 256) & (t.topk == 8) & (t.moe_tp_size == 1)
            & (t.moe_ep_size == 256) & (t.distribution == "balanced") & (t.num_tokens == 16384)]
    measured = row.latency.min() * 1e-3
    shape = (6144, 2048, 8, 256, 1, 256, "fp8")
    # those rows at the HBM's full rate are 73 % of the measured time, the rank's own work 3 %
    assert 0.6 < ops.moe_roofline(*shape, fused=True)(16384) / measured < 1.0
    assert ops.moe_roofline(*shape)(16384) < 0.1 * measured
    assert remote_row_bytes(6144, 2048, 8, 256) == pytest.approx(
        8 * 255 / 256 * (5 * 2048 + 2 * 6144) * ACT_BYTES)
    assert remote_row_bytes(6144, 2048, 8, 1) == 0.0


def test_the_roofline_adds_the_rows_of_other_ranks_experts_where_sglang_keeps_them():
    model = load_model_spec("deepseek-v3")
    tokens = 16384

    def experts_s(hw: str, **par) -> float:
        cost = make_cost_model("roofline", model, load_hardware_spec(hw), Parallelism(**par),
                               role="prefill", expert_imbalance=False)
        return cost.step_breakdown_s([extend_shape(tokens)])["moe_experts"]

    efficiency = RooflineParams().bw_efficiency
    mem = load_hardware_spec("h200").stream_gb_per_s * 1e9 * efficiency
    remote = model.num_moe_layers * tokens * remote_row_bytes(
        model.hidden_size, model.moe_intermediate_size, model.experts_per_token, 8) / mem
    # EP 8 and TP-MoE over 8 GPUs do the same FLOPs a GPU (their activation bytes differ a
    # little); EP adds the other ranks' rows
    assert experts_s("h200", tp=8, ep=8) - experts_s("h200", tp=8) == pytest.approx(remote,
                                                                                   rel=0.15)
    # FlashInfer's MoE on Blackwell gives a rank its own rows only: the experts at EP 8 take
    # less than those rows alone would at B200's rate
    b200 = load_hardware_spec("b200")
    assert experts_s("b200", tp=8, ep=8) < remote * mem / (b200.stream_gb_per_s * 1e9 * efficiency)


def _tp_rows(shape: tuple, ms_per_token: float, floor_ms: float) -> list[dict]:
    """Balanced EP 1 rows of one shape at moe_tp 1: `floor_ms` plus `ms_per_token` a token."""
    h, i, k, e = shape
    return [dict(hidden_size=h, inter_size=i, topk=k, num_experts=e, moe_tp_size=1,
                 moe_ep_size=1, num_tokens=n, latency=floor_ms + n * ms_per_token,
                 distribution="balanced", kernel_source="sglang_fused_moe_triton")
            for n in (1, 16, 32, 64, 1024)]


def test_rows_faster_than_reading_the_experts_they_reach_are_the_ones_not_read():
    hbm = 4800.0  # GB/s
    kimi = (7168, 2048, 8, 384)
    floor_ms = {s: s[3] * 3 * s[0] * s[1] / (hbm * 1e9) * 1e3 for s in (DEEPSEEK, kimi)}
    table = pd.DataFrame(_tp_rows(DEEPSEEK, 0.0, 0.6 * floor_ms[DEEPSEEK])
                         + _tp_rows(kimi, 1e-4, 1.4 * floor_ms[kimi]))
    assert underread_shapes(table, 1.0, hbm) == {(*DEEPSEEK, 1)}
    # a few tokens reach a few experts: only rows where balanced routing reaches every expert
    # (tokens * topk >= experts: 32 tokens for 256 experts of top 8) are held to the floor
    small = table[table.num_tokens < 32]
    assert underread_shapes(small, 1.0, hbm) == set()
    # 2-byte weights double the floor
    assert underread_shapes(table, 2.0, hbm) == {(*DEEPSEEK, 1), (*kimi, 1)}
    # weights an L2 cache may hold between a benchmark's repeats (50 MB here) are not judged
    cached = pd.DataFrame(_tp_rows((1024, 256, 8, 64), 0.0, 1e-6))
    assert underread_shapes(cached, 1.0, hbm) == set()


@needs_tables
@pytest.mark.parametrize("system,preset", [("h100_sxm", "h100"), ("h200_sxm", "h200")])
def test_deepseek_v3_fused_experts_at_tp_read_every_expert(system, preset):
    """aiconfigurator's DeepSeek-V3 rows at EP 1 (every moe_tp) come out faster than reading
    the experts balanced routing reaches, at the GPU's datasheet HBM rate: SGLang's grouped
    top-k kept half of them. pdsim moves Kimi-K2's shape (same hidden, inter and top-k, 384
    experts, read whole) instead, so a batch that reaches every expert reads every expert."""
    hw = load_hardware_spec(preset)
    ops = OpTables(system, "sglang", "current", hw)
    t = tables.read_table(tables.table_path(system, "moe", "sglang", ops.version,
                                            "moe_perf.parquet"))
    t = t[t.moe_dtype == "fp8_block"]
    bad = underread_shapes(t, 1.0, hw.hbm_gb_per_s)
    assert {(*DEEPSEEK, tp) for tp in (1, 2, 4, 8)} <= bad
    assert not {s for s in bad if s[:4] != DEEPSEEK}  # no other shape on Hopper
    rows = t[(t.hidden_size == 7168) & (t.num_experts == 256) & (t.moe_tp_size == 8)
             & (t.moe_ep_size == 1) & (t.distribution == "balanced")]
    floor_s = 256 * 3 * 7168 * 2048 / 8 / (hw.hbm_gb_per_s * 1e9)
    assert rows[rows.num_tokens == 64].latency.min() * 1e-3 < 0.9 * floor_s
    curve = ops.moe(*DEEPSEEK, 8, 1, "fp8", "balanced")
    assert curve.transferred
    assert all(curve(n) > floor_s for n in (64, 256, 1024))  # 512+ routed pairs: all 256 hit
    assert curve(1) < 0.2 * floor_s  # one token reads its 8 experts only


@needs_tables
def test_randomly_routed_tokens_reach_fewer_experts_than_the_tables_balanced_ones():
    """16 tokens of Qwen3-235B (top 8 of 128) reach all 128 experts balanced, 82 at random: the
    measured balanced row is moved by the two rooflines' ratio (not counted as a transfer),
    which lands near the row measured with power-law routing; with every expert reached
    either way, the measured row stands."""
    ops = OpTables("h200_sxm", "sglang", "current", load_hardware_spec("h200"))
    t = tables.read_table(tables.table_path("h200_sxm", "moe", "sglang", ops.version,
                                            "moe_perf.parquet"))
    rows = t[(t.moe_dtype == "bfloat16") & (t.hidden_size == 4096) & (t.inter_size == 1536)
             & (t.num_experts == 128) & (t.moe_tp_size == 8) & (t.moe_ep_size == 1)]
    by = rows.groupby(["distribution", "num_tokens"]).latency.min() * 1e-3
    curve = ops.moe(4096, 1536, 8, 128, 8, 1, "bf16", "balanced")
    assert not curve.transferred
    balanced = ops.moe_roofline(4096, 1536, 8, 128, 8, 1, "bf16")
    random = ops.moe_roofline(4096, 1536, 8, 128, 8, 1, "bf16", random=True)
    assert curve(16) == pytest.approx(by["balanced", 16] * random(16) / balanced(16), rel=1e-6)
    assert curve(16) < 0.75 * by["balanced", 16]
    assert curve(16) == pytest.approx(by["power_law_1.01", 16], rel=0.25)
    assert curve(4096) == pytest.approx(by["balanced", 4096], rel=1e-3)
    # under EP too: the mean rank's randomly routed copies reach fewer of its experts than
    # the balanced rows give it (the busiest rank is the model's `moe_busiest`)
    ep8 = t[(t.moe_dtype == "bfloat16") & (t.hidden_size == 4096) & (t.inter_size == 1536)
            & (t.num_experts == 128) & (t.moe_tp_size == 1) & (t.moe_ep_size == 8)
            & (t.distribution == "balanced") & (t.num_tokens == 16)].latency.min() * 1e-3
    to_random = ops.random_routing(4096, 1536, 8, 128, 1, 8, "bf16", True)
    assert to_random(16) < 0.8
    assert ops.moe(4096, 1536, 8, 128, 1, 8, "bf16", "balanced")(16) == pytest.approx(
        ep8 * to_random(16))
