"""The serving engine: one thread drives the core's instance step (pdsim/core/instance.py) with a
`ModelExecutor`, the same four moves as the simulator's instance process
(pdsim/sim/instance.py), on a monotonic wall clock whose zero is `start()`:

    now, stop = sync.begin(inbox, apply)    # agree on this iteration's inbox and clock; apply it
    step = inst.begin(now)                  # plan; then stream the core's outbox (`emitted`)
    result = executor.execute(step)         # a torch forward, measured
    inst.finish(step, result, now)          # (a forward that raises: inst.fail)
    stream the new tokens; finished requests stream their end as the core lets them go

The engine is composed, not subclassed: the scheduler is the colocated baseline's
`ColocatedScheduler` unless another is given (a PD worker passes a `PrefillScheduler` or
`DecodeScheduler`, or with attention DP one per DP rank, which the core's instance steps together
and gives each request to as the simulator's does: `dp_assignment`); the synchroniser `sync` is `LocalSync` (one process) unless another is given
(a PD worker's `LockstepSync`, runtime/pd/lockstep_engine.py, broadcasts rank 0's inputs to the
tensor-parallel ranks and MIN-reduces their transfer polls); `gauges` says what the metrics show.

Other threads talk to the engine only through its inbox (`submit`, `abort`, `call`: typed
entries, `Entry`), which the loop drains between forwards, so the scheduler and the executor are touched by the engine
thread alone. A request whose sampling fails is failed alone after the forward (the executor
lists it); the rest of its batch goes on. After every forward each affected request's new tokens
go to its *sink*, a callable the submitter gives (the HTTP servers' hand them to their event
loop in batches: runtime/streams.py); a finished request's last event carries its finish reason
("stop": it generated a stop token; "length": it reached `max_new_tokens`) or its error. Sinks
are called on the engine thread and must not block.

Finished and failed requests leave a `RequestRecord` (the simulator's schema) in `records`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pdsim.core.batch import BatchResult
from pdsim.core.config import SchedulerConfig
from pdsim.core.instance import Abort, Instance, RoomInUse
from pdsim.core.radix import token_page_keys
from pdsim.core.records import RequestRecord
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler, InstanceScheduler
from runtime.executor import ModelExecutor, save_table
from runtime.protocol.stream import StreamEvent
from runtime.sampling import SamplingParams
from runtime.serve_metrics import ServeMetrics
from runtime.streams import EngineStopped, Sink, deliver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    req: Request
    sink: Sink
    top_logprobs: int = 0  # top logprobs asked for per token
    pushed: int = 0  # output tokens already sent to the sink
    rejected: bool = False  # refused when it arrived (it can never run here)


# Request fields a submitter may set beyond the prompt and sampling (PD: where the two sides meet).
REQUEST_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

@dataclass(frozen=True, slots=True)
class Submit:
    """Inbox: a new request, where its tokens go, and how many top logprobs it wants each."""

    req: Request
    sink: Sink
    top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class Call:
    """Inbox: run `fn()` on the engine thread between two forwards; its result goes to `future`."""

    fn: Callable[[], Any]
    future: Future


@dataclass(frozen=True, slots=True)
class CheckPools:
    """Inbox (PD): every rank reports, at the same point, whether its pools are full."""

    future: Future


Entry = Submit | Abort | Call | CheckPools
Apply = Callable[[Entry, float], None]  # applies one entry at a time


class Synchroniser(Protocol):
    """Where the ranks of an instance agree on each iteration's inputs (one rank: nothing)."""

    def begin(self, entries: list[Entry], stopping: bool, now: float,
              apply: Apply) -> tuple[float, bool]:
        """Agree on this iteration's inputs and `apply` them in order; returns the iteration's
        clock and whether to stop. Raises when the ranks cannot agree (a peer is gone): the
        engine then stops."""
        ...

    def idle_timeout(self, inst: Instance, now: float) -> float | None:
        """How long to sleep when nothing runs (None: until the inbox gets something; 0: not)."""
        ...

    def release(self, req: Request) -> None:
        """`req` is done: forget what the synchroniser keeps about it."""
        ...


class LocalSync:
    """One process: the inbox as it is, the engine's own clock."""

    def begin(self, entries: list[Entry], stopping: bool, now: float,
              apply: Apply) -> tuple[float, bool]:
        for entry in entries:
            apply(entry, now)
        return now, stopping

    def idle_timeout(self, inst: Instance, now: float) -> float | None:
        return None if inst.is_idle else 0.01

    def release(self, req: Request) -> None:
        pass


def pages_in_use(sched: InstanceScheduler) -> int:
    """KV pages requests hold or pin: cached prefix pages nobody pins count as free (an
    allocation evicts them), as SGLang's token usage counts them."""
    return sched.pool.num_used - (sched.cache.evictable_pages if sched.cache is not None else 0)


def scheduler_gauges(sched: InstanceScheduler) -> dict[str, float]:
    """The gauges every engine shows (runtime/serve_metrics.py names them): running and waiting
    requests, KV token slots, request slots."""
    used = pages_in_use(sched)
    page_size = sched.config.page_size
    return {
        "sglang:num_running_reqs": len(sched.running),
        "sglang:num_queue_reqs": len(sched.waiting),
        "sglang:num_used_tokens": used * page_size,
        "sglang:token_usage": used / sched.pool.size,
        "sglang:max_total_num_tokens": sched.pool.size * page_size,
        "pdsim_request_slots_used": sched.req_slots.num_used,
    }


def merged_gauges(scheds: Sequence[InstanceScheduler]) -> dict[str, float]:
    """`scheduler_gauges` over an instance's DP ranks: counts add up, the token usage is the
    share of all their KV slots."""
    gauges: dict[str, float] = {}
    for sched in scheds:
        for key, value in scheduler_gauges(sched).items():
            gauges[key] = gauges.get(key, 0) + value
    gauges["sglang:token_usage"] = (gauges["sglang:num_used_tokens"]
                                    / gauges["sglang:max_total_num_tokens"])
    return gauges


class Engine:
    """`scheduler`: the core scheduler to drive (built with `config`); default a
    `ColocatedScheduler(config, instance_id)`; `schedulers` instead: one per attention-DP rank,
    handed requests by `dp_assignment`. `sync`: default `LocalSync()`. `gauges`: the
    schedulers' gauges for the metrics; default `merged_gauges`."""

    def __init__(self, executor: ModelExecutor, config: SchedulerConfig, *, instance_id: int = 0,
                 scheduler: InstanceScheduler | None = None,
                 schedulers: Sequence[InstanceScheduler] | None = None,
                 dp_assignment: str = "auto", sync: Synchroniser | None = None,
                 gauges: Callable[[Sequence[InstanceScheduler]], dict[str, float]] = merged_gauges,
                 max_records: int = 100_000, metrics: ServeMetrics | None = None) -> None:
        if (config.num_pages, config.page_size) != (executor.kv.num_pages, executor.page_size):
            raise ValueError(
                f"scheduler pool {config.num_pages} pages x {config.page_size} tokens differs from "
                f"the executor's KV cache {executor.kv.num_pages} x {executor.page_size}")
        if scheduler is not None and schedulers is not None:
            raise ValueError("give scheduler or schedulers, not both")
        if schedulers is None:
            schedulers = [scheduler if scheduler is not None
                          else ColocatedScheduler(config, instance_id)]
        if any(s.config != config for s in schedulers):
            raise ValueError("the scheduler was built with another SchedulerConfig than the "
                             "engine's")
        self.executor = executor
        self.config = config
        self.scheds = list(schedulers)
        self.sched = self.scheds[0]
        self.inst = Instance(self.scheds, self._finished, dp_assignment)
        self.sync: Synchroniser = sync if sync is not None else LocalSync()
        self.gauges = gauges
        self.metrics = metrics or ServeMetrics()
        self.records: deque[RequestRecord] = deque(maxlen=max_records)
        self._streams: dict[str, _Stream] = {}
        self._inbox: deque[Entry] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._t0 = 0.0
        self._update_gauges()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread; return once it has bound the executor (its threads, its
        warm-up: `ModelExecutor.bind_thread`), so that no request waits for them."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._t0 = time.monotonic()
        bound: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(bound,), name="pdsim-engine",
                                        daemon=True)
        self._thread.start()
        bound.result()  # raises what binding raised
        return self

    def now(self) -> float:
        """Seconds since `start()` on the monotonic clock (the records' time base)."""
        return time.monotonic() - self._t0

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop taking requests, fail the unfinished ones ("server shutting down") and join."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine thread ends (after `stop()`, or a TP peer's stop)."""
        if self._thread is not None:
            self._thread.join(timeout)

    async def shutdown(self) -> None:
        """`stop()` without blocking the calling event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def problems(self) -> dict[str, str]:
        """What keeps the engine from serving (empty: nothing)."""
        return {} if self.running else {"engine": "stopped"}

    # ---- the inbox (any thread) --------------------------------------------------------------

    def post(self, entry: Entry) -> None:
        """Queue an inbox entry for the engine thread (`submit`, `abort`, `call` use it)."""
        with self._cond:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running")
            self._inbox.append(entry)
            self._cond.notify()

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: Sink, *,
               sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
               top_logprobs: int = 0, rid: str | None = None, **fields: Any) -> str:
        """Queue a request; its tokens go to `sink`. Returns its id. `fields` sets the
        `REQUEST_FIELDS` (a PD worker's bootstrap host, port and room). Raises ValueError for a
        malformed request and `EngineStopped` once the engine stops."""
        unknown = sorted(set(fields) - set(REQUEST_FIELDS))
        if unknown:
            raise ValueError(f"unknown request fields {unknown}; allowed: {list(REQUEST_FIELDS)}")
        rid = rid or uuid.uuid4().hex
        req = Request(rid, len(prompt_ids), max_new_tokens, arrival_s=self.now(),
                      prompt_ids=list(prompt_ids), stop_token_ids=frozenset(stop_token_ids),
                      sampling=sampling, **fields)
        self.post(Submit(req, sink, top_logprobs))
        return rid

    def abort(self, rid: str, reason: str = "aborted by the client") -> None:
        """Fail `rid` (no-op if it already finished); its sink gets the error event."""
        try:
            self.post(Abort(rid, reason))
        except EngineStopped:
            pass  # shutting down fails every request anyway

    def wake(self) -> None:
        """Wake an idle loop (a transfer made progress)."""
        with self._cond:
            self._cond.notify()

    def call(self, fn: Callable[[], Any], timeout: float | None = 30.0) -> Any:
        """Run `fn()` on the engine thread between two forwards and return its result."""
        fut: Future = Future()
        self.post(Call(fn, fut))
        return fut.result(timeout)

    def has_request(self, rid: str, timeout: float | None = 30.0) -> bool:
        """Whether `rid` is in flight here (asked on the engine thread, after every request
        submitted before this call was taken in)."""
        return self.call(lambda: rid in self._streams, timeout)

    def check_pools_full(self, timeout: float = 30.0) -> None:
        """Wait until no request is active, then check that every page and slot is back."""
        deadline = time.monotonic() + timeout
        while not self.call(lambda: self.inst.is_idle):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine is still busy after {timeout} s")
            time.sleep(0.01)
        self.call(self.inst.check_pools_full)

    # ---- the loop (engine thread) ------------------------------------------------------------

    def _run(self, bound: Future) -> None:
        try:
            self.executor.bind_thread()
        except BaseException as exc:  # start() raises it
            bound.set_exception(exc)
            return
        bound.set_result(None)
        while True:
            now, stop = self._begin()
            if stop:
                break
            step = self.plan(now)
            if step is None:
                with self._cond:
                    if not self._inbox and not self._stopping:
                        timeout = self.sync.idle_timeout(self.inst, now)
                        if timeout is None or timeout > 0:
                            self._cond.wait(timeout)
                continue
            try:
                result = self.executor.execute(step)
            except Exception as exc:
                log.exception("forward failed")
                self.inst.fail(step, f"forward failed: {exc}", self.now())
                self._update_gauges()
                continue
            self.settle(step, result, self.now())
        self._fail_all("server shutting down")
        self._update_gauges()

    def plan(self, now: float) -> list | None:
        """The core's step at `now` (the inbox already applied), with the tokens it gave outside
        a forward streamed; None when nothing runs. The loop's first half, on the engine
        thread (or a test's manual clock, tests/core_harness.py)."""
        try:
            step = self.inst.begin(now)
        except Exception as exc:  # a core invariant broke: fail what is there, go on
            log.exception("scheduler step failed")
            self._fail_all(f"scheduler error: {exc}")
            return None
        self._push_new(self.inst.emitted)  # tokens from outside a forward
        if step is None:
            self._update_gauges()
        return step

    def settle(self, step: list, result: BatchResult | list[BatchResult | None],
               now: float) -> None:
        """The step's forward ended at `now`: the core takes its results (one, or one per
        attention-DP rank), the new tokens are streamed. The loop's second half."""
        results = result if isinstance(result, list) else [result] * len(step)
        forwards = []
        for batch, res in zip(step, results):
            if batch is None:
                continue
            for rid, reason in (res.failed or {}).items():
                log.warning("request %s failed alone: %s", rid, reason)
            # The requests this forward gives a token, read before `finish` hands it over: a
            # prefill chunk is last only while the request's fill length is still its prompt's.
            produced = (batch.reqs if batch.kind == "decode"
                        else [seg.req for seg in batch.segments if seg.is_last])
            forwards.append((batch, res.duration_s, produced))
        self.inst.finish(step, result, now)
        for batch, duration_s, produced in forwards:
            self.metrics.observe_forward(batch, duration_s, produced)
            self._push_new(produced)
        self._update_gauges()

    def _begin(self) -> tuple[float, bool]:
        """Start an iteration: agree on the inputs (`sync`) and apply them; (now, stop)."""
        with self._cond:
            items = list(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        try:
            return self.sync.begin(items, stopping, self.now(), self.apply)
        except Exception as exc:  # a collective failed (a peer rank is gone), or worse
            log.exception("the synchroniser failed")
            with self._cond:
                self._stopping = True
            self._fail_all(f"failed to sync with the other ranks: {exc}")
            return self.now(), True

    # ---- the inbox, applied (engine thread) ----------------------------------------------------

    def apply(self, entry: Entry, now: float) -> None:
        """Apply one inbox entry (on the engine thread, or a test's manual clock)."""
        if type(entry) is Submit:
            self._add(entry.req, entry.sink, entry.top_logprobs, now)
        elif type(entry) is Abort:
            if entry.rid in self._streams:
                self.inst.abort(entry.rid, entry.reason, now)
        else:
            fut = entry.future
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(entry.fn())
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)

    def _add(self, req: Request, sink: Sink, top_logprobs: int, now: float) -> None:
        if req.rid in self._streams:
            deliver(sink, StreamEvent(finished=True, error=f"request id {req.rid!r} is in use",
                                      prompt_tokens=req.input_len, status=409))
            return
        stream = self._streams[req.rid] = _Stream(req, sink, top_logprobs)
        if top_logprobs:
            self.executor.want_top_logprobs(req.rid, top_logprobs)
        if self.sched.cache is not None:  # every TP rank keys alike: their schedulers stay equal
            req.prefix_keys = token_page_keys(req.prompt_ids, self.config.page_size)
        # The core fails a request it can never hold (longer than the KV pool) at once: its
        # stream ends with a 400 then.
        stream.rejected = True
        try:
            self.inst.add_request(req, now)
        except RoomInUse as exc:
            del self._streams[req.rid]
            self.executor.release(req.rid)
            deliver(sink, StreamEvent(finished=True, prompt_tokens=req.input_len, status=409,
                                      error=str(exc)))
            return
        stream.rejected = False

    def _fail_all(self, reason: str) -> None:
        now = self.now()
        for rid, stream in list(self._streams.items()):
            if not self.inst.abort(rid, reason, now) and not stream.req.finished:
                # In no queue (a core invariant broke mid-step): end its stream all the same.
                del self._streams[rid]
                deliver(stream.sink, StreamEvent(finished=True, error=reason,
                                                 prompt_tokens=stream.req.input_len))

    def _push_new(self, reqs) -> None:
        for req in reqs:
            stream = self._streams.get(req.rid)
            if stream is not None and not req.finished:
                event = self._new_tokens(stream)
                if event.token_ids:
                    deliver(stream.sink, event)

    def _new_tokens(self, stream: _Stream, **final: Any) -> StreamEvent:
        req = stream.req
        ids = tuple(req.output_ids[stream.pushed:])
        lps = tuple(req.output_logprobs[stream.pushed:])
        top = tuple(tuple(t) for t in self.executor.take_top_logprobs(req.rid))
        if stream.top_logprobs and len(top) < len(ids):
            # A token that no local forward sampled (a PD decode worker's first token, which
            # came in the KV metadata) has no top logprobs: an empty entry keeps them aligned.
            top = ((),) * (len(ids) - len(top)) + top
        stream.pushed = len(req.output_ids)
        return StreamEvent(ids, lps, top, prompt_tokens=req.input_len, **final)

    def _finished(self, req: Request) -> None:
        """The core let `req` go (finished or failed): record it and end its stream."""
        self.sync.release(req)
        record = req.to_record("failed" if req.error else "ok")
        self.records.append(record)
        self.metrics.observe_request(record)
        stream = self._streams.pop(req.rid, None)
        if stream is not None:
            if req.error:
                reason = None
            elif req.output_ids and req.output_ids[-1] in req.stop_token_ids:
                reason = "stop"
            else:
                reason = "length"
            deliver(stream.sink, self._new_tokens(
                stream, finished=True, finish_reason=reason, error=req.error or None,
                completion_tokens=req.num_output, cached_tokens=req.cached_tokens,
                status=400 if stream.rejected and req.error else None,
                param="prompt" if stream.rejected and req.error else None))
        self.executor.release(req.rid)

    def _update_gauges(self) -> None:
        self.metrics.set_gauges(self.gauges(self.scheds))

    # ---- results -----------------------------------------------------------------------------

    def records_frame(self):
        """The finished requests' records as the simulator's per-request table."""
        from pdsim.metrics import records_frame

        return records_frame(list(self.records))

    def save_records(self, path: str | Path) -> Path:
        """Write the records to `.csv` or `.parquet` (by the file's suffix)."""
        return save_table(self.records_frame(), path, "records")
