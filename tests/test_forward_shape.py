"""The shape SGLang's kernels run a step at: CUDA-graph padding and DP attention's gather
(pdsim.sim.forward_shape), as both cost models price it."""

from __future__ import annotations

import pytest

from pdsim.core.batch import BatchShape
from pdsim.sim.cost import Parallelism, make_cost_model, tbo_splits
from pdsim.sim.forward_shape import (
    StepShaper, capture_batch_sizes, graph_alignment, mlp_gathers, step_totals,
)
from pdsim.sim.silicon import tables
from pdsim.specs.hardware import load_hardware_spec
from pdsim.specs.models import model_preset

H100, H200 = load_hardware_spec("h100"), load_hardware_spec("h200")
LLAMA_70B, DSV3 = model_preset("llama-3.1-70b"), model_preset("deepseek-v3")
COST_MODELS = ["roofline", pytest.param("silicon", marks=pytest.mark.skipif(
    tables.systems_dir() is None, reason="aiconfigurator-core not installed"))]


def decode(reqs: int, context_each: int = 2048, query_len: int = 1) -> BatchShape:
    return BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * context_each,
                      decode_query_len=query_len)


def test_sglangs_default_capture_sizes():
    sizes = capture_batch_sizes(512, speculative=False)
    assert sizes[:8] == (1, 2, 4, 8, 12, 16, 24, 32)
    assert 256 in sizes and 264 not in sizes and 272 in sizes and sizes[-2:] == (496, 512)
    assert capture_batch_sizes(100, speculative=False)[-3:] == (88, 96, 100)  # max_bs kept
    spec = capture_batch_sizes(160, speculative=True)
    assert spec[:10] == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12) and 44 in spec and 46 not in spec
    assert capture_batch_sizes(64, speculative=False, alignment=8) == (8, 16, 24, 32, 40, 48,
                                                                        56, 64)
    assert capture_batch_sizes(0, speculative=False) == ()


def test_which_steps_gather_the_mlp_and_what_a_graph_size_must_divide():
    large_ep = dict(tp=32, dp_attention=32, ep=32, moe_a2a="deepep")
    assert mlp_gathers(8, "none", None, False)
    assert mlp_gathers(32, "deepep", None, True)  # the dense MLP still gathers
    assert not mlp_gathers(32, "deepep", 1, True)  # SGLang's large-EP recipe
    assert not mlp_gathers(1, "none", None, False)
    assert graph_alignment(Parallelism(**large_ep, two_batch_overlap=True)) == 2
    assert graph_alignment(Parallelism(tp=8, ep=8, moe_a2a="deepep")) == 8  # scattered over 8
    assert graph_alignment(Parallelism(tp=8)) == 1


def test_a_graphed_decode_pads_to_the_next_captured_size():
    shaper = StepShaper(Parallelism(tp=8), cuda_graph_max_bs=512)
    step = shaper([decode(65)])
    assert step.ranks == (BatchShape(decode_reqs=72, decode_context_tokens=65 * 2048 + 7),)
    assert step.totals.tokens == 72 and step.raw_totals.tokens == 65
    assert shaper([decode(600)]).ranks == (decode(600),)  # above the graphs: eager, as it is
    extend = [BatchShape(prefill_tokens=65, prefill_attn_pairs=65 * 33)]
    assert shaper(extend).ranks == tuple(extend)
    assert StepShaper(Parallelism(tp=8), 512, padding=False)([decode(65)]).ranks == (decode(65),)
    assert StepShaper(Parallelism(tp=8), 512, capture_bs=(64, 128))([decode(65)]).totals.tokens \
        == 128
    # speculative verify steps replay the finer list: 9 requests of 4 tokens run as 10, not 12
    assert shaper([decode(9, query_len=4)]).totals.tokens == 10 * 4
    assert shaper([decode(9)]).totals.tokens == 12


def test_dp_attention_pads_every_rank_to_the_busiest_when_it_gathers():
    gathered = StepShaper(Parallelism(tp=8, dp_attention=8, ep=8), cuda_graph_max_bs=512)
    ranks = [decode(n) for n in (64, 50, 30, 20, 60, 45, 10, 0)]
    step = gathered(ranks)
    assert [s.decode_reqs for s in step.ranks] == [64] * 8  # idle rank included
    assert step.totals.tokens == 8 * 64 and step.raw_totals.tokens == 279
    # eagerly (no graphs): the padded gather when it costs at most twice the sum (MAX_LEN)...
    eager = StepShaper(Parallelism(tp=8, dp_attention=8, ep=8), cuda_graph_max_bs=0)
    assert eager(ranks).totals.tokens == 8 * 64
    # ...else the sum (SUM_LEN): one busy rank of eight
    lone = [decode(64)] + [BatchShape()] * 7
    assert eager(lone).totals.tokens == 64 and gathered(lone).totals.tokens == 8 * 64
    # an extend on any rank gathers the sum
    mixed = [BatchShape(prefill_tokens=512, prefill_attn_pairs=512 * 257)] + ranks[1:]
    assert gathered(mixed).ranks == tuple(mixed)
    # without the gather (SGLang's large-EP flags) each rank replays its own size
    own = StepShaper(Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep", moe_dense_tp=1,
                                 dp_lm_head=True), cuda_graph_max_bs=512)
    assert [s.decode_reqs for s in own(ranks).ranks] == [64, 56, 32, 24, 64, 48, 12, 0]


@pytest.mark.parametrize("name", COST_MODELS)
def test_cost_models_price_the_padded_batch(name):
    par = Parallelism(tp=8)
    padded = make_cost_model(name, LLAMA_70B, H100, par, role="decode")
    unpadded = make_cost_model(name, LLAMA_70B, H100, par, role="decode",
                               cuda_graph_padding=False)
    parts = padded.step_breakdown_s([decode(65)])
    as_72 = unpadded.step_breakdown_s([decode(72)])
    assert {k: v for k, v in parts.items() if k != "attention"} == pytest.approx(
        {k: v for k, v in as_72.items() if k != "attention"}, rel=1e-12)
    # the attention block's GEMMs run 72 rows, its kernel the 65 requests' contexts
    assert unpadded.step_breakdown_s([decode(65)])["attention"] < parts["attention"] \
        < as_72["attention"]
    assert sum(parts.values()) == pytest.approx(padded.step_time_s([decode(65)]), rel=1e-12)
    assert padded.step_time_s([decode(65)]) > unpadded.step_time_s([decode(65)])


@pytest.mark.parametrize("name", COST_MODELS)
def test_uneven_dp_ranks_pay_the_busiest_ranks_batch_on_every_rank(name):
    cost = make_cost_model(name, DSV3, H200, Parallelism(tp=8, dp_attention=8, ep=8),
                           role="decode", expert_imbalance=False)
    uneven = [decode(40)] + [decode(8)] * 7
    # the attention waits for the busiest rank, the MLP runs 8 x 40 rows
    assert cost.step_time_s(uneven) == pytest.approx(cost.step_time_s([decode(40)] * 8),
                                                     rel=1e-9)
    assert cost.step_time_s(uneven) > 1.1 * cost.step_time_s([decode(8)] * 8)


@pytest.mark.parametrize("name", COST_MODELS)
def test_deepep_dispatches_and_routes_the_scheduler_batch_not_the_padding(name):
    """SGLang masks padded rows' top-k (`num_token_non_padded`): under DeepEP the padding
    costs attention and the per-GPU layers only."""
    par = Parallelism(tp=32, dp_attention=32, ep=32, moe_a2a="deepep", moe_dense_tp=1,
                      dp_lm_head=True)
    make = lambda **p: make_cost_model(name, DSV3, H200, par, role="decode",  # noqa: E731
                                       expert_imbalance=False, **p)
    ranks = [decode(33)] * 32
    padded, unpadded = make().step_breakdown_s(ranks), make(
        cuda_graph_padding=False).step_breakdown_s(ranks)
    for part in ("moe_experts", "moe_comm"):
        assert padded[part] == pytest.approx(unpadded[part], rel=1e-12), part
    assert padded["attention"] != unpadded["attention"]  # 40 rows through its GEMMs
    if name == "roofline":  # the measured GEMM tables need not rise from 33 rows to 40
        assert padded["attention"] > unpadded["attention"]
        assert padded["dense_mlp"] > unpadded["dense_mlp"]


def test_two_batch_overlap_runs_only_when_every_busy_rank_agrees():
    par = Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep", two_batch_overlap=True)
    extend = BatchShape(prefill_tokens=2048, prefill_attn_pairs=2048 * 1024.5)
    assert tbo_splits(par, "colocated", [decode(64)] * 8)
    assert tbo_splits(par, "colocated", [extend] * 4 + [BatchShape()] * 4)
    assert not tbo_splits(par, "colocated", [extend] + [decode(64)] * 7)
    assert not tbo_splits(par, "decode", [extend] * 8)  # an extend under low-latency DeepEP
    assert not tbo_splits(Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep"),
                          "colocated", [decode(64)] * 8)


@pytest.mark.parametrize("name", COST_MODELS)
def test_a_step_two_batch_overlap_leaves_whole_launches_once(name):
    tbo = make_cost_model(name, DSV3, H200, Parallelism(
        tp=8, dp_attention=8, ep=8, moe_a2a="deepep", two_batch_overlap=True),
        role="colocated", expert_imbalance=False)
    plain = make_cost_model(name, DSV3, H200, Parallelism(
        tp=8, dp_attention=8, ep=8, moe_a2a="deepep"), role="colocated",
        expert_imbalance=False)
    mixed = [BatchShape(prefill_tokens=2048, prefill_attn_pairs=2048 * 1024.5)] + [
        decode(64)] * 7
    assert tbo.step_breakdown_s(mixed) == pytest.approx(plain.step_breakdown_s(mixed))


def test_step_totals_count_an_extends_lm_row():
    totals = step_totals([BatchShape(prefill_tokens=100, prefill_attn_pairs=5050),
                          decode(3), BatchShape()])
    assert totals == (103, 100, 4, 3, True)


def test_a_speculating_instance_replays_every_graph_at_sglangs_speculative_sizes():
    """SGLang captures a speculating server's graphs at the speculative list (1..8 each):
    the draft's one-token forwards too, not at the plain list's 1, 2, 4, 8. The verify's
    graphs keep the sizes whose bs * num_draft_tokens tokens are a multiple of mul_base, the
    draft's those whose bs is (get_batch_sizes_to_capture's num_tokens_per_bs)."""
    plain = StepShaper(Parallelism(tp=8), 256)
    target, draft = plain.speculating(verify=True), plain.speculating(verify=False)
    assert [plain.padded_reqs(n, 1) for n in (3, 5, 9)] == [4, 8, 12]
    assert [draft.padded_reqs(n, 1) for n in (3, 5, 9)] == [3, 5, 10]
    assert [target.padded_reqs(n, 4) for n in (3, 5, 9)] == [3, 5, 10]
    # TP 8 with DeepEP, no DP attention: the input sits in a buffer gathered over 8 GPUs
    deepep = StepShaper(Parallelism(tp=8, ep=8, moe_a2a="deepep"), 256)
    assert graph_alignment(Parallelism(tp=8, ep=8, moe_a2a="deepep")) == 8
    assert deepep.speculating(verify=True).padded_reqs(3, 4) == 4  # 3 * 4 tokens: 4 * 4 = 16
    assert deepep.speculating(verify=True).padded_reqs(3, 3) == 8  # 8 * 3 = 24
    assert deepep.speculating(verify=False).padded_reqs(3, 4) == 8  # the draft extend's graph


def test_the_speculative_cost_model_prices_both_models_at_the_speculative_sizes():
    from pdsim.sim.speculative import draft_spec, make_speculative_cost_model
    from pdsim.specs import load_hardware_spec, load_model_spec

    v3 = load_model_spec("deepseek-v3")
    cost = make_speculative_cost_model("roofline", v3, load_hardware_spec("h200"),
                                       Parallelism(tp=8), draft_spec("mtp", v3), 3)
    assert (cost.target._shape.verify, cost.draft._shape.verify) == (True, False)
    one_each = BatchShape(decode_reqs=5, decode_context_tokens=5 * 1000)
    assert cost.draft._shape([one_each]).ranks[0].decode_reqs == 5  # not the plain list's 8
