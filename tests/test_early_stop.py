"""The planner's early stop (pdsim.planning.early_stop): a run ends only once its SLO is out of
reach, counted exactly as NumPy's percentile reads it, and overdue requests count before they
finish. Simulated both ways, candidates get the same verdicts."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from pdsim.config import parse_experiment
from pdsim.core.request import Request
from pdsim.planning import meets, parse_plan
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.early_stop import SloWatch
from pdsim.planning.search import tpot_percentiles
from pdsim.runner import run_point
from pdsim.workload import ClosedLoop, Workload

PLAN = {"name": "p", "model": "llama-3.1-8b", "hardware": "h100", "max_gpus": 1,
        "workload": {"num_requests": 20, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                     "input_len": {"dist": "fixed", "value": 64},
                     "output_len": {"dist": "fixed", "value": 4}}}


def _request(i: int, ttft_s: float | None, gap_s: float = 0.01, n: int = 4) -> Request:
    """Request i, arrived at i s; its tokens (none when `ttft_s` is None) from i + ttft_s."""
    req = Request(str(i), 64, n, arrival_s=float(i))
    if ttft_s is not None:
        req.token_times_s = [i + ttft_s + k * gap_s for k in range(n)]
    return req


def _workload(n: int, out: int = 4, closed: bool = False) -> Workload:
    if closed:  # the clients' requests carry their own send times
        return Workload(np.zeros(n), np.full(n, 64), np.full(n, out), closed_loop=ClosedLoop(2))
    return Workload(np.arange(n, dtype=float), np.full(n, 64), np.full(n, out))


def test_finished_requests_stop_the_run_at_the_first_that_puts_the_percentile_out_of_reach():
    cfg = parse_plan({**PLAN, "slo": {"ttft_p90_s": 1.0}})
    watch = SloWatch(cfg, _workload(20, closed=True))  # closed loop: finished requests only
    # p90 of 20 values is within 1 s while 18 are (the 18th order statistic, NumPy's
    # interpolation): two slow requests are allowed, the third is not.
    assert watch(_request(0, 5.0)) == "" and watch(_request(1, 5.0)) == ""
    assert watch(_request(2, 0.5)) == ""
    reason = watch(_request(3, 5.0))
    assert reason.startswith("3 requests over the TTFT p90 target of 1,000 ms")
    ttfts = np.array([5.0, 5.0, 5.0] + [0.0] * 17)
    assert np.percentile(ttfts, 90) > 1.0 and np.percentile(ttfts[1:].tolist() + [0.0], 90) <= 1.0


def test_overdue_requests_count_before_they_finish():
    cfg = parse_plan({**PLAN, "slo": {"ttft_p90_s": 1.0}})
    watch = SloWatch(cfg, _workload(20))  # open loop: two may miss TTFT
    reqs = [_request(i, None) for i in range(6)]
    for i in range(4):  # at 3 s, requests 0 and 1 are more than 1 s old without a token
        assert watch.sent(reqs[i]) == ""
    reqs[2].token_times_s = [2.9]  # request 2's first token came 0.9 s after it arrived
    assert watch.sent(reqs[4]) == ""  # at 4 s, request 2 is within its target, 3 is not due
    reason = watch.sent(reqs[5])  # at 5 s request 3 is overdue too: none of them finished
    assert reason.startswith("3 requests over the TTFT p90 target of 1,000 ms (at most 2")


def test_a_first_token_over_the_target_counts_once_finished_or_overdue():
    cfg = parse_plan({**PLAN, "slo": {"ttft_p90_s": 1.0}})
    watch = SloWatch(cfg, _workload(20))
    for i in range(3):
        watch.sent(_request(i, 1.5))  # first tokens 1.5 s after each arrival: misses
    assert watch(_request(0, 1.5)) == ""  # finished at 1.53 s: request 0 counted
    assert watch(_request(1, 1.5)) == ""  # 2.53 s: request 1
    assert watch(_request(2, 1.5)).startswith("3 requests over the TTFT p90")


def test_itl_counts_gaps_and_tpot_counts_requests():
    cfg = parse_plan({**PLAN, "slo": {"itl_p90_s": 0.1, "tpot_p50_s": 0.2}})
    watch = SloWatch(cfg, _workload(10))  # 30 gaps: 3 may exceed; 10 TPOTs: 5 may
    assert watch(_request(0, 0.1, 0.15)) == ""  # 3 slow gaps, TPOT 150 ms within 200
    assert watch(_request(1, 0.1, 0.05)) == ""
    assert watch(_request(2, 0.1, 0.5, n=2)).startswith("4 gaps over the ITL p90 target")


def test_a_failed_request_ends_the_run():
    cfg = parse_plan({**PLAN, "slo": {"ttft_p90_s": 1.0}})
    req = _request(0, 0.1, 0.01)
    req.error = "KV transfer failed"
    assert "failed (KV transfer failed)" in SloWatch(cfg, _workload(20))(req)


# Llama-3.1-8B on H100s at 80 req/s of ~1k-token prompts: one prefill GPU overloads (TTFT
# several times its target); colocated instances, whose prefills stall their decodes, miss the
# TPOT target; the disaggregated ones with more prefill meet the SLO.
SIM_PLAN = {
    "name": "stop", "model": "llama-3.1-8b", "hardware": "h100", "max_gpus": 8,
    "workload": {"num_requests": 300, "seed": 1, "arrival": {"process": "poisson", "rate_rps": 80},
                 "input_len": {"dist": "lognormal", "mean": 1024, "cv": 0.5, "min": 64,
                               "max": 4096},
                 "output_len": {"dist": "lognormal", "mean": 96, "cv": 0.5, "min": 8, "max": 256}},
    "slo": {"ttft_p90_s": 0.5, "tpot_p90_s": 0.012},
    "search": {"early_stop": True},
}
SIM_CANDIDATES = [
    Candidate("disaggregated", (("prefill", 1, RoleShape(1)), ("decode", 1, RoleShape(1)))),
    Candidate("disaggregated", (("prefill", 2, RoleShape(1)), ("decode", 1, RoleShape(1)))),
    Candidate("disaggregated", (("prefill", 3, RoleShape(1)), ("decode", 1, RoleShape(2)))),
    Candidate("disaggregated", (("prefill", 4, RoleShape(1)), ("decode", 2, RoleShape(1)))),
    Candidate("colocated", (("colocated", 1, RoleShape(1)),)),
    Candidate("colocated", (("colocated", 2, RoleShape(2)),)),
    Candidate("colocated", (("colocated", 4, RoleShape(1)),)),
]


@pytest.fixture(scope="module")
def runs():
    """Each candidate simulated to the end and with the SLO watch: (candidate, full, watched)."""
    cfg = parse_plan(SIM_PLAN)
    out = []
    for i, dep in enumerate(SIM_CANDIDATES):
        exp = parse_experiment(dep.experiment_data(cfg, name=f"stop_{i}"), dep.label)
        both = [run_point(i, exp, {}, None, stop) for stop in (None, partial(SloWatch, cfg))]
        for r in both:
            r.summary.update(tpot_percentiles(r.requests))
        out.append((dep, *both))
    return cfg, out


def test_early_stopped_verdicts_equal_full_run_verdicts(runs):
    cfg, results = runs
    verdicts = [meets(cfg, full.summary) for _, full, _ in results]
    assert any(verdicts) and not all(verdicts)  # the set holds both kinds
    for (dep, full, watched), feasible in zip(results, verdicts):
        assert meets(cfg, watched.summary) == feasible, dep.label
        if feasible:  # a run that meets the SLO is never stopped: its figures are the same
            assert watched.summary["stopped"] == "", dep.label
            assert watched.requests.equals(full.requests), dep.label
        else:
            assert watched.summary["stopped"], dep.label
            assert watched.summary["sim_time_s"] < full.summary["sim_time_s"], dep.label


def test_overload_stops_on_overdue_requests_long_before_they_finish(runs):
    _, results = runs
    dep, full, watched = results[0]  # one TP1 prefill instance for 80 req/s
    assert full.summary["ttft_p90_s"] > 4 * 0.5
    reason = watched.summary["stopped"]
    assert "over the TTFT p90 target" in reason
    misses = int(reason.split()[0])
    # More requests were counted as missing the target than had even finished.
    assert watched.summary["completed"] < misses
    assert watched.summary["sim_time_s"] < full.summary["sim_time_s"] / 4
