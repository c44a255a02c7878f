"""The ZMQ wire format of the transfer backend: versioned dataclasses encoded with msgpack.

Every frame is one msgpack map: `type` and `version` plus exactly the dataclass's fields. Decoding
is strict: an unknown type, another version, a missing or extra field, a field of the wrong type
or bytes that are not one complete msgpack map raise `ProtocolError` naming the problem.

Decode → prefill: `RegisterDecode` (once per decode rank and prefill rank), `TransferInfo`
(per request), `Abort`, `Heartbeat`. Prefill → decode: `Status`, `Heartbeat` (the echo).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


@dataclass(frozen=True, slots=True)
class RegisterDecode:
    """A decode rank's KV and metadata buffers, sent once to each prefill rank it talks to."""

    TYPE: ClassVar[str] = "register_decode"
    session_id: str  # the decode rank's transfer engine, "host:rpc_port"
    endpoint: str  # its ZMQ PULL socket, "tcp://host:port": where status goes
    tp_rank: int
    tp_size: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]  # bytes per buffer: bounds for the pages a request names
    kv_item_lens: list[int]  # bytes per page, per buffer
    metadata_ptr: int
    metadata_len: int
    metadata_item_len: int
    page_size: int
    kv_dtype: str
    is_mla: bool
    total_kv_heads: int
    kv_heads_per_rank: int


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """Where one request's KV goes on one decode rank; `is_dummy` ranks send nothing."""

    TYPE: ClassVar[str] = "transfer_info"
    room: int
    session_id: str
    decode_tp_rank: int
    dst_pages: bytes  # packed little-endian page indices, see `pack_pages`
    page_dtype: str  # "int32" or "int64"
    metadata_slot: int
    is_dummy: bool

    def pages(self) -> np.ndarray:
        return unpack_pages(self.dst_pages, self.page_dtype)


@dataclass(frozen=True, slots=True)
class Status:
    """A prefill rank's progress on one room (a `KVPoll` value) with the reason of a failure."""

    TYPE: ClassVar[str] = "status"
    room: int
    poll: int
    reason: str
    prefill_tp_rank: int


@dataclass(frozen=True, slots=True)
class Abort:
    """The decode side gave up on a room."""

    TYPE: ClassVar[str] = "abort"
    room: int
    reason: str
    session_id: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness: decode sends `reply=False`, prefill echoes it with `reply=True`."""

    TYPE: ClassVar[str] = "heartbeat"
    session_id: str
    endpoint: str  # where the echo goes
    reply: bool


Message = RegisterDecode | TransferInfo | Status | Abort | Heartbeat
MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (RegisterDecode, TransferInfo, Status, Abort, Heartbeat)
}
_HINTS = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in fields(cls)}
    for cls in MESSAGE_TYPES.values()
}


def encode(msg: Message) -> bytes:
    cls = type(msg)
    if cls not in _HINTS:
        raise TypeError(f"not a protocol message: {cls.__name__}")
    body = {"type": cls.TYPE, "version": PROTOCOL_VERSION}
    for f in fields(cls):
        body[f.name] = getattr(msg, f.name)
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes) -> Message:
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise ProtocolError(f"frame of {len(frame)} bytes is not one msgpack map: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame is a msgpack {type(body).__name__}, expected a map")
    kind = body.pop("type", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None  # a list is unhashable
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r:.80}; known: {sorted(MESSAGE_TYPES)}")
    version = body.pop("version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{kind}: protocol version {version!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})")
    hints = _HINTS[cls]
    missing = sorted(set(hints) - set(body))
    extra = sorted(set(body) - set(hints))
    if missing or extra:
        raise ProtocolError(f"{kind}: missing fields {missing}, unexpected fields {extra}")
    for name, value in body.items():
        if not _has_type(value, hints[name]):
            raise ProtocolError(f"{kind}.{name} must be {hints[name]}, got {value!r:.80}")
    return cls(**body)


def _has_type(value: object, hint: object) -> bool:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if hint is float:
        return type(value) in (float, int)
    return type(value) is hint  # exact: a bool is not an int here


def pack_pages(pages) -> tuple[bytes, str]:
    """Page indices as compact little-endian bytes: int32 when they fit, else int64."""
    arr = np.asarray(pages, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"page indices must be 1-D, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"page indices must be >= 0, got {int(arr.min())}")
    if arr.size == 0 or arr.max() < 2**31:
        return arr.astype("<i4").tobytes(), "int32"
    return arr.astype("<i8").tobytes(), "int64"


def unpack_pages(data: bytes, dtype: str) -> np.ndarray:
    codes = {"int32": "<i4", "int64": "<i8"}
    if dtype not in codes:
        raise ProtocolError(f"page dtype must be one of {sorted(codes)}, got {dtype!r}")
    width = np.dtype(codes[dtype]).itemsize
    if len(data) % width:
        raise ProtocolError(f"{len(data)} bytes of {dtype} page indices is not a whole number")
    return np.frombuffer(data, dtype=codes[dtype]).astype(np.int64)
