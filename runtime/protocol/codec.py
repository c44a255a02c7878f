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

import functools
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any, ClassVar

import msgpack

VERSION = 4  # of every message here; bump it on any change of a message's fields or meaning
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LogProb = Annotated[float, "may be -inf"]
MESSAGES: dict[str, type] = {}  # every registered message type, by its `TYPE`
_HINTS: dict[type, dict[str, Any]] = {}
_NESTING: dict[type, set[str]] = {}  # per message type, the fields that may hold messages


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
    _NESTING[cls] = {name for name, hint in _HINTS[cls].items() if _holds_messages(hint)}
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
    nesting = _NESTING[type(msg)]
    return {name: _out(getattr(msg, name)) if name in nesting else getattr(msg, name)
            for name in _HINTS[type(msg)]}


def _holds_messages(hint: Any) -> bool:
    return hint in _HINTS or any(_holds_messages(a) for a in typing.get_args(hint)
                                 if not isinstance(a, str))


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
        return _converter(hint)(value)
    except _Mismatch as exc:
        raise ProtocolError(f"{kind}.{name} must be {_describe(hint)}, got {_short(value)}"
                            f"{exc.where}", message_type=kind, field=name) from None


class _Mismatch(Exception):
    def __init__(self, where: str = "") -> None:
        self.where = where


def _is_int(v: Any) -> bool:
    return type(v) is int and INT64_MIN <= v <= INT64_MAX


def _is_float(v: Any) -> bool:
    return (type(v) is float and math.isfinite(v)) or _is_int(v)


@functools.cache
def _converter(hint: Any) -> Callable[[Any], Any]:
    """A function that returns a wire value as a `hint` field holds it, else raises `_Mismatch`;
    built once per hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:  # LogProb
        inner = _converter(args[0])
        return lambda v: v if type(v) is float and v == -math.inf else inner(v)
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        return _union([_converter(a) for a in args])
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return _fixed_tuple([_converter(a) for a in args])
    if origin in (list, tuple):
        return _sequence(args[0], _converter(args[0]), list if origin is list else tuple)
    if hint in _HINTS:
        return functools.partial(_nested, hint)
    test = {int: _is_int, float: _is_float, type(None): lambda v: v is None}.get(
        hint, lambda v: type(v) is hint)  # exact: a bool is not an int, a str subclass not a str

    def scalar(v: Any) -> Any:
        if test(v):
            return v
        raise _Mismatch()
    return scalar


def _union(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        for option in options:
            try:
                return option(v)
            except _Mismatch:
                continue
        raise _Mismatch()
    return convert


def _sequence(item_hint: Any, item: Callable[[Any], Any], make: type) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            raise _Mismatch()
        if item_hint is int and all(type(x) is int for x in v) and (  # the common case, fast
                not v or INT64_MIN <= min(v) and max(v) <= INT64_MAX):
            return make(v)
        return make(_items(v, [item] * len(v)))
    return convert


def _fixed_tuple(items: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            raise _Mismatch()
        if len(v) != len(items):
            raise _Mismatch(f" ({len(v)} items; allowed: {len(items)})")
        return tuple(_items(v, items))
    return convert


def _items(values: list | tuple, items: list[Callable[[Any], Any]]) -> list:
    out = []
    for i, (v, item) in enumerate(zip(values, items)):
        try:
            out.append(item(v))
        except _Mismatch as exc:
            raise _Mismatch(f" (item {i}: {_short(v)}{exc.where})") from None
    return out


def _nested(cls: type, v: Any) -> Any:
    if isinstance(v, cls):
        return v
    if not isinstance(v, dict) or v.get("type") != cls.TYPE:
        raise _Mismatch()
    return _build(cls, v, {"type"})


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
