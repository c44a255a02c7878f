"""The simulator's transfer backend: the core's KV manager, sender and receiver over a network
model that charges handshake latency and, per KV transfer, a fixed floor plus bytes / bandwidth.

Each instance has one NIC link (per GPU bandwidth × GPUs that send in parallel, at the share of
the line rate the protocol reaches). A chunk occupies the sender's and the receiver's link from
the moment both are free: FIFO sharing of the bottleneck, enough to see a network that cannot
carry the KV. With `enabled: false` the bytes move for free (NVLink-attached or a what-if); the
per-transfer floor and the message latencies remain. The floor is latency, not link time:
concurrent transfers overlap their floors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import simpy

from pdsim.core.kvpoll import KVPoll, advance
from pdsim.core.transfer import DictMetadataStore


@dataclass(frozen=True)
class Protocol:
    """What a KV transfer over one protocol costs beyond the line rate (docs/cost_model.md)."""

    line_rate_efficiency: float  # share of the NIC's line rate a large transfer reaches
    transfer_floor_s: float  # fixed time of one transfer: posting, completion, status hand-off


PROTOCOLS = {
    # Mooncake's README: 87 GB/s over 4 x 200 Gb/s RoCE (100 GB/s); the floor is an assumption.
    "rdma": Protocol(line_rate_efficiency=0.87, transfer_floor_s=1.0e-3),
    # Mooncake's README: ~36 GB/s over the same NICs; the floor from benchmarks/pd_overhead.py.
    "tcp": Protocol(line_rate_efficiency=0.36, transfer_floor_s=2.7e-3),
}


@dataclass(frozen=True)
class NetworkModel:
    enabled: bool = True
    message_latency_s: float = 50e-6  # one ZMQ message between instances
    first_contact_s: float = 2e-3  # HTTP bootstrap lookup + registration, once per pair
    handshake_s: float = 0.58e-3  # per request after the first: lookup + receiver set-up
    transfer_floor_s: float = PROTOCOLS["rdma"].transfer_floor_s  # per chunk sent


class Link:
    """A NIC shared first come, first served; `SimFabric.transfer_end` books it."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self.busy_until = 0.0


class _Room:
    __slots__ = (
        "sender_state", "receiver_state", "dst_manager", "dst_slot", "reason", "chunks_pending",
        "last_sent", "src_manager", "expected_pages", "sent_pages", "metadata_sent",
    )

    def __init__(self) -> None:
        self.sender_state = KVPoll.Bootstrapping
        self.receiver_state = KVPoll.Bootstrapping
        self.src_manager: SimKVManager | None = None
        self.dst_manager: SimKVManager | None = None
        self.dst_slot = -1
        self.reason = ""
        self.chunks_pending = 0
        self.last_sent = False
        self.expected_pages = -1
        self.sent_pages = 0
        self.metadata_sent = None


class SimFabric:
    """All instances' endpoints meet here by room, as real ones meet through the bootstrap server."""

    def __init__(self, env: simpy.Environment, model: NetworkModel):
        self.env = env
        self.model = model
        self.rooms: dict[int, _Room] = {}
        self.kv_bytes = 0.0  # KV bytes sent over the fabric so far
        self._contacted: set[tuple[int, int]] = set()
        self.faults = None  # a pdsim.sim.faults.SimFaults when faults are injected

    def join(self, room_id: int, *, sender: "SimKVManager | None" = None,
             receiver: "SimKVManager | None" = None) -> _Room:
        """The room both endpoints of `room_id` share; forgotten once both have joined."""
        r = self.rooms.get(room_id)
        if r is None:
            r = self.rooms[room_id] = _Room()
        if sender is not None:
            r.src_manager = sender
        if receiver is not None:
            r.dst_manager = receiver
        if r.src_manager is not None and r.dst_manager is not None:
            del self.rooms[room_id]
        return r

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _ev: fn())

    def handshake_delay(self, decode_id: int, prefill_id: int) -> float:
        key = (decode_id, prefill_id)
        if key in self._contacted:
            return self.model.handshake_s
        self._contacted.add(key)
        return self.model.first_contact_s

    def transfer_end(self, src: Link, dst: Link, nbytes: float) -> float:
        """Reserve both links for `nbytes`; the simulated time the last byte lands."""
        now = self.env.now
        self.kv_bytes += nbytes
        if not self.model.enabled:
            return now + self.model.transfer_floor_s
        start = max(now, src.busy_until, dst.busy_until)
        sent = start + nbytes / min(src.bytes_per_s, dst.bytes_per_s)
        src.busy_until = dst.busy_until = sent
        return sent + self.model.transfer_floor_s

    def fail(self, r: _Room, reason: str) -> None:
        if r.sender_state is KVPoll.Failed and r.receiver_state is KVPoll.Failed:
            return
        r.reason = r.reason or reason
        r.sender_state = r.receiver_state = KVPoll.Failed
        for m in (r.src_manager, r.dst_manager):
            if m is not None:
                m.changed()


class SimKVManager:
    """One per instance rank; `changed()` marks that a poll may answer differently and wakes
    the instance's driver."""

    def __init__(self, fabric: SimFabric, instance_key: int, link: Link, bytes_per_page: float,
                 notify: Callable[[], None], state_bytes_per_request: float = 0.0):
        self.fabric = fabric
        self.instance_key = instance_key
        self.link = link
        self.bytes_per_page = bytes_per_page
        self.state_bytes_per_request = state_bytes_per_request  # with the last chunk
        self._notify = notify
        self.epoch = 0
        self.metadata = DictMetadataStore()

    def changed(self) -> None:
        self.epoch += 1
        self._notify()

    def poll_epoch(self) -> int:
        return self.epoch

    def create_sender(self, req) -> "SimKVSender":
        sender = SimKVSender(self, self.fabric.join(req.bootstrap_room, sender=self))
        if self.fabric.faults is not None:
            self.fabric.faults.sender_created(req, sender.room)
        return sender

    def create_receiver(self, req) -> "SimKVReceiver":
        receiver = SimKVReceiver(self, self.fabric.join(req.bootstrap_room, receiver=self))
        delay = self.fabric.handshake_delay(self.instance_key, req.prefill_instance)
        self.fabric.later(delay, receiver._handshake_done)
        return receiver


class _Endpoint:
    def __init__(self, manager: SimKVManager, room: _Room):
        self.manager = manager
        self.fabric = manager.fabric
        self.room = room

    def abort(self, reason: str) -> None:
        self.fabric.fail(self.room, reason)

    def failure_reason(self) -> str:
        return self.room.reason


class SimKVSender(_Endpoint):
    def poll(self) -> KVPoll:
        return self.room.sender_state

    def init(self, num_pages: int, metadata_slot: int) -> None:
        room = self.room
        room.expected_pages = num_pages
        self._metadata_slot = metadata_slot

    def send(self, page_indices: Sequence[int], last: bool) -> None:
        room = self.room
        if room.sender_state is KVPoll.Failed:
            return
        if self.fabric.faults is not None and (reason := self.fabric.faults.drops(room)):
            self.fabric.fail(room, reason)  # before any byte moves, as the real sender does
            return
        room.sender_state = advance(room.sender_state, KVPoll.Transferring)
        self.manager.epoch += 1
        room.sent_pages += len(page_indices)
        if last:
            room.last_sent = True
            room.metadata_sent = self.manager.metadata.read(self._metadata_slot)
        dst = room.dst_manager
        nbytes = len(page_indices) * self.manager.bytes_per_page
        if last:
            nbytes += self.manager.state_bytes_per_request
        end = self.fabric.transfer_end(self.manager.link, dst.link, nbytes)
        room.chunks_pending += 1
        self.fabric.later(end - self.fabric.env.now, self._chunk_landed)

    def _chunk_landed(self) -> None:
        room = self.room
        room.chunks_pending -= 1
        if room.sender_state is KVPoll.Failed or room.chunks_pending or not room.last_sent:
            return
        if room.sent_pages != room.expected_pages:
            self.fabric.fail(
                room,
                f"sent {room.sent_pages} pages, the receiver expects {room.expected_pages}",
            )
            return
        room.dst_manager.metadata.write(room.dst_slot, room.metadata_sent)
        room.sender_state = KVPoll.Success
        self.manager.changed()
        # The status message reaches the decode side one latency later.
        self.fabric.later(self.fabric.model.message_latency_s, self._receiver_success)

    def _receiver_success(self) -> None:
        room = self.room
        if room.receiver_state is not KVPoll.Failed:
            room.receiver_state = KVPoll.Success
            room.dst_manager.changed()


class SimKVReceiver(_Endpoint):
    def poll(self) -> KVPoll:
        return self.room.receiver_state

    def _handshake_done(self) -> None:
        room = self.room
        room.receiver_state = advance(room.receiver_state, KVPoll.WaitingForInput)
        self.manager.changed()

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int) -> None:
        room = self.room
        room.dst_slot = metadata_slot
        room.receiver_state = advance(room.receiver_state, KVPoll.Transferring)
        self.manager.epoch += 1
        self.fabric.later(self.fabric.model.message_latency_s, self._metadata_arrived)

    def _metadata_arrived(self) -> None:
        room = self.room
        room.sender_state = advance(room.sender_state, KVPoll.WaitingForInput)
        if room.src_manager is not None:
            room.src_manager.changed()
