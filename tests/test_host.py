"""Shared host cores (pdsim/sim/host.py): forwards that overlap share the cores equally, so a
job's end follows from processor sharing; a simulation with `cluster.host_cores` stretches
concurrent forwards and leaves lone ones alone."""

from __future__ import annotations

import pytest
import simpy

from pdsim.config import ConfigError, parse_experiment
from pdsim.metrics import SLO, summarize
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.sim.host import SharedHost
from pdsim.workload import generate


def _ends(cores: float, jobs: list[tuple[float, float, float]]) -> list[float]:
    """End times of jobs (start s, demand cores, work s) on a host of `cores`."""
    env = simpy.Environment()
    host = SharedHost(env, cores)
    ends = [0.0] * len(jobs)

    def job(i, start, demand, work):
        yield env.timeout(start)
        yield host.run(demand, work)
        ends[i] = env.now

    for i, spec in enumerate(jobs):
        env.process(job(i, *spec))
    env.run()
    return ends


def test_jobs_share_the_cores_equally_while_they_overlap():
    # Alone, or as many one-core jobs as cores: full speed.
    assert _ends(2, [(0, 1, 1.0)]) == [pytest.approx(1.0)]
    assert _ends(2, [(0, 1, 1.0), (0, 1, 2.0)]) == [pytest.approx(1.0), pytest.approx(2.0)]
    # Three one-core jobs on two cores run at 2/3 speed until the first ends at 1.5 s.
    assert _ends(2, [(0, 1, 1.0)] * 3) == [pytest.approx(1.5)] * 3
    # A job joining halfway: 0.5 s alone, then both at 1/2 speed on one core; the first's last
    # 0.5 s of work takes 1 s, the second then runs alone.
    assert _ends(1, [(0, 1, 1.0), (0.5, 1, 1.0)]) == [pytest.approx(1.5), pytest.approx(2.0)]
    # A two-core job beside a one-core job on two cores: both at 2/3 speed.
    assert _ends(2, [(0, 2, 1.0), (0, 1, 1.0)]) == [pytest.approx(1.5)] * 2
    assert _ends(2, [(0, 1, 0.0)]) == [0.0]
    with pytest.raises(ValueError, match="host cores=0"):
        SharedHost(simpy.Environment(), 0)


def _pd(host_cores: int | None, rate_rps: float) -> dict:
    cluster = {"mode": "disaggregated", "prefill": {"instances": 2, "threads": 1},
               "decode": {"instances": 1, "threads": 1}}
    if host_cores is not None:
        cluster["host_cores"] = host_cores
    return {"name": "host", "model": "llama-3.1-8b", "hardware": "h100", "seed": 0,
            "cluster": cluster, "cost_model": {"name": "roofline"},
            "workload": {"num_requests": 60, "seed": 0,
                         "arrival": {"process": "poisson", "rate_rps": rate_rps},
                         "input_len": {"dist": "fixed", "value": 2048},
                         "output_len": {"dist": "fixed", "value": 32}}}


def _summary(data: dict) -> dict:
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    records = simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens,
                       seed=cfg.seed).records
    assert all(r.ok for r in records)
    return summarize(records, num_gpus=cfg.cluster.num_gpus, slo=SLO())


def test_forwards_on_shared_cores_stretch_only_when_they_overlap():
    own, roomy, tight = (_summary(_pd(cores, 2.0)) for cores in (None, 3, 1))
    # As many cores as rank processes: nothing waits for a core, as with devices of their own.
    assert roomy["ttft_mean_s"] == pytest.approx(own["ttft_mean_s"], rel=1e-6)
    assert roomy["itl_mean_s"] == pytest.approx(own["itl_mean_s"], rel=1e-6)
    # Three processes on one core: every overlap stretches both forwards.
    assert tight["ttft_mean_s"] > 1.2 * own["ttft_mean_s"]
    assert tight["itl_mean_s"] > 1.05 * own["itl_mean_s"]  # only steps beside a prefill
    with pytest.raises(ConfigError, match="host_cores"):
        parse_experiment(_pd(0, 2.0))


def _inbound_s(host_cores: int | None) -> tuple[list[float], float]:
    """Arrival -> bootstrap done of two requests, the second sent while the first decodes (a
    decode forward on the cores at every moment), and the fixed costs on that path: the front
    end and the handshake."""
    import numpy as np

    cluster = build_cluster(parse_experiment(_pd(host_cores, 1.0)))
    records = simulate(cluster, np.array([0.0, 0.5]), np.array([64, 64]),
                       np.array([400, 4]), seed=0).records
    assert all(r.ok for r in records)
    fixed = cluster.frontend_latency_s + cluster.network.handshake_s
    return [r.bootstrap_done_s - r.arrival_s for r in records], fixed


def test_fixed_costs_are_host_work_beside_the_forwards():
    (own, fixed), (roomy, _), (tight, _) = (_inbound_s(cores) for cores in (None, 4, 1))
    # Cores to spare: the front end and the handshake take their own time.
    assert roomy == pytest.approx(own, rel=1e-9)
    # One core: the first request's fixed costs run alone; the second's share the core with
    # the first one's decode steps, at about half speed: they take about twice as long.
    assert tight[0] == pytest.approx(own[0], rel=1e-9)
    assert 0.8 * fixed < tight[1] - own[1] < 2 * fixed
