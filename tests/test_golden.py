"""Golden outputs, as SimPy keeps them: a small PD scenario through the SimPy driver, its exact
event log compared line by line with tests/golden/pd_small.log; and the same scenario through
the core test driver (tests/core_harness.py), whose order of events must be the simulator's.

The log has one line per event: `time instance event rids`, with `event` one of `extend` and
`decode` (a forward starts, with the requests in it) and `done` (the instance finished the
request). An intended change of the simulator's behaviour shows up as a diff of this file;
regenerate it with

    PDSIM_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py

and review the diff before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from configs import scheduler_config
from core_harness import Driver, FixedExecutor

from pdsim.core.decode import DecodeScheduler
from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request
from pdsim.sim.cluster import ClusterSpec, RoleSpec, Simulation
from pdsim.sim.network import NetworkModel

GOLDEN = Path(__file__).parent / "golden" / "pd_small.log"
REGEN = os.environ.get("PDSIM_REGEN_GOLDEN") == "1"

EXTEND_S, DECODE_S = 1.0, 0.25
PREFILL = scheduler_config(16, page_size=4, max_prefill_tokens=8, chunked_prefill_size=8)
DECODE = scheduler_config(16, page_size=4, num_reserved_decode_tokens=4)
# (arrival s, input tokens, output tokens): chunked prefill (r2), a queue behind one batch.
WORKLOAD = [(0.0, 8, 3), (0.0, 8, 2), (0.5, 12, 4), (1.2, 4, 2)]
INSTANT = NetworkModel(enabled=False, message_latency_s=0.0, first_contact_s=0.0,
                       handshake_s=0.0, transfer_floor_s=0.0)


class FixedCost:
    """Every forward with prefill tokens takes EXTEND_S, a decode step DECODE_S."""

    def step_time_s(self, shapes) -> float:
        return EXTEND_S if any(s.prefill_tokens for s in shapes) else DECODE_S


def simpy_log(network: NetworkModel) -> list[tuple[float, str, str, tuple[str, ...]]]:
    """Run WORKLOAD through the SimPy driver (one event per decode step) and trace it by
    wrapping each scheduler's `step` and each instance's `on_done`."""
    role = dict(instances=1, dp_attention=1, gpus_per_instance=1, cost=FixedCost)
    cluster = ClusterSpec(mode="disaggregated", router_policy="round_robin", network=network,
                          prefill=RoleSpec(scheduler=PREFILL, **role),
                          decode=RoleSpec(scheduler=DECODE, **role))
    sim = Simulation(cluster, seed=0, decode_runs=False)
    log = []
    for name, inst in [("P0", sim.prefills[0]), ("D0", sim.serving[0])]:
        for sched in inst.schedulers:
            def step(now, _step=sched.step, _name=name):
                batch = _step(now)
                if batch is not None:
                    reqs = [s.req for s in batch.segments] if batch.kind == "extend" else batch.reqs
                    log.append((now, _name, batch.kind, tuple(r.rid for r in reqs)))
                return batch
            sched.step = step

        def done(req, _done=inst.instance.on_done, _name=name):
            log.append((sim.env.now, _name, "done", (req.rid,)))
            _done(req)
        inst.instance.on_done = done
    arrival, n_in, n_out = (np.array(c) for c in zip(*WORKLOAD))
    sim.run(arrival.astype(float), n_in, n_out)
    return log


def render(log) -> str:
    return "".join(f"{t:.9f} {inst} {event} {' '.join(rids)}\n" for t, inst, event, rids in log)


def test_simpy_driver_matches_the_golden_log():
    got = render(simpy_log(NetworkModel()))  # default KV path: first contact, handshake, floor
    if REGEN:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    assert GOLDEN.is_file(), f"{GOLDEN} missing: regenerate it with PDSIM_REGEN_GOLDEN=1"
    assert got.splitlines() == GOLDEN.read_text().splitlines()


def lifecycle(log) -> list[tuple[float, str, str]]:
    """(time, rid, what) per request: its prefill starts, its prefill ends, it starts decoding,
    it finishes; ties at one time in a canonical order."""
    seen, out = set(), []
    for t, inst, event, rids in log:
        what = {("P", "extend"): "prefill", ("P", "done"): "prefilled",
                ("D", "decode"): "decoding", ("D", "running"): "decoding",
                ("D", "done"): "done"}.get((inst[0], event))
        for rid in rids:
            if what is not None and (rid, what) not in seen:
                seen.add((rid, what))
                out.append((round(t, 9), rid, what))
    return sorted(out)


class EngineExecutor(FixedExecutor):
    """FixedExecutor's times and token ids, with what a serving `Engine` asks of its executor
    besides the port: the KV cache's size, top logprobs, per-request state."""

    def __init__(self, config):
        super().__init__(extend_s=EXTEND_S, decode_s=DECODE_S, token_fn=lambda batch, i: 7 + i)
        self.page_size = config.page_size
        self.kv = type("KV", (), {"num_pages": config.num_pages})()

    def want_top_logprobs(self, rid: str, k: int) -> None:
        pass

    def take_top_logprobs(self, rid: str) -> list:
        return []

    def release(self, rid: str) -> None:
        pass


def harness_log(engines: list | None = None, *, decode_config=DECODE, workload=WORKLOAD
                ) -> list[tuple[float, str, str, tuple[str, ...]]]:
    """The same scenario on the core test driver with the instant fake transfer backend; with
    `engines` (an empty list to fill), each instance is a real serving `Engine` (runtime/
    driver.py) whose own loop halves the driver runs on its clock."""
    wire = FakeWire()
    drv = Driver(FixedExecutor(extend_s=EXTEND_S, decode_s=DECODE_S))
    prefill = PrefillScheduler(PREFILL, FakeKVManager(wire), instance_id=0)
    decode = DecodeScheduler(decode_config, FakeKVManager(wire), instance_id=1)
    if engines is None:
        drv.add_instance("P0", prefill)
        drv.add_instance("D0", decode)
    else:
        from runtime.driver import Engine  # (loads torch)

        for name, sched in (("P0", prefill), ("D0", decode)):
            engines.append(Engine(EngineExecutor(sched.config), sched.config, scheduler=sched))
            drv.add_engine(name, engines[-1])
    for i, (at, n_in, n_out) in enumerate(workload):
        for name in ("P0", "D0"):
            drv.submit(at, name, Request(str(i), n_in, n_out, arrival_s=at,
                                         prompt_ids=list(range(n_in)), bootstrap_room=1000 + i))
    drv.run()
    if engines is not None:
        engines[:] = [drv.slots[name] for name in ("P0", "D0")]
    out = []
    for entry, t in drv.log:  # "rid P0:queue"
        rid, where = entry.split()
        inst, state = where.split(":")
        out.append((t, inst, state, (rid,)))
    return out


def test_core_harness_runs_the_scenario_in_the_same_order():
    """With an instant KV path, every request starts prefill, starts decoding and finishes at
    the same time in the same order under both drivers. The one difference is when the prefill
    side lets a request go: the fake backend reports `Success` inside the `send` call, so the
    harness's prefill frees the KV in the step that sent it; the simulated network reports it
    as an event at the same time, which a prefill instance busy with its next forward polls
    only after that forward (as a real prefill worker does)."""
    sim = lifecycle(simpy_log(INSTANT))
    harness = lifecycle(harness_log())
    assert len(sim) == len(harness) == 4 * len(WORKLOAD)
    assert [e for e in sim if e[2] != "prefilled"] == [e for e in harness if e[2] != "prefilled"]
    released = {rid: t for t, rid, what in harness if what == "prefilled"}
    assert all(t >= released[rid] for t, rid, what in sim if what == "prefilled")


@pytest.mark.real
def test_the_real_engine_runs_the_scenario_as_the_core_harness_does():
    """The serving engine's loop (runtime/driver.py: its inbox, the core step, its streams and
    records), driven on the same clock, goes through the scenario exactly as the harness's
    bare instance step does; every decode stream gets each token and one end."""
    engines: list = []
    assert lifecycle(harness_log(engines)) == lifecycle(harness_log())
    prefill, decode = engines
    ends = [e for e in decode.engine_events if e.finished]
    assert sorted(e.completion_tokens for e in ends) == sorted(n for _, _, n in WORKLOAD)
    assert all(e.error is None and e.finish_reason == "length" for e in ends)
    streamed = sum(len(e.token_ids) for e in decode.engine_events)
    assert streamed == sum(n for _, _, n in WORKLOAD)
    assert [r.status for r in decode.engine.records] == ["ok"] * len(WORKLOAD)
    assert len(prefill.engine.records) == len(WORKLOAD)
    for slot in (prefill, decode):
        slot.engine.sched.check_pools_full()


@pytest.mark.real
def test_a_prefill_streams_its_first_token_from_the_step_that_made_it():
    """A colocated engine streams a request's first token when its prefill forward settles,
    not one decode step later with the second."""
    from runtime.driver import Engine, Submit

    config = scheduler_config(16, page_size=4)
    engine = Engine(EngineExecutor(config), config)
    events: list = []
    req = Request("r", 6, 3, arrival_s=0.0, prompt_ids=list(range(6)))
    engine.apply(Submit(req, events.append), 0.0)
    step = engine.plan(0.0)
    assert step[0].kind == "extend"
    engine.settle(step, engine.executor.execute(step), EXTEND_S)
    assert [e.token_ids for e in events] == [(7,)]
    step = engine.plan(EXTEND_S)
    engine.settle(step, engine.executor.execute(step), EXTEND_S + DECODE_S)
    assert [len(e.token_ids) for e in events] == [1, 1]


@pytest.mark.real
def test_the_real_engine_puts_the_wait_for_a_running_slot_in_ttft_not_itl():
    """At max_running_requests, a request whose KV landed waits in the prebuilt line; the
    serving engine streams its first token when it joins the running batch (as SGLang's
    prebuilt batch does), so its TTFT holds the wait and its gaps are one decode step each."""
    engines: list = []
    one_slot = scheduler_config(16, page_size=4, num_reserved_decode_tokens=4,
                                max_running_requests=1)
    harness_log(engines, decode_config=one_slot, workload=[(0.0, 4, 3), (0.0, 4, 3)])
    _, decode = engines
    first, second = sorted(decode.engine.records, key=lambda r: r.first_token_s)
    assert first.status == second.status == "ok"
    assert second.decode_join_s >= first.finish_s  # it waited for the only running slot
    assert second.first_token_s == second.decode_join_s > second.transfer_done_s
    gaps = np.diff(second.token_times_s)
    assert np.allclose(gaps, DECODE_S)  # the wait is in TTFT, none of it in ITL
