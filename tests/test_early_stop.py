"""The planner's early stop (pdsim.planning.early_stop): a run ends only once its SLO is out of
reach, counted exactly as NumPy's percentile reads it."""

from __future__ import annotations

import numpy as np

from pdsim.core.request import Request
from pdsim.planning import parse_plan
from pdsim.planning.early_stop import SloWatch
from pdsim.workload import Workload

PLAN = {"name": "p", "model": "llama-3.1-8b", "hardware": "h100", "max_gpus": 1,
        "workload": {"num_requests": 20, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                     "input_len": {"dist": "fixed", "value": 64},
                     "output_len": {"dist": "fixed", "value": 4}}}


def _request(i: int, ttft_s: float, gap_s: float, n: int = 4) -> Request:
    req = Request(str(i), 64, n, arrival_s=float(i))
    req.token_times_s = [i + ttft_s + k * gap_s for k in range(n)]
    return req


def _workload(n: int, out: int = 4) -> Workload:
    return Workload(np.arange(n, dtype=float), np.full(n, 64), np.full(n, out))


def test_stops_at_the_first_request_that_puts_the_percentile_out_of_reach():
    cfg = parse_plan({**PLAN, "slo": {"ttft_p90_s": 1.0}})
    watch = SloWatch(cfg, _workload(20))
    # p90 of 20 values is within 1 s while 18 are (the 18th order statistic, NumPy's
    # interpolation): two slow requests are allowed, the third is not.
    assert watch(_request(0, 5.0, 0.01)) == "" and watch(_request(1, 5.0, 0.01)) == ""
    assert watch(_request(2, 0.5, 0.01)) == ""
    reason = watch(_request(3, 5.0, 0.01))
    assert reason.startswith("3 requests over the TTFT p90 target of 1,000 ms")
    ttfts = np.array([5.0, 5.0, 5.0] + [0.0] * 17)
    assert np.percentile(ttfts, 90) > 1.0 and np.percentile(ttfts[1:].tolist() + [0.0], 90) <= 1.0


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
