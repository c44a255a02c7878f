"""First-token metadata slots in raw memory, so the transfer engine can write them across hosts.

Each slot is 32 bytes: room (int64), first token id (int64), cached tokens (int64), first logprob
(float32) and 4 bytes of padding. A slot whose room is -1 is empty (`read` returns None). The
decode scheduler compares the room it reads with the request's own to catch crossed buffers.
"""

from __future__ import annotations

import ctypes

import numpy as np

from pdsim.core.transfer import FirstTokenMetadata

SLOT_DTYPE = np.dtype([
    ("room", "<i8"), ("first_token_id", "<i8"), ("cached_tokens", "<i8"),
    ("first_logprob", "<f4"), ("_pad", "<u4"),
])
SLOT_BYTES = SLOT_DTYPE.itemsize
EMPTY_ROOM = -1


class MetadataBuffer:
    """`MetadataStore` over a structured numpy array (owned, or a view of foreign memory)."""

    def __init__(self, slots: np.ndarray) -> None:
        if slots.dtype != SLOT_DTYPE or slots.ndim != 1:
            raise ValueError(f"metadata slots must be a 1-D array of {SLOT_DTYPE}")
        self._slots = slots

    @classmethod
    def allocate(cls, num_slots: int) -> MetadataBuffer:
        slots = np.zeros(num_slots, dtype=SLOT_DTYPE)
        slots["room"] = EMPTY_ROOM
        return cls(slots)

    @classmethod
    def at_address(cls, ptr: int, nbytes: int) -> MetadataBuffer:
        """A view of `nbytes` at `ptr`; the caller keeps that memory alive."""
        if nbytes % SLOT_BYTES:
            raise ValueError(
                f"metadata buffer of {nbytes} bytes is not whole {SLOT_BYTES}-byte slots")
        raw = (ctypes.c_char * nbytes).from_address(ptr)
        return cls(np.frombuffer(raw, dtype=SLOT_DTYPE))

    @property
    def ptr(self) -> int:
        return self._slots.ctypes.data

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    @property
    def item_len(self) -> int:
        return SLOT_BYTES

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def write(self, slot: int, meta: FirstTokenMetadata) -> None:
        self._slots[self._check(slot)] = (
            meta.bootstrap_room, meta.first_token_id, meta.cached_tokens, meta.first_logprob, 0)

    def read(self, slot: int) -> FirstTokenMetadata | None:
        row = self._slots[self._check(slot)]
        if int(row["room"]) == EMPTY_ROOM:
            return None
        return FirstTokenMetadata(
            bootstrap_room=int(row["room"]), first_token_id=int(row["first_token_id"]),
            first_logprob=float(row["first_logprob"]), cached_tokens=int(row["cached_tokens"]))

    def clear(self, slot: int) -> None:
        self._slots["room"][self._check(slot)] = EMPTY_ROOM

    def _check(self, slot: int) -> int:
        if not 0 <= slot < len(self._slots):
            raise IndexError(f"metadata slot {slot} out of range 0..{len(self._slots) - 1}")
        return slot
