"""What an engine hands back per request, and what a decode worker streams to the router: a
`StreamEvent`. On the wire (the decode worker's SSE stream, runtime/pd/http.py) each event is one
`data:` line of the codec's untyped JSON, with the protocol `version`; the router decodes it
strictly (runtime/router.py) and fails the request with 502 on an event it cannot read.

Events are not checked when they are built (engines build one per request per step); the
receiver checks them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.protocol import codec
from runtime.protocol.codec import LogProb, message

TopLogprobs = tuple[tuple[int, LogProb], ...]


@message
@dataclass(frozen=True, slots=True)
class StreamEvent:
    """New tokens of one request; the last event of a request has `finished` set."""

    TYPE: ClassVar[str] = "stream_event"
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[LogProb, ...] = ()
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one entry per token when they were asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" or "length" when finished without error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated in all, on the last event
    cached_tokens: int = 0  # prompt tokens a prefix cache supplied, on the last event
    status: int | None = None  # HTTP status of an error raised before any token (router)
    param: str | None = None  # the request field a 4xx error is about


def to_sse_data(event: StreamEvent) -> str:
    """The JSON of one `data:` line of the decode stream."""
    return codec.to_json(event)


def from_sse_data(data: str) -> StreamEvent:
    """One `data:` line's JSON as an event; `ProtocolError` for anything else."""
    return codec.from_json(data, StreamEvent)
