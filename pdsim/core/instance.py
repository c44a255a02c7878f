"""One serving instance as every driver runs it: the SimPy process, the real engine thread and the
test harness all repeat the same four moves,

    step = inst.begin(now, ops)          # apply the inbox, step every attention-DP rank
    result = executor.execute(step)      # the port in core/executor.py: price it (simulator) or run the forward (real)
    ... wait result.duration_s ...       # SimPy timeout, the forward itself, a manual clock
    inst.finish(step, result, now)       # or inst.fail(step, reason, now) if it raised

An instance with attention DP = d holds d schedulers (one batch and KV pool each); they step
together and the slowest rank sets the step's time, since the layers after attention are shared.
A step is the list of the ranks' batches (None: the rank idles through it). Requests that end
go to `on_done` as soon as the core lets them go; `emitted` holds the requests the last `begin`
gave a token outside a forward (a decode worker's first token) for a driver that streams.

What a driver may put in the inbox is typed: `Add` a request, `Abort` one. The instance picks a
request's DP rank and refuses a bootstrap room already in use (two live requests meeting in one
room would cross their KV), the same way in both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pdsim.core.batch import BatchResult
from pdsim.core.request import Request
from pdsim.core.router import pick_dp_rank
from pdsim.core.scheduler import InstanceScheduler

Step = list  # list[Batch | None]: one entry per attention-DP rank, in rank order


@dataclass(frozen=True, slots=True)
class Add:
    """Inbox: take a new request in."""

    req: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """Inbox: fail request `rid` wherever it is queued (its client went away, say)."""

    rid: str
    reason: str


InboxOp = Add | Abort


class RoomInUse(ValueError):
    """A request names a bootstrap room that a live request of this instance already uses."""


class Instance:
    """The schedulers of one instance, stepped as one (see the module docstring).

    `dp_assignment` picks a new request's attention-DP rank (`pick_dp_rank`; `auto`: the
    schedulers' role's default).
    """

    def __init__(self, schedulers: Sequence[InstanceScheduler],
                 on_done: Callable[[Request], None], dp_assignment: str = "auto"):
        if not schedulers:
            raise ValueError("an instance needs at least one scheduler")
        self.schedulers = list(schedulers)
        self.on_done = on_done
        self.dp_assignment = (self.schedulers[0].auto_dp_assignment if dp_assignment == "auto"
                              else dp_assignment)
        self._assigned = 0  # requests handed to a DP rank so far (round_robin's turn)
        self.emitted: list[Request] = []
        self._checks_rooms = self.schedulers[0].meets_by_room
        self._rooms: dict[int, str] = {}  # bootstrap room -> rid of the live request using it
        self._plans_ahead = self.schedulers[0].config.overlap_schedule == "plans_ahead"
        self._late_results = self.schedulers[0].config.overlap_schedule == "late_results"
        self._forward_began_s: float | None = None  # overlap: when the last planned step began

    # ----- the inbox -------------------------------------------------------------------------

    def apply(self, op: InboxOp, now: float) -> None:
        if type(op) is Add:
            self.add_request(op.req, now)
        else:
            self.abort(op.rid, op.reason, now)

    def add_request(self, req: Request, now: float) -> None:
        """Queue `req` on its DP rank. Raises `RoomInUse` (and queues nothing) when its bootstrap
        room is taken (PD instances); a request the rank can never hold fails at once (see
        `on_done`)."""
        room = req.bootstrap_room
        if self._checks_rooms and room >= 0:
            owner = self._rooms.get(room)
            if owner is not None:
                raise RoomInUse(f"bootstrap room {room} is in use by request {owner!r}")
            self._rooms[room] = req.rid
        scheds = self.schedulers
        rank = 0 if len(scheds) == 1 else pick_dp_rank(
            self.dp_assignment, room, len(scheds), lambda r: scheds[r].num_active, self._assigned)
        self._assigned += 1
        scheds[rank].add_request(req, now)
        self._drain()

    def abort(self, rid: str, reason: str, now: float) -> bool:
        """Fail `rid` on whichever rank holds it; whether one did."""
        found = any(s.abort(rid, reason, now) for s in self.schedulers)
        self._drain()
        return found

    # ----- one step --------------------------------------------------------------------------

    def begin(self, now: float, ops: Sequence[InboxOp] = ()) -> Step | None:
        """Apply `ops` in order, let every rank's queues advance and plan its next forward.
        Returns the step to run, or None when no rank has anything to run."""
        for op in ops:
            self.apply(op, now)
        if self._plans_ahead:
            return self._begin_planned_ahead(now)
        step = self._plan(now)
        if step is None and self._late_results:
            # SGLang's overlap loop, with nothing to launch, takes up the last batch's results
            for sched in self.schedulers:
                sched.take_up_results(now)
            self._drain()
        return step

    def _plan(self, now: float) -> Step | None:
        scheds = self.schedulers
        if len(scheds) == 1:
            sched = scheds[0]
            batch = sched.step(now)
            self.emitted = sched.emitted
            if sched.done:
                self._drain()
            return None if batch is None else [batch]
        step = [s.step(now) for s in scheds]
        self.emitted = [r for s in scheds for r in s.emitted]
        self._drain()
        return step if any(b is not None for b in step) else None

    def _begin_planned_ahead(self, now: float) -> Step | None:
        """SGLang's overlap event loops (`event_loop_overlap_disagg_prefill`,
        `event_loop_overlap_disagg_decode`, `event_loop_overlap`) plan batch k+1 when they have
        launched batch k, while batch k-1 still runs, and wait for batch k-1's result only after
        that: so the batch that follows a forward was planned when that forward began, from
        the requests then waiting or merged. Here it is planned as the forward ends, leaving
        out requests that reached the waiting queue after the forward began (`plan_cutoff_s`;
        a decode instance's requests merged now decode from the step after: `staged`). If that
        leaves every rank without a batch while some were held back, SGLang had planned nothing
        then, and its next iteration plans from every waiting request and launches at once: so
        does this. An idle instance plans from all."""
        scheds = self.schedulers
        for sched in scheds:
            sched.plan_cutoff_s = self._forward_began_s
            sched.held_back = False
        step = self._plan(now)
        if step is None and self._forward_began_s is not None and any(s.held_back for s in scheds):
            emitted = list(self.emitted)  # first tokens already sent by the plan just made
            for sched in scheds:
                sched.plan_cutoff_s = None
            step = self._plan(now)
            self.emitted = emitted + self.emitted
        self._forward_began_s = None if step is None else now
        return step

    def finish(self, step: Step, result: BatchResult | Sequence[BatchResult | None],
               now: float) -> None:
        """The step's forward ended at `now` with `result`: one for the whole step (the
        simulator's: a duration), or one per rank (tokens are per rank: the real backend's
        attention-DP executor)."""
        if isinstance(result, BatchResult):
            if result.token_ids is not None and len(step) > 1:
                raise ValueError("an executor returned one token result for an attention-DP "
                                 "step; tokens are per rank: return one result per rank")
            results = [result] * len(step)
        else:
            results = list(result)
            if len(results) != len(step):
                raise ValueError(f"{len(results)} results for a step of {len(step)} ranks")
        if self._late_results:  # the batch before this one's, held since it ended
            for sched in self.schedulers:
                sched.take_up_results(now)
        for sched, batch, res in zip(self.schedulers, step, results):
            if batch is not None:
                sched.on_batch_done(batch, res, now)
        self._drain()

    def fail(self, step: Step, reason: str, now: float) -> None:
        """The step's forward raised: its requests fail (the others go on)."""
        for sched, batch in zip(self.schedulers, step):
            if batch is not None:
                sched.fail_batch(batch, reason, now)
        self._drain()

    # ----- runs of decode steps ----------------------------------------------------------------

    def decode_run_steps(self, step: Step, max_steps: int) -> int:
        """After a `begin` that planned one rank's decode: how many decode steps (at most
        `max_steps`) can run back to back, each `begin` between them only growing the running
        batch's pages, if nothing outside happens meanwhile (SGLang's continuous decode steps).
        A driver runs them as one and settles them with `finish_decode_run`; the outcome is
        the same as one by one. 1 when no such run is possible."""
        if len(step) != 1 or step[0].kind != "decode":
            return 1
        return self.schedulers[0].decode_run_steps(max_steps)

    def finish_decode_run(self, end_times_s: list[float]) -> None:
        """Settle a run of decode steps (`decode_run_steps`) that ended at `end_times_s`."""
        if self._plans_ahead and len(end_times_s) > 1:
            self._forward_began_s = end_times_s[-2]  # the run's last step began then
        self.schedulers[0].on_decode_run_done(end_times_s)
        self._drain()

    # ----- what drivers read -------------------------------------------------------------------

    def _drain(self) -> None:
        on_done, rooms = self.on_done, self._rooms
        for sched in self.schedulers:
            done = sched.done
            if done:
                for req in done:
                    room = req.bootstrap_room
                    if room >= 0 and rooms.get(room) == req.rid:
                        del rooms[room]
                    on_done(req)
                done.clear()

    def next_deadline_s(self, now: float) -> float | None:
        """The earliest time after `now` a queued request may time out (None: none may)."""
        deadlines = [d for d in (s.next_deadline_s(now) for s in self.schedulers) if d is not None]
        return min(deadlines) if deadlines else None

    @property
    def is_idle(self) -> bool:
        return all(s.is_idle for s in self.schedulers)

    @property
    def num_active(self) -> int:
        return sum(s.num_active for s in self.schedulers)

    @property
    def retractions(self) -> int:
        """Running requests its schedulers retracted for want of KV pages."""
        return sum(s.retractions for s in self.schedulers)

    def restart(self, schedulers: Sequence[InstanceScheduler]) -> None:
        """Start afresh with new schedulers (a restarted process): what the old ones held is
        gone, its rooms too."""
        self.schedulers = list(schedulers)
        self.emitted = []
        self._rooms.clear()
        self._forward_began_s = None

    def check_pools_full(self) -> None:
        for sched in self.schedulers:
            sched.check_pools_full()
