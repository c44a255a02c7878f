"""A transfer backend that moves nothing and succeeds at once, for unit tests of the schedulers.

Every instance's manager shares one `FakeWire`; endpoints meet there by bootstrap room, like the
real ones meet through the bootstrap server. The handshake completes immediately, metadata is
copied when the last chunk is sent, and `fail_room` injects a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdsim.core.kvpoll import KVPoll, advance
from pdsim.core.transfer import DictMetadataStore, state_mismatch


@dataclass(slots=True)
class _Room:
    state: KVPoll = KVPoll.WaitingForInput
    receiver_ready: bool = False
    dst_pages: list[int] = field(default_factory=list)
    dst_metadata_slot: int = -1
    dst_manager: "FakeKVManager | None" = None
    src_pages: list[int] = field(default_factory=list)
    dst_states: list[int] = field(default_factory=list)
    reason: str = ""


class FakeWire:
    """Shared state of all fake endpoints: what each room has seen."""

    def __init__(self) -> None:
        self.epoch = 0  # bumped on every change any endpoint could observe
        self.rooms: dict[int, _Room] = {}
        self.sent_pages: dict[int, list[tuple[int, int]]] = {}  # room → (src, dst) page pairs
        self.sent_states: dict[int, list[tuple[int, int]]] = {}  # room → (src, dst) state slots

    def room(self, room_id: int) -> _Room:
        return self.rooms.setdefault(room_id, _Room())

    def fail_room(self, room_id: int, reason: str = "injected failure") -> None:
        self.epoch += 1
        r = self.room(room_id)
        r.state = KVPoll.Failed
        r.reason = reason

    def close(self, room_id: int) -> None:
        self.rooms.pop(room_id, None)


class FakeKVSender:
    def __init__(self, wire: FakeWire, room_id: int, manager: "FakeKVManager"):
        self._wire = wire
        self._room_id = room_id
        self._manager = manager
        self._metadata_slot = -1

    def _room(self) -> _Room:
        return self._wire.room(self._room_id)

    def poll(self) -> KVPoll:
        r = self._room()
        if r.state is KVPoll.WaitingForInput and not r.receiver_ready:
            return KVPoll.Bootstrapping
        return r.state

    def init(self, num_pages: int, metadata_slot: int) -> None:
        self._metadata_slot = metadata_slot

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        self._wire.epoch += 1
        r = self._room()
        if r.state is KVPoll.Failed:
            return
        r.src_pages.extend(page_indices)
        r.state = advance(r.state, KVPoll.Transferring)
        if last:
            if len(r.src_pages) != len(r.dst_pages):
                r.state = KVPoll.Failed
                r.reason = f"sent {len(r.src_pages)} pages, receiver expects {len(r.dst_pages)}"
                return
            if len(state_indices) != len(r.dst_states):
                r.state = KVPoll.Failed
                r.reason = state_mismatch(state_indices, r.dst_states)
                return
            self._wire.sent_pages[self._room_id] = list(zip(r.src_pages, r.dst_pages))
            self._wire.sent_states[self._room_id] = list(zip(state_indices, r.dst_states))
            # The one-sided write of the metadata slot into the receiver's buffer.
            meta = self._manager.metadata.read(self._metadata_slot)
            if meta is not None and r.dst_manager is not None:
                r.dst_manager.metadata.write(r.dst_metadata_slot, meta)
            r.state = KVPoll.Success

    def abort(self, reason: str) -> None:
        self._wire.fail_room(self._room_id, reason)

    def failure_reason(self) -> str:
        return self._room().reason


class FakeKVReceiver:
    def __init__(self, wire: FakeWire, room_id: int, manager: "FakeKVManager"):
        self._wire = wire
        self._room_id = room_id
        self._manager = manager

    def poll(self) -> KVPoll:
        return self._wire.room(self._room_id).state

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        self._wire.epoch += 1
        r = self._wire.room(self._room_id)
        r.dst_pages = list(page_indices)
        r.dst_states = list(state_indices)
        r.dst_metadata_slot = metadata_slot
        r.dst_manager = self._manager
        r.receiver_ready = True

    def abort(self, reason: str) -> None:
        self._wire.fail_room(self._room_id, reason)

    def failure_reason(self) -> str:
        return self._wire.room(self._room_id).reason


class FakeKVManager:
    def __init__(self, wire: FakeWire):
        self.wire = wire
        self.metadata = DictMetadataStore()

    def poll_epoch(self) -> int:
        return self.wire.epoch

    def create_sender(self, req) -> FakeKVSender:
        return FakeKVSender(self.wire, req.bootstrap_room, self)

    def create_receiver(self, req) -> FakeKVReceiver:
        return FakeKVReceiver(self.wire, req.bootstrap_room, self)

