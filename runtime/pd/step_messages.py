"""What rank 0 of a tensor-parallel instance tells its other ranks at the start of every loop
iteration (runtime/pd/lockstep_engine.py): a versioned `Step` of typed operations, encoded with msgpack.

A message is checked when it is built: every field has its declared type, every integer fits a
64-bit signed integer (msgpack's range), and an `AddRequest` holds what the other ranks can build
a request from (a non-empty prompt, max_new_tokens >= 1, valid sampling, top logprobs in range).
Rank 0 builds each operation before it broadcasts, so a request that cannot be sent fails alone
there and the broadcast itself never raises for one request. Decoding is strict in the same way:
bytes that are not one msgpack map of this version, an unknown operation, a missing or extra field
or a bad value raise `StepMessageError`, and nothing else.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, fields
from typing import ClassVar

import msgpack

from runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

STEP_VERSION = 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StepMessageError(ValueError):
    """A step message, or one of its operations, that is not valid."""


class _Checked:
    """Type and range checks of a message dataclass's fields, run when it is built."""

    def __post_init__(self) -> None:
        hints = _HINTS[type(self)]
        for f in fields(self):
            value = getattr(self, f.name)
            if not _valid(value, hints[f.name]):
                raise StepMessageError(f"{type(self).__name__}.{f.name} must be "
                                       f"{_hint_name(hints[f.name])} (integers within 64 bits, "
                                       f"numbers finite), got {_short(value)}")
        self._check()

    def _check(self) -> None:
        """Checks beyond the fields' types."""


@dataclass(frozen=True, slots=True)
class AddRequest(_Checked):
    TYPE: ClassVar[str] = "add"
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float
    stop_token_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    top_logprobs: int

    def _check(self) -> None:
        if not self.prompt_ids:
            raise StepMessageError(f"request {self.rid}: an empty prompt")
        if self.max_new_tokens < 1:
            raise StepMessageError(f"request {self.rid}: max_new_tokens={self.max_new_tokens}; "
                                   "allowed: >= 1")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise StepMessageError(f"request {self.rid}: top_logprobs={self.top_logprobs}; "
                                   f"allowed: 0..{MAX_TOP_LOGPROBS}")
        self.sampling()

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, seed=self.seed)
        except ValueError as exc:
            raise StepMessageError(f"request {self.rid}: {exc}") from None


@dataclass(frozen=True, slots=True)
class AbortRequest(_Checked):
    TYPE: ClassVar[str] = "abort"
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class CheckPools(_Checked):
    """Every rank reports whether its pools are full (a collective, at the same point)."""

    TYPE: ClassVar[str] = "pools"


Op = AddRequest | AbortRequest | CheckPools
OPS: dict[str, type] = {cls.TYPE: cls for cls in (AddRequest, AbortRequest, CheckPools)}


@dataclass(frozen=True, slots=True)
class Step(_Checked):
    """One iteration's start: rank 0's clock, whether to stop, and the operations in order."""

    now: float
    stop: bool
    ops: list  # of `Op`s, checked in `_check`

    def _check(self) -> None:
        for op in self.ops:
            if type(op) not in OPS.values():
                raise StepMessageError(f"Step.ops holds a {type(op).__name__}; allowed: "
                                       f"{', '.join(c.__name__ for c in OPS.values())}")


_HINTS = {cls: typing.get_type_hints(cls) for cls in (*OPS.values(), Step)}


def encode(step: Step) -> bytes:
    ops = [{"op": op.TYPE, **{f.name: getattr(op, f.name) for f in fields(op)}}
           for op in step.ops]
    return msgpack.packb({"version": STEP_VERSION, "now": step.now, "stop": step.stop,
                          "ops": ops}, use_bin_type=True)


def decode(frame: bytes) -> Step:
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise StepMessageError(f"a step of {len(frame)} bytes is not one msgpack map: "
                               f"{_short(str(exc))}") from None
    _keys("step", body, {"version", "now", "stop", "ops"})
    if body["version"] != STEP_VERSION or type(body["version"]) is not int:
        raise StepMessageError(f"step version {_short(body['version'])} is not supported (this "
                               f"rank speaks {STEP_VERSION})")
    if not isinstance(body["ops"], list):
        raise StepMessageError(f"step ops must be a list, got {_short(body['ops'])}")
    ops = []
    for i, raw in enumerate(body["ops"]):
        cls = OPS.get(raw.get("op")) if isinstance(raw, dict) and isinstance(
            raw.get("op"), str) else None
        if cls is None:
            raise StepMessageError(f"step op {i}: {_short(raw)} names no known operation; "
                                   f"known: {sorted(OPS)}")
        _keys(f"step op {i} ({cls.TYPE})", raw, {"op", *(f.name for f in fields(cls))})
        ops.append(cls(**{k: v for k, v in raw.items() if k != "op"}))
    return Step(now=body["now"], stop=body["stop"], ops=ops)


def _keys(what: str, body: object, expected: set[str]) -> None:
    if not isinstance(body, dict):
        raise StepMessageError(f"{what} must be a map, got {_short(body)}")
    missing, extra = sorted(expected - set(body)), sorted(map(repr, set(body) - expected))
    if missing or extra:
        raise StepMessageError(f"{what}: missing fields {missing}, unexpected fields "
                               f"{_short(extra)}")


def _valid(value: object, hint: object) -> bool:
    if isinstance(hint, types.UnionType):
        return any(_valid(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_valid(v, item) for v in value)
    if hint is list:
        return isinstance(value, list)
    if hint is type(None):
        return value is None
    if hint is int:
        return type(value) is int and INT64_MIN <= value <= INT64_MAX
    if hint is float:
        return (type(value) is float and math.isfinite(value)) or (
            type(value) is int and INT64_MIN <= value <= INT64_MAX)
    return type(value) is hint  # exact: a bool is not an int here


def _hint_name(hint: object) -> str:
    return str(hint) if typing.get_args(hint) else getattr(hint, "__name__", str(hint))


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
