"""Metrics on hand-built records whose every number is worked out below."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from pdsim.core.records import RequestRecord
from pdsim.metrics import RECORD_COLUMNS, SLO, littles_law, meets_slo, records_frame, summarize

NAN = math.nan


def ok(rid, arrival, tokens, *, input_tokens):
    return RequestRecord(rid=rid, input_tokens=input_tokens, output_tokens=len(tokens), status="ok",
                         arrival_s=arrival, first_token_s=tokens[0], finish_s=tokens[-1],
                         token_times_s=list(tokens))


@pytest.fixture
def records():
    """Three completed requests and one that failed mid-decode.

    TTFT (s): 0.5, 1.0, 2.0.  Gaps (s): [0.25, 0.25], [0.5], [0.5, 0.5, 1.0].  TPOT: 0.25, 0.5, 2/3.
    E2E (s): 1.0, 1.5, 4.0.  Input tokens 10+20+30 = 60, output 3+2+4 = 9 (completed only).
    The failed one (gap 1.5, finish 7.0) stretches the duration to 7.0 - 0.0 = 7.0 s.
    """
    return [
        ok("a", 0.0, [0.5, 0.75, 1.0], input_tokens=10),
        ok("b", 1.0, [2.0, 2.5], input_tokens=20),
        ok("c", 2.0, [4.0, 4.5, 5.0, 6.0], input_tokens=30),
        RequestRecord(rid="d", input_tokens=40, output_tokens=2, status="failed", error="transfer",
                      arrival_s=3.0, first_token_s=3.5, finish_s=7.0, token_times_s=[3.5, 5.0]),
    ]


def test_summarize_hand_computed(records):
    s = summarize(records, num_gpus=2, slo=SLO(ttft_s=1.0, itl_s=0.5))
    assert (s["num_requests"], s["completed"], s["failed"], s["num_gpus"]) == (4, 3, 1, 2)
    # TTFT [0.5, 1.0, 2.0]: linear interpolation at ranks 1.0, 1.8, 1.98.
    assert s["ttft_mean_s"] == pytest.approx(3.5 / 3)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["ttft_p90_s"] == pytest.approx(1.8)
    assert s["ttft_p99_s"] == pytest.approx(1.98)
    # Pooled gaps [0.25, 0.25, 0.5, 0.5, 0.5, 1.0] (the failed request's 1.5 excluded):
    # ranks 2.5, 4.5, 4.95.
    assert s["itl_mean_s"] == pytest.approx(0.5)
    assert s["itl_p50_s"] == pytest.approx(0.5)
    assert s["itl_p90_s"] == pytest.approx(0.75)
    assert s["itl_p99_s"] == pytest.approx(0.975)
    assert s["tpot_mean_s"] == pytest.approx((0.25 + 0.5 + 2 / 3) / 3)
    assert s["e2e_mean_s"] == pytest.approx(6.5 / 3)
    assert s["e2e_p50_s"] == pytest.approx(1.5)
    assert s["e2e_p99_s"] == pytest.approx(1.5 + 0.98 * 2.5)
    assert s["duration_s"] == pytest.approx(7.0)
    assert s["input_tok_s"] == pytest.approx(60 / 7)
    assert s["output_tok_s"] == pytest.approx(9 / 7)
    assert s["output_tok_s_per_gpu"] == pytest.approx(9 / 14)
    assert s["request_throughput_req_s"] == pytest.approx(3 / 7)
    # "a" meets; "b" sits exactly on both bounds and meets; "c" misses TTFT; "d" failed.
    assert s["mean_concurrency"] == pytest.approx(6.5 / 7)  # E2Es summed / duration
    assert s["goodput_req_s"] == pytest.approx(2 / 7)
    assert s["goodput_req_s_per_gpu"] == pytest.approx(1 / 7)
    assert s["slo_attainment"] == pytest.approx(0.5)


def test_summarize_percentiles_match_numpy_linear(records):
    s = summarize(records, num_gpus=1, slo=SLO())
    gaps = np.concatenate([np.diff(r.token_times_s) for r in records if r.ok])
    for q in (50, 90, 99):
        assert s[f"itl_p{q}_s"] == pytest.approx(np.percentile(gaps, q, method="linear"), abs=1e-15)


def test_tpot_percentiles_are_over_requests_not_gaps(records):
    """bench_serving's TPOT (and aiperf's ITL) percentiles are over each request's
    (latency - ttft) / (output - 1); the pooled gaps (bench_serving's ITL) weigh long outputs more.
    TPOTs 0.25, 0.5, 2/3: p50 0.5, p90 0.25 + ... at rank 1.8, p99 at rank 1.98."""
    s = summarize(records, num_gpus=1, slo=SLO())
    tpot = np.array([(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in records if r.ok])
    assert s["tpot_mean_s"] == pytest.approx(tpot.mean())
    for q in (50, 90, 99):
        assert s[f"tpot_p{q}_s"] == pytest.approx(np.percentile(tpot, q))
    assert s["tpot_p90_s"] == pytest.approx(0.5 + 0.8 * (2 / 3 - 0.5))
    assert s["tpot_p99_s"] != pytest.approx(s["itl_p99_s"])  # 0.65 against the gaps' 0.975
    one = summarize([ok("one", 0.0, [0.25], input_tokens=5)], num_gpus=1, slo=SLO())
    assert math.isnan(one["tpot_p50_s"]) and math.isnan(one["tpot_p99_s"])


def test_slo_bounds_are_inclusive(records):
    b = records[1]  # TTFT exactly 1.0, mean ITL exactly 0.5
    assert meets_slo([b], SLO(ttft_s=1.0, itl_s=0.5)).tolist() == [True]
    assert meets_slo([b], SLO(ttft_s=np.nextafter(1.0, 0.0), itl_s=0.5)).tolist() == [False]
    assert meets_slo([b], SLO(ttft_s=1.0, itl_s=np.nextafter(0.5, 0.0))).tolist() == [False]
    assert meets_slo(records, SLO(ttft_s=1.0, itl_s=0.5)).tolist() == [True, True, False, False]


def test_slo_judges_mean_itl_not_the_worst_gap(records):
    c = records[2]  # gaps 0.5, 0.5, 1.0: mean 2/3, max 1.0
    assert meets_slo([c], SLO(ttft_s=10.0, itl_s=0.7)).tolist() == [True]
    assert meets_slo([c], SLO(ttft_s=10.0, itl_s=0.6)).tolist() == [False]


def test_single_token_request_has_no_gap_and_meets_the_itl_bound():
    r = ok("one", 0.0, [0.25], input_tokens=5)
    s = summarize([r], num_gpus=1, slo=SLO(ttft_s=0.5, itl_s=0.001))
    assert math.isnan(s["itl_p50_s"]) and math.isnan(s["tpot_mean_s"])
    assert s["slo_attainment"] == 1.0
    assert s["duration_s"] == 0.25 and s["goodput_req_s"] == pytest.approx(4.0)


def test_failed_requests_are_counted_but_not_in_latencies(records):
    base = summarize(records[:3], num_gpus=1, slo=SLO())
    more = summarize(records[:3] + [records[3]] * 5, num_gpus=1, slo=SLO())
    assert more["failed"] == 5 and more["completed"] == 3
    for key in ("ttft_p99_s", "itl_p99_s", "itl_mean_s", "e2e_mean_s", "tpot_mean_s"):
        assert more[key] == base[key]
    assert more["slo_attainment"] == pytest.approx(base["slo_attainment"] * 3 / 8)


def test_empty_input_gives_nans_and_zero_counts():
    s = summarize([], num_gpus=4, slo=SLO())
    assert (s["num_requests"], s["completed"], s["failed"]) == (0, 0, 0)
    for key in ("ttft_p50_s", "itl_p99_s", "e2e_mean_s", "duration_s", "output_tok_s",
                "goodput_req_s", "slo_attainment"):
        assert math.isnan(s[key]), key


def test_all_failed_gives_nan_latencies_and_zero_rates(records):
    failed = [records[3], RequestRecord(rid="e", input_tokens=1, output_tokens=0, status="failed",
                                        arrival_s=1.0, finish_s=2.0)]
    s = summarize(failed, num_gpus=1, slo=SLO())
    assert (s["completed"], s["failed"]) == (0, 2)
    assert math.isnan(s["ttft_p50_s"]) and math.isnan(s["itl_p50_s"]) and math.isnan(s["e2e_p99_s"])
    assert s["duration_s"] == 6.0
    assert s["output_tok_s"] == 0.0 and s["goodput_req_s"] == 0.0 and s["slo_attainment"] == 0.0


def test_summarize_rejects_nonpositive_gpus(records):
    with pytest.raises(ValueError, match="num_gpus"):
        summarize(records, num_gpus=0, slo=SLO())


def test_slo_model_is_strict_and_frozen():
    assert SLO() == SLO(ttft_s=2.0, itl_s=0.1)
    with pytest.raises(ValidationError):
        SLO(ttft_ms=5)
    with pytest.raises(ValidationError):
        SLO(ttft_s=-1.0)
    with pytest.raises(ValidationError):
        SLO().ttft_s = 3.0


def test_records_frame_matches_to_row(records):
    extra = RequestRecord(rid="x", input_tokens=1, output_tokens=0, status="failed")  # all NaN
    everything = records + [extra, ok("one", 0.0, [0.25], input_tokens=5)]
    frame = records_frame(everything)
    expected = pd.DataFrame([r.to_row() for r in everything])
    assert list(frame.columns) == list(expected.columns) == list(RECORD_COLUMNS)
    pd.testing.assert_frame_equal(frame, expected, check_dtype=False, rtol=1e-12)
    assert frame.loc[2, "itl_max_s"] == 1.0 and frame.loc[2, "itl_mean_s"] == pytest.approx(2 / 3)


def test_records_frame_of_nothing_has_the_columns():
    frame = records_frame([])
    assert list(frame.columns) == list(RECORD_COLUMNS) and frame.empty
    assert frame["ttft_s"].dtype == np.float64 and frame["input_tokens"].dtype == np.int64


def test_littles_law_hand_computed():
    # In system: [0,1) 1, [1,2) 2, [2,3) 2 (one leaves as one arrives at 2), [3,4) 1.
    arrivals, departures = [0.0, 1.0, 2.0], [3.0, 2.0, 4.0]
    full = littles_law(arrivals, departures)
    assert full.time_avg_in_system == pytest.approx(6 / 4)
    assert full.lambda_w == pytest.approx(3 / 4 * 2.0)  # W = mean(3, 1, 2)
    # Over [1, 3]: L = (2 + 2) / 2; arrivals at 1 and 2 -> lambda 1/s, W = mean(1, 2).
    window = littles_law(arrivals, departures, window_s=(1.0, 3.0))
    assert window == (pytest.approx(2.0), pytest.approx(1.5))


def test_littles_law_sides_agree_on_a_simulated_queue():
    rng = random.Random(7)
    t, free_at, arrivals, departures = 0.0, 0.0, [], []
    for _ in range(5000):  # FIFO single server, utilisation about 0.8
        t += rng.expovariate(1.0)
        free_at = max(free_at, t) + rng.expovariate(1.25)
        arrivals.append(t)
        departures.append(free_at)
    full = littles_law(arrivals, departures)
    assert full.time_avg_in_system == pytest.approx(full.lambda_w, rel=1e-9)
    assert full.time_avg_in_system == pytest.approx(
        np.sum(np.subtract(departures, arrivals)) / (max(departures) - arrivals[0]), rel=1e-9)
    steady = littles_law(arrivals, departures, window_s=(500.0, 4500.0))
    assert steady.time_avg_in_system == pytest.approx(steady.lambda_w, rel=0.05)


def test_littles_law_rejects_bad_input():
    assert all(math.isnan(v) for v in littles_law([], []))
    with pytest.raises(ValueError, match="departure before arrival"):
        littles_law([0.0, 2.0], [1.0, 1.5])
    with pytest.raises(ValueError, match="finite"):
        littles_law([0.0], [NAN])
    with pytest.raises(ValueError, match="equal length"):
        littles_law([0.0, 1.0], [1.0])
