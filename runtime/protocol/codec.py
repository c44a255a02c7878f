"""One codec for every message the serving backend puts on a wire.

A message is a frozen dataclass registered with `@message`, named by its `TYPE`. On the wire it
is one map: `type`, `version` (`VERSION`, the same for every message) and exactly the dataclass's
fields; a field that is itself a message (the operations of a TP step) is a nested map with its
own `type` and no `version`. Binary links (the TP broadcast, the transfer channel) carry msgpack
(`encode`/`decode`); HTTP bodies and SSE events carry JSON (`to_json`/`from_json`), without
`type` where the endpoint already says what the body is.

Decoding is strict: bytes that are not one map, an unknown type, another version, a missing or
extra key, or a value of the wrong type (list elements and nested messages included) raise
`ProtocolError`, and nothing else, naming the message type, the field, the value and what is
allowed. Field types: `str`, `bytes`, `bool`, `int` (64-bit signed: msgpack's range; a bool is
not an int), `float` (finite; an int is accepted), `LogProb` (a float that may be -inf), `None`,
unions of these, `list[...]`, `tuple[X, ...]`, fixed `tuple[X, Y]` and registered messages.
Subclasses of `Checked` are checked the same way when they are built, so a sender cannot build
what a receiver would refuse.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import fields
from typing import Annotated, Any, ClassVar

import msgpack

VERSION = 2  # of every message here; bump it on any change of a message's fields or meaning
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LogProb = Annotated[float, "may be -inf"]
MESSAGES: dict[str, type] = {}  # every registered message type, by its `TYPE`
_HINTS: dict[type, dict[str, Any]] = {}


class ProtocolError(ValueError):
    """A message that is not valid; `message_type` and `field` say where, when known."""

    def __init__(self, text: str, *, message_type: str | None = None,
                 field: str | None = None) -> None:
        super().__init__(text)
        self.message_type = message_type
        self.field = field


def message(cls: type) -> type:
    """Register the dataclass `cls` under its `TYPE` (which must be unique)."""
    if cls.TYPE in MESSAGES:
        raise ValueError(f"message type {cls.TYPE!r} is registered twice")
    hints = typing.get_type_hints(cls, include_extras=True)
    _HINTS[cls] = {f.name: hints[f.name] for f in fields(cls)}
    MESSAGES[cls.TYPE] = cls
    return cls


class Checked:
    """A message checked when it is built: its fields' types, then `_check()`."""

    TYPE: ClassVar[str]

    def __post_init__(self) -> None:
        for name, hint in _HINTS[type(self)].items():
            _check_value(self.TYPE, name, getattr(self, name), hint)
        self._check()

    def _check(self) -> None:
        """Checks beyond the fields' types; raise `ProtocolError` via `self._refuse`."""

    def _refuse(self, field: str, text: str) -> None:
        raise ProtocolError(f"{self.TYPE}.{field}: {text}", message_type=self.TYPE, field=field)


# ---- encoding ----------------------------------------------------------------------------------


def to_dict(msg: Any, *, typed: bool = True) -> dict[str, Any]:
    """`msg` as its wire map: `type` (if `typed`), `version`, then its fields."""
    body: dict[str, Any] = {"type": msg.TYPE} if typed else {}
    body["version"] = VERSION
    body.update(_fields_out(msg))
    return body


def encode(msg: Any) -> bytes:
    """`msg` as one msgpack map."""
    if type(msg) not in _HINTS:
        raise TypeError(f"not a registered message: {type(msg).__name__}")
    return msgpack.packb(to_dict(msg), use_bin_type=True)


def to_json(msg: Any, *, typed: bool = False) -> str:
    """`msg` as compact JSON (untyped by default: the endpoint names the body)."""
    return json.dumps(to_dict(msg, typed=typed), separators=(",", ":"))


def _fields_out(msg: Any) -> dict[str, Any]:
    return {name: _out(getattr(msg, name)) for name in _HINTS[type(msg)]}


def _out(value: Any) -> Any:
    if type(value) in _HINTS:
        return {"type": value.TYPE, **_fields_out(value)}
    if isinstance(value, (list, tuple)):
        return [_out(v) for v in value]
    return value


# ---- decoding ----------------------------------------------------------------------------------


def decode(frame: bytes, expect: type | tuple[type, ...] | None = None) -> Any:
    """The message in one msgpack `frame`; `expect` limits which types are accepted."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"a frame of {len(frame)} bytes is not one msgpack map: "
                            f"{_short(str(exc))}") from None
    return from_dict(body, expect)


def from_json(text: str | bytes, cls: type) -> Any:
    """The `cls` message in an untyped JSON body."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{cls.TYPE}: not valid JSON: {_short(str(exc))}",
                            message_type=cls.TYPE) from None
    return from_dict(body, cls, typed=False)


def from_dict(body: Any, expect: type | tuple[type, ...] | None = None, *,
              typed: bool = True) -> Any:
    """The message in a decoded wire map. Untyped maps need `expect` to be one class."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the frame is a {type(body).__name__}, expected a map")
    allowed = (expect,) if isinstance(expect, type) else expect or tuple(MESSAGES.values())
    if typed:
        cls = _message_class(body.get("type"), allowed, "the frame")
    else:
        (cls,) = allowed
    check_version(cls.TYPE, body.get("version"))
    return _build(cls, body, {"type", "version"} if typed else {"version"})


def check_version(what: str, version: Any) -> None:
    """Raise `ProtocolError` (field `version`) unless `version` is `VERSION`."""
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"{what}: protocol version {_short(version)} is not supported; "
                            f"allowed: {VERSION} (this side's version)", message_type=what,
                            field="version")


def check_keys(what: str, body: dict, required: set[str], optional: set[str] = frozenset()
               ) -> None:
    """Raise `ProtocolError` naming the first unknown or missing key of `body`."""
    extra = sorted(map(str, set(body) - required - optional))
    missing = sorted(required - set(body))
    if extra or missing:
        field = (extra or missing)[0]
        raise ProtocolError(f"{what}: missing fields {missing}, unexpected fields "
                            f"{_short(extra)}; allowed: {sorted(required | optional)}",
                            message_type=what, field=field)


def _message_class(kind: Any, allowed: tuple[type, ...], where: str) -> type:
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None  # a list is unhashable
    if cls not in allowed:
        raise ProtocolError(f"{where}: unknown message type {_short(kind)}; allowed: "
                            f"{sorted(c.TYPE for c in allowed)}", field="type")
    return cls


def _build(cls: type, body: dict, envelope: set[str]) -> Any:
    hints = _HINTS[cls]
    check_keys(cls.TYPE, body, set(hints) | envelope)
    values = {name: _check_value(cls.TYPE, name, body[name], hint)
              for name, hint in hints.items()}
    try:
        return cls(**values)
    except ProtocolError:
        raise
    except (ValueError, TypeError) as exc:  # a message's own checks beyond the types
        raise ProtocolError(f"{cls.TYPE}: {exc}", message_type=cls.TYPE) from None


def _check_value(kind: str, name: str, value: Any, hint: Any) -> Any:
    """`value` as field `name` of a `kind` message holds it (lists of tuples become tuples,
    nested maps messages), else `ProtocolError`."""
    try:
        return _as(value, hint)
    except _Mismatch as exc:
        raise ProtocolError(f"{kind}.{name} must be {_describe(hint)}, got {_short(value)}"
                            f"{exc.where}", message_type=kind, field=name) from None


class _Mismatch(Exception):
    def __init__(self, where: str = "") -> None:
        self.where = where


def _as(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        if type(value) is float and value == -math.inf:
            return value
        return _as(value, args[0])
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        for option in args:
            try:
                return _as(value, option)
            except _Mismatch:
                continue
        raise _Mismatch()
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch()
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise _Mismatch(f" ({len(value)} items; allowed: {len(args)})")
            items = args
        else:
            items = (args[0],) * len(value)
        out = []
        for i, (v, h) in enumerate(zip(value, items)):
            try:
                out.append(_as(v, h))
            except _Mismatch as exc:
                raise _Mismatch(f" (item {i}: {_short(v)}{exc.where})") from None
        return tuple(out) if origin is tuple else out
    if hint in _HINTS:
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict) or value.get("type") != hint.TYPE:
            raise _Mismatch()
        return _build(hint, value, {"type"})
    if hint is type(None):
        if value is None:
            return value
    elif hint is int:
        if type(value) is int and INT64_MIN <= value <= INT64_MAX:
            return value
    elif hint is float:
        if (type(value) is float and math.isfinite(value)) or (
                type(value) is int and INT64_MIN <= value <= INT64_MAX):
            return value
    elif type(value) is hint:  # exact: a bool is not an int, a str subclass not a str
        return value
    raise _Mismatch()


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return f"{_describe(args[0])} or -inf"
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        return " or ".join(_describe(a) for a in args)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"a list of ({_describe(args[0])})"
    if origin is tuple:
        return f"a list [{', '.join(_describe(a) for a in args)}]"
    if hint in _HINTS:
        return f"a {hint.TYPE!r} map"
    return {type(None): "null", int: "an integer within 64 bits",
            float: "a finite number", bool: "a boolean", str: "a string",
            bytes: "bytes"}.get(hint, getattr(hint, "__name__", str(hint)))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
