"""`pdsim validate` and `pdsim calibrate` (docs/validation.md).

The end-to-end test calibrates this machine (`pdsim calibrate`), serves a 1 prefill : 1 decode
tiny-llama deployment for real (Mooncake over TCP on loopback), replays 12 requests, simulates
them with that calibration and requires every checked metric within the matrix's goals plus the
real-vs-real noise of a run this size (the run is conftest.py's `pd_validation`, shared with
tests/test_phases.py; docs/validation.md, "In CI").
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, summarize
from pdsim.validation.compare import METRICS, Tolerance, markdown, side_by_side
from pdsim.validation.validate import calibrated

REPO = Path(__file__).resolve().parents[1]
PD_1P1D = REPO / "experiments" / "validation" / "pd_1p1d_low.yaml"
CALIBRATION = REPO / "experiments" / "validation" / "calibration" / "pd.yaml"


def pdsim(*args, cwd, timeout=240):
    env = {**os.environ, "GLOG_minloglevel": "2"}
    return subprocess.run([sys.executable, "-m", "pdsim.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.real
@pytest.mark.slow
def test_calibrate_then_validate_a_pd_deployment_end_to_end(pd_validation):
    """This machine calibrated now, then 12 requests served and simulated: throughput within the
    goal, mean latencies within the real-vs-real spread of this machine (conftest.py's
    NOISE_RATIO), and the exit code the table's verdict."""
    from conftest import NOISE_RATIO
    from runtime.calibration import IDLE_PROBES, LONE_PROBES

    proc, out, n = pd_validation.proc, pd_validation.out, pd_validation.num_requests
    written = yaml.safe_load(pd_validation.calibration.read_text())
    params = written["cost_model"]["params"]
    assert params["step_overhead_s"] >= 0 and params["token_overhead_s"] >= 0
    assert set(params["roles"]) == {"prefill"} and written["cluster"]["host_cores"] > 0
    # Lone requests' client TTFTs over their fastest are the router's draws, back to back and
    # after the deployment idled; the front end is the median's rest, and the idle wake what
    # the fastest after idle pays more than the fastest back to back.
    probe, router = written["measured"]["probe"], written["router"]
    assert probe["idle_gap_s"] > 0 and probe["idle_client_ttft_s"] > 0
    jitter, idle_jitter = router["jitter_s"], router["idle_jitter_s"]
    assert len(jitter) == LONE_PROBES and len(idle_jitter) == IDLE_PROBES
    for draws in (jitter, idle_jitter):
        assert draws == sorted(draws) and draws[0] == 0.0 and draws[-1] > 0
    fastest = probe["client_ttft_s"] - statistics.median(jitter)
    fastest_idle = probe["idle_client_ttft_s"] - statistics.median(idle_jitter)
    assert router["idle_wakeup_s"] == pytest.approx(max(0.0, fastest_idle - fastest), abs=4e-6)
    assert router["frontend_latency_s"] == pytest.approx(
        max(0.0, fastest - probe["engine_ttft_s"]), abs=4e-6)
    assert "wakeup_s" not in written["cluster"]["prefill"]["scheduler"]
    # Both roles' first step after idle runs cold, by the line the forwards after idle gave.
    assert len(written["measured"]["after_idle_s"]) == 7
    cold = [written["cluster"][role]["scheduler"] for role in ("prefill", "decode")]
    assert cold[0]["cold_step_factor"] == cold[1]["cold_step_factor"] >= 1
    assert cold[0]["cold_step_s"] == cold[1]["cold_step_s"] >= 0
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_csv(out / "validation.csv").set_index("metric")
    assert list(table.index) == [label for label, _ in METRICS]
    assert proc.returncode == (0 if table["within"].all() else 1)
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == n
    # Open loop below saturation: both serve what arrives (two real runs: within 3%).
    assert abs(table.loc["throughput (output tok/s)", "error"]) <= 0.15
    for label in ("TTFT mean", "ITL mean", "E2E mean"):
        ratio = table.loc[label, "sim"] / table.loc[label, "real"]
        assert 1 / NOISE_RATIO <= ratio <= NOISE_RATIO, (label, table.loc[label].to_dict())
    real = pd.read_csv(out / "real_requests.csv")
    assert len(real) == n and (real["status"] == "ok").all()
    assert (out / "validation.png").stat().st_size > 10_000
    assert "| TTFT P90 |" in (out / "validation.md").read_text()


def _records(ttft_s: float, gap_s: float, n: int = 10) -> list[RequestRecord]:
    out = []
    for i in range(n):
        t0 = float(i)
        times = [t0 + ttft_s + k * gap_s for k in range(4)]
        out.append(RequestRecord(rid=str(i), input_tokens=8, output_tokens=4, status="ok",
                                 arrival_s=t0, first_token_s=times[0], finish_s=times[-1],
                                 token_times_s=times))
    return out


def test_tolerance_flags_exactly_the_metrics_outside_it():
    slo = SLO(ttft_s=1.0, itl_s=1.0)
    real = summarize(_records(0.100, 0.010), num_gpus=2, slo=slo)
    sim = summarize(_records(0.110, 0.020), num_gpus=2, slo=slo)  # TTFT +10%, ITL +100%
    table = side_by_side(real, sim, Tolerance(mean=0.15, p90=0.25)).set_index("metric")
    assert table.loc["TTFT mean", "error"] == pytest.approx(0.10)
    assert table.loc["ITL mean", "error"] == pytest.approx(1.0)
    assert list(table.index[~table["within"]]) == ["ITL mean", "ITL P90"]
    assert math.isnan(table.loc["TTFT P99", "limit"]) and table.loc["TTFT P99", "within"]
    text = markdown(table.reset_index(), "t")
    assert "| ITL mean | 10.0 ms | 20.0 ms | +100.0% | ±15% | **over** |" in text


@pytest.mark.slow
def test_calibration_lies_over_the_experiment(tmp_path):
    raw = yaml.safe_load(PD_1P1D.read_text())
    cfg = calibrated(raw, str(PD_1P1D), CALIBRATION)
    calib = yaml.safe_load(CALIBRATION.read_text())
    assert cfg.cost_model.name == "profiled"
    assert Path(cfg.cost_model.params["timings"]) == (CALIBRATION.parent / calib["cost_model"][
        "params"]["timings"]).resolve()
    assert cfg.router.frontend_latency_s == calib["router"]["frontend_latency_s"]
    assert cfg.network.transfer_floor_s == calib["network"]["transfer_floor_s"]
    assert cfg.router.policy == raw["router"]["policy"]  # what the calibration does not set stays
    (tmp_path / "bad.yaml").write_text("cost_model: {name: profiled}\nbogus: 1\n")
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(raw))
    proc = pdsim("validate", "x.yaml", "--calibration", "bad.yaml", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "bogus" in proc.stderr and "allowed" in proc.stderr


@pytest.mark.real  # runtime.calibration: the real extra
def test_steps_after_idle_are_probed_for_the_roles_whose_ranks_run_one_thread():
    from runtime.calibration import cold_start_roles
    from runtime.serve_config import load_serve_config

    validation = REPO / "experiments" / "validation"
    assert cold_start_roles(load_serve_config(PD_1P1D)) == ["prefill", "decode"]
    # a tp-2 prefill role runs other forwards than the probed decode rank
    assert cold_start_roles(load_serve_config(validation / "pd_tp2to1_low.yaml")) == ["decode"]
    # a colocated server of a torch thread per CPU: with more than one the probe would time
    # waking the other CPUs
    colocated = load_serve_config(validation / "colocated_low.yaml")
    one = colocated.forward_threads("colocated") == 1
    assert cold_start_roles(colocated) == (["colocated"] if one else [])


@pytest.mark.real
@pytest.mark.slow
def test_profile_forwards_and_transfer_measure_real_components():
    from runtime.calibration import (page_bytes_per_buffer, profile_cold_start,
                                     profile_descriptors, profile_forwards, profile_transfer,
                                     served_alike)
    from runtime.executor import TIMING_COLUMNS
    from runtime.serve_config import load_serve_config

    config = load_serve_config(PD_1P1D)
    frame = profile_forwards(config, repeats=1, prefill_tokens=(16, 64), prefill_context=(0,),
                             decode_batch=(1, 4), decode_context=(64,))
    assert list(frame.columns) == list(TIMING_COLUMNS) and len(frame) == 4
    assert (frame["duration_s"] > 0).all()
    assert list(frame["prefill_attn_pairs"][:2]) == [16 * 17 / 2, 64 * 65 / 2]
    assert list(frame["decode_context_tokens"][2:]) == [65, 4 * 65]
    # After idle: the same shapes, each forward after the rank slept; the line against the
    # back-to-back profile never prices a forward after idle faster than the profile does.
    start = time.perf_counter()
    idle = profile_forwards(config, repeats=1, prefill_tokens=(16, 64), prefill_context=(0,),
                            decode_batch=(1, 4), decode_context=(64,), idle_gap_s=0.1)
    assert time.perf_counter() - start >= 4 * 0.1 and (idle["duration_s"] > 0).all()
    assert idle.iloc[:, :-1].equals(frame.iloc[:, :-1])
    full = profile_forwards(config, repeats=1, prefill_context=(0,), decode_batch=(1, 16),
                            decode_context=(64,))
    cold = profile_cold_start(config, full, repeats=1)
    assert len(cold.rows) == len(full) and cold.factor >= 1 and cold.step_s >= 0
    assert cold.extra_s(0.01) == pytest.approx(cold.step_s + (cold.factor - 1) * 0.01)
    fit = profile_transfer(config, repeats=2, pages=(1, 8, 64))
    assert [b for b, _ in fit.rows] == [n * fit.page_bytes for n in (1, 8, 64)]
    assert fit.floor_s >= 0 and fit.gb_per_s > 0 and 0 < fit.handshake_s < 1
    items = page_bytes_per_buffer(config)
    slices = profile_descriptors(items, config.page_size, fit.gb_per_s, repeats=2, pages=(2, 16),
                                 fits=3)
    # two ranks, one descriptor per token slot per buffer each (the probe checks the bytes landed)
    assert [d for d, _ in slices.rows] == [2 * n * config.page_size * len(items) for n in (2, 16)]
    assert slices.rows[1][1] > slices.rows[0][1] and slices.per_descriptor_s > 0
    with pytest.raises(RuntimeError, match="do not split into 3 equal slices"):
        profile_descriptors(items, config.page_size, fit.gb_per_s, senders=3)
    # A prefill role served at tp 2 is profiled on its own two rank processes, extends only.
    mismatch = load_serve_config(REPO / "experiments" / "validation" / "pd_tp2to1_low.yaml")
    assert served_alike(config) and not served_alike(mismatch)
    extends = profile_forwards(mismatch, role="prefill", repeats=1, prefill_tokens=(16,),
                               prefill_context=(0, 64), decode_batch=(), decode_context=())
    assert list(extends["kind"]) == ["extend", "extend"] and (extends["duration_s"] > 0).all()


@pytest.mark.real  # runtime.calibration: the real extra
def test_the_batch_probe_reads_the_pace_while_every_request_decodes():
    from runtime.calibration import _batch_gap_s

    def rec(first_s, gap_s, n):
        times = [first_s + k * gap_s for k in range(n)]
        return RequestRecord(rid=str(first_s), input_tokens=16, output_tokens=n, status="ok",
                             arrival_s=0.0, first_token_s=times[0], finish_s=times[-1],
                             token_times_s=times)

    # Joined 10 ms apart, then one step of 4 ms each: the pace while all three decode.
    together = [rec(0.010, 0.004, 40), rec(0.020, 0.004, 40), rec(0.030, 0.004, 40)]
    assert _batch_gap_s(together) == pytest.approx(0.004, rel=0.05)
    one_after_another = [rec(0.0, 0.004, 10), rec(1.0, 0.004, 10)]
    with pytest.raises(RuntimeError, match="did not decode together"):
        _batch_gap_s(one_after_another)


@pytest.mark.real  # runtime.calibration: the real extra
def test_the_batch_probe_asks_for_longer_outputs_until_the_requests_overlap(monkeypatch):
    """A slow prefill spreads the batch's joins 0.5 s apart: 64 tokens at 4 ms each end before
    the next request starts, 256 do not; every round then runs at 256."""
    import pdsim.validation.replay as replay_module
    from runtime.calibration import NotTogether, _batch_probe

    asked = []

    def fake_replay(url, model, arrival_s, input_tokens, output_tokens, *, seed=0):
        asked.append(output_tokens[0])
        n = output_tokens[0]
        return [RequestRecord(rid=f"{seed}-{i}", input_tokens=16, output_tokens=n, status="ok",
                              arrival_s=0.0, first_token_s=0.5 * i, finish_s=0.5 * i + 0.004 * n,
                              token_times_s=[0.5 * i + 0.004 * k for k in range(n)])
                for i in range(len(arrival_s))]

    monkeypatch.setattr(replay_module, "replay", fake_replay)
    gap, tokens = _batch_probe("http://unused", "m", 3, 16, seed=0)
    assert tokens == 256 and gap == pytest.approx(0.004, rel=0.05)
    assert asked == [64, 256, 256, 256]
    # 30 requests joining over 14.5 s: even 1024 tokens each (4.1 s) do not overlap them all.
    asked.clear()
    with pytest.raises(NotTogether, match="up to 1024 output tokens"):
        _batch_probe("http://unused", "m", 30, 16, seed=0)
    assert asked == [64, 256, 1024]
