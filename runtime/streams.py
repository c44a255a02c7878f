"""Where an engine hands its `StreamEvent`s (runtime/protocol/stream.py): a sink, and the HTTP
status of a failure. Shared by the engines, the OpenAI front, the PD workers and the router."""

from __future__ import annotations

import logging
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
# Failures that mean "too busy right now" (a request that waited its turn too long), "a peer
# is restarting" or "this transfer failed", not a fault of the request: 503, the client may
# retry (and the router does, once, before any token).
RETRYABLE_FAILURES = ("shutting down", "bootstrap timed out", "KV did not arrive within",
                      PEER_LOST, WRITE_FAILED)


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
