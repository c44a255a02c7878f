"""Fused MoE under expert parallelism without an all-to-all backend: which measured rows time one
rank's share of a layer, and the rows of other ranks' experts SGLang's Triton kernel still moves."""

from __future__ import annotations

import pandas as pd
import pytest

from pdsim.core.batch import extend_shape
from pdsim.sim.cost import (
    ACT_BYTES, Parallelism, RooflineParams, make_cost_model, remote_row_bytes,
)
from pdsim.sim.silicon import tables
from pdsim.sim.silicon.ops import EP_ROWS_MAX_SHARE, OpTables, unshared_ep_shapes
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
    assert times[0] == pytest.approx(by_ep[1] * 1e-3, rel=1e-9) and not at[1].transferred
    assert all(a > b for a, b in zip(times, times[1:]))
    assert times[1] < 0.65 * times[0] and times[3] < 0.35 * times[0]
    assert all(at[ep].transferred for ep in (2, 4, 8, 16, 32))


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
