"""Small stand-ins for driving the core schedulers in tests, with time given by hand.

- `StubKV`: a transfer backend whose endpoints do only what the test tells them (set `state`),
  and record every call made on them.
- `FixedExecutor`: every extend forward takes `extend_s`, every decode step `decode_s`; it can
  also hand back token ids, like a real executor.
- `Driver`: drives any number of instances (the core's `Instance` step, as the SimPy process and
  the real engine do) on one manual clock, event by event, the way the SimPy driver does (an
  instance begins a step only when it is not running a forward), and logs each request's queue
  transitions as `(event, time)` tuples, e.g. `("r0 P:extend", 0.0)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdsim.core.batch import Batch, BatchResult
from pdsim.core.executor import only_batch
from pdsim.core.instance import Add, Instance
from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.transfer import DictMetadataStore, FirstTokenMetadata

# ----- a scripted transfer backend -----------------------------------------------------------


class StubEndpoint:
    """A sender or receiver whose poll result the test sets; every call is recorded."""

    def __init__(self, req: Request, state: KVPoll):
        self.room = req.bootstrap_room
        self.state = state
        self.reason = ""
        self.calls: list[tuple] = []

    def poll(self) -> KVPoll:
        return self.state

    def fail(self, reason: str) -> None:
        self.state = KVPoll.Failed
        self.reason = reason

    # sender side
    def init(self, num_pages: int, metadata_slot: int) -> None:
        self.calls.append(("init", num_pages, metadata_slot))

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        self.calls.append(("send", list(page_indices), last))

    # receiver side
    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        self.calls.append(("send_metadata", list(page_indices), metadata_slot))

    def abort(self, reason: str) -> None:
        self.calls.append(("abort", reason))
        self.fail(reason)

    def failure_reason(self) -> str:
        return self.reason

    def sends(self) -> list[tuple[list[int], bool]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "send"]


class StubKV:
    """A KV manager handing out `StubEndpoint`s, kept by rid so the test can script them."""

    def __init__(self, initial: KVPoll = KVPoll.Bootstrapping):
        self.initial = initial
        self.metadata = DictMetadataStore()
        self.endpoints: dict[str, StubEndpoint] = {}
        self._epoch = 0

    def _create(self, req: Request) -> StubEndpoint:
        ep = StubEndpoint(req, self.initial)
        self.endpoints[req.rid] = ep
        return ep

    create_sender = _create
    create_receiver = _create

    def poll_epoch(self) -> int:
        """Tests flip endpoint states behind the manager's back: every poll may differ."""
        self._epoch += 1
        return self._epoch

    def __getitem__(self, rid: str) -> StubEndpoint:
        return self.endpoints[rid]

    def deliver(self, req: Request, first_token: int = 7, room: int | None = None,
                logprob: float = -0.5, cached_tokens: int = 0) -> None:
        """Decode side: the prefill side wrote the KV and the metadata slot of `req`."""
        room = req.bootstrap_room if room is None else room
        self.metadata.write(req.metadata_slot, FirstTokenMetadata(room, first_token, logprob, cached_tokens))
        self.endpoints[req.rid].state = KVPoll.Success


# ----- executors -----------------------------------------------------------------------------


class FixedExecutor:
    """Fixed forward durations. With `token_fn(batch, i)` it also returns one token id per
    extend segment or decode request (logprob -1.0 each), like a real executor. `execute` is
    the core's executor port; `forward` runs the one batch (subclasses wrap it)."""

    def __init__(self, extend_s: float = 1.0, decode_s: float = 0.25,
                 token_fn: Callable[[Batch, int], int] | None = None):
        self.extend_s = extend_s
        self.decode_s = decode_s
        self.token_fn = token_fn
        self.batches: list[Batch] = []

    def execute(self, step) -> BatchResult:
        return self.forward(only_batch(step))

    def forward(self, batch: Batch) -> BatchResult:
        self.batches.append(batch)
        duration = self.extend_s if batch.kind == "extend" else self.decode_s
        if self.token_fn is None:
            return BatchResult(duration)
        n = len(batch.segments) if batch.kind == "extend" else len(batch.reqs)
        ids = [self.token_fn(batch, i) for i in range(n)]
        return BatchResult(duration, token_ids=ids, logprobs=[-1.0] * n)


# ----- an event-by-event driver on a manual clock --------------------------------------------

_QUEUES = ("bootstrap", "prealloc", "transfer", "prebuilt", "waiting", "inflight")


class _Slot:
    """One instance the driver runs: the core's `Instance` step, by hand (`add_instance`) or
    through a real serving `Engine`'s own two halves (`add_engine`)."""

    def __init__(self, name: str, sched, executor, engine=None):
        self.name = name
        self.sched = sched
        self.done: list[Request] = []
        self.engine = engine
        if engine is None:
            self.inst = Instance([sched], self.done.append)
        else:  # the engine's instance records and streams; the driver also collects
            self.inst = engine.inst
            finished = engine.inst.on_done
            engine.inst.on_done = lambda req: (finished(req), self.done.append(req))
        self.executor = executor
        self.step: list | None = None
        self.result: BatchResult | None = None
        self.end_s = math.inf
        self.reqs: dict[str, Request] = {}
        self.state: dict[str, str] = {}

    @property
    def batch(self) -> Batch | None:
        return self.step[0] if self.step is not None else None

    def take(self, req: Request, now: float) -> None:
        if self.engine is None:
            self.inst.apply(Add(req), now)
        else:
            from runtime.driver import Submit  # (the real engine's module loads torch)

            self.engine.apply(Submit(req, self.engine_events.append), now)

    def begin(self, now: float):
        return self.inst.begin(now) if self.engine is None else self.engine.plan(now)

    def finish(self, step, result: BatchResult, now: float) -> None:
        if self.engine is None:
            self.inst.finish(step, result, now)
        else:
            self.engine.settle(step, result, now)


class Driver:
    """Runs schedulers the way the SimPy driver does, but on a plain float clock.

    At each event time: finish the forwards that end now, add the arrivals due now, then step
    every idle instance, again and again while that changes anything (one instance's step can
    unblock another's, as decode's `send_metadata` unblocks prefill's bootstrap queue). Time then
    jumps to the next forward end or arrival; with neither left but work pending it moves by
    `tick_s` (so timeouts can fire), or raises when `tick_s` is None: the schedulers are stuck.
    """

    def __init__(self, executor=None, log: bool = True, tick_s: float | None = None):
        self.executor = executor or FixedExecutor()
        self.now = 0.0
        self.log_enabled = log
        self.log: list[tuple[str, float]] = []
        self.tick_s = tick_s
        self.slots: dict[str, _Slot] = {}
        self._arrivals: list[tuple[float, int, str, Request]] = []

    def add_instance(self, name: str, sched, executor=None) -> None:
        self.slots[name] = _Slot(name, sched, executor or self.executor)

    def add_engine(self, name: str, engine) -> None:
        """A real serving `Engine` (runtime/driver.py), not started: the driver runs its loop's
        two halves (`plan`, `settle`) on this clock with the engine's own executor; the events
        it streams collect in `slot.engine_events`."""
        slot = self.slots[name] = _Slot(name, engine.sched, engine.executor, engine)
        slot.engine_events = []

    def submit(self, at_s: float, name: str, req: Request) -> None:
        """Hand `req` to instance `name` at time `at_s` (submission order breaks ties)."""
        self._arrivals.append((at_s, len(self._arrivals), name, req))
        self._arrivals.sort(key=lambda a: (a[0], a[1]))

    def done(self, name: str) -> list[Request]:
        return self.slots[name].done

    # --- observation ---

    def _states(self, slot: _Slot) -> dict[int, str]:
        """id(request) → the queue it is in, for every request the scheduler holds."""
        sched = slot.sched
        states: dict[int, str] = {}
        for q in _QUEUES:
            for r in getattr(sched, q, ()):
                states[id(r)] = q
        for r in sched.running.reqs:
            states[id(r)] = "running"
        if slot.batch is not None and slot.batch.kind == "extend":
            for seg in slot.batch.segments:
                states[id(seg.req)] = "extend"
        return states

    def _observe(self, slot: _Slot) -> bool:
        states = self._states(slot)
        changed = False
        for rid, req in slot.reqs.items():
            if req.finished:
                state = "failed" if req.error else "done"
            else:
                state = states.get(id(req), "?")
            if slot.state.get(rid) != state:
                slot.state[rid] = state
                changed = True
                if self.log_enabled:
                    self.log.append((f"{rid} {slot.name}:{state}", self.now))
        return changed

    # --- time ---

    def _idle(self) -> bool:
        return not self._arrivals and all(s.inst.is_idle and s.step is None for s in self.slots.values())

    def run(self, until_s: float = math.inf, max_events: int = 1_000_000) -> None:
        for _ in range(max_events):
            t = self.now
            for slot in self.slots.values():
                if slot.step is not None and slot.end_s <= t:
                    step, result = slot.step, slot.result
                    slot.step, slot.result, slot.end_s = None, None, math.inf
                    slot.finish(step, result, t)
                    self._observe(slot)
            while self._arrivals and self._arrivals[0][0] <= t:
                _, _, name, req = self._arrivals.pop(0)
                slot = self.slots[name]
                slot.reqs[req.rid] = req
                slot.take(req, t)  # the inbox, applied as it arrives
                self._observe(slot)
            for _pass in range(1000):
                changed = False
                for slot in self.slots.values():
                    if slot.step is not None:
                        continue
                    step = slot.begin(t)
                    if step is not None:
                        slot.step = step
                        slot.result = slot.executor.execute(step)
                        slot.end_s = t + slot.result.duration_s
                        changed = True
                    changed |= self._observe(slot)
                if not changed:
                    break
            else:
                raise RuntimeError(f"the schedulers did not settle at t={t}")
            if self._idle():
                return
            ends = [s.end_s for s in self.slots.values() if s.step is not None]
            if self._arrivals:
                ends.append(self._arrivals[0][0])
            if ends:
                nxt = min(ends)
            elif self.tick_s is not None:
                nxt = t + self.tick_s
            else:
                raise RuntimeError(f"stuck at t={t}: work is queued but nothing can run")
            if nxt > until_s:
                return
            self.now = nxt
        raise RuntimeError(f"no quiescence after {max_events} events")
