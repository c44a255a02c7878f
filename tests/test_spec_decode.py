"""Speculative decoding in the simulator: acceptance, the verify step's price, exact lengths,
pools, determinism, and the draft state that moves with the KV in PD."""

from __future__ import annotations

import math

import numpy as np
import pytest

from configs import scheduler_config
from core_harness import Driver, FixedExecutor
from pdsim import sglang_defaults
from pdsim.config import ConfigError, SpeculativeConfig, parse_experiment
from pdsim.core.batch import BatchResult, BatchShape
from pdsim.core.pool import PagePool
from pdsim.core.request import Request
from pdsim.core.running import Speculation, SpeculativeRunningBatch
from pdsim.core.records import RequestRecord
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.metrics import SLO, records_frame, summarize
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.sim.cost import Parallelism, kv_capacity_tokens, make_cost_model
from pdsim.sim.speculative import (
    accept_len_probs,
    draft_spec,
    make_speculative_cost_model,
    rate_for_mean_accept_len,
)
from pdsim.specs import load_hardware_spec, load_model_spec
from pdsim.workload import generate

MTP3 = {"method": "mtp", "num_draft_tokens": 3, "acceptance": {"rates": [0.8, 0.7, 0.6]}}


def joined(rb: SpeculativeRunningBatch, rid: str, n_in: int, n_out: int) -> Request:
    """A request just out of its prefill (prompt KV, first token at t=0), joined to `rb`."""
    r = Request(rid, n_in, n_out)
    r.pages = rb.pool.alloc_many(-(-n_in // rb.page_size))
    r.computed_tokens, r.num_output, r.token_times_s = n_in, 1, [0.0]
    rb.join(r)
    return r


def run_to_end(rb: SpeculativeRunningBatch) -> int:
    """Step the batch until it is empty, giving pages as asked; the request-steps it ran."""
    request_steps, t = 0, 0.0
    while rb.reqs:
        for r in rb.pages_due():
            rb.add_page(r, rb.pool.alloc())
        for r in rb.reqs:  # every request holds the pages its verify writes into
            assert len(r.pages) * rb.page_size >= min(rb.kv_len(r) + rb._query_len,
                                                      r.input_len + r.max_new_tokens)
        assert rb.context_tokens == sum(rb.kv_len(r) for r in rb.reqs)
        batch = rb.plan(t)
        request_steps += len(rb.reqs)
        t += 1.0
        for r in rb.complete(batch, BatchResult(1.0), t):
            rb.leave(r)
    return request_steps


# ----- acceptance --------------------------------------------------------------------------


def test_accept_length_distribution_from_rates_and_from_a_mean():
    assert accept_len_probs([0.9, 0.5]) == pytest.approx((0.1, 0.45, 0.45))
    p = rate_for_mean_accept_len(2.35, 3)
    assert 1 + p + p**2 + p**3 == pytest.approx(2.35)
    cfg = SpeculativeConfig(method="mtp", num_draft_tokens=2, acceptance={"rates": [0.9, 0.5, 0.1]})
    assert cfg.accept_len_probs() == pytest.approx((0.1, 0.45, 0.45))  # first k rates
    one = SpeculativeConfig(method="mtp", num_draft_tokens=2, acceptance={"rates": [0.5]})
    assert one.accept_len_probs() == pytest.approx((0.5, 0.25, 0.25))


@pytest.mark.parametrize("k, acceptance", [
    (1, {"rates": [0.7]}), (3, {"rates": [0.8, 0.7, 0.6]}), (3, {"mean_accept_len": 2.4}),
])
def test_mean_tokens_per_request_step_is_the_configured_accept_length(k, acceptance):
    cfg = SpeculativeConfig(method="mtp", num_draft_tokens=k, acceptance=acceptance)
    spec = Speculation(k, cfg.accept_len_probs(), seed=5)
    rb = SpeculativeRunningBatch(PagePool(60_000, page_size=16), spec)
    reqs = [joined(rb, str(i), 100, 5000) for i in range(60)]
    steps = run_to_end(rb)
    emitted = sum(r.num_output - 1 for r in reqs)
    assert emitted / steps == pytest.approx(spec.mean_accept_len, rel=0.01)
    if "mean_accept_len" in acceptance:
        assert spec.mean_accept_len == pytest.approx(2.4)
    assert all(r.num_output == 5000 and len(r.token_times_s) == 5000 for r in reqs)
    assert rb.pool.num_free == 60_000 - sum(len(r.pages) for r in reqs)


def test_tokens_of_one_step_share_its_end_time_and_the_last_step_truncates():
    spec = Speculation(3, accept_len_probs([1.0, 1.0, 1.0]), seed=0)  # always 4 per step
    rb = SpeculativeRunningBatch(PagePool(64, page_size=4), spec)
    r = joined(rb, "a", 5, 11)  # 10 tokens left: 4 + 4 + 2
    assert r.emitted_by_step == [0, 4, 8, 10]
    assert run_to_end(rb) == 3
    assert r.token_times_s == [0.0] + [1.0] * 4 + [2.0] * 4 + [3.0] * 2
    assert (r.num_output, r.computed_tokens) == (11, 15)
    # Pages: before step 1 the verify writes kv 5..8 (needs 9 slots), step 2 13, step 3 capped
    # at input + max_new = 16: 4 pages, never more.
    assert len(r.pages) == 4


def test_a_verify_longer_than_a_page_gets_several_pages_in_one_step():
    spec = Speculation(4, accept_len_probs([1.0] * 4), seed=0)  # 5 query tokens, pages of 2
    rb = SpeculativeRunningBatch(PagePool(100, page_size=2), spec)
    r = joined(rb, "a", 2, 21)
    due = rb.pages_due()
    assert [x.rid for x in due] == ["a"] * 3  # needs 2 + 5 = 7 slots: 4 pages
    for x in due:
        rb.add_page(x, rb.pool.alloc())
    run_to_end(rb)
    # Four steps of 5 tokens; the last verify writes kv 17 + 5 = 22 slots: 11 pages.
    assert r.emitted_by_step is None and r.num_output == 21 and len(r.pages) == 11


def test_a_real_executor_returning_token_ids_is_refused():
    rb = SpeculativeRunningBatch(PagePool(8, page_size=4), Speculation(1, (0.5, 0.5)))
    joined(rb, "a", 4, 5)
    with pytest.raises(ValueError, match="simulated only"):
        rb.complete(rb.plan(0.0), BatchResult(1.0, token_ids=[3]), 1.0)


def test_retraction_under_a_small_pool_keeps_lengths_exact_and_returns_every_page():
    retracted = []

    class Counting(ColocatedScheduler):
        def _reserved_tokens(self):  # admit as if running requests would generate nothing
            return 0

        def _retract_one(self):
            retracted.append(self.running.step)
            return super()._retract_one()

    spec = Speculation(3, accept_len_probs([0.8, 0.6, 0.4]), seed=2)
    sched = Counting(scheduler_config(40, page_size=4, num_reserved_decode_tokens=4,
                                      speculation=spec))
    d = Driver(FixedExecutor(), log=False)
    d.add_instance("C", sched)
    lengths = {str(i): (8 + 3 * i, 30 + 7 * i) for i in range(8)}
    for rid, (n_in, n_out) in lengths.items():
        d.submit(0.1 * int(rid), "C", Request(rid, n_in, n_out))
    d.run()
    done = d.done("C")
    assert retracted, "the pool was meant to run out"
    assert sorted(r.rid for r in done) == sorted(lengths)
    for r in done:
        assert not r.error
        assert r.num_output == lengths[r.rid][1] == len(r.token_times_s)
        assert np.all(np.diff(r.token_times_s) >= 0)
    sched.check_pools_full()


def test_itl_gives_each_token_of_a_step_an_equal_share_of_its_gap_as_bench_serving_does():
    recs = [RequestRecord("a", 8, 5, "ok", arrival_s=0.0, first_token_s=0.0, finish_s=2.0,
                          token_times_s=[0.0, 1.0, 1.0, 1.0, 2.0]),  # a step emitting 3, then 1
            RequestRecord("b", 8, 3, "ok", arrival_s=0.0, first_token_s=0.0, finish_s=1.5,
                          token_times_s=[0.0, 0.5, 1.5])]
    frame = records_frame(recs)
    assert list(frame["itl_mean_s"]) == pytest.approx([0.5, 0.75])  # gap sums are kept
    assert list(frame["itl_max_s"]) == pytest.approx([1.0, 1.0])
    summary = summarize(recs, num_gpus=1, slo=SLO())
    # Pooled gaps: 1/3, 1/3, 1/3, 1 (a) and 0.5, 1 (b); none is zero.
    assert summary["itl_p50_s"] == pytest.approx(np.median([1 / 3] * 3 + [1, 0.5, 1]))


# ----- the verify step's price -------------------------------------------------------------


@pytest.mark.parametrize("model_name, tp", [("llama-3.1-8b", 1), ("deepseek-v3", 8)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_step_is_target_with_k_plus_1_queries_plus_k_draft_forwards(model_name, tp, k):
    model, hw, par = load_model_spec(model_name), load_hardware_spec("h200"), Parallelism(tp=tp)
    draft = draft_spec("mtp", model)
    spec_cost = make_speculative_cost_model("roofline", model, hw, par, draft, k)
    target = make_cost_model("roofline", model, hw, par)
    draft_cost = make_cost_model("roofline", draft, hw, par)
    n, ctx = 4, 2000
    plain = BatchShape(decode_reqs=n, decode_context_tokens=n * (ctx + 1))
    verify = BatchShape(decode_reqs=n, decode_context_tokens=n * (ctx + k + 1),
                        decode_query_len=k + 1)
    one_each = BatchShape(decode_reqs=n, decode_context_tokens=n * (ctx + k + 1))
    # SGLang replays the k - 1 one-token draft forwards as one CUDA graph: one step overhead
    expected = (target.step_time_s([verify]) + draft_cost.step_time_s([verify])
                + (k - 1) * draft_cost.step_time_s([one_each])
                - max(k - 2, 0) * draft_cost.params.step_overhead_s)
    assert spec_cost.step_time_s([verify]) == pytest.approx(expected)
    t_plain = target.step_time_s([plain])
    assert t_plain < spec_cost.step_time_s([verify]) < (k + 1) * t_plain
    # An extend also runs the draft over the prompt.
    pf = BatchShape(prefill_tokens=512, prefill_attn_pairs=512 * 513 / 2)
    assert spec_cost.step_time_s([pf]) == pytest.approx(
        target.step_time_s([pf]) + draft_cost.step_time_s([pf]))


def test_the_summary_names_the_cost_model_inside_the_speculative_wrapper():
    from pdsim.sim.silicon import cost_columns

    v3 = load_model_spec("deepseek-v3")
    wrapped = make_speculative_cost_model("roofline", v3, load_hardware_spec("h200"),
                                          Parallelism(tp=8), draft_spec("mtp", v3), 2)
    assert cost_columns("auto", [wrapped])["cost_model"] == "roofline"


@pytest.mark.parametrize("method, extra", [("mtp", {}), ("eagle", {}),
                                           ("eagle", {"draft_model": "llama-3.1-8b"})])
def test_drafts_price_under_dp_attention_and_deepep(method, extra):
    data = experiment({"method": method, "num_draft_tokens": 2, "acceptance": {"rates": [0.8]},
                       **extra})
    role = {"tp": 8, "dp_attention": 8, "ep": 8, "moe_a2a": "deepep", "two_batch_overlap": True}
    data.update(model="deepseek-v3", hardware="h200", cost_model={"name": "roofline"})
    data["cluster"].update(prefill=role, decode=role)
    cluster = build_cluster(parse_experiment(data))
    verify = BatchShape(decode_reqs=4, decode_context_tokens=4 * 1003, decode_query_len=3)
    plain = BatchShape(decode_reqs=4, decode_context_tokens=4 * 1001)
    base = make_cost_model("roofline", load_model_spec("deepseek-v3"), load_hardware_spec("h200"),
                           Parallelism(tp=8, dp_attention=8, ep=8, moe_a2a="deepep",
                                       two_batch_overlap=True))
    assert cluster.decode.cost().step_time_s([verify] * 8) > base.step_time_s([plain] * 8)


def test_mtp_draft_is_one_layer_of_the_target_and_eagle_a_small_dense_model():
    v3 = load_model_spec("deepseek-v3")
    mtp = draft_spec("mtp", v3)
    assert (mtp.num_layers, mtp.num_moe_layers, mtp.hidden_size) == (1, 1, v3.hidden_size)
    eagle = draft_spec("eagle", v3, draft_layers=2)
    assert (eagle.num_layers, eagle.num_moe_layers) == (2, 0)
    assert draft_spec("eagle", v3, draft_model="llama-3.1-8b").name == "llama-3.1-8b"
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        draft_spec("medusa", v3)


# ----- end to end in the simulator ---------------------------------------------------------


def experiment(speculative: dict, mode: str = "disaggregated", seed: int = 1) -> dict:
    return {
        "name": "spec", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"mode": mode, "prefill": {"instances": 1}, "decode": {"instances": 1}},
        "speculative": speculative,
        "workload": {
            "num_requests": 200, "seed": 3,
            "arrival": {"process": "poisson", "rate_rps": 10},
            "input_len": {"dist": "uniform", "low": 16, "high": 2000},
            "output_len": {"dist": "uniform", "low": 1, "high": 300},
        },
    }


def simulate(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    cluster = build_cluster(cfg)
    return cfg, wl, Simulation(cluster, cfg.seed).run(wl.arrival_s, wl.input_tokens,
                                                      wl.output_tokens)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_every_request_gets_exactly_its_tokens_sooner_and_pools_return(mode):
    _, wl, plain = simulate(experiment({"method": "none"}, mode))
    _, _, spec = simulate(experiment(MTP3, mode))
    shared_times = 0
    for rec, n_out in zip(spec.records, wl.output_tokens):
        assert rec.ok and rec.output_tokens == n_out == len(rec.token_times_s)
        assert np.all(np.diff(rec.token_times_s) >= 0)
        shared_times += n_out - len(set(rec.token_times_s))
    assert shared_times > 0  # tokens of one verify step share its end time
    spec.check_pools_full()
    e2e = lambda res: np.mean([r.e2e_s for r in res.records])  # noqa: E731
    assert e2e(spec) < 0.8 * e2e(plain)


def test_same_seed_same_records_and_another_seed_other_acceptance():
    _, _, a = simulate(experiment(MTP3))
    _, _, b = simulate(experiment(MTP3))
    _, _, c = simulate(experiment(MTP3, seed=2))
    assert [r.token_times_s for r in a.records] == [r.token_times_s for r in b.records]
    assert [r.token_times_s for r in a.records] != [r.token_times_s for r in c.records]


def test_pd_moves_the_draft_kv_and_hidden_state_with_each_request():
    cfg, wl, plain = simulate(experiment({"method": "none"}))
    _, _, spec = simulate(experiment(MTP3))
    model = load_model_spec(cfg.model)
    page = cfg.cluster.decode.scheduler.page_size
    pages = sum(math.ceil(n / page) for n in wl.input_tokens)
    draft_page_bytes = page * draft_spec("mtp", model).kv_bytes_per_token(cfg.kv_dtype_bytes)
    extra = pages * draft_page_bytes + len(wl) * model.hidden_size * 2
    assert (spec.kv_transfer_gb - plain.kv_transfer_gb) * 1e9 == pytest.approx(extra)
    assert draft_page_bytes * 32 == page * model.kv_bytes_per_token(cfg.kv_dtype_bytes)


@pytest.mark.slow
def test_the_draft_takes_its_weights_and_kv_from_the_pool():
    data = experiment(MTP3)
    data.update(model="deepseek-v3", hardware="h200")
    data["cluster"]["decode"]["tp"] = data["cluster"]["prefill"]["tp"] = 8
    pages = build_cluster(parse_experiment(data)).decode.scheduler.num_pages
    v3, par = load_model_spec("deepseek-v3"), Parallelism(tp=8)
    # the memory share SGLang derives for a speculating tp 8 instance on an H200
    fraction = sglang_defaults.mem_fraction_static(141, chunk=8192, max_prefill_tokens=16384,
                                                   graph_bs=512, tp=8, speculative=True)
    tokens = kv_capacity_tokens(v3, load_hardware_spec("h200"), par, fraction)
    # The MTP module is one more MoE layer (sharing embedding and LM head) with its own KV.
    plus_one = v3.model_copy(update={"num_layers": v3.num_layers + 1})
    layer_bytes = plus_one.weight_bytes_per_rank(8) - v3.weight_bytes_per_rank(8)
    kv = v3.kv_bytes_per_token_per_rank(8)
    expected = (tokens * kv - layer_bytes) // (kv * 62 / 61) // 16
    assert pages == pytest.approx(expected, abs=1)
    assert 0.94 < pages * 16 / tokens < 0.97


@pytest.mark.parametrize("speculative, message", [
    ({"method": "mtp"}, "exactly one of acceptance.rates and acceptance.mean_accept_len"),
    ({"method": "mtp", "num_draft_tokens": 2, "acceptance": {"mean_accept_len": 3.5}},
     r"exceeds num_draft_tokens \+ 1 = 3"),
    ({"method": "mtp", "num_draft_tokens": 3, "acceptance": {"rates": [0.9, 0.8]}},
     "needs 1 or at least 3"),
    ({"method": "mtp", "acceptance": {"rates": [1.2]}}, r"must lie in \[0, 1\]"),
    ({"method": "mtp", "draft_model": "llama-3.1-8b", "acceptance": {"rates": [0.5]}},
     "draft_model applies to method 'eagle' only"),
    ({"method": "medusa"}, "speculative.method"),
])
def test_bad_speculative_config_says_what_is_wrong(speculative, message):
    with pytest.raises(ConfigError, match=message):
        parse_experiment(experiment(speculative))


@pytest.mark.slow
def test_the_shipped_experiment_runs_end_to_end_with_its_plots(tmp_path):
    import yaml

    from pdsim.runner import run_experiment

    raw = yaml.safe_load(open("experiments/spec_decode.yaml"))
    raw["workload"]["num_requests"] = 40  # the shipped file, shrunk, on the faster roofline
    raw["cost_model"] = {"name": "roofline"}
    raw["metrics"] = {"warmup_requests": 8, "cooldown_requests": 8}
    raw["sweep"]["workload.arrival.concurrency"] = [2, 8]
    settings = "speculative.method,speculative.num_draft_tokens,speculative.acceptance.rates"
    raw["sweep"][settings] = [raw["sweep"][settings][i] for i in (0, 3, 6)]  # none, k=3 hi, lo
    path = tmp_path / "spec_decode.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    summary, out = run_experiment(path, tmp_path / "out", jobs=1, progress=False)
    assert len(summary) == 2 * 3
    assert (out / "throughput_vs_itl.png").is_file() and (out / "itl.png").is_file()
    method = summary["sweep.speculative.method"]
    k = summary["sweep.speculative.num_draft_tokens"]
    high = summary["sweep.speculative.acceptance.rates"].map(lambda r: r[0] == 0.85)
    for clients in (2, 8):
        at = summary["concurrency"] == clients
        plain = summary[at & (method == "none")]["itl_mean_s"].item()
        best = summary[at & (method == "mtp") & (k == 3) & high]["itl_mean_s"].item()
        assert best < 0.9 * plain


# ----- SGLang's defaults under speculation ---------------------------------------------------


def test_an_unset_max_running_requests_is_sglangs_48_when_speculating():
    """SGLang's `_handle_speculative_decoding` sets --max-running-requests 48 for EAGLE/MTP
    when it is not given, split over the DP ranks; a given value or no speculation keep theirs."""
    def running(speculative: dict, **decode) -> int:
        data = experiment(speculative)
        data["cluster"]["decode"].update(decode)
        return build_cluster(parse_experiment(data)).decode.scheduler.max_running_requests

    assert running(MTP3) == 48
    assert running({"method": "none"}) > 48  # the pool's derivation
    assert running(MTP3, scheduler={"max_running_requests": 200}) == 200
    knobs = scheduler_knobs()
    spec = Speculation(3, accept_len_probs([0.8, 0.7, 0.6]), 0)
    assert knobs.build(10_000, dp_attention=8, speculation=spec).max_running_requests == 6
    with pytest.raises(ValueError, match="48 requests, less than one per each of "
                                         "dp_attention=64 ranks"):
        knobs.build(10_000, dp_attention=64, speculation=spec)


def scheduler_knobs():
    from pdsim.deployment import SchedulerKnobs

    return SchedulerKnobs()
