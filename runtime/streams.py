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
# Failures that mean "too busy right now" (a request that waited its turn too long) or "a peer
# is restarting", not a fault: 503, the client may retry.
BUSY_FAILURES = ("shutting down", "bootstrap timed out", "KV did not arrive within", PEER_LOST)


def failure_status(event: StreamEvent) -> int:
    """The HTTP status of a failed request: its own (a refusal), 503 when the server was too
    busy or is stopping (the client may retry), else 500."""
    if event.status:
        return event.status
    return 503 if event.error and any(m in event.error for m in BUSY_FAILURES) else 500


def deliver(sink: Sink, event: StreamEvent) -> None:
    """Hand `event` to `sink`; a sink that raises loses the event, not its caller."""
    try:
        sink(event)
    except Exception:  # a consumer gone (its event loop closed, say) must not stop the engine
        log.debug("dropping an event for a closed sink", exc_info=True)
