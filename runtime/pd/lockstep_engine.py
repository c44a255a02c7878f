"""The engine of one rank of a prefill or decode worker instance: the serving `Engine`
(runtime/driver.py: the thread, inbox, streams, records and metrics) composed with a
`PrefillScheduler` or `DecodeScheduler` over a Mooncake `KVManager` seen through `SnapshotKV`
(runtime/pd/kv.py), and a `LockstepSync` that keeps the `tp` ranks of an instance running their
schedulers and model forwards in lock step, SGLang style. At the start of each iteration:

1. rank 0 takes its inbox (new requests, aborts, pool checks) and broadcasts it with its clock
   reading `now` and whether to stop, one typed `Step` message (runtime/protocol/step.py);
   the other ranks wait for it. A request that does not fit the message (a value out of range)
   fails alone on rank 0 and is not sent;
2. every rank applies those operations in order, with that `now`, then takes one poll snapshot
   (`SnapshotKV.refresh`: one `all_reduce_min_int`, the MIN reduction of SGLang's
   `poll_and_all_reduce`);
3. every rank calls `sched.step(now)` -- the same inputs, so the same batch -- and runs the
   forward (whose all-reduces keep the ranks together).

Only rank 0 has clients: its sinks get the tokens; the other ranks' requests stream nowhere.
Rank 0 sleeps while there is nothing to do until its inbox gets something, its transfer
manager reports progress (`on_progress`), a queue timeout falls due, or -- with tp > 1 --
`poll_interval_s` passes while transfers are in flight (another rank may be the one that moved)
or `tick_s` passes (so the waiting ranks' collectives never time out).

Attention DP (`dp` > 1): every rank process holds one scheduler per DP rank, in one core
`Instance`, exactly as the simulator's instance does; the broadcast inbox is applied to all of
them, so every process holds the same states and plans the same step (one batch per DP rank).
A prefill instance hands a request to DP rank `bootstrap_room % dp` (where the decode side looks
it up: `prefill_dp_rank` in the bootstrap lookup); a decode instance picks by `dp_assignment`
(the router's, as the simulator does). A process transfers the KV of its own DP rank only; the
other ranks' schedulers see their transfers through the MIN-reduced snapshot
(runtime/pd/kv.py, `mirror`). The executor runs this process's rank's batch, or the idle batch,
and gathers every rank's tokens (runtime/executor.py).

A decode worker's first token comes in the KV metadata, not from a forward: the core puts the
request in its outbox (`sched.emitted`) and the engine streams it like any other token.
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
from pdsim.core.scheduler import InstanceScheduler
from pdsim.core.instance import Instance
from runtime.distributed import TPGroup
from pdsim.core.instance import Abort
from runtime.driver import (
    Apply, Call, CheckPools, Engine, Entry, Submit, merged_gauges, pages_in_use,
)
from runtime.executor import ModelExecutor
from runtime.protocol.stream import StreamEvent
from runtime.sampling import SamplingParams
from runtime.protocol import step as steps
from runtime.pd.kv import SnapshotKV
from runtime.serve_metrics import ServeMetrics
from runtime.streams import deliver

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


def _discard(event: StreamEvent) -> None:
    """The sink of a request on a rank without clients."""


class LockstepSync:
    """The synchroniser of a PD rank (`TPGroup.single()`: tp = 1, nothing is broadcast):
    rank 0 broadcasts its inputs as one `Step`, every rank refreshes the MIN-reduced poll
    snapshot. `pools_status` runs on every rank at the same point for a `CheckPools` entry."""

    def __init__(self, group: TPGroup, kv: SnapshotKV, pools_status: Callable[[], dict],
                 *, poll_interval_s: float = 0.005, tick_s: float = 1.0) -> None:
        self.group = group
        self.kv = kv
        self.pools_status = pools_status
        self.poll_interval_s = poll_interval_s
        self.tick_s = tick_s

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    def begin(self, entries: list[Entry], stopping: bool, now: float,
              apply: Apply) -> tuple[float, bool]:
        if self.is_leader:
            if not self.group.is_single:
                entries, ops = self._sendable(entries)
                self.group.broadcast_bytes(steps.encode(steps.Step(now=now, stop=stopping,
                                                                   ops=ops)))
            entries = [Call(self.pools_status, e.future) if type(e) is CheckPools else e
                       for e in entries]
        else:
            step = steps.decode(self.group.broadcast_bytes(None))
            now, stopping, entries = step.now, step.stop, [self._entry_of(op) for op in step.ops]
        for entry in entries:
            apply(entry, now)
        self.kv.refresh()
        return now, stopping

    def _sendable(self, entries: list[Entry]) -> tuple[list[Entry], list[steps.Op]]:
        """The inbox entries the other ranks can be told of, and their operations. A request that
        does not fit a step message fails here, alone, before anything is broadcast."""
        kept, ops = [], []
        for entry in entries:
            try:
                op = _op_of(entry)
            except steps.StepMessageError as exc:
                log.warning("not broadcast to the TP ranks (%s): %s", type(entry).__name__, exc)
                if type(entry) is Submit:
                    deliver(entry.sink, StreamEvent(finished=True, error=f"invalid request: {exc}",
                                                    prompt_tokens=entry.req.input_len, status=400))
                continue
            kept.append(entry)
            if op is not None:
                ops.append(op)
        return kept, ops

    def _entry_of(self, op: steps.Op) -> Entry:
        """A broadcast operation as a follower's inbox entry."""
        if isinstance(op, steps.AddRequest):
            return Submit(_request_of(op), _discard, op.top_logprobs)
        if isinstance(op, steps.AbortRequest):
            return Abort(op.rid, op.reason)
        return Call(self.pools_status, Future())

    def idle_timeout(self, sched: Instance, now: float) -> float | None:
        if not self.is_leader or self.kv.inner.poll_epoch() != self.kv.inner_epoch_seen:
            return 0  # followers wait in the next broadcast; news arrived since the snapshot
        waits = []
        deadline = sched.next_deadline_s(now)
        if deadline is not None:
            waits.append(max(0.0, deadline - now))
        if not self.group.is_single:
            waits.append(self.tick_s)
            if self.kv.num_pending:
                waits.append(self.poll_interval_s)
        if not sched.is_idle:
            waits.append(0.5)  # a safety net; progress wakes the loop earlier
        return min(waits) if waits else None

    def release(self, req: Request) -> None:
        self.kv.release(req)


class PDEngine:
    """One rank's engine: an `Engine` over the role's scheduler (one per DP rank with
    `dp` > 1; this process is in DP rank `dp_rank`) with a `LockstepSync`. `kv_manager` is this
    rank's real transfer manager (Mooncake); `group` the instance's TP group, every process of
    the instance (`TPGroup.single()` for tp = 1)."""

    def __init__(self, executor: ModelExecutor, config: SchedulerConfig, *, role: str,
                 kv_manager, group: TPGroup | None = None, instance_id: int = 0,
                 dp: int = 1, dp_rank: int = 0, dp_assignment: str = "auto",
                 max_records: int = 100_000, metrics: ServeMetrics | None = None,
                 poll_interval_s: float = 0.005, tick_s: float = 1.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}; allowed: {', '.join(ROLES)}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp={dp}")
        self.role = role
        self.group = group or TPGroup.single()
        self.kv = SnapshotKV(kv_manager, self.group)
        make = PrefillScheduler if role == "prefill" else DecodeScheduler
        self.scheds = [make(config, self.kv if r == dp_rank else self.kv.mirror(), instance_id)
                       for r in range(dp)]
        self.sched = self.scheds[dp_rank]
        if role == "prefill":
            dp_assignment = "room"  # the decode side looks the prefill rank up by the room
        self.load: dict[str, float] = {"load": 0, "num_active": 0, "pending_tokens": 0}
        self.queues: dict[str, int] = {}
        self._speculation = executor.speculation  # its acceptance is a decode gauge
        self.sync = LockstepSync(self.group, self.kv, self._pools_status,
                                 poll_interval_s=poll_interval_s, tick_s=tick_s)
        self.driver = Engine(executor, config, schedulers=self.scheds,
                             dp_assignment=dp_assignment, sync=self.sync,
                             gauges=self._gauges, max_records=max_records,
                             metrics=metrics or ServeMetrics(role))
        self.metrics = self.driver.metrics
        self.records = self.driver.records
        if self.is_leader:
            kv_manager.on_progress(self.driver.wake)

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    # ---- the driver's lifecycle and inbox ------------------------------------------------------

    def start(self) -> PDEngine:
        self.driver.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self.driver.stop(timeout)

    def join(self, timeout: float | None = None) -> None:
        self.driver.join(timeout)

    async def shutdown(self) -> None:
        await self.driver.shutdown()

    @property
    def running(self) -> bool:
        return self.driver.running

    def submit(self, *args: Any, **kwargs: Any) -> str:
        if not self.is_leader:
            raise RuntimeError("only rank 0 of an instance takes requests")
        return self.driver.submit(*args, **kwargs)

    def abort(self, rid: str, reason: str = "aborted by the client") -> None:
        self.driver.abort(rid, reason)

    def call(self, fn: Callable[[], Any], timeout: float | None = 30.0) -> Any:
        return self.driver.call(fn, timeout)

    def has_request(self, rid: str, timeout: float | None = 30.0) -> bool:
        return self.driver.has_request(rid, timeout)

    def pools(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """Ask every rank whether all its pages, request, metadata and state slots are back and
        its transfers released: `{"full": bool, "detail": str}` (rank 0 only)."""
        fut: Future = Future()
        self.driver.post(CheckPools(fut))
        return fut.result(timeout)

    def check_pools_full(self, timeout: float = 30.0) -> None:
        """Wait until every rank is idle with its pools full; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not (state := self.pools(timeout))["full"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not full after {timeout} s: {state['detail']}")
            time.sleep(0.02)

    # ---- parts handed to the driver (engine thread) --------------------------------------------

    def _pools_status(self) -> dict[str, Any]:
        """Every rank, at the same point: this rank's leftovers, MIN-reduced over the ranks."""
        problems = []
        for r, s in enumerate(self.scheds):
            where = f"DP rank {r}: " if len(self.scheds) > 1 else ""
            if not s.is_idle:
                problems.append(f"{where}{s.num_active} requests active")
            for pool in (s.pool, s.req_slots, s.metadata_slots, s.state_slots):
                if pool is None:  # no recurrent-state slots: not a hybrid model
                    continue
                used = pages_in_use(s) if pool is s.pool else pool.num_used
                if used:
                    problems.append(f"{where}{used} of {pool.size} {pool.name}s in use")
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

    def _gauges(self, scheds: list[InstanceScheduler]) -> dict[str, float]:
        """The instance's gauges, queues and load: its DP ranks' added up."""
        gauges = merged_gauges(scheds)
        queues: dict[str, int] = {}
        pending = load = 0
        for sched in scheds:
            if isinstance(sched, PrefillScheduler):
                mine = {"bootstrap": len(sched.bootstrap), "waiting": len(sched.waiting),
                        "inflight": len(sched.inflight)}
                pending += sched.pending_tokens
            else:
                mine = {"prealloc": len(sched.prealloc), "transfer": len(sched.transfer),
                        "prebuilt": len(sched.prebuilt), "waiting": len(sched.waiting),
                        "running": len(sched.running)}
                pending += (sum(r.input_len for r in sched.prealloc)
                            + sum(r.input_len for r in sched.transfer))
            for key, value in mine.items():
                queues[key] = queues.get(key, 0) + value
            load += sched.load()
        if self.role == "prefill":
            gauges["sglang:num_prefill_prealloc_queue_reqs"] = queues["bootstrap"]
            gauges["sglang:num_prefill_inflight_queue_reqs"] = queues["inflight"]
        else:
            # SGLang's decode waiting queue holds the requests whose KV is in place
            gauges["sglang:num_queue_reqs"] = queues["waiting"] + queues["prebuilt"]
            gauges["sglang:num_decode_prealloc_queue_reqs"] = queues["prealloc"]
            gauges["sglang:num_decode_transfer_queue_reqs"] = queues["transfer"]
        self.queues = queues
        self.load = {"load": load, "num_active": sum(s.num_active for s in scheds),
                     "pending_tokens": pending}
        gauges["pdsim_metadata_slots_used"] = sum(s.metadata_slots.num_used for s in scheds)
        gauges["pdsim_transfers_pending"] = self.kv.num_pending
        if self.role == "decode" and self._speculation is not None:
            gauges["sglang:spec_accept_length"] = self._speculation.stats.mean_accept_len
        return gauges


# ---- the broadcast operations --------------------------------------------------------------


def _op_of(entry: Entry) -> steps.Op | None:
    """An inbox entry as the operation the other ranks apply (None: rank 0 only). Raises
    `StepMessageError` for a request that does not fit the message."""
    if type(entry) is Submit:
        req, top = entry.req, entry.top_logprobs
        s = req.sampling if req.sampling is not None else SamplingParams()
        return steps.AddRequest(
            rid=req.rid, prompt_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens,
            arrival_s=req.arrival_s, stop_token_ids=sorted(req.stop_token_ids),
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
            bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
            bootstrap_room=req.bootstrap_room, top_logprobs=top)
    if type(entry) is Abort:
        return steps.AbortRequest(entry.rid, entry.reason)
    if type(entry) is CheckPools:
        return steps.CheckPools()
    return None  # a `Call` runs on rank 0 alone and must not change the scheduler's state


def _request_of(op: steps.AddRequest) -> Request:
    return Request(
        op.rid, len(op.prompt_ids), op.max_new_tokens, arrival_s=op.arrival_s,
        prompt_ids=op.prompt_ids, stop_token_ids=frozenset(op.stop_token_ids),
        sampling=op.sampling(), bootstrap_host=op.bootstrap_host,
        bootstrap_port=op.bootstrap_port, bootstrap_room=op.bootstrap_room)
