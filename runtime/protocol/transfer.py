"""The ZMQ messages of the transfer backend, between a prefill rank and a decode rank, in the
codec's msgpack (runtime/protocol/codec.py: a `type`, the `version`, exactly the fields; strict
decoding, every problem a `ProtocolError`).

Decode -> prefill: `RegisterDecode` (once per decode rank and prefill rank), `TransferInfo`
(per request), `Abort`, `Heartbeat`. Prefill -> decode: `Status`, `Heartbeat` (the echo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from runtime.protocol import codec
from runtime.protocol.codec import ProtocolError, message


@message
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
    # Its recurrent-state buffer (hybrid models; all 0 without one), see `KVArgs`.
    state_ptr: int = 0
    state_len: int = 0
    state_slot_len: int = 0
    state_layers: int = 0
    total_state_heads: int = 0
    # Its draft hidden-state buffer (speculative decoding; all 0 without one), see `KVArgs`.
    hidden_ptr: int = 0
    hidden_len: int = 0
    hidden_slot_len: int = 0


@message
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
    # Its state slots (a hybrid model's recurrent state, a speculating instance's hidden
    # state), written with the last chunk.
    dst_state_slots: list[int] = field(default_factory=list)

    def pages(self) -> np.ndarray:
        return unpack_pages(self.dst_pages, self.page_dtype)


@message
@dataclass(frozen=True, slots=True)
class Status:
    """A prefill rank's progress on one room (a `KVPoll` value) with the reason of a failure."""

    TYPE: ClassVar[str] = "status"
    room: int
    poll: int
    reason: str
    prefill_tp_rank: int


@message
@dataclass(frozen=True, slots=True)
class Abort:
    """The decode side gave up on a room."""

    TYPE: ClassVar[str] = "abort"
    room: int
    reason: str
    session_id: str


@message
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness: decode sends `reply=False`, prefill echoes it with `reply=True`."""

    TYPE: ClassVar[str] = "heartbeat"
    session_id: str
    endpoint: str  # where the echo goes
    reply: bool


Message = RegisterDecode | TransferInfo | Status | Abort | Heartbeat
MESSAGE_TYPES: tuple[type, ...] = (RegisterDecode, TransferInfo, Status, Abort, Heartbeat)


def encode(msg: Message) -> bytes:
    if type(msg) not in MESSAGE_TYPES:
        raise TypeError(f"not a transfer message: {type(msg).__name__}")
    return codec.encode(msg)


def decode(frame: bytes) -> Message:
    """One transfer message; any other message type is refused like an unknown one."""
    return codec.decode(frame, MESSAGE_TYPES)


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
