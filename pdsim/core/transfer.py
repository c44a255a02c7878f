"""The transfer-backend port: a KV manager per instance, a sender or receiver per request.

Prefill side (`KVSender`): created when a request arrives, polled in the bootstrap queue until the
decode side has said where to write (`WaitingForInput`); `init` then fixes the page count and the
metadata slot; `send` hands over pages chunk by chunk, the last call also carries the metadata
and, for a hybrid model, the request's recurrent-state slot (`state_indices`).

Decode side (`KVReceiver`): created when a request arrives, handshakes with the prefill rank
(`Bootstrapping` → `WaitingForInput`); once pages are allocated, `send_metadata` tells the prefill
side the destination pages, metadata slot and state slot (`state_indices`, empty when the model
keeps no per-request state); `Success` means KV and metadata are in place.

The sim, fake and Mooncake backends implement these three classes and nothing else; one contract
test runs against all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdsim.core.kvpoll import KVPoll


@dataclass(frozen=True, slots=True)
class FirstTokenMetadata:
    """What the prefill side writes into the metadata slot next to the last KV chunk."""

    bootstrap_room: int
    first_token_id: int
    first_logprob: float
    cached_tokens: int


def state_mismatch(src_states: Sequence[int], dst_states: Sequence[int]) -> str:
    """The failure when the two sides disagree on whether a request has a state to move (one
    model with a recurrent state, the other without: a misconfigured pair)."""
    return (f"the prefill side sends {len(src_states)} state slots, the decode side expects "
            f"{len(dst_states)}: both sides must serve the same model")


class MetadataStore(Protocol):
    """Slots of first-token metadata, written by prefill and read by decode."""

    def write(self, slot: int, meta: FirstTokenMetadata) -> None: ...

    def read(self, slot: int) -> FirstTokenMetadata | None: ...


class DictMetadataStore:
    """In-memory metadata slots (the sim and fake backends' buffers)."""

    def __init__(self) -> None:
        self._slots: dict[int, FirstTokenMetadata] = {}

    def write(self, slot: int, meta: FirstTokenMetadata) -> None:
        self._slots[slot] = meta

    def read(self, slot: int) -> FirstTokenMetadata | None:
        return self._slots.get(slot)


class KVSender(Protocol):
    def poll(self) -> KVPoll: ...

    def init(self, num_pages: int, metadata_slot: int) -> None: ...

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        """Queue the next pages of this request (in order); `last` also ships the metadata slot
        and the state in `state_indices`."""
        ...

    def abort(self, reason: str) -> None: ...

    def failure_reason(self) -> str: ...


class KVReceiver(Protocol):
    def poll(self) -> KVPoll: ...

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None: ...

    def abort(self, reason: str) -> None: ...

    def failure_reason(self) -> str: ...


class KVManager(Protocol):
    """One per instance rank; creates the per-request endpoints and owns the metadata buffers."""

    metadata: MetadataStore

    def poll_epoch(self) -> int:
        """A counter that changes whenever a poll of any of this manager's endpoints may answer
        differently. Schedulers skip re-polling a queue while it is unchanged, so a backend
        that cannot tell should return a fresh value on every call."""
        ...

    def create_sender(self, req) -> KVSender: ...

    def create_receiver(self, req) -> KVReceiver: ...
