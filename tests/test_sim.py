"""The SimPy backend end to end: determinism, conservation, pools, monotonic trends, Little's law."""

from __future__ import annotations

import numpy as np
import pytest

from pdsim.config import parse_experiment
from pdsim.metrics import summarize
from pdsim.runner import run_point
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.specs.models import model_preset
from pdsim.workload import generate


def experiment(**over) -> dict:
    base = {
        "name": "t",
        "seed": 1,
        "model": "llama-3.1-8b",
        "hardware": "h100",
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {
            "num_requests": 300,
            "seed": 3,
            "arrival": {"process": "poisson", "rate_rps": 10},
            "input_len": {"dist": "lognormal", "mean": 1500, "cv": 0.8, "min": 16, "max": 8000},
            "output_len": {"dist": "uniform", "low": 16, "high": 300},
        },
    }
    for dotted, value in over.items():
        node = base
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return base


def run(data: dict):
    cfg = parse_experiment(data)
    return run_point(0, cfg, {}, None)


def simulate_cfg(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed)
    return sim, wl, sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens)


def test_same_seed_gives_identical_summary_and_requests():
    a, b = run(experiment()), run(experiment())
    assert a.summary == pytest.approx(b.summary, nan_ok=True)
    assert a.requests.equals(b.requests)
    c = run(experiment(workload__seed=4))
    assert c.summary["ttft_mean_s"] != a.summary["ttft_mean_s"]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "random"])
def test_every_arrival_completes_and_pools_return(mode, policy):
    sim, wl, result = simulate_cfg(experiment(cluster__mode=mode, router__policy=policy))
    assert len(result.records) == len(wl)
    assert all(r.ok for r in result.records)
    for rec, n_out in zip(result.records, wl.output_tokens):
        assert rec.output_tokens == n_out
        assert len(rec.token_times_s) == n_out
        assert np.all(np.diff(rec.token_times_s) >= 0)
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
    if mode == "disaggregated":
        r = result.records[0]
        assert r.arrival_s <= r.bootstrap_done_s <= r.prefill_start_s < r.prefill_end_s
        assert r.prefill_end_s < r.transfer_done_s == r.first_token_s
    result.check_pools_full()


def test_overload_under_tiny_pools_retracts_and_still_conserves():
    data = experiment(
        workload__arrival={"process": "poisson", "rate_rps": 200},
        workload__num_requests=200,
    )
    data["cluster"]["decode"]["scheduler"] = {"num_pages": 400, "page_size": 16,
                                              "num_reserved_decode_tokens": 16}
    data["cluster"]["prefill"]["scheduler"] = {"num_pages": 400, "page_size": 16}
    sim, wl, result = simulate_cfg(data)
    ok = [r for r in result.records if r.ok]
    failed = [r for r in result.records if not r.ok]
    assert len(ok) + len(failed) == len(wl)
    assert all(r.error for r in failed)  # any failure says why
    assert len(ok) > 0.9 * len(wl)
    for r in ok:
        assert len(r.token_times_s) == r.output_tokens
    result.check_pools_full()
    assert result.retractions > 0


def test_a_decode_retraction_is_priced_as_its_host_copies():
    """The decode side retracts by copying KV pages to the host and back (no forward
    recomputes): a step that moves pages takes their copies over the GPU's host link more."""
    data = experiment(workload__arrival={"process": "poisson", "rate_rps": 200},
                      workload__num_requests=200)
    data["cluster"]["decode"]["scheduler"] = {"num_pages": 400, "page_size": 16,
                                              "num_reserved_decode_tokens": 16}
    cfg = parse_experiment(data)
    cluster = build_cluster(cfg)
    page_bytes = 16 * model_preset("llama-3.1-8b").kv_bytes_per_token_per_rank(1, 2)
    assert cluster.decode.host_copy_s_per_page == pytest.approx(page_bytes / 64e9)
    moved = []
    sim = Simulation(cluster, cfg.seed)
    decode = sim.serving[0]
    execute = decode.executor.execute

    def watched(step):
        result = execute(step)
        pages = sum(len(m.pages) for b in step if b is not None for m in b.kv_moves)
        if pages:
            plain = decode.executor.step_time_s(step)
            moved.append((pages, result.duration_s - plain))
            assert all(b.kind == "decode" for b in step if b is not None)
        return result

    decode.executor.execute = watched
    planned = []  # pages every planned step moves (a step priced apart must carry them all)
    for sched in decode.instance.schedulers:
        def step(now, plan=sched.step):
            batch = plan(now)
            if batch is not None and batch.kv_moves:
                planned.append(sum(len(m.pages) for m in batch.kv_moves))
            return batch
        sched.step = step
    wl = generate(cfg.workload)
    result = sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens)
    assert result.retractions > 0 and moved
    assert sorted(pages for pages, _ in moved) == sorted(planned)
    for pages, extra in moved:
        assert extra == pytest.approx(pages * cluster.decode.host_copy_s_per_page)
    assert run(data).summary["retractions"] == result.retractions


def test_requests_longer_than_the_pool_fail_clearly_and_others_go_on():
    data = experiment(workload__input_len={"dist": "uniform", "low": 100, "high": 4000})
    data["cluster"]["decode"]["scheduler"] = {"num_pages": 200, "page_size": 16}  # 3,200 tokens
    sim, wl, result = simulate_cfg(data)
    too_long = wl.input_tokens + wl.output_tokens > 3200
    assert too_long.any() and not too_long.all()
    for rec, long in zip(result.records, too_long):
        if long:
            assert not rec.ok and "pool holds 3200" in rec.error
        else:
            assert rec.ok
    result.check_pools_full()


def test_more_prefill_instances_lower_ttft_when_prefill_bound():
    load = {"process": "poisson", "rate_rps": 24}
    one = run(experiment(workload__arrival=load, cluster__prefill={"instances": 1}))
    two = run(experiment(workload__arrival=load, cluster__prefill={"instances": 2}))
    assert two.summary["ttft_p50_s"] < 0.5 * one.summary["ttft_p50_s"]


def test_more_decode_instances_lower_itl_when_decode_bound():
    wl = {"arrival": {"process": "poisson", "rate_rps": 30},
          "output_len": {"dist": "fixed", "value": 600},
          "input_len": {"dist": "fixed", "value": 512}}
    data = experiment(cluster__prefill={"instances": 2})
    data["workload"].update(wl)
    one = run(data)
    data2 = experiment(cluster__prefill={"instances": 2}, cluster__decode={"instances": 2})
    data2["workload"].update(wl)
    two = run(data2)
    assert two.summary["itl_p50_s"] < 0.8 * one.summary["itl_p50_s"]


def test_littles_law_holds_on_the_simulated_system():
    """Time-average requests in the system, sampled from the schedulers' own counters, equals
    arrival rate × mean time in system from the records."""
    cfg = parse_experiment(experiment(workload__num_requests=600))
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed)
    samples = []
    dt = 0.01

    def monitor():
        while True:
            samples.append(sum(s.num_active for inst in sim.serving for s in inst.schedulers))
            yield sim.env.timeout(dt)

    sim.env.process(monitor())
    result = sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens)
    arrivals = np.array([r.arrival_s for r in result.records])
    finishes = np.array([r.finish_s for r in result.records])
    horizon = finishes.max()
    lam = len(arrivals) / horizon
    w = float(np.mean(finishes - arrivals))
    l_sampled = float(np.mean(samples[: int(horizon / dt)]))
    assert l_sampled == pytest.approx(lam * w, rel=0.03)


def test_network_disabled_is_faster_than_a_slow_network():
    slow = run(experiment(network={"bandwidth_gb_per_s": 0.5}))
    free = run(experiment(network={"enabled": False}))
    assert free.summary["ttft_p50_s"] < slow.summary["ttft_p50_s"]
    # 1500 tokens × 128 KiB at 0.5 GB/s is ~0.4 s of wire time per request.
    assert slow.summary["ttft_p50_s"] > 0.3


def test_dp_attention_runs_one_scheduler_per_rank():
    data = experiment(cluster__decode={"instances": 1, "tp": 2, "dp_attention": 2})
    sim, wl, result = simulate_cfg(data)
    (decode,) = sim.serving
    assert len(decode.schedulers) == 2
    served = [s for s in decode.schedulers if s.running.step > 0]
    assert len(served) == 2  # rooms spread over both ranks
    assert all(r.ok for r in result.records)
    result.check_pools_full()


def test_summary_counts_gpus_of_both_roles():
    res = run(experiment(cluster__prefill={"instances": 2, "tp": 2}, cluster__decode={"instances": 1, "tp": 4}))
    assert res.summary["num_gpus"] == 8
    s = summarize([], num_gpus=1, slo=parse_experiment(experiment()).slo)
    assert s["completed"] == 0


def test_bootstrap_timeout_fails_waiting_requests_and_the_rest_complete():
    """A decode instance with room for ~one request at a time keeps later requests in its
    prealloc queue; their prefill senders stay Bootstrapping past the timeout and fail."""
    data = experiment(
        workload__num_requests=30,
        workload__arrival={"process": "poisson", "rate_rps": 50},
        workload__input_len={"dist": "fixed", "value": 1000},
        workload__output_len={"dist": "fixed", "value": 400},
    )
    data["cluster"]["decode"]["scheduler"] = {"num_pages": 100, "page_size": 16,
                                              "num_reserved_decode_tokens": 0}
    data["cluster"]["prefill"]["scheduler"] = {"bootstrap_timeout_s": 3.0}
    sim, wl, result = simulate_cfg(data)
    failed = [r for r in result.records if not r.ok]
    ok = [r for r in result.records if r.ok]
    assert failed and ok
    assert all("bootstrap timed out after 3.0 s" in r.error for r in failed)
    # The prefill side gives up at exactly 3 s; the decode side hears of it by the end of its
    # current forward step.
    assert all(3.0 <= r.finish_s - r.arrival_s < 3.05 for r in failed)
    result.check_pools_full()


def test_utilisation_and_kv_bytes_are_reported():
    sim, wl, result = simulate_cfg(experiment())
    pages = sum(-(-int(n) // 16) for n in wl.input_tokens)
    # Llama-3.1-8B in bf16: 32 layers × K and V × 8 heads × 128 × 2 bytes per token.
    assert result.kv_transfer_gb == pytest.approx(pages * 16 * 131072 / 1e9)
    assert 0 < result.prefill_busy_frac < 1 and 0 < result.decode_busy_frac < 1
    # Little's law on the decode batch: mean batch ≈ decode rate × mean time in decode.
    ok = [r for r in result.records if r.ok]
    in_decode = sum(r.finish_s - r.first_token_s for r in ok) / result.sim_time_s
    assert result.decode_mean_batch == pytest.approx(in_decode, rel=0.05)
    colo = simulate_cfg(experiment(cluster__mode="colocated"))[2]
    assert colo.kv_transfer_gb == 0 and np.isnan(colo.prefill_busy_frac)


def test_a_busy_decode_instance_takes_a_new_request_in_at_its_step_boundary():
    """As a real worker (and SGLang's scheduler loop) reads new requests between forwards, a
    decode instance in the middle of a step creates the request's receiver, and so starts the
    handshake that lets the prefill side begin, only when that step ends."""
    from pdsim.sim.cluster import simulate

    cluster = build_cluster(parse_experiment(experiment()))
    first, second = simulate(cluster, np.array([0.0, 0.5]), np.array([64, 64]),
                             np.array([400, 4]), seed=0).records
    reaches = second.arrival_s + cluster.frontend_latency_s
    # The first request is decoding when the second comes: each of its tokens ends a step.
    boundary = min(t for t in first.token_times_s if t >= reaches)
    assert boundary > reaches and first.finish_s > boundary
    assert second.bootstrap_done_s >= boundary + cluster.network.handshake_s
