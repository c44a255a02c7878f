"""The simulator's runs of decode steps (one event for k steps) give exactly the records of one
event per step: every timestamp and every token time equal, bit for bit."""

from __future__ import annotations

import math

import pytest

from pdsim.config import parse_experiment
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.sim.instance import SimInstance
from pdsim.workload import generate


def experiment(mode: str = "disaggregated", **extra) -> dict:
    cluster = ({"mode": "colocated", "colocated": {"instances": 1}} if mode == "colocated"
               else {"prefill": {"instances": 1}, "decode": {"instances": 1}})
    data = {
        "name": "fast", "seed": 1, "model": "llama-3.1-8b", "hardware": "h100",
        "cost_model": {"name": "roofline"},
        "cluster": cluster,
        # The network the runs' share below was measured on (FIFO links, no descriptor cost):
        # the share settled by runs moves with transfer timings (fair + descriptors: 0.40).
        "network": {"sharing": "fifo", "per_descriptor_s": 0.0},
        "workload": {
            "num_requests": 150, "seed": 3,
            "arrival": {"process": "poisson", "rate_rps": 4},
            "input_len": {"dist": "uniform", "low": 16, "high": 3000},
            "output_len": {"dist": "uniform", "low": 1, "high": 400},
        },
    }
    data.update(extra)
    return data


def both_ways(data: dict, monkeypatch):
    """(step-by-step result, runs-of-steps result, decode steps settled by runs)."""
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    settled = []
    original = SimInstance._decode_run

    def counting(self, *args):
        before = self.steps
        yield from original(self, *args)
        settled.append(self.steps - before)

    monkeypatch.setattr(SimInstance, "_decode_run", counting)
    results = [simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens,
                        seed=cfg.seed, max_duration_s=cfg.max_duration_s,
                        closed_loop=wl.closed_loop, decode_runs=runs)
               for runs in (False, True)]
    return results[0], results[1], settled


def assert_same_records(slow, fast) -> None:
    assert len(slow.records) == len(fast.records)
    for a, b in zip(slow.records, fast.records):
        for name in a.__slots__:
            x, y = getattr(a, name), getattr(b, name)
            if name == "token_times_s":
                assert list(x) == list(y), f"request {a.rid}: token times differ"
            else:
                assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), \
                    f"request {a.rid}: {name} {x!r} != {y!r}"
    assert slow.sim_time_s == fast.sim_time_s
    assert [i.steps for i in slow.instances] == [i.steps for i in fast.instances]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_runs_of_steps_give_the_step_by_step_records(mode, monkeypatch):
    slow, fast, settled = both_ways(experiment(mode), monkeypatch)
    assert_same_records(slow, fast)
    assert all(r.ok for r in fast.records)
    # The runs did real work: a good share of the decode steps was settled many at a time
    # (a PD decode instance goes step by step while transfers arrive every step or two).
    decode_steps = sum(i.steps for i in fast.instances if i.schedulers[0].running.step)
    assert sum(settled) > 0.25 * decode_steps and max(settled) >= 20


def test_a_colocated_run_ends_at_the_next_arrival_without_an_interrupt(monkeypatch):
    """A colocated run plans no step past the one in progress at the next arrival, so the
    arrival (its only outside event) finds nothing to cut: no run is interrupted."""
    import simpy

    interrupts = []
    original = simpy.Process.interrupt
    monkeypatch.setattr(simpy.Process, "interrupt",
                        lambda self, cause=None: interrupts.append(cause) or original(self, cause))
    slow, fast, settled = both_ways(experiment("colocated"), monkeypatch)
    assert_same_records(slow, fast)
    assert settled and interrupts == []


def test_free_decode_steps_run_too():
    """A fitted cost model may price a decode step at 0 s: runs still plan (no division by
    the step time) and give the step-by-step records."""
    import dataclasses

    class FreeDecode:
        def __init__(self, inner):
            self.inner = inner

        def step_time_s(self, shapes):
            if all(s.prefill_tokens == 0 for s in shapes):
                return 0.0
            return self.inner.step_time_s(shapes)

    cfg = parse_experiment(experiment("colocated"))
    wl = generate(cfg.workload)
    spec = build_cluster(cfg)
    role = spec.colocated
    spec = dataclasses.replace(spec, colocated=dataclasses.replace(
        role, cost=lambda: FreeDecode(role.cost())))
    slow, fast = (simulate(spec, wl.arrival_s, wl.input_tokens, wl.output_tokens,
                           decode_runs=runs) for runs in (False, True))
    assert_same_records(slow, fast)
    assert all(r.ok for r in fast.records)
    assert any(r.finish_s == r.first_token_s and r.output_tokens > 1 for r in fast.records)


def test_a_tight_pool_retracts_the_same_requests(monkeypatch):
    """Runs stop where the pool cannot give the next step its pages; retraction then happens
    as step by step (here many times)."""
    data = experiment("colocated")
    data["cluster"]["colocated"]["scheduler"] = {"num_pages": 400, "num_reserved_decode_tokens": 0}
    data["workload"]["arrival"]["rate_rps"] = 20
    slow, fast, settled = both_ways(data, monkeypatch)
    assert_same_records(slow, fast)
    assert any(r.ok for r in fast.records) and settled


def test_closed_loop_and_timeouts(monkeypatch):
    data = experiment(network={"transfer_floor_s": 0.04})
    # Twelve clients at once: the decode side takes their pages together, and the last of
    # them wait for the prefill longer than this: some time out, the rest decode.
    data["cluster"]["decode"]["scheduler"] = {"waiting_timeout_s": 0.4}
    data["workload"]["arrival"] = {"process": "closed", "concurrency": 12, "think_time_s": 0.0}
    slow, fast, settled = both_ways(data, monkeypatch)
    assert_same_records(slow, fast)
    assert settled
    assert any(not r.ok for r in fast.records) and any(r.ok for r in fast.records)


def test_a_decode_kill_mid_run(monkeypatch):
    data = experiment(faults={"kill": [{"role": "decode", "instance": 0, "at_s": 9.0,
                                        "restart_after_s": 2.0}]})
    slow, fast, _ = both_ways(data, monkeypatch)
    assert_same_records(slow, fast)
    assert any(not r.ok for r in fast.records) and any(r.ok for r in fast.records)


def test_speculative_decoding_runs_step_by_step(monkeypatch):
    """A speculative batch emits a varying number of tokens per step: no runs of steps."""
    data = experiment(speculative={"method": "mtp", "num_draft_tokens": 2,
                                   "acceptance": {"rates": [0.8, 0.6]}})
    slow, fast, settled = both_ways(data, monkeypatch)
    assert_same_records(slow, fast)
    assert settled == []


def test_token_times_are_views_not_floats():
    cfg = parse_experiment(experiment("colocated"))
    wl = generate(cfg.workload)
    result = simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens)
    longest = max(result.records, key=lambda r: r.output_tokens)
    times = longest.token_times_s
    assert len(times) == longest.output_tokens > 100
    assert len(times._parts) <= 3  # the first token, then one or two views of the step times
    assert list(times) == sorted(times) and times[0] == longest.first_token_s
    assert times[-1] == longest.finish_s and times[-1] == list(times)[-1]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_metrics_of_views_match_metrics_of_plain_lists(mode):
    """Gaps inside step-time views are counted with weights instead of expanded per token;
    every figure equals the one from the same times as plain lists (to float rounding), and
    from the records after a round trip through pickle (as a process pool returns them: each
    view comes back an array of its own)."""
    import dataclasses
    import pickle

    from pdsim.metrics import SLO, records_frame, summarize

    cfg = parse_experiment(experiment(mode))
    wl = generate(cfg.workload)
    result = simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens)
    compact = result.records
    plain = [dataclasses.replace(r, token_times_s=list(r.token_times_s)) for r in compact]
    copied = pickle.loads(pickle.dumps(compact))
    assert compact[0].token_times_s.step_offsets() is not None
    assert copied[0].token_times_s.step_offsets() is None  # its offsets no longer hold
    assert copied[0].token_times_s == compact[0].token_times_s
    slo = SLO(ttft_s=1.0, itl_s=0.02)
    a = summarize(compact, num_gpus=2, slo=slo)
    fa = records_frame(compact)
    for other in (plain, copied):
        b = summarize(other, num_gpus=2, slo=slo)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-12, nan_ok=True), key
        fb = records_frame(other)
        for col in ("itl_mean_s", "itl_max_s"):
            assert fa[col].to_numpy() == pytest.approx(fb[col].to_numpy(), rel=1e-12, nan_ok=True)
