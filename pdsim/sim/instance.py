"""One simulated instance: a SimPy process that drives the core's `Instance` step, and the
simulator's executor port, `CostExecutor`.

The process repeats what every driver does (pdsim/core/instance.py): `begin` the step, have the
executor price it, wait that long, `finish` it. With nothing to run it sleeps until the transfer
backend, the router or a queue timeout wakes it, then takes its role's `wakeup_s` to notice;
a step that starts long enough after the last one ended runs cold (`ColdStart`).

A run of decode steps that nothing outside can change (the core's `decode_run_steps`) is one
event, priced in closed form; an outside event cuts it at the step in progress, so the records
are those of one event per step.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence

import simpy

from pdsim.core.batch import Batch, BatchResult, BatchShape
from pdsim.core.instance import Abort, Add, Instance, InboxOp
from pdsim.core.request import Request
from pdsim.core.scheduler import InstanceScheduler
from pdsim.sim.cost import CostModel
from pdsim.sim.events import At
from pdsim.sim.host import SharedHost
from pdsim.sim.spec import ColdStart

EMPTY = BatchShape()
MAX_RUN_STEPS = 4096  # decode steps one event may cover (see SimInstance._decode_run)
RUN_WORTH_STEPS = 3  # runs that settle fewer steps on average cost more than they save...
RUN_BACKOFF_STEPS = 256  # ...so the instance then goes step by step this long
STEP_MEMO_SIZE = 65_536  # one-shape step times an executor remembers (cleared when full)


class CostExecutor:
    """The executor port of the simulator: a step takes the cost model's time for its shapes
    (the slowest attention-DP rank's, as the cost model prices a list of rank shapes). One-rank
    step times are remembered by shape: cost models are pure functions of the shapes, and
    equal shapes recur (every prefill of one prompt length, decode batches that come back to a
    size and context).

    It also counts the steps it ran by shape, so that `breakdown_s` can price where their time
    went once per distinct shape after the run, off the step path. Decode-only steps are
    counted by (requests, query length, context within ~9%) and priced at their mean context."""

    def __init__(self, cost: CostModel, host_copy_s_per_page: float = 0.0):
        self.cost = cost
        self.host_copy_s_per_page = host_copy_s_per_page
        self._memo: dict[tuple, float] = {}
        self._counts: dict[tuple, int] = {}  # steps run per shape (several ranks: per tuple)
        # (requests, query length, context bucket) -> [steps, their summed context tokens]
        self._decode: dict[tuple[int, int, int], list] = {}
        self._parts_s: dict[str, float] = {}  # priced so far (see _fold)

    def execute(self, step: Sequence[Batch | None]) -> BatchResult:
        one = len(step) == 1
        if one:
            key = tuple(step[0].shape)
        else:
            key = tuple(tuple(b.shape if b is not None else EMPTY) for b in step)
        counts = self._counts
        n = counts.get(key)
        if n is None:
            if len(counts) >= STEP_MEMO_SIZE:
                self._fold()
            counts[key] = 1
        else:
            counts[key] = n + 1
        if one:
            duration = self._memo.get(key)
            if duration is None:
                duration = self.shape_time_s(step[0].shape)
            return BatchResult(duration + self.kv_moves_s(step))
        return BatchResult(self.step_time_s(step) + self.kv_moves_s(step))

    def kv_moves_s(self, step: Sequence[Batch | None]) -> float:
        """The host copies a step's batches run before their forward (a retraction's
        `KVMove`s), each GPU its own pages over its own host link, one after another; DP
        ranks copy at once, and the step waits for the slowest."""
        moves = [sum(len(m.pages) for m in b.kv_moves) for b in step if b is not None]
        return max(moves, default=0) * self.host_copy_s_per_page

    def step_time_s(self, step: Sequence[Batch | None]) -> float:
        if len(step) == 1:
            return self.shape_time_s(step[0].shape)
        return self.cost.step_time_s([b.shape if b is not None else EMPTY for b in step])

    def shape_time_s(self, shape: BatchShape) -> float:
        key = tuple(shape)  # a plain tuple of numbers, which the collector stops tracking
        memo = self._memo
        duration = memo.get(key)
        if duration is None:
            if len(memo) >= STEP_MEMO_SIZE:
                memo.clear()
            duration = memo[key] = self.cost.step_time_s((shape,))
        return duration

    def decode_step_s(self, reqs: int, context_tokens: int) -> float:
        """`shape_time_s` of a plain decode step, without building its shape when remembered."""
        d = self._memo.get((0, 0.0, reqs, context_tokens, 1))
        if d is None:
            d = self.shape_time_s(BatchShape(decode_reqs=reqs, decode_context_tokens=context_tokens))
        return d

    def count_decode_run(self, reqs: int, context_tokens: int, steps: int) -> None:
        """Count a run of `steps` plain decode steps of `reqs` requests from `context_tokens`
        (each step adds one token per request)."""
        if steps:
            self._count_decode(reqs, 1, context_tokens + reqs * (steps - 1) / 2, steps)

    def _count_decode(self, reqs: int, query_len: int, mean_context: float, steps: int) -> None:
        key = (reqs, query_len, round(8 * math.log2(max(mean_context, 1.0))))
        bucket = self._decode.get(key)
        if bucket is None:
            self._decode[key] = [steps, mean_context * steps]
        else:
            bucket[0] += steps
            bucket[1] += mean_context * steps

    def _fold(self) -> None:
        """Move the counted steps into the decode buckets (decode-only one-rank steps) or
        price them into the running breakdown (the rest), and clear the counts."""
        price = getattr(self.cost, "step_breakdown_s", None)
        for key, n in self._counts.items():
            if key and not isinstance(key[0], tuple):
                shape = BatchShape(*key)
                if shape.decode_reqs and not shape.prefill_tokens:
                    self._count_decode(shape.decode_reqs, shape.decode_query_len,
                                       shape.decode_context_tokens, n)
                    continue
                shapes = [shape]
            else:
                shapes = [BatchShape(*k) for k in key]
            if price is not None:
                self._add(price(shapes), n)
        self._counts.clear()

    def _add(self, parts: dict[str, float], times: float) -> None:
        acc = self._parts_s
        for part, seconds in parts.items():
            acc[part] = acc.get(part, 0.0) + seconds * times

    def breakdown_s(self) -> dict[str, float] | None:
        """Seconds of every step counted so far by part (pdsim.sim.cost.BREAKDOWN_PARTS,
        summed over steps), or None when the cost model has no `step_breakdown_s`. Prices
        each distinct shape once: call it after the run."""
        price = getattr(self.cost, "step_breakdown_s", None)
        if price is None:
            return None
        self._fold()
        for (reqs, query_len, _), (steps, context) in self._decode.items():
            shape = BatchShape(decode_reqs=reqs, decode_query_len=query_len,
                               decode_context_tokens=round(context / steps))
            self._add(price([shape]), steps)
        self._decode.clear()
        return dict(self._parts_s)


class SimInstance:
    """`instance` (the core's) driven on `env`; `make_schedulers()` builds the schedulers a new
    process of this instance starts with (fault injection's restarts)."""

    def __init__(self, env: simpy.Environment, instance: Instance, executor: CostExecutor,
                 make_schedulers: Callable[[], list[InstanceScheduler]], wakeup_s: float = 0.0,
                 decode_runs: bool = True,
                 next_arrival_s: Callable[[], float] = lambda: math.inf,
                 host: SharedHost | None = None, host_demand: float = 1.0,
                 cold: ColdStart | None = None):
        self.env = env
        self.instance = instance
        self.executor = executor
        self.make_schedulers = make_schedulers
        self.decode_runs = decode_runs
        self.next_arrival_s = next_arrival_s  # a known wake-up ahead: runs plan no further
        self.wakeup_s = wakeup_s
        self.cold = cold
        self._last_step_end = env.now  # when its last step ended (idle since it started)
        self.host, self.host_demand = host, host_demand  # shared host cores (pdsim/sim/host.py)
        self.busy_s = 0.0  # simulated seconds spent in forwards
        self.decode_req_s = 0.0  # ∫ requests in decode batches dt: its mean is the batch size
        self.steps = 0
        self._wake: simpy.Event | None = None
        self._timer_at = math.inf  # when the pending timeout wake-up fires
        self.alive = True
        self.generation = 0  # bumped by kill(): the running process then ends
        self.inbox: list[InboxOp] = []  # applied at the start of the next step
        self._in_run = False  # inside a run of decode steps that a notify must cut short...
        self._run_ends: list[float] = []  # ...planned to end at these times
        self._run_horizon = 2  # steps the next run may plan: doubles while runs go uncut
        self._run_backoff = 0  # steps to run one by one before trying a run again
        self._run_mean = float(RUN_WORTH_STEPS)  # moving average of the steps a run settles
        self._proc = env.process(self._run())

    @property
    def cost(self) -> CostModel:
        return self.executor.cost

    @property
    def schedulers(self) -> list[InstanceScheduler]:
        return self.instance.schedulers

    # ----- what happens to it from outside -----------------------------------------------------

    def kill(self) -> None:
        """Stop at once (fault injection, pdsim/sim/faults.py): a forward in progress is lost,
        and so is everything it held."""
        self.alive = False
        self.generation += 1
        self.instance.restart(self.make_schedulers())
        self.notify()

    def restart(self) -> None:
        """Serve again as a new process: empty queues, full pools."""
        self.instance.restart(self.make_schedulers())
        self.alive = True
        self.inbox.clear()
        self._wake, self._timer_at = None, math.inf
        self._in_run = False
        self._proc = self.env.process(self._run())

    def post_abort(self, rid: str, reason: str) -> None:
        """Abort `rid` between forwards, as a real worker applies an abort from its inbox."""
        if self.alive:
            self.inbox.append(Abort(rid, reason))
            self.notify()

    def post_add(self, req: Request) -> None:
        """Take `req` in at the next step boundary, as a real worker applies a new request from
        its inbox between forwards (SGLang's scheduler receives requests once per loop
        iteration): a decode instance busy with a step creates the request's receiver, and
        takes its pages, only when that step ends."""
        self.inbox.append(Add(req))
        self.notify()

    def notify(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        elif self._in_run and (not self.alive or self._cuts_run()):
            self._in_run = False
            self._proc.interrupt()

    def _cuts_run(self) -> bool:
        """Whether an outside event now ends the run of decode steps in progress before its
        last planned step (a colocated instance's run already ends at the step in progress
        at the next arrival, which then need not interrupt it)."""
        ends = self._run_ends
        return bisect_left(ends, self.env.now) < len(ends) - 1

    def _arm_timer(self, now: float) -> None:
        """Make sure the instance wakes for the earliest queue timeout of its schedulers."""
        deadline = self.instance.next_deadline_s(now)
        if deadline is not None and deadline < self._timer_at:
            self._timer_at = deadline
            self.env.timeout(deadline - now).callbacks.append(self._timer_fired)

    def _timer_fired(self, _event) -> None:
        self._timer_at = math.inf
        self.notify()

    # ----- the process -------------------------------------------------------------------------

    def _run(self):
        env, inst, inbox, gen = self.env, self.instance, self.inbox, self.generation
        execute = self.executor.execute
        while True:
            now = env.now
            if inbox:
                step = inst.begin(now, inbox)
                inbox.clear()
            else:
                step = inst.begin(now)
            if step is None:
                if (yield from self._idle(now, gen)):
                    return  # killed
                continue
            cold = self.cold is not None and now - self._last_step_end >= self.cold.after_s
            if self.decode_runs and not cold and len(step) == 1 and step[0].kind == "decode":
                steps = 1
                if self._run_backoff:
                    self._run_backoff -= 1
                else:
                    horizon, deadline = self._run_plan(step[0], now)
                    steps = inst.decode_run_steps(step, horizon)
                if steps > 1:
                    yield from self._decode_run(step[0], now, steps, deadline)
                    if gen != self.generation:
                        return  # killed during the run: the step in progress is lost
                    self._last_step_end = env.now
                    continue
            result = execute(step)
            work_s = self.cold.duration_s(result.duration_s) if cold else result.duration_s
            start = env.now
            if self.host is None:
                yield env.timeout(work_s)
            else:  # the cost model's time is the work; it stretches while others run too
                yield self.host.run(self.host_demand, work_s)
            if gen != self.generation:
                return  # killed during the forward: its results are lost
            duration = env.now - start
            self.busy_s += duration
            self.decode_req_s += duration * (step[0].shape.decode_reqs if len(step) == 1 else
                                             sum(b.shape.decode_reqs for b in step if b))
            self.steps += 1
            self._last_step_end = env.now
            inst.finish(step, result, env.now)

    def _idle(self, now: float, gen: int):
        """Nothing to run: sleep until woken (or the next queue timeout), then take the role's
        `wakeup_s` to notice. Returns whether the instance was killed meanwhile."""
        self._arm_timer(now)
        self._wake = self.env.event()
        yield self._wake
        if gen != self.generation:
            return True
        self._wake = None
        if self.wakeup_s:
            yield self.env.timeout(self.wakeup_s)
        return False

    def _run_plan(self, batch: Batch, now: float) -> tuple[int, float]:
        """(the most steps a run from the decode `batch` may plan, the time it must end by):
        the horizon, cut to about the steps before the next queue timeout or known arrival
        at the first step's pace (later steps, with more context, are no faster; should one
        be, the run ends early and the next one goes on)."""
        deadline = self.instance.next_deadline_s(now)
        deadline = min(math.inf if deadline is None else deadline, self.next_arrival_s())
        horizon = self._run_horizon
        first = self.executor.shape_time_s(batch.shape)
        if deadline < math.inf and first > 0:  # (a fitted cost model may price a step at 0)
            horizon = min(horizon, int((deadline - now) / first) + 2)
        return horizon, deadline

    def _decode_run(self, batch: Batch, now: float, steps: int, deadline: float):
        """Up to `steps` decode steps of an unchanging batch (`decode_run_steps`) as one event.

        Step times come from the cost model in closed form: the batch keeps its requests and
        its context grows by one token per request per step; end times add up exactly as one
        timeout per step would. The run also ends at the first step end at or after
        `deadline` (the next queue timeout or known arrival). An outside event (`notify`: KV
        progress, an arrival, an abort, a kill) cuts it at the end of the step in progress,
        where a step-by-step driver would first see the change; only the steps that ran are
        settled, so the records are the same as one event per step (ties of an outside event
        with a step end at the same float time excepted: here the outside event counts
        first)."""
        env, gen = self.env, self.generation
        n, context = batch.shape.decode_reqs, batch.shape.decode_context_tokens
        step_s = self.executor.decode_step_s
        ends, durations = [], []
        t = now
        for _ in range(steps):
            d = step_s(n, context)
            t += d
            ends.append(t)
            durations.append(d)
            if t >= deadline:
                break
            context += n
        self._in_run, self._run_ends = True, ends
        try:
            yield At(env, ends[-1])
        except simpy.Interrupt:
            # The step in progress ends at the first end time at or after the interruption;
            # killed, the steps before it count as done and that one is lost.
            ends = ends[: bisect_left(ends, env.now) + (self.generation == gen)]
            if ends and ends[-1] > env.now:
                yield At(env, ends[-1])
            # Plan about twice what ran: an outside event that cuts runs short wastes the
            # steps priced beyond it. Where outside events come every step or two (a busy PD
            # decode instance hears of each transfer), a run costs more than the events it
            # saves: then go step by step for a while before trying again.
            self._run_horizon = max(2, 2 * len(ends))
            self._run_mean += 0.25 * (len(ends) - self._run_mean)
            if self._run_mean < RUN_WORTH_STEPS:
                self._run_backoff = RUN_BACKOFF_STEPS
                self._run_mean = float(RUN_WORTH_STEPS)  # judge afresh after the pause
        else:
            # It ended where it was planned to (a finish, the pages, a deadline, the horizon):
            # one event for its steps however short, so plan further next time.
            self._run_horizon = min(MAX_RUN_STEPS, max(self._run_horizon, 2 * len(ends)))
        self._in_run = False
        self.executor.count_decode_run(n, batch.shape.decode_context_tokens, len(ends))
        for d in durations[: len(ends)]:
            self.busy_s += d
            self.decode_req_s += d * n
        self.steps += len(ends)
        if self.generation == gen:
            self.instance.finish_decode_run(ends)
