"""What an engine hands back per request, and what a decode worker streams to the router: a
`StreamEvent`. On the wire (the decode worker's SSE stream, runtime/pd/http.py) each event is one
`data:` line of the codec's untyped JSON, with the protocol `version`; the router decodes it
strictly (runtime/router.py) and fails the request with 502 on an event it cannot read.

Events are not checked when they are built (engines build one per request per step); the
receiver checks them.

Every generated token passes here twice (the decode worker encodes, the router decodes), so this
one hot type has its own fast path on both sides: the encoder builds the wire map directly (the
codec's JSON, byte for byte), and the decoder checks the common well-formed event by hand with
the codec's exact rules; anything it does not accept goes through the codec's generic decoder,
which accepts it or names what is wrong (tests/test_protocol.py holds both to the codec's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.protocol import codec
from runtime.protocol.codec import INT64_MAX, INT64_MIN, VERSION, LogProb, message

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


# The wire map's keys, in the codec's order: `version`, then the fields.
_KEYS = ("version", "token_ids", "logprobs", "top_logprobs", "finished", "finish_reason",
         "error", "prompt_tokens", "completion_tokens", "cached_tokens", "status", "param")
_KEY_SET = frozenset(_KEYS)
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per call
_NEG_INF = -math.inf


def to_sse_data(event: StreamEvent) -> str:
    """The JSON of one `data:` line of the decode stream (the codec's `to_json`)."""
    e = event
    return _ENCODER.encode({
        "version": VERSION, "token_ids": e.token_ids, "logprobs": e.logprobs,
        "top_logprobs": e.top_logprobs, "finished": e.finished,
        "finish_reason": e.finish_reason, "error": e.error, "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens, "cached_tokens": e.cached_tokens,
        "status": e.status, "param": e.param})


def from_sse_data(data: str | bytes) -> StreamEvent:
    """One `data:` line's JSON as an event; `ProtocolError` for anything else."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return codec.from_json(data, StreamEvent)  # names the error
    event = _fast_event(body) if type(body) is dict and body.keys() == _KEY_SET else None
    return event if event is not None else codec.from_dict(body, StreamEvent, typed=False)


def _int(v: Any) -> bool:
    return type(v) is int and INT64_MIN <= v <= INT64_MAX


def _logprob(v: Any) -> bool:
    t = type(v)
    return (t is float and (math.isfinite(v) or v == _NEG_INF)) or (
        t is int and INT64_MIN <= v <= INT64_MAX)


def _optional_str(v: Any) -> bool:
    return v is None or type(v) is str


def _fast_event(b: dict) -> StreamEvent | None:
    """The event in a wire map with exactly the right keys, when every value is as the codec
    requires; None otherwise (the generic decoder then decides, and names the error)."""
    version, ids, lps, tops = b["version"], b["token_ids"], b["logprobs"], b["top_logprobs"]
    if type(version) is not int or version != VERSION:
        return None
    if type(ids) is not list or not all(map(_int, ids)):
        return None
    if type(lps) is not list or not all(map(_logprob, lps)):
        return None
    if type(tops) is not list:
        return None
    top_out = []
    for top in tops:
        if type(top) is not list:
            return None
        pairs = []
        for pair in top:
            if type(pair) is not list or len(pair) != 2 or not (
                    _int(pair[0]) and _logprob(pair[1])):
                return None
            pairs.append((pair[0], pair[1]))
        top_out.append(tuple(pairs))
    finished, status = b["finished"], b["status"]
    if type(finished) is not bool or not (status is None or _int(status)):
        return None
    if not (_optional_str(b["finish_reason"]) and _optional_str(b["error"])
            and _optional_str(b["param"])):
        return None
    if not (_int(b["prompt_tokens"]) and _int(b["completion_tokens"])
            and _int(b["cached_tokens"])):
        return None
    return StreamEvent(tuple(ids), tuple(lps), tuple(top_out), finished, b["finish_reason"],
                       b["error"], b["prompt_tokens"], b["completion_tokens"],
                       b["cached_tokens"], status, b["param"])
