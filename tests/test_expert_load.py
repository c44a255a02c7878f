"""Expert load imbalance under EP, EPLB, and DeepEP's low-latency batch cap."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchShape
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim.sim.expert_load import LAYER_DRAWS, ExpertLoad, eplb_shares, popularity
from pdsim.sim.silicon import tables
from pdsim.specs import load_hardware_spec, model_preset

DSV3 = model_preset("deepseek-v3")
H200 = load_hardware_spec("h200")
WORKLOAD = {"num_requests": 1, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
            "input_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": 4}}


def load(ep: int, redundant: int | None = None, seed: int = 0) -> ExpertLoad:
    return ExpertLoad(DSV3.num_experts, DSV3.experts_per_token, ep, redundant, seed)


def test_one_rank_is_never_imbalanced() -> None:
    one = load(1)
    assert [one.imbalance(t) for t in (1, 7, 128, 100_000)] == [1.0] * 4


def test_imbalance_grows_with_ep_at_a_fixed_batch_per_rank() -> None:
    factors = [load(ep).imbalance(128 * ep) for ep in (2, 8, 16, 32, 72)]
    assert all(b > a for a, b in zip(factors, factors[1:])), factors
    assert factors[0] > 1.0


def test_few_tokens_are_noise_bound_many_are_skew_bound() -> None:
    # One token's 8 copies over 8 ranks: the busiest rank gets 2-3 of them on average; with
    # millions of tokens the noise averages out and the factor is the layers' mean busiest
    # share of the popularity (the skew alone), which is above 1.
    ep8 = load(8)
    assert 2.0 < ep8.imbalance(1) < 3.0
    factors = [ep8.imbalance(t) for t in (1, 16, 256, 4096)]
    assert all(b < a for a, b in zip(factors, factors[1:])), factors
    skew = float(np.mean(ep8._shares.max(axis=1))) * 8
    assert ep8.imbalance(4_000_000) == pytest.approx(skew, rel=0.01)
    assert skew > 1.2


def test_eplb_and_redundant_experts_reduce_the_imbalance() -> None:
    # EP 64: four experts per rank. Packing by load already evens the ranks out; the hottest
    # expert alone outweighs a rank's share, and only copies of it split that load.
    tokens = 64 * 256
    default, packed, copies = load(64).imbalance(tokens), load(64, 0).imbalance(tokens), \
        load(64, 64).imbalance(tokens)
    assert default > packed > copies > 1.0
    assert copies < 0.85 * packed


def test_eplb_packing_fills_every_rank_and_keeps_the_load() -> None:
    pop = popularity(256, np.random.default_rng(3))
    shares = eplb_shares(pop, ep=72, redundant=32)
    assert shares.sum() == pytest.approx(1.0) and len(shares) == 72
    assert shares.max() < 1.5 / 72  # the default placement puts ~3x the mean on its busiest


def test_imbalance_is_seeded() -> None:
    a, b, other = load(32, seed=5), load(32, seed=5), load(32, seed=6)
    assert a.imbalance(4096) == b.imbalance(4096)
    assert np.array_equal(a._shares, b._shares) and len(a._shares) == LAYER_DRAWS
    assert a.imbalance(4096) != other.imbalance(4096)


def test_redundant_experts_are_checked_against_the_ep_size() -> None:
    with pytest.raises(ValueError, match="256 experts \\+ 0 copies must split evenly over "
                                         "ep=72 ranks; e.g. 32 or 104"):
        load(72, 0)
    with pytest.raises(ValueError, match="needs expert parallelism"):
        load(1, 8)
    with pytest.raises(ValueError, match=">= 0"):
        load(8, -8)


def deepep(ep: int, name: str = "roofline", **params) -> object:
    par = Parallelism(tp=ep, dp_attention=ep, ep=ep, moe_a2a="deepep", moe_dense_tp=1,
                      dp_lm_head=True)
    return make_cost_model(name, DSV3, H200, par, role="decode", **params)


@pytest.mark.parametrize("name", [
    "roofline",
    pytest.param("silicon", marks=pytest.mark.skipif(tables.systems_dir() is None,
                                                     reason="aiconfigurator-core not installed")),
])
@pytest.mark.slow
def test_a_step_at_ep_32_costs_more_with_imbalance(name: str) -> None:
    shapes = [BatchShape(decode_reqs=128, decode_context_tokens=128 * 2048)] * 32
    flat = deepep(32, name, expert_imbalance=False).step_breakdown_s(shapes)
    skewed = deepep(32, name).step_breakdown_s(shapes)
    balanced = deepep(32, name, eplb_redundant_experts=32).step_breakdown_s(shapes)
    for part in ("moe_experts", "moe_comm"):
        assert skewed[part] > balanced[part] > flat[part], part
    assert skewed["attention"] == flat["attention"]
    assert sum(skewed.values()) > 1.1 * sum(flat.values())


def experiment(decode: dict, **extra) -> object:
    return parse_experiment({
        "name": "x", "model": "deepseek-v3", "hardware": "h200",
        "cost_model": {"name": "roofline"},
        "cluster": {"prefill": {"tp": 8, "ep": 8, "dp_attention": 8, "moe_a2a": "deepep"},
                    "decode": decode},
        "workload": WORKLOAD, **extra})


DECODE = {"tp": 16, "ep": 16, "dp_attention": 16, "moe_a2a": "deepep",
          "scheduler": {"max_running_requests": 16 * 256}}


def test_low_latency_dispatch_caps_the_decode_batch_per_rank() -> None:
    assert build_cluster(experiment(DECODE)).decode.scheduler.max_running_requests == 128
    raised = {**DECODE, "num_max_dispatch_tokens_per_rank": 256}
    assert build_cluster(experiment(raised)).decode.scheduler.max_running_requests == 256
    # Two-batch overlap dispatches each half of the batch in its own call.
    tbo = {**DECODE, "two_batch_overlap": True}
    assert build_cluster(experiment(tbo)).decode.scheduler.max_running_requests == 256
    # A given max_running_requests above the cap is priced at it, and the run says so.
    assert any("max_running_requests 4096 (256 a DP rank) is above DeepEP's low-latency cap "
               "of 128" in note for note in build_cluster(experiment(DECODE)).notes)
    assert not any("low-latency cap" in n for n in build_cluster(experiment(tbo)).notes)
    # Speculative decoding's verify step carries 1 + 3 tokens a request: 128 // 4.
    spec = experiment(DECODE, speculative={"method": "mtp", "num_draft_tokens": 3,
                                             "acceptance": {"mean_accept_len": 2.0}})
    assert build_cluster(spec).decode.scheduler.max_running_requests == 32
    # Without DeepEP there is no dispatch buffer, and prefill runs normal mode.
    cluster = build_cluster(experiment({**DECODE, "moe_a2a": "none"}))
    assert cluster.decode.scheduler.max_running_requests == 256
    assert build_cluster(experiment(DECODE)).prefill.scheduler.max_running_requests > 128


def test_eplb_and_imbalance_reach_the_cost_model_and_are_checked() -> None:
    cluster = build_cluster(experiment({**DECODE, "eplb": {"redundant_experts": 32},
                                        "expert_imbalance": True}))
    cost = cluster.decode.cost()
    assert cost.params.eplb_redundant_experts == 32 and cost._load.redundant_experts == 32
    assert build_cluster(experiment({**DECODE, "expert_imbalance": False})).decode.cost()._load \
        is None
    with pytest.raises(ConfigError, match="cluster.decode: eplb.redundant_experts=8: 256 "
                                          "experts \\+ 8 copies must split evenly over ep=16"):
        build_cluster(experiment({**DECODE, "eplb": {"redundant_experts": 8}}))
    with pytest.raises(ValueError, match="eplb balances experts over expert-parallel ranks: "
                                         "it needs ep > 1"):
        experiment({"tp": 8, "eplb": {"redundant_experts": 0}})
    with pytest.raises(ValueError, match="redundant_experts"):
        experiment({**DECODE, "eplb": {"redundant_experts": -1}})


def test_redundant_experts_take_memory_and_are_read() -> None:
    """SGLang builds each MoE layer with n_routed_experts + --ep-num-redundant-experts physical
    experts: at EP 8 with 32 copies a GPU holds 36 experts a layer instead of 32."""
    ep8 = {"tp": 8, "ep": 8, "dp_attention": 8, "moe_a2a": "deepep"}
    plain = build_cluster(experiment(ep8))
    copies = build_cluster(experiment({**ep8, "eplb": {"redundant_experts": 32}}))
    extra = 32 // 8 * DSV3.num_moe_layers * DSV3.expert_params  # FP8: a byte a weight
    assert copies.decode.weight_bytes_per_gpu - plain.decode.weight_bytes_per_gpu == extra
    assert extra / 2**30 > 9  # 9.5 GiB: the KV pool gives it up
    pool = {name: c.decode.scheduler.num_pages * c.decode.scheduler.page_size
            for name, c in (("plain", plain), ("copies", copies))}
    assert pool["copies"] < 0.8 * pool["plain"]
    # A weight-bound decode step reads the copies too (uniform routing: the load alone).
    shapes = [BatchShape(decode_reqs=32, decode_context_tokens=32 * 2048)] * 8
    for name in ("roofline", "silicon"):
        if name == "silicon" and tables.systems_dir() is None:
            continue
        par = Parallelism(**ep8)
        read = {n: make_cost_model(name, DSV3, H200, par, expert_imbalance=False,
                                   eplb_redundant_experts=n).step_breakdown_s(shapes)["moe_experts"]
                for n in (0, 32)}
        assert 1.03 < read[32] / read[0] < 36 / 32 + 0.01, (name, read)


def test_fused_moe_under_ep_matches_the_tables_skewed_rows() -> None:
    """Without DeepEP every rank runs the fused kernel over all tokens; the busiest rank holds
    more rows, and at a few tokens reaches more of its experts than the mean rank (randomly
    routed copies: 9.7 of Qwen3-235B's 16 a rank at EP 8 and 8 tokens, against 6.5). Its
    weight reads are what the skew costs there: aiconfigurator's rows measured with power-law
    routing (alpha 1.2, the busiest rank) at 8 tokens are 114 us on H100, the balanced rows
    126 us; their synthetic routing (rounded expected counts) reaches fewer experts than
    random copies do, so pdsim's busiest rank sits above them there (147 us)."""
    if tables.systems_dir() is None:
        pytest.skip("aiconfigurator-core not installed")
    qwen = model_preset("qwen3-235b-a22b")
    par = Parallelism(tp=8, ep=8)
    h100 = load_hardware_spec("h100")

    def routed(tokens: int, **params) -> float:
        cost = make_cost_model("silicon", qwen, h100, par, **params)
        shape = [BatchShape(decode_reqs=tokens, decode_context_tokens=tokens * 2048)]
        return cost.step_breakdown_s(shape)["moe_experts"] / qwen.num_moe_layers

    for tokens in (8, 128, 1024):  # against the table's own busiest rank
        skewed = routed(tokens, moe_distribution="power_law_1.2")
        assert routed(tokens) == pytest.approx(skewed, rel=0.2 if tokens > 8 else 0.35), tokens
        assert routed(tokens) >= routed(tokens, expert_imbalance=False)
    # the mean rank's 6.5 experts against the busiest rank's 9.7: less than 1.5x
    assert routed(8) < 1.5 * routed(8, expert_imbalance=False)


def test_each_model_family_routes_with_aiconfigurators_exponent() -> None:
    """aiconfigurator fits 1.01 for DeepSeek-V3's architecture and uses 1.2 for its generic MoE
    models; the steeper law concentrates more load on the hot experts, so Qwen3's busiest rank
    carries more at the same EP."""
    par = Parallelism(tp=8, ep=8)
    qwen3, kimi = model_preset("qwen3-235b-a22b"), model_preset("kimi-k2")
    assert [make_cost_model("roofline", m, H200, par)._load.alpha
            for m in (DSV3, kimi, qwen3)] == [1.01, 1.01, 1.2]
    qwen3_load = make_cost_model("roofline", qwen3, H200, par)._load
    flat = ExpertLoad(qwen3.num_experts, qwen3.experts_per_token, 8, alpha=1.01)
    assert qwen3_load.imbalance(4096) > 1.05 * flat.imbalance(4096)


def test_experts_that_do_not_split_over_the_ranks_are_noted_as_sglang_refuses_them(tmp_path):
    """SGLang asserts that the physical experts divide by the EP size (expert_location.py),
    EPLB or not: such a point is priced (its uneven blocks) and noted, by `pdsim check` too."""
    ep72 = {"tp": 72, "ep": 72, "dp_attention": 72, "moe_a2a": "deepep",
            "scheduler": {"mem_fraction_static": 0.88}}
    (note,) = build_cluster(experiment(ep72)).notes
    assert note.startswith("decode: ep=72 does not divide deepseek-v3's 256 experts")
    assert "`eplb: {redundant_experts: 32}`" in note
    assert build_cluster(experiment({**ep72, "eplb": {"redundant_experts": 32}})).notes == ()
    assert not any("does not divide" in n  # 256 over 16
                   for n in build_cluster(experiment(DECODE)).notes)
    config = tmp_path / "ep72.yaml"
    config.write_text(yaml.safe_dump({
        "name": "x", "model": "deepseek-v3", "hardware": "h200", "cost_model": {"name": "roofline"},
        "cluster": {"prefill": {"tp": 8, "ep": 8, "dp_attention": 8, "moe_a2a": "deepep"},
                    "decode": ep72}, "workload": WORKLOAD}))
    result = CliRunner().invoke(app, ["check", str(config)])
    assert result.exit_code == 0 and "refuses without EPLB" in " ".join(result.output.split())
