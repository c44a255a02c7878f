"""The measurement window: half-open, throughputs counting the tokens emitted inside it, and
goodput over the same requests as SLO attainment (hand-built records, then a simulated run)."""

from __future__ import annotations

import numpy as np
import pytest

from pdsim.config import parse_experiment
from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, MeasurementWindow, summarize
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.workload import generate


def request(rid: int, arrival: float, ttft: float, gap: float, tokens: int) -> RequestRecord:
    times = [arrival + ttft + gap * k for k in range(tokens)]
    return RequestRecord(rid=str(rid), input_tokens=100, output_tokens=tokens, status="ok",
                         arrival_s=arrival, first_token_s=times[0], finish_s=times[-1],
                         token_times_s=times)


def one_client(n: int = 6) -> list[RequestRecord]:
    """One closed-loop client, no think time: request i arrives at 1.5 i, the instant i - 1
    ends; first token 0.5 s later, then 4 more 0.25 s apart (5 tokens in 1.5 s, 1/TPOT = 4)."""
    return [request(i, 1.5 * i, 0.5, 0.25, 5) for i in range(n)]


def test_a_closed_loop_client_is_counted_once_at_each_edge():
    records = one_client()
    window = MeasurementWindow(warmup_requests=2, cooldown_requests=2)
    s = summarize(records, num_gpus=1, slo=SLO(), window=window)
    # [3.0, 6.0): starts as request 2 arrives (request 1 ends), ends as request 3 ends
    # (request 4 arrives): the arrival at 6.0 and the finish at 6.0 are the next window's.
    assert (s["window_start_s"], s["window_end_s"]) == (3.0, 6.0)
    arrivals = np.array([r.arrival_s for r in records])
    finishes = np.array([r.finish_s for r in records])
    np.testing.assert_array_equal(window.mask(arrivals, finishes), [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(window.ended_mask(arrivals, finishes), [0, 1, 1, 0, 0, 0])
    assert s["num_requests"] == 2
    assert s["request_throughput_req_s"] == pytest.approx(1 / 1.5)  # one request per 1.5 s
    # Tokens emitted in [3, 6): request 1's last (3.0), all 5 of request 2, 4 of request 3:
    # 10 in 3 s, what one client receives (5 per 1.5 s), below its 1/TPOT of 4 tok/s. (Tokens
    # of the requests that ended in [3, 6] would be 15: 5 tok/s.)
    assert s["output_tok_s"] == pytest.approx(10 / 3)
    assert s["output_tok_s"] <= 1 / s["tpot_mean_s"]
    # The prompts whose first token came in the window: requests 2 (3.5) and 3 (5.0).
    assert s["input_tok_s"] == pytest.approx(200 / 3)


def test_the_window_counts_the_tokens_of_requests_that_straddle_it():
    """A long request in flight across the whole window delivers tokens inside it; a short one
    that ends inside it delivered most of them before. Only what was emitted inside counts."""
    records = [request(0, 0.0, 0.0, 0.1, 101),  # 0.0 ... 10.0, every 0.1 s
               request(1, 0.0, 0.0, 1.0, 4),  # 0, 1, 2, 3: ends inside
               request(2, 4.0, 0.0, 1.0, 2),  # 4, 5: defines the start (warmup 2)
               request(3, 5.0, 0.0, 0.5, 2),  # 5.0, 5.5: its end is the window's (cooldown 2)
               request(4, 9.0, 0.0, 0.5, 3)]  # 9.0 ... 10.0
    window = MeasurementWindow(warmup_requests=2, cooldown_requests=2)
    s = summarize(records, num_gpus=2, slo=SLO(), window=window)
    assert (s["window_start_s"], s["window_end_s"]) == (4.0, 5.5)
    # [4.0, 5.5): request 0 at 4.0, 4.1, ..., 5.4 (15), request 2 at 4 and 5, request 3 at 5.0.
    assert s["output_tok_s"] == pytest.approx(18 / 1.5)
    assert s["output_tok_s_per_gpu"] == pytest.approx(9 / 1.5)


def test_goodput_counts_the_requests_slo_attainment_counts():
    """The requests that arrived in the window all miss the TTFT bound; earlier ones that met
    it end inside the window. Goodput is zero with attainment, not their rate."""
    early = [request(i, 0.1 * i, 0.2, 0.1, 30) for i in range(4)]  # end at 3.1 ... 3.4
    late = [request(4 + i, 1.0 + i, 5.0, 0.1, 3) for i in range(3)]  # TTFT 5 s, end 6.2 ...
    slo = SLO(ttft_s=1.0, itl_s=0.5)
    window = MeasurementWindow(warmup_s=1.0, cooldown_s=1.0)  # [1.0, 7.2)
    s = summarize(early + late, num_gpus=1, slo=slo, window=window)
    assert s["num_requests"] == 3 and s["slo_attainment"] == 0.0
    assert s["request_throughput_req_s"] > 0  # the early ones were served in it
    assert s["goodput_req_s"] == s["goodput_req_s_per_gpu"] == 0.0
    met = summarize(early + late, num_gpus=1, slo=SLO(ttft_s=6.0, itl_s=0.5), window=window)
    assert met["slo_attainment"] == 1.0
    assert met["goodput_req_s"] == pytest.approx(3 / met["duration_s"])


def test_simulated_window_throughput_is_the_tokens_emitted_in_it():
    """A closed loop of 16 clients, its first and last waves left out: output tokens/s is the
    count of token times in [start, end) over its length (the requests straddling an edge read
    from the shared step times), and goodput is attainment times the window's requests."""
    n = 16
    cfg = parse_experiment({
        "name": "closed", "seed": 2, "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {"num_requests": 240, "seed": 5,
                     "arrival": {"process": "closed", "concurrency": n, "think_time_s": 0.0},
                     "input_len": {"dist": "uniform", "low": 64, "high": 1500},
                     "output_len": {"dist": "uniform", "low": 4, "high": 60}},
        "metrics": {"warmup_requests": n, "cooldown_requests": n},
        "slo": {"ttft_s": 0.05, "itl_s": 0.1},
    })
    wl = generate(cfg.workload)
    records = Simulation(build_cluster(cfg), cfg.seed, cfg.max_duration_s).run(
        wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop).records
    s = summarize(records, num_gpus=2, slo=cfg.slo, window=cfg.metrics)
    start, end = s["window_start_s"], s["window_end_s"]
    arrival = np.array([r.arrival_s for r in records])
    assert arrival.max() == end  # the last request, sent as the window closes, is out
    assert s["num_requests"] == np.count_nonzero((arrival >= start) & (arrival < end))
    times = np.concatenate([list(r.token_times_s) for r in records if r.ok])
    emitted = np.count_nonzero((times >= start) & (times < end))
    assert s["output_tok_s"] == pytest.approx(emitted / (end - start), rel=1e-12)
    assert 0 < s["slo_attainment"] < 1
    assert s["goodput_req_s"] == pytest.approx(
        s["slo_attainment"] * s["num_requests"] / s["duration_s"], rel=1e-12)


def test_mean_concurrency_is_bench_servings_and_shows_a_short_runs_ramp_and_drain():
    """bench_serving's "Concurrency" (E2Es summed / duration): a closed loop of 16 clients
    over the whole run reads below 16, the more so the fewer requests a client sends (4 each:
    the ramp-up and drain weigh more than at 15 each); its steady window reads close to 16."""
    n = 16

    def run(requests: int, window: MeasurementWindow) -> dict:
        cfg = parse_experiment({
            "name": "closed", "model": "llama-3.1-8b", "hardware": "h100",
            "cluster": {"mode": "colocated", "colocated": {"instances": 1}},
            "workload": {"num_requests": requests, "seed": 5,
                         "arrival": {"process": "closed", "concurrency": n},
                         "input_len": {"dist": "sglang_random", "len": 1024},
                         "output_len": {"dist": "sglang_random", "len": 64}}})
        wl = generate(cfg.workload)
        records = Simulation(build_cluster(cfg), cfg.seed, cfg.max_duration_s).run(
            wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop).records
        return summarize(records, num_gpus=1, slo=cfg.slo, window=window)

    short, long = run(4 * n, MeasurementWindow()), run(15 * n, MeasurementWindow())
    for s in (short, long):
        assert s["mean_concurrency"] == pytest.approx(
            s["request_throughput_req_s"] * s["e2e_mean_s"] * s["num_requests"] / s["completed"])
    assert short["mean_concurrency"] < long["mean_concurrency"] < n
    steady = run(15 * n, MeasurementWindow(warmup_requests=n, cooldown_requests=n))
    assert steady["mean_concurrency"] == pytest.approx(n, rel=0.1)
