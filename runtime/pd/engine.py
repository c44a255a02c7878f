"""The engine of one rank of a prefill or decode worker instance.

`PDEngine` is the colocated `Engine` (runtime/engine.py: the same thread, inbox, streams, records
and metrics) driving a `PrefillScheduler` or a `DecodeScheduler` instead, over a Mooncake
`KVManager` seen through `SnapshotKV` (runtime/pd/kv.py). What it changes is the start of each
loop iteration, so that the `tp` ranks of an instance run their schedulers and model forwards in
lock step, SGLang style:

1. rank 0 takes its inbox (new requests, aborts, pool checks) and broadcasts it with its clock
   reading `now` and whether to stop, one typed `Step` message (runtime/pd/step_messages.py);
   the other ranks wait for it. A request that does not fit the message (a value out of range)
   fails alone on rank 0 and is not sent;
2. every rank applies those operations in order, with that `now`;
3. every rank takes one poll snapshot (`SnapshotKV.refresh`: one `all_reduce_min_int`);
4. every rank calls `sched.step(now)` -- the same inputs, so the same batch -- and runs the
   forward (whose all-reduces keep the ranks together).

Only rank 0 has clients: its sinks get the tokens; the other ranks' requests stream nowhere.
Rank 0 sleeps while there is nothing to do until its inbox gets something, its transfer
manager reports progress (`on_progress`), a queue timeout falls due, or -- with tp > 1 --
`poll_interval_s` passes while transfers are in flight (another rank may be the one that moved)
or `tick_s` passes (so the waiting ranks' collectives never time out).

A decode worker's first token comes in the KV metadata, not from a forward: it is streamed as soon
as the scheduler has taken it (`_after_step`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request
from runtime.distributed import TPGroup
from runtime.engine import Engine, StreamEvent, deliver
from runtime.executor import ModelExecutor
from runtime.sampling import SamplingParams
from runtime.pd import step_messages as steps
from runtime.pd.kv import SnapshotKV
from runtime.serve_metrics import GAUGES, ServeMetrics

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")

PD_GAUGES = {
    **GAUGES,
    "pdsim_num_requests_bootstrap": "Prefill: requests waiting for the decode side (bootstrap).",
    "pdsim_num_requests_inflight": "Prefill: requests whose KV is being sent.",
    "pdsim_num_requests_prealloc": "Decode: requests waiting for KV pages (prealloc).",
    "pdsim_num_requests_transfer": "Decode: requests whose KV is on its way.",
    "pdsim_num_requests_prebuilt": "Decode: requests with their KV, waiting to join the batch.",
    "pdsim_metadata_slots_used": "First-token metadata slots in use.",
    "pdsim_transfers_pending": "Transfers not yet finished on every TP rank.",
}


def _discard(event: StreamEvent) -> None:
    """The sink of a request on a rank without clients."""


class PDEngine(Engine):
    """One rank's engine. `kv_manager` is this rank's real transfer manager (Mooncake);
    `group` the instance's TP group (`TPGroup.single()` for tp = 1)."""

    def __init__(self, executor: ModelExecutor, config: SchedulerConfig, *, role: str,
                 kv_manager, group: TPGroup | None = None, instance_id: int = 0,
                 max_records: int = 100_000, metrics: ServeMetrics | None = None,
                 poll_interval_s: float = 0.005, tick_s: float = 1.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}; allowed: {', '.join(ROLES)}")
        self.role = role
        self.group = group or TPGroup.single()
        self.kv = SnapshotKV(kv_manager, self.group)
        self.poll_interval_s = poll_interval_s
        self.tick_s = tick_s
        self.load: dict[str, int] = {"num_active": 0, "pending_tokens": 0}
        self._rooms: dict[int, str] = {}  # bootstrap room -> rid, of the requests not done
        self.queues: dict[str, int] = {}
        make = PrefillScheduler if role == "prefill" else DecodeScheduler
        super().__init__(executor, config, scheduler=make(config, self.kv, instance_id),
                         max_records=max_records, metrics=metrics or ServeMetrics(PD_GAUGES))
        if self.group.rank == 0:
            kv_manager.on_progress(self._wake)

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    def submit(self, *args: Any, **kwargs: Any) -> str:
        if not self.is_leader:
            raise RuntimeError("only rank 0 of an instance takes requests")
        return super().submit(*args, **kwargs)

    def pools(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """Ask every rank whether all its pages, request slots and metadata slots are back and
        its transfers released: `{"full": bool, "detail": str}` (rank 0 only)."""
        fut: Future = Future()
        self._post("pools", fut)
        return fut.result(timeout)

    def check_pools_full(self, timeout: float = 30.0) -> None:
        """Wait until every rank is idle with its pools full; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not (state := self.pools(timeout))["full"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not full after {timeout} s: {state['detail']}")
            time.sleep(0.02)

    # ---- the lock-step start of an iteration -------------------------------------------------

    def _sync(self) -> tuple[float, bool]:
        try:
            if self.is_leader:
                return self._lead()
            return self._follow()
        except Exception as exc:  # a collective failed (a peer rank is gone), or worse
            reason = f"rank {self.group.rank} of the instance failed to sync: {exc}"
            log.exception("rank %d: %s", self.group.rank, reason)
            with self._cond:
                self._stopping = True
            self._fail_all(reason)
            return self.now(), True

    def _lead(self) -> tuple[float, bool]:
        with self._cond:
            items = list(self._inbox)
            self._inbox.clear()
            stop = self._stopping
        now = self.now()
        if not self.group.is_single:
            items, ops = self._sendable(items)
            self.group.broadcast_bytes(steps.encode(steps.Step(now=now, stop=stop, ops=ops)))
        for kind, item in items:
            if kind == "pools":
                _resolve(item, self._pools_status)
            else:
                self._apply(kind, item, now)
        self.kv.refresh()
        return now, stop

    def _sendable(self, items: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list]:
        """The inbox entries the other ranks can be told of, and their operations. A request that
        does not fit a step message fails here, alone, before anything is broadcast."""
        kept, ops = [], []
        for kind, item in items:
            try:
                op = _op_of(kind, item)
            except steps.StepMessageError as exc:
                log.warning("not broadcast to the TP ranks (%s): %s", kind, exc)
                if kind == "add":
                    req, sink, _top = item
                    deliver(sink, StreamEvent(finished=True, error=f"invalid request: {exc}",
                                              prompt_tokens=req.input_len, status=400))
                continue
            kept.append((kind, item))
            if op is not None:
                ops.append(op)
        return kept, ops

    def _follow(self) -> tuple[float, bool]:
        step = steps.decode(self.group.broadcast_bytes(None))
        for op in step.ops:
            if isinstance(op, steps.AddRequest):
                self._apply("add", (_request_of(op), _discard, op.top_logprobs), step.now)
            elif isinstance(op, steps.AbortRequest):
                self._apply("abort", (op.rid, op.reason), step.now)
            else:
                self._pools_status()
        self.kv.refresh()
        return step.now, step.stop

    def _pools_status(self) -> dict[str, Any]:
        """Every rank, at the same point: this rank's leftovers, MIN-reduced over the ranks."""
        s, problems = self.sched, []
        if not s.is_idle:
            problems.append(f"{s.num_active} requests active")
        for pool in (s.pool, s.req_slots, s.metadata_slots):
            if pool.num_used:
                problems.append(f"{pool.num_used} of {pool.size} {pool.name}s in use")
        if self.kv.num_live:
            problems.append(f"{self.kv.num_live} transfer endpoints not released")
        flags = [1] * self.group.size
        flags[self.group.rank] = 0 if problems else 1
        flags = self.group.all_reduce_min_int(flags)
        others = [r for r, ok in enumerate(flags) if not ok and r != self.group.rank]
        if others:
            problems.append(f"tp ranks {others} are not full either"
                            if problems else f"tp ranks {others} are not full")
        return {"full": all(flags), "detail": "; ".join(problems)}

    # ---- hooks --------------------------------------------------------------------------------

    def _after_step(self) -> None:
        if self.role != "decode" or not self.is_leader:
            return
        for stream in self._streams.values():  # first tokens, from the KV metadata
            req = stream.req
            if len(req.output_ids) > stream.pushed and not req.finished:
                deliver(stream.sink, self._new_tokens(stream))

    def _idle_timeout(self, now: float) -> float | None:
        if not self.is_leader or self.kv.inner.poll_epoch() != self.kv.inner_epoch_seen:
            return 0  # followers wait in the next broadcast; news arrived since the snapshot
        waits = []
        deadline = self.sched.next_deadline_s(now)
        if deadline is not None:
            waits.append(max(0.0, deadline - self.now()))
        if not self.group.is_single:
            waits.append(self.tick_s)
            if self.kv.num_pending:
                waits.append(self.poll_interval_s)
        if not self.sched.is_idle:
            waits.append(0.5)  # a safety net; progress wakes the loop earlier
        return min(waits) if waits else None

    def _add(self, req: Request, sink, top_logprobs: int, now: float) -> None:
        owner = self._rooms.get(req.bootstrap_room)
        if owner is not None and req.rid not in self._streams:
            deliver(sink, StreamEvent(
                finished=True, prompt_tokens=req.input_len, status=409,
                error=f"bootstrap room {req.bootstrap_room} is in use by request {owner!r}"))
            return
        super()._add(req, sink, top_logprobs, now)
        if not req.finished:
            self._rooms[req.bootstrap_room] = req.rid

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _finish_done(self) -> None:
        for req in self.sched.done:
            self.kv.release(req)
            if self._rooms.get(req.bootstrap_room) == req.rid:
                del self._rooms[req.bootstrap_room]
        super()._finish_done()

    def _gauges(self) -> dict[str, float]:
        s = self.sched
        gauges = super()._gauges()
        if isinstance(s, PrefillScheduler):
            queues = {"bootstrap": len(s.bootstrap), "waiting": len(s.waiting),
                      "inflight": len(s.inflight)}
            pending = s.pending_tokens
        else:
            queues = {"prealloc": len(s.prealloc), "transfer": len(s.transfer),
                      "prebuilt": len(s.prebuilt), "waiting": len(s.waiting),
                      "running": len(s.running)}
            pending = sum(r.input_len for r in s.prealloc) + sum(r.input_len for r in s.transfer)
        self.queues = queues
        self.load = {"num_active": s.num_active, "pending_tokens": pending}
        for name, n in queues.items():
            gauges[f"pdsim_num_requests_{name}"] = n
        gauges["pdsim_metadata_slots_used"] = s.metadata_slots.num_used
        gauges["pdsim_transfers_pending"] = self.kv.num_pending
        return gauges


# ---- the broadcast operations --------------------------------------------------------------


def _op_of(kind: str, item: Any) -> steps.Op | None:
    """An inbox entry as the operation the other ranks apply (None: rank 0 only). Raises
    `StepMessageError` for a request that does not fit the message."""
    if kind == "add":
        req, _sink, top = item
        s = req.sampling if req.sampling is not None else SamplingParams()
        return steps.AddRequest(
            rid=req.rid, prompt_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens,
            arrival_s=req.arrival_s, stop_token_ids=sorted(req.stop_token_ids),
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room, top_logprobs=top)
    if kind == "abort":
        return steps.AbortRequest(*item)
    if kind == "pools":
        return steps.CheckPools()
    return None  # "call": runs on rank 0 alone and must not change the scheduler's state


def _request_of(op: steps.AddRequest) -> Request:
    return Request(
        op.rid, len(op.prompt_ids), op.max_new_tokens, arrival_s=op.arrival_s,
        prompt_ids=op.prompt_ids, stop_token_ids=frozenset(op.stop_token_ids),
        sampling=op.sampling(), bootstrap_host=op.bootstrap_host,
        bootstrap_port=op.bootstrap_port, bootstrap_room=op.bootstrap_room)


def _resolve(fut: Future, fn: Callable[[], Any]) -> None:
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the caller
            fut.set_exception(exc)

