"""The router -> worker `/generate` body: a versioned message in JSON (the codec's `version`,
runtime/protocol/codec.py; no `type`: the endpoint names it). The router builds a
`GenerateParams` and posts `to_body()`; the worker decodes it with `parse_generate`, strictly,
with the codec's version and key checks: another `version`, an unknown or missing field, or a bad
value is a `BadRequest` (HTTP 400) naming the field, the value and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.checks import BadRequest, check_text, check_token_ids, is_int
from runtime.protocol.codec import VERSION, ProtocolError, check_keys, check_version
from runtime.sampling import (
    MAX_TOP_LOGPROBS, SAMPLING_FIELDS, SamplingError, SamplingParams, parse_sampling,
)

ROOM_LIMIT = 2**63
MAX_RID_CHARS = 256
REQUIRED_FIELDS = ("version", "rid", "input_ids", "max_new_tokens", "bootstrap_host",
                   "bootstrap_port", "bootstrap_room")
OPTIONAL_FIELDS = ("sampling", "stop_token_ids", "top_logprobs")
GENERATE_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS


@dataclass(frozen=True)
class GenerateParams:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int]
    top_logprobs: int
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int

    def to_body(self) -> dict[str, Any]:
        """The JSON body the router posts to both workers."""
        s = self.sampling
        return {"version": VERSION, "rid": self.rid, "input_ids": list(self.input_ids),
                "max_new_tokens": self.max_new_tokens,
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                             "seed": s.seed},
                "stop_token_ids": list(self.stop_token_ids), "top_logprobs": self.top_logprobs,
                "bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": self.bootstrap_room}


def parse_generate(body: Any, *, model_vocab: int, max_position: int) -> GenerateParams:
    """A `/generate` body, checked field by field (`BadRequest` names the field)."""
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body is a JSON {type(body).__name__}; allowed: an object")
    try:
        check_keys("generate", body, set(REQUIRED_FIELDS), set(OPTIONAL_FIELDS))
        check_version("generate", body["version"])
    except ProtocolError as exc:
        raise BadRequest(exc.field, str(exc)) from None
    rid = check_rid(body["rid"])
    ids = check_token_ids("input_ids", body["input_ids"], model_vocab, empty_ok=False)
    max_new = body["max_new_tokens"]
    if not is_int(max_new) or max_new < 1:
        raise BadRequest("max_new_tokens", f"max_new_tokens={max_new!r}; allowed: an integer >= 1")
    if len(ids) + max_new > max_position:
        raise BadRequest("max_new_tokens", f"input ({len(ids)} tokens) + max_new_tokens "
                         f"({max_new}) = {len(ids) + max_new}; allowed: at most {max_position} "
                         "(the model's max position)")
    sampling = _sampling(body.get("sampling"))
    stop = check_token_ids("stop_token_ids", body.get("stop_token_ids") or [], model_vocab,
                           empty_ok=True)
    top = body.get("top_logprobs") or 0
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest("top_logprobs", f"top_logprobs={top!r}; allowed: an integer "
                         f"0..{MAX_TOP_LOGPROBS}")
    host, port, room = check_bootstrap(body)
    return GenerateParams(rid, ids, max_new, sampling, stop, top, host, port, room)


def check_rid(rid: Any) -> str:
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS:
        raise BadRequest("rid", f"rid={rid!r:.80}; allowed: a string of 1..{MAX_RID_CHARS} "
                         "characters")
    return check_text("rid", rid)


def check_bootstrap(body: dict) -> tuple[str, int, int]:
    """A body's `bootstrap_host`, `bootstrap_port` and `bootstrap_room`: where the two sides of
    a request meet (the prefill instance's bootstrap server, and the room that names the
    request on both sides)."""
    host, port, room = body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise BadRequest("bootstrap_host", f"bootstrap_host={host!r:.80}; allowed: a host name")
    check_text("bootstrap_host", host)
    if not is_int(port) or not 0 < port < 65536:
        raise BadRequest("bootstrap_port", f"bootstrap_port={port!r}; allowed: 1..65535")
    if not is_int(room) or not 0 <= room < ROOM_LIMIT:
        raise BadRequest("bootstrap_room", f"bootstrap_room={room!r}; allowed: 0..2**63-1")
    return host, port, room


def _sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("sampling", "sampling must be an object {temperature, top_p, top_k, "
                         "seed}")
    extra = sorted(set(raw) - set(SAMPLING_FIELDS))
    if extra:
        raise BadRequest(f"sampling.{extra[0]}", f"unknown sampling fields {extra}; allowed: "
                         f"{list(SAMPLING_FIELDS)}")
    try:
        return parse_sampling(raw, default_temperature=0.0)
    except SamplingError as exc:
        raise BadRequest(f"sampling.{exc.field}", str(exc)) from None
