"""Per-phase timestamps (RequestRecord) and `pdsim validate`'s phase table
(pdsim/validation/phases.py): the simulator stamps every phase in order, worker clocks are moved
onto the client's, and the phase that carries the TTFT error is named."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pdsim.config import parse_experiment
from pdsim.core.records import RequestRecord
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.validation.phases import PHASES, merge_worker_records, phase_table
from pdsim.workload import generate

REPO = Path(__file__).resolve().parents[1]
PD_1P1D = REPO / "experiments" / "validation" / "pd_1p1d_low.yaml"
TIMINGS = REPO / "experiments" / "calibration" / "tiny_llama_cpu_timings.csv"
CALIBRATION = REPO / "experiments" / "validation" / "calibration" / "pd.yaml"
ORDER = ("arrival_s", "bootstrap_done_s", "prefill_start_s", "prefill_end_s", "transfer_done_s",
         "decode_join_s", "first_token_s", "finish_s")


def _pd_raw(num_requests: int, chunk_tokens: int) -> dict:
    raw = yaml.safe_load(PD_1P1D.read_text())
    raw["workload"]["num_requests"] = num_requests
    raw["cost_model"]["params"]["timings"] = str(TIMINGS)
    raw["cluster"]["prefill"]["scheduler"]["chunked_prefill_size"] = chunk_tokens
    return raw


def _simulate(raw: dict) -> list[RequestRecord]:
    cfg = parse_experiment(raw, "test")
    work = generate(cfg.workload)
    return simulate(build_cluster(cfg), work.arrival_s, work.input_tokens, work.output_tokens,
                    seed=cfg.seed).records


def test_the_simulator_stamps_every_pd_phase_in_order():
    records = _simulate(_pd_raw(30, chunk_tokens=128))  # prompts of 64-384: some take 3 chunks
    assert all(r.ok for r in records)
    for r in records:
        stamps = [getattr(r, k) for k in ORDER]
        assert all(math.isfinite(t) for t in stamps), r
        assert stamps == sorted(stamps), r
        assert r.first_token_s == r.decode_join_s  # PD: the first token goes out as it joins
        # KV leaves with the first complete chunk: before the forward ends when chunked
        assert r.prefill_start_s < r.transfer_start_s <= r.prefill_end_s
        if r.input_tokens > 128:
            assert r.transfer_start_s < r.prefill_end_s, r
    # a short prompt that one forward computed whole sends its KV as that forward ends (one
    # that shared a chunk with another may have been cut, and send earlier)
    assert any(r.transfer_start_s == r.prefill_end_s for r in records if r.input_tokens <= 128)


def test_phases_sum_to_ttft_and_the_largest_gap_is_named():
    def rec(i: int, forward_s: float, landed_s: float) -> RequestRecord:
        t = float(i)
        stamps = dict(arrival_s=t, bootstrap_done_s=t + 0.010, prefill_start_s=t + 0.015,
                      prefill_end_s=t + 0.015 + forward_s,
                      transfer_done_s=t + 0.015 + forward_s + landed_s)
        join = stamps["transfer_done_s"] + 0.002
        times = [join + 0.001, join + 0.011, join + 0.021]
        return RequestRecord(rid=str(i), input_tokens=8, output_tokens=3, status="ok",
                             decode_join_s=join, first_token_s=times[0], finish_s=times[-1],
                             token_times_s=times, **stamps)

    real = [rec(i, forward_s=0.050, landed_s=0.040) for i in range(5)]
    sim = [rec(i, forward_s=0.045, landed_s=0.005) for i in range(5)]
    sim.append(RequestRecord(rid="x", input_tokens=8, output_tokens=0, status="failed"))
    table = phase_table(real, sim).set_index("phase")
    labels = [label for label, _, _ in PHASES]
    assert list(table.index) == labels + ["TTFT", "decode ITL"]
    for side in ("real_s", "sim_s"):
        assert table.loc[labels, side].sum() == pytest.approx(table.loc["TTFT", side])
    assert table.loc["prefill forward", "diff_s"] == pytest.approx(-0.005)
    assert table.loc["prefill end -> KV landed", "diff_s"] == pytest.approx(-0.035)
    assert table.loc["decode ITL", "diff_s"] == pytest.approx(0.0)
    assert list(table.index[table["largest"]]) == ["prefill end -> KV landed"]


def test_worker_clocks_are_moved_onto_the_clients():
    # The client sends at 10, 11, 12; each reaches the workers 2, 1 and 3 ms later. The prefill
    # worker's clock reads 100 s behind the client's, the decode worker's 5 s ahead.
    delay_s = [0.002, 0.001, 0.003]
    client = [RequestRecord(rid=f"r{i}", input_tokens=8, output_tokens=1, status="ok",
                            arrival_s=10.0 + i, first_token_s=10.5 + i, finish_s=10.5 + i,
                            token_times_s=[10.5 + i]) for i in range(3)]
    prefill = [[{"rid": f"r{i}", "prefill_instance": 0, "arrival_s": 10.0 + i + d - 100,
                 "bootstrap_done_s": 10.1 + i - 100, "prefill_start_s": 10.2 + i - 100,
                 "prefill_end_s": 10.3 + i - 100, "transfer_start_s": 10.3 + i - 100}
                for i, d in enumerate(delay_s)]]
    decode = [[{"rid": f"r{i}", "decode_instance": 1, "arrival_s": 10.0 + i + d + 5,
                "transfer_done_s": 10.4 + i + 5, "decode_join_s": None if i == 2 else 10.45 + i + 5}
               for i, d in enumerate(delay_s)],
              [{"rid": "from another run", "decode_instance": 0, "arrival_s": 3.0}]]
    merged = merge_worker_records(client, prefill, decode)
    assert [r.rid for r in merged] == ["r0", "r1", "r2"]
    for i, r in enumerate(merged):
        # exact up to the fastest delivery (1 ms): worker stamps land that much early
        assert r.bootstrap_done_s == pytest.approx(10.1 + i - 0.001)
        assert r.prefill_end_s == pytest.approx(10.3 + i - 0.001)
        assert r.transfer_start_s == pytest.approx(10.3 + i - 0.001)
        assert r.transfer_done_s == pytest.approx(10.4 + i - 0.001)
        assert (r.prefill_instance, r.decode_instance) == (0, 1)
        assert (r.arrival_s, r.first_token_s) == (client[i].arrival_s, client[i].first_token_s)
    assert merged[0].decode_join_s == pytest.approx(10.449)
    assert math.isnan(merged[2].decode_join_s)


@pytest.mark.real
@pytest.mark.slow
def test_validate_writes_the_phase_table_of_a_real_pd_deployment(pd_validation):
    proc, out = pd_validation.proc, pd_validation.out  # conftest.py: chunks of 512 tokens
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_csv(out / "phases.csv").set_index("phase")
    labels = [label for label, _, _ in PHASES]
    assert list(table.index) == labels + ["TTFT", "decode ITL"]
    assert table[["real_s", "sim_s"]].notna().all().all(), table
    for side in ("real_s", "sim_s"):  # every request has every stamp: the phases add up
        assert table.loc[labels, side].sum() == pytest.approx(table.loc["TTFT", side])
    assert table.loc["prefill forward", "real_s"] > 0
    assert table["largest"].sum() == 1
    largest = table.index[table["largest"]][0]
    assert abs(table.loc[largest, "diff_s"]) == table.loc[labels, "diff_s"].abs().max()
    assert f"Sim and real part most in **{largest}**" in proc.stdout
    # The workers' stamps, on the client's clock, come in the order the request passed them
    # (a cross-process step may look early by the fastest delivery: a few ms).
    real = pd.read_csv(out / "real_requests.csv")
    assert len(real) == pd_validation.num_requests and (real["status"] == "ok").all()
    assert real["rid"].str.startswith("cmpl-").all()
    for a, b in zip(ORDER, ORDER[1:]):
        assert (real[b] - real[a] >= -0.005).all(), (a, b, (real[b] - real[a]).min())
    assert (real["prefill_end_s"] - real["prefill_start_s"] > 0).all()
