"""What an engine hands back per request: `StreamEvent`s to a sink, and the HTTP status of a
failure. Shared by the engines, the OpenAI front, the PD workers and the router."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """New tokens of one request; the last event of a request has `finished` set."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one entry per token when they were asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" or "length" when finished without error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated in all, on the last event
    cached_tokens: int = 0  # prompt tokens a prefix cache supplied, on the last event
    status: int | None = None  # HTTP status of an error raised before any token (router)
    param: str | None = None  # the request field a 4xx error is about


Sink = Callable[[StreamEvent], None]


class EngineStopped(RuntimeError):
    """The engine no longer takes requests."""


RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again
# Failures that mean "too busy right now" (a request that waited its turn too long), not a fault.
BUSY_FAILURES = ("shutting down", "bootstrap timed out", "KV did not arrive within")


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
