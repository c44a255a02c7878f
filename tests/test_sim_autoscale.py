"""Autoscaling in the simulator (pdsim/sim/autoscaler.py): a fixed schedule gives its instance
timeline, a new instance joins only after its cold start, a drain loses no request and gives
every page and slot back, and experiments/autoscaling.yaml passes `pdsim check`."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdsim.config import parse_experiment
from pdsim.runner import run_point
from pdsim.sim.autoscaler import AutoscaleSetup, cold_start_s
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.workload import generate

REPO = Path(__file__).resolve().parent.parent


def experiment(autoscaling: dict, num_requests: int = 600, rate_rps: float = 6.0,
               instances: tuple[int, int] = (1, 1)) -> dict:
    return {
        "name": "as", "seed": 2, "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"prefill": {"instances": instances[0]}, "decode": {"instances": instances[1]}},
        "router": {"policy": "round_robin"},
        "autoscaling": {"interval_s": 10, "prefill": {"max_instances": 3},
                        "decode": {"max_instances": 3}, **autoscaling},
        "workload": {"num_requests": num_requests, "seed": 5,
                     "arrival": {"process": "poisson", "rate_rps": rate_rps},
                     "input_len": {"dist": "uniform", "low": 200, "high": 3000},
                     "output_len": {"dist": "uniform", "low": 20, "high": 400}},
    }


def run(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    cluster = build_cluster(cfg)
    result = simulate(cluster, wl.arrival_s, wl.input_tokens, wl.output_tokens, seed=cfg.seed,
                      autoscale=AutoscaleSetup(cfg.autoscaling, cfg.slo.itl_s))
    return cfg, cluster, result


SCHEDULE = [{"at_s": 0, "prefill": 1, "decode": 1}, {"at_s": 25, "prefill": 3, "decode": 2},
            {"at_s": 65, "prefill": 1, "decode": 1}]


def test_fixed_schedule_gives_the_scheduled_instance_timeline():
    cfg, cluster, result = run(experiment({"policy": "fixed", "fixed": {"schedule": SCHEDULE},
                                           "cold_start": {"weights_gb_per_s": 4.0,
                                                          "process_start_s": 3.0}}))
    scaler = result.autoscaler
    cold = cold_start_s(cfg.autoscaling, cluster.prefill)
    assert 5 < cold < 10  # 16 GB of Llama-3.1-8B at 4 GB/s + 3 s
    serving = {s.end_s: (s.running["prefill"], s.running["decode"]) for s in scaler.samples}
    target = {s.end_s: (s.target["prefill"], s.target["decode"]) for s in scaler.samples}
    # a sample is the state at the tick, before its target is acted on: the 30 s tick (the
    # first at or after 25 s) sets 3:2, served from its cold start on
    assert serving[30] == (1, 1) and target[20] == (1, 1) and target[30] == (3, 2)
    assert serving[40] == (3, 2) and serving[60] == (3, 2)
    # the 70 s tick drains the newest ones at once; by 80 s every drain has finished
    assert serving[70] == (3, 2) and target[70] == (1, 1)
    assert serving[80] == (1, 1) and all(s.draining == {"prefill": 0, "decode": 0}
                                         for s in scaler.samples if s.end_s >= 80)
    assert all(s.drain_s == 70 for s in scaler.spans if not math.isnan(s.drain_s))
    joined = sorted(s.joined_s for s in scaler.spans if s.requested_s > 0)
    assert joined == pytest.approx([30 + cold] * 3)
    # the joined instances served requests, and the later ones none once they left
    p_used = {r.prefill_instance for r in result.records}
    assert {1, 2} <= p_used
    left = {s.index: s.left_s for s in scaler.spans if s.role == "prefill" and s.index > 0}
    for r in result.records:
        if r.prefill_instance in left:
            assert r.arrival_s <= left[r.prefill_instance]
    # GPU-hours: two 1-GPU instances for the run plus three from 30 s to their leaving
    end = result.sim_time_s
    extra = sum(s.left_s - 30 for s in scaler.spans if s.requested_s > 0)
    assert scaler.gpu_hours(end) == pytest.approx((2 * end + extra) / 3600)


def test_cold_start_delays_joining_by_the_stated_time():
    data = experiment({"policy": "fixed", "fixed": {"schedule": [
        {"at_s": 0, "prefill": 1, "decode": 1}, {"at_s": 10, "prefill": 1, "decode": 2}]},
        "cold_start": {"weights_gb_per_s": 1.0, "process_start_s": 12.0}},
        num_requests=400, rate_rps=8)
    cfg, cluster, result = run(data)
    weights_s = cluster.decode.weight_bytes_per_gpu / 1e9
    assert weights_s == pytest.approx(16.06, abs=0.1)  # Llama-3.1-8B's bf16 weights on one GPU
    new = [s for s in result.autoscaler.spans if s.requested_s > 0]
    assert len(new) == 1 and new[0].role == "decode" and new[0].requested_s == 10
    joined_s = 10 + 12.0 + weights_s
    assert new[0].joined_s == pytest.approx(joined_s)
    first = min(r.arrival_s for r in result.records if r.decode_instance == 1)
    assert first >= joined_s - cluster.frontend_latency_s  # sent no earlier than it joined
    assert first < joined_s + 1  # and soon after, at 8 req/s round robin
    before = [s for s in result.autoscaler.samples if s.end_s < joined_s and s.end_s > 10]
    assert before and all(s.starting["decode"] == 1 and s.running["decode"] == 1 for s in before)


def test_drain_loses_no_request_and_every_page_and_slot_comes_back():
    # busy 3P:3D shrinks to 1:1 while loaded: the drained instances hold running requests
    data = experiment({"policy": "fixed", "fixed": {"schedule": [
        {"at_s": 0, "prefill": 3, "decode": 3}, {"at_s": 20, "prefill": 1, "decode": 1}]}},
        num_requests=500, rate_rps=12, instances=(3, 3))
    cfg, cluster, result = run(data)
    assert len(result.records) == 500 and all(r.ok for r in result.records)
    spans = [s for s in result.autoscaler.spans if not math.isnan(s.drain_s)]
    assert len(spans) == 4 and all(s.drain_s == 20 for s in spans)
    assert all(s.left_s > s.drain_s for s in spans if s.role == "decode")  # work to finish
    for s in spans:  # nothing was sent to a draining instance; it left once its work was done
        if s.role == "prefill":
            served = [r for r in result.records if r.prefill_instance == s.index]
            done_s = max(r.transfer_done_s for r in served)  # its KV landed
        else:
            served = [r for r in result.records if r.decode_instance == s.index]
            done_s = max(r.finish_s for r in served)
        assert served and max(r.arrival_s for r in served) <= 20
        assert done_s <= s.left_s
    result.check_pools_full()


def test_threshold_and_sla_runs_scale_up_under_a_step_in_load_and_report_gpu_hours():
    for policy in ("threshold", "sla"):
        data = experiment({"policy": policy, "threshold": {"cooldown_s": 10},
                           "sla": {"predictor": "last", "headroom": 0.5}}, num_requests=1500)
        data["workload"]["arrival"] = {"process": "steps", "steps": [
            {"at_s": 0, "rate_rps": 2}, {"at_s": 40, "rate_rps": 30}]}
        point = run_point(0, parse_experiment(data), {}, None)
        row = point.summary
        assert row["scale_ups"] >= 1 and row["peak_gpus"] > 2, policy
        assert row["completed"] == 1500
        assert row["gpu_hours"] == pytest.approx(row["mean_gpus"] * row["sim_time_s"] / 3600)
        timeline = point.timeline
        late = timeline[timeline["start_s"] >= 60]
        assert (late["prefill_running"] + late["decode_running"]).max() > 2, policy
        assert timeline["arrivals"].sum() == 1500
        if policy == "sla":
            assert row["sla_prefill_tokens_per_s"] > row["sla_decode_tokens_per_s"] > 0


def test_autoscaling_with_faults_is_refused():
    data = experiment({"policy": "static"})
    data["faults"] = {"kill": [{"role": "decode", "instance": 0, "at_s": 5}]}
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    with pytest.raises(ValueError, match="autoscaling with fault injection"):
        simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens,
                 autoscale=AutoscaleSetup(cfg.autoscaling, 0.1))


def test_the_autoscaling_experiment_passes_check():
    proc = subprocess.run([sys.executable, "-m", "pdsim.cli", "check", "experiments/autoscaling.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "3 point(s)" in proc.stdout


def test_timeline_windows_count_every_arrival_once():
    cfg, cluster, result = run(experiment({"policy": "static"}, num_requests=200))
    from pdsim.sim.autoscaler import timeline_frame

    frame = timeline_frame(result.autoscaler, result.records, result.sim_time_s, cfg.slo)
    assert frame["arrivals"].sum() == 200
    assert np.all(np.diff(frame["end_s"]) > 0) and frame["end_s"].iloc[-1] == result.sim_time_s
    assert (frame["gpus"].dropna() == 2).all()


def test_busy_fractions_count_only_the_time_an_instance_was_there(tmp_path):
    from pdsim.plots import plot_timeline
    from pdsim.sim.autoscaler import timeline_frame

    cfg, cluster, result = run(experiment({"policy": "fixed", "fixed": {"schedule": SCHEDULE}}))
    scaler, end = result.autoscaler, result.sim_time_s
    prefill_busy_s = sum(inst.busy_s for inst in scaler.instances["prefill"])
    assert result.prefill_busy_frac == pytest.approx(
        prefill_busy_s / scaler.serving_s("prefill", end))
    assert scaler.serving_s("prefill", end) < 3 * end  # two of the three served a while only
    frame = timeline_frame(scaler, result.records, end, cfg.slo)
    frame["label"] = "fixed"
    path = plot_timeline(frame, tmp_path / "timeline.png", slo=cfg.slo)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
