"""Where an engine hands its `StreamEvent`s (runtime/protocol/stream.py): a sink, and the HTTP
status of a failure. Shared by the engines, the OpenAI front, the PD workers and the router.

An HTTP handler takes its request's events from an `EventQueue`, whose sink (`Mailbox.sink`)
the engine thread calls. Every generated token crosses here, so the crossing is batched: the
engine thread appends to its loop's `Mailbox` and wakes the loop only when no wake-up is pending
already (about one `call_soon_threadsafe` per engine step, whatever its batch: 1.3 for 16
requests a step, where one per event made 16), and a handler takes every event that is ready
at once (`EventQueue.get_ready`) to answer them in one write.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

from runtime.protocol.stream import StreamEvent

log = logging.getLogger(__name__)

Sink = Callable[[StreamEvent], None]


class EngineStopped(RuntimeError):
    """The engine no longer takes requests."""


RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again
# In the reason of a request failed because its peer worker died or restarted under it (the
# transfer layer noticed: runtime/transfer/decode.py, prefill.py): a retry meets the new one.
PEER_LOST = "peer restarted or gone"
# A KV write that failed on the wire (Mooncake's error, or an injected fault): the next try
# takes a new pair and room.
WRITE_FAILED = "KV write failed"
# A request its router withdrew (`POST /abort`: the other worker was lost, its client went
# away): the router answers the client itself; the worker's own answer is no fault of its.
ROUTER_ABORT = "aborted by the router"
# Failures that mean "too busy right now" (a request that waited its turn too long), "a peer
# is restarting" or "this transfer failed", not a fault of the request: 503, the client may
# retry (and the router does, once, before any token).
RETRYABLE_FAILURES = ("shutting down", "bootstrap timed out", "KV did not arrive within",
                      PEER_LOST, WRITE_FAILED, ROUTER_ABORT)


def failure_status(event: StreamEvent) -> int:
    """The HTTP status of a failed request: its own (a refusal), 503 when a retry may succeed
    (RETRYABLE_FAILURES), else 500."""
    if event.status:
        return event.status
    return 503 if event.error and any(m in event.error for m in RETRYABLE_FAILURES) else 500


def deliver(sink: Sink, event: StreamEvent) -> None:
    """Hand `event` to `sink`; a sink that raises loses the event, not its caller."""
    try:
        sink(event)
    except Exception:  # a consumer gone (its event loop closed, say) must not stop the engine
        log.debug("dropping an event for a closed sink", exc_info=True)


class EventQueue:
    """The events of one request, on its HTTP handler's event loop (an `asyncio.Queue` without
    its per-item overheads, that also hands out every event ready at once)."""

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, event: StreamEvent) -> None:
        """Add `event` (on the loop's thread)."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self) -> StreamEvent:
        """The next event, once there is one."""
        await self._wait()
        return self._events.popleft()

    async def get_ready(self) -> list[StreamEvent]:
        """Every event there is (at least one), in order."""
        await self._wait()
        events = list(self._events)
        self._events.clear()
        return events


class Mailbox:
    """Hands events from any thread to the `EventQueue`s of one event loop, in batches: a sink
    called off the loop appends and wakes the loop only if no wake-up is pending; on the loop's
    own thread (the PD router's relay) it puts at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the loop (`for_running_loop`)
        self._lock = threading.Lock()
        self._pending: list[tuple[EventQueue, StreamEvent]] = []
        self.wakeups = 0  # wake-ups scheduled so far (tests count them)

    def sink(self, queue: EventQueue) -> Sink:
        """The sink whose events reach `queue`."""
        return lambda event: self.post(queue, event)

    def post(self, queue: EventQueue, event: StreamEvent) -> None:
        if threading.get_ident() == self._loop_thread:
            queue.put(event)
            return
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:  # a wake-up is pending: it takes this one too
                return
            self.wakeups += 1
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nothing will take these
            with self._lock:
                self._pending.clear()
            raise

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put(event)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
    weakref.WeakKeyDictionary())


def for_running_loop() -> Mailbox:
    """The running event loop's `Mailbox` (one per loop, made on first use)."""
    loop = asyncio.get_running_loop()
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box
