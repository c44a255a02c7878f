"""Drive the core schedulers with SimPy: one process per instance, and an arrival source.

An instance process asks each of its schedulers (one per attention-DP rank) for the next
forward, charges the cost model's time for the step (the slowest rank sets it), and hands the
results back. With nothing to run it sleeps until the transfer backend or the router wakes it,
then takes its role's `wakeup_s` to notice.

The arrival source decides when each request (lengths from the workload, by index) is sent:
`OpenLoop` at the workload's times, `ClosedLoopSource` when a client's previous request ends.
A request sent at t reaches the router and its instances at t + `frontend_latency_s`
(tokenizer, HTTP, router); its record's `arrival_s` is the send time.
"""

from __future__ import annotations

import gc
import math
from bisect import bisect_left
from contextlib import contextmanager
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import simpy

from pdsim.core.batch import BatchResult, BatchShape
from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.records import RequestRecord
from pdsim.core.request import Request
from pdsim.core.router import Router, pick_dp_rank
from pdsim.core.scheduler import ColocatedScheduler, InstanceScheduler
from pdsim.core.token_times import TokenTimes
from pdsim.faults import FaultsConfig
from pdsim.sim.cost import CostModel
from pdsim.sim.events import At
from pdsim.sim.faults import SimFaults
from pdsim.sim.network import Link, NetworkModel, SimFabric, SimKVManager
from pdsim.workload import ClosedLoop, PrefixBlocks

EMPTY = BatchShape()
MAX_RUN_STEPS = 4096  # decode steps one event may cover (see SimInstance._decode_run)
RUN_WORTH_STEPS = 3  # runs that settle fewer steps on average cost more than they save...
RUN_BACKOFF_STEPS = 256  # ...so the instance then goes step by step this long
STEP_MEMO_SIZE = 65_536  # one-shape step times an instance remembers (cleared when full)


@dataclass(frozen=True)
class RoleSpec:
    """The instances of one role (prefill, decode or colocated)."""

    instances: int
    dp_attention: int
    gpus_per_instance: int
    scheduler: SchedulerConfig
    cost: Callable[[], CostModel]  # one cost model per instance
    nic_bytes_per_s: float = math.inf  # the instance's NIC bandwidth, all its GPUs together
    kv_bytes_per_page: float = 0.0  # bytes a page of this role's KV weighs on the wire
    state_bytes_per_request: float = 0.0  # sent with a request's last chunk (draft state)
    wakeup_s: float = 0.0  # an idle scheduler of this role notices new work this late


@dataclass(frozen=True)
class ClusterSpec:
    mode: str  # "disaggregated" or "colocated"
    router_policy: str
    network: NetworkModel
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    colocated: RoleSpec | None = None
    frontend_latency_s: float = 0.0  # tokenizer + HTTP + router, per request
    dp_assignment: str = "room"  # how an instance picks the attention-DP rank of a request
    faults: FaultsConfig = FaultsConfig()
    router_options: dict[str, float] = field(default_factory=dict)  # the policy's settings

    @property
    def num_gpus(self) -> int:
        roles = [r for r in (self.prefill, self.decode, self.colocated) if r is not None]
        return sum(r.instances * r.gpus_per_instance for r in roles)


@dataclass
class SimResult:
    records: list[RequestRecord]
    sim_time_s: float
    instances: list["SimInstance"] = field(repr=False)
    prefill_busy_frac: float = math.nan  # mean fraction of the run a prefill instance computed
    decode_busy_frac: float = math.nan  # the same for decode (or colocated) instances
    kv_transfer_gb: float = 0.0  # KV moved between instances, GB
    decode_mean_batch: float = math.nan  # time-average requests per decode (or colocated) instance

    def check_pools_full(self) -> None:
        for inst in self.instances:
            for sched in inst.schedulers if inst.alive else ():  # a killed one lost its state
                sched.check_pools_full()


class SimInstance:
    def __init__(self, env: simpy.Environment, schedulers: Sequence[InstanceScheduler],
                 cost: CostModel, on_done: Callable[[Request], None], wakes_on_arrival: bool,
                 wakeup_s: float = 0.0, decode_runs: bool = True,
                 next_arrival_s: Callable[[], float] = lambda: math.inf):
        self.env = env
        self.decode_runs = decode_runs
        self.next_arrival_s = next_arrival_s  # a known wake-up ahead: runs plan no further
        self.wakes_on_arrival = wakes_on_arrival
        self.wakeup_s = wakeup_s
        self.schedulers = list(schedulers)
        self.cost = cost
        self.on_done = on_done
        self.busy_s = 0.0  # simulated seconds spent in forwards
        self.decode_req_s = 0.0  # ∫ requests in decode batches dt: its mean is the batch size
        self.steps = 0
        self._wake: simpy.Event | None = None
        self._timer_at = math.inf  # when the pending timeout wake-up fires
        self.alive = True
        self.generation = 0  # bumped by kill(): the running process then ends
        self.aborts: list[tuple[str, str]] = []  # (rid, reason), applied before the next step
        self._in_run = False  # inside a run of decode steps that a notify must cut short...
        self._run_ends: list[float] = []  # ...planned to end at these times
        self._run_horizon = 2  # steps the next run may plan: doubles while runs go uncut
        self._run_backoff = 0  # steps to run one by one before trying a run again
        self._run_mean = float(RUN_WORTH_STEPS)  # moving average of the steps a run settles
        self._step_memo: dict[tuple, float] = {}
        self._proc = env.process(self._run())

    def kill(self) -> None:
        """Stop at once (fault injection, pdsim/sim/faults.py): a forward in progress is lost."""
        self.alive = False
        self.generation += 1
        self.notify()

    def restart(self, schedulers: Sequence[InstanceScheduler]) -> None:
        self.schedulers = list(schedulers)
        self.alive = True
        self.aborts.clear()
        self._wake, self._timer_at = None, math.inf
        self._in_run = False
        self._proc = self.env.process(self._run())

    def post_abort(self, rid: str, reason: str) -> None:
        """Abort `rid` between forwards, as a real worker applies an abort from its inbox."""
        if self.alive:
            self.aborts.append((rid, reason))
            self.notify()

    def admitted(self) -> None:
        """A request was just added. A PD scheduler has nothing to run for it until its transfer
        endpoint makes progress, which wakes the instance anyway; only a request refused at
        once needs handing on now. A colocated one may have work: wake it."""
        if self.wakes_on_arrival:
            self.notify()
        else:
            self._drain()

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
        deadlines = [d for d in (s.next_deadline_s(now) for s in self.schedulers) if d is not None]
        if not deadlines:
            return
        deadline = min(deadlines)
        if deadline < self._timer_at:
            self._timer_at = deadline
            self.env.timeout(deadline - now).callbacks.append(self._timer_fired)

    def _timer_fired(self, _event) -> None:
        self._timer_at = math.inf
        self.notify()

    def _one_shape_s(self, shape: BatchShape) -> float:
        """The cost model's time for a step of one shape, remembered: cost models are pure
        functions of the shapes, and equal shapes recur (every prefill of one prompt length,
        decode batches that come back to a size and context)."""
        key = tuple(shape)  # a plain tuple of numbers, which the collector stops tracking
        memo = self._step_memo
        duration = memo.get(key)
        if duration is None:
            if len(memo) >= STEP_MEMO_SIZE:
                memo.clear()
            duration = memo[key] = self.cost.step_time_s((shape,))
        return duration

    def _drain(self) -> None:
        for sched in self.schedulers:
            if sched.done:
                for req in sched.done:
                    self.on_done(req)
                sched.done.clear()

    def _run(self):
        return self._run_single() if len(self.schedulers) == 1 else self._run_ranks()

    def _run_single(self):
        """`_run_ranks` for one scheduler (every instance without attention DP), with the
        per-rank lists, zips and sums left out."""
        env = self.env
        sched = self.schedulers[0]
        done = sched.done
        on_done = self.on_done
        aborts = self.aborts
        gen = self.generation
        while True:
            now = env.now
            if aborts:
                for rid, reason in aborts:
                    sched.abort(rid, reason, now)
                aborts.clear()
            batch = sched.step(now)
            if done:
                for req in done:
                    on_done(req)
                done.clear()
            if not batch:
                if (yield from self._idle(now, gen)):
                    return  # killed
                continue
            if self.decode_runs and batch.kind == "decode":
                steps = 1
                if self._run_backoff:
                    self._run_backoff -= 1
                else:
                    horizon, deadline = self._run_plan(sched, batch, now)
                    steps = sched.decode_run_steps(horizon)
                if steps > 1:
                    yield from self._decode_run(sched, batch, now, steps, deadline)
                    if gen != self.generation:
                        return  # killed during the run: the step in progress is lost
                    self._drain()
                    continue
            shape = batch.shape
            duration = self._one_shape_s(shape)
            yield env.timeout(duration)
            if gen != self.generation:
                return  # killed during the forward: its results are lost
            self.busy_s += duration
            self.decode_req_s += duration * shape.decode_reqs
            self.steps += 1
            sched.on_batch_done(batch, BatchResult(duration), env.now)
            if done:
                for req in done:
                    on_done(req)
                done.clear()

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

    def _run_ranks(self):
        """One forward at a time over every attention-DP rank: the slowest rank's step time
        counts (runs of decode steps are for single schedulers only)."""
        env = self.env
        scheds = self.schedulers
        gen = self.generation
        while True:
            now = env.now
            for rid, reason in self.aborts:
                any(s.abort(rid, reason, now) for s in scheds)
            self.aborts.clear()
            batches = [s.step(now) for s in scheds]
            self._drain()
            if not any(batches):
                if (yield from self._idle(now, gen)):
                    return  # killed
                continue
            decode_reqs = sum(b.shape.decode_reqs for b in batches if b is not None)
            duration = self.cost.step_time_s([b.shape if b else EMPTY for b in batches])
            yield env.timeout(duration)
            if gen != self.generation:
                return  # killed during the forward: its results are lost
            self.busy_s += duration
            self.decode_req_s += duration * decode_reqs
            self.steps += 1
            result = BatchResult(duration)
            now = env.now
            for sched, batch in zip(scheds, batches):
                if batch is not None:
                    sched.on_batch_done(batch, result, now)
            self._drain()

    def _run_plan(self, sched: InstanceScheduler, batch, now: float) -> tuple[int, float]:
        """(the most steps a run from the decode `batch` may plan, the time it must end by):
        the horizon, cut to about the steps before the next queue timeout or known arrival
        at the first step's pace (later steps, with more context, are no faster; should one
        be, the run ends early and the next one goes on)."""
        deadline = sched.next_deadline_s(now)
        deadline = min(math.inf if deadline is None else deadline, self.next_arrival_s())
        horizon = self._run_horizon
        first = self._one_shape_s(batch.shape)
        if deadline < math.inf and first > 0:  # (a fitted cost model may price a step at 0)
            horizon = min(horizon, int((deadline - now) / first) + 2)
        return horizon, deadline

    def _decode_run(self, sched: InstanceScheduler, batch, now: float, steps: int,
                    deadline: float):
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
        env, n, gen = self.env, batch.shape.decode_reqs, self.generation
        shape = batch.shape
        memo, context = self._step_memo, shape.decode_context_tokens
        ends, durations = [], []
        t = now
        for _ in range(steps):
            # `_one_shape_s` of the step's shape, which is built only when not remembered
            d = memo.get((0, 0.0, n, context, 1))
            if d is None:
                d = self._one_shape_s(BatchShape(decode_reqs=n, decode_context_tokens=context))
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
        for d in durations[: len(ends)]:
            self.busy_s += d
            self.decode_req_s += d * n
        self.steps += len(ends)
        if self.generation == gen:
            sched.on_decode_run_done(ends)


class Simulation:
    """One simulated run of a cluster on a workload."""

    def __init__(self, cluster: ClusterSpec, seed: int, max_duration_s: float = math.inf,
                 decode_runs: bool = True):
        self.cluster = cluster
        self.decode_runs = decode_runs
        self.env = simpy.Environment()
        self.fabric = SimFabric(self.env, cluster.network)
        self.router_seed = seed
        self.max_duration_s = max_duration_s
        self.next_arrival_s = math.inf  # when the open-loop source sends next (inf: unknown)
        self.final: dict[str, Request] = {}
        self.prefill_side: dict[str, Request] = {}
        self.instances: list[SimInstance] = []
        self.faults: SimFaults | None = None
        if cluster.mode == "colocated":
            self.serving = self._build_role(cluster.colocated, "colocated", 0)
            self.prefills: list[SimInstance] = []
        else:
            self.prefills = self._build_role(cluster.prefill, "prefill", 0)
            self.serving = self._build_role(cluster.decode, "decode", len(self.prefills))
            if cluster.faults.any:
                self.faults = SimFaults(self, cluster.faults)

    def _build_role(self, role: RoleSpec, kind: str, key_base: int) -> list[SimInstance]:
        insts = []
        for i in range(role.instances):
            holder: list[SimInstance] = []
            notify = lambda h=holder: h[0].notify()  # noqa: E731  (bound once the instance exists)
            scheds: list[InstanceScheduler] = []
            dp = role.dp_attention
            for _ in range(dp):
                if kind == "colocated":
                    scheds.append(ColocatedScheduler(role.scheduler, i))
                    continue
                # A DP rank's KV lives on its own GPUs: it sends through their NICs only.
                link = Link(role.nic_bytes_per_s / dp, max(1, role.gpus_per_instance // dp))
                kv = SimKVManager(self.fabric, key_base + i, link, role.kv_bytes_per_page, notify,
                                  role.state_bytes_per_request)
                cls = PrefillScheduler if kind == "prefill" else DecodeScheduler
                scheds.append(cls(role.scheduler, kv, i))
            on_done = self._prefill_done if kind == "prefill" else self._request_done
            inst = SimInstance(self.env, scheds, role.cost(), on_done,
                               wakes_on_arrival=kind == "colocated",
                               wakeup_s=role.wakeup_s, decode_runs=self.decode_runs,
                               next_arrival_s=(lambda: self.next_arrival_s)
                               if kind == "colocated" else lambda: math.inf)
            holder.append(inst)
            insts.append(inst)
        self.instances.extend(insts)
        return insts

    def _prefill_done(self, req: Request) -> None:
        self.prefill_side[req.rid] = req

    def _request_done(self, req: Request) -> None:
        self.final[req.rid] = req
        self._source.finished()
        if len(self.final) == self.num_requests:
            self._all_done.succeed()

    def submit(self, i: int, sent_s: float) -> None:
        """Route request `i`, sent by its client at `sent_s`, to its instances (now)."""
        now = self.env.now
        self._sent_s[i] = sent_s
        rid = str(i)
        n_in, n_out = self._inputs[i], self._outputs[i]
        keys = () if self._prefix is None else self._prefix.ids_of(i).tolist()  # router: blocks
        p, d, room = self._router.route(self._prefill_load, self._decode_load, keys)
        if self.faults is not None and self.faults.refused(rid, n_in, n_out, sent_s, p, d):
            return  # routed to a dead instance
        if self.prefills:
            pre = self.prefills[p]
            preq = Request(rid, n_in, n_out, arrival_s=sent_s, bootstrap_room=room,
                           prefix_keys=self._page_keys(self.cluster.prefill, i, n_in))
            self._scheduler_for(pre, room).add_request(preq, now)
            pre.admitted()
        dec = self.serving[d]
        dreq = Request(rid, n_in, n_out, arrival_s=sent_s, bootstrap_room=room, prefill_instance=p,
                       prefix_keys=None if self.prefills else self._page_keys(self.cluster.colocated, i, n_in),
                       token_times_s=TokenTimes())  # compact: views of the step times
        self._scheduler_for(dec, room).add_request(dreq, now)
        dec.admitted()
        if self.faults is not None:
            self.faults.track(preq, dreq)

    def _page_keys(self, role: RoleSpec, i: int, n_in: int) -> list | None:
        """Request i's prefix-cache keys, when its prompt side caches and the workload knows them."""
        if self._prefix is None or not role.scheduler.prefix_cache:
            return None
        return self._prefix.page_keys(i, n_in, role.scheduler.page_size)

    def _scheduler_for(self, inst: SimInstance, room: int) -> InstanceScheduler:
        scheds = inst.schedulers
        rank = pick_dp_rank(self.cluster.dp_assignment, room, len(scheds),
                            lambda r: scheds[r].num_active)
        return scheds[rank]

    def give_up_at(self, at_s: float) -> None:
        """Requests unfinished at `at_s` (simulated) count as failed; the run ends there."""
        if math.isfinite(at_s):
            self.env.timeout(max(at_s - self.env.now, 0.0)).callbacks.append(
                lambda _ev: self._give_up.succeed() if not self._give_up.triggered else None)

    def run(self, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
            closed_loop: ClosedLoop | None = None, prefix: PrefixBlocks | None = None) -> SimResult:
        """Serve the requests: open loop at `arrival_s`, or by `closed_loop`'s clients (then
        `arrival_s` is ignored and the records hold the times the clients sent at). `prefix`
        (the workload's prefix blocks) keys the router and, where enabled, the prefix caches."""
        self._prefix = prefix
        self.num_requests = len(input_tokens)
        self._all_done = self.env.event()
        self._give_up = self.env.event()
        if self.num_requests == 0:
            return SimResult([], 0.0, self.instances)
        self._inputs, self._outputs = input_tokens.tolist(), output_tokens.tolist()
        self._sent_s = [math.nan] * self.num_requests
        self._router = Router(self.cluster.router_policy, len(self.prefills), len(self.serving),
                              self.router_seed, policy_options=self.cluster.router_options)
        self._source: ArrivalSource = (OpenLoop(arrival_s) if closed_loop is None
                                       else ClosedLoopSource(closed_loop))
        self._source.start(self)
        with _collector_paused():
            self.env.run(until=self._all_done | self._give_up)
            records = self._records(input_tokens)
        # The records hold what is kept; the requests would only outlive the run (the
        # instances, which a result keeps, reach this object) and burden the collector.
        self.final.clear()
        self.prefill_side.clear()
        span = self.env.now or math.nan
        return SimResult(
            records, self.env.now, self.instances,
            prefill_busy_frac=_mean_busy(self.prefills, span),
            decode_busy_frac=_mean_busy(self.serving, span),
            kv_transfer_gb=self.fabric.kv_bytes / 1e9,
            decode_mean_batch=sum(i.decode_req_s for i in self.serving) / (len(self.serving) * span),
        )

    def _prefill_load(self, i: int) -> float:
        return sum(s.load() for s in self.prefills[i].schedulers)

    def _decode_load(self, i: int) -> float:
        return sum(s.load() for s in self.serving[i].schedulers)

    def _records(self, input_tokens) -> list[RequestRecord]:
        records = []
        for i in range(self.num_requests):
            rid = str(i)
            req = self.final.get(rid)
            if req is None:
                sent = self._sent_s[i]
                records.append(RequestRecord(
                    rid=rid, input_tokens=int(input_tokens[i]), output_tokens=0, status="failed",
                    error="never sent: its client's earlier request did not finish in time"
                    if math.isnan(sent) else "did not finish before the simulation's time limit",
                    arrival_s=sent,
                ))
                continue
            rec = req.to_record("failed" if req.error else "ok")
            pre = self.prefill_side.get(rid)
            if pre is not None:
                rec.prefill_instance = pre.prefill_instance
                rec.bootstrap_done_s = pre.bootstrap_done_s
                rec.prefill_start_s = pre.prefill_start_s
                rec.prefill_end_s = pre.prefill_end_s
            records.append(rec)
        return records


class ArrivalSource(Protocol):
    """Decides when each request of a run is sent (`Simulation.submit`)."""

    def start(self, sim: Simulation) -> None: ...

    def finished(self) -> None:
        """A request ended (completed or failed)."""


class OpenLoop:
    """Requests sent at the workload's arrival times, whatever the cluster does."""

    def __init__(self, arrival_s: np.ndarray):
        self.arrival_s = arrival_s

    def start(self, sim: Simulation) -> None:
        sim.give_up_at(float(self.arrival_s[-1]) + sim.max_duration_s)
        sim.env.process(self._send_all(sim))

    def _send_all(self, sim: Simulation):
        env = sim.env
        delay = sim.cluster.frontend_latency_s
        for i, sent in enumerate(self.arrival_s.tolist()):
            at = sim.next_arrival_s = sent + delay
            if at > env.now:
                yield env.timeout(at - env.now)
            sim.submit(i, sent)
        sim.next_arrival_s = math.inf

    def finished(self) -> None:
        pass


class ClosedLoopSource:
    """`concurrency` clients start at 0 s; each sends the next unsent request (in workload
    order) `think_time_s` after its previous one ended, completed or failed."""

    def __init__(self, loop: ClosedLoop):
        self.loop = loop
        self.next_index = 0

    def start(self, sim: Simulation) -> None:
        self.sim = sim
        for _ in range(min(self.loop.concurrency, sim.num_requests)):
            self._send(0.0)

    def finished(self) -> None:
        if self.next_index < self.sim.num_requests:
            self._send(self.sim.env.now + self.loop.think_time_s)

    def _send(self, sent_s: float) -> None:
        # Always through an event, even with no delay: `finished` runs inside an instance's
        # hand-off of its done requests, which must not be re-entered.
        sim, i = self.sim, self.next_index
        self.next_index += 1
        at = sent_s + sim.cluster.frontend_latency_s
        sim.env.timeout(at - sim.env.now).callbacks.append(lambda _ev: sim.submit(i, sent_s))
        if self.next_index == sim.num_requests:
            sim.give_up_at(sent_s + sim.max_duration_s)


def _mean_busy(instances: Sequence[SimInstance], span_s: float) -> float:
    if not instances:
        return math.nan
    return sum(i.busy_s for i in instances) / (len(instances) * span_s)


@contextmanager
def _collector_paused():
    """A run allocates many small objects that live until it ends and no cyclic garbage (a
    collection right after a run finds none that the run made: PD with kills and failed
    transfers, prefix caching, speculative decoding, closed loops, trace replay), so Python's
    cycle collector, which would rescan the live ones over and over (~20% of the run at its
    default thresholds), is paused while it runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(cluster: ClusterSpec, arrival_s, input_tokens, output_tokens, *, seed: int = 0,
             max_duration_s: float = math.inf, closed_loop: ClosedLoop | None = None,
             decode_runs: bool = True, prefix: PrefixBlocks | None = None) -> SimResult:
    """Serve the workload on the cluster. `decode_runs=False` simulates every decode step as
    its own event (the reference the faster runs of steps must match)."""
    return Simulation(cluster, seed, max_duration_s, decode_runs).run(
        np.asarray(arrival_s, dtype=float), np.asarray(input_tokens), np.asarray(output_tokens),
        closed_loop, prefix,
    )
