"""The simulator's transfer backend: the core's KV manager, sender and receiver over a network
model that charges handshake latency and, per KV transfer, a fixed floor plus the time its bytes
and descriptors take on the NICs.

Each DP rank of an instance has one NIC link (per GPU bandwidth × its GPUs, which send their
slices in parallel, at the share of the line rate the protocol reaches). `sharing: fair`
(default): the transfers in flight share every link max-min fairly, each at the smallest fair
share along its path (sender's link and receiver's link), recomputed whenever one starts or
ends (processor sharing). `sharing: fifo`: a chunk occupies both links alone from the moment both
are free. Every transfer also costs `per_descriptor_s` of NIC time per descriptor (one per
buffer and run of pages contiguous on both sides, or per token slot when GQA heads move as
slices across a TP mismatch), spread over the GPUs of the sides that handle them: over RDMA the
sender's alone (its ranks post one-sided writes, which the receiving NIC takes without its
host), over TCP both; alone, a transfer lasts as long as the slower side needs for its bytes
and descriptors (`transfer_work_bytes`),
so prefill and decode on different hardware move the KV at the slower NIC. An instance of
pipeline stages sends from all its stages' NICs at
once, each stage its own layers' KV (`stage_kv_page_bytes`): its link is the stages' NICs
together, at the pace of the stage with the most layers, and its descriptors spread over all its
GPUs. With `enabled: false` the bytes move for free; the per-transfer
floor and the message latencies remain. The floor is latency, not link time: concurrent
transfers overlap their floors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import simpy

from pdsim.core.kvpoll import KVPoll, advance
from pdsim.core.transfer import DictMetadataStore, state_mismatch
from pdsim.sim.events import Call, call_fn, push_after
from pdsim.sim.host import SharedHost
from pdsim.specs.pipeline import stage_layer_ranges


@dataclass(frozen=True)
class Protocol:
    """What a KV transfer over one protocol costs beyond the line rate (docs/cost_model.md)."""

    line_rate_efficiency: float  # share of the NIC's line rate a large transfer reaches
    transfer_floor_s: float  # fixed time of one transfer: posting, completion, status hand-off
    per_descriptor_s: float  # NIC time of one descriptor (one contiguous write) on one GPU's NIC
    sender_posts: bool  # one-sided writes: only the sender handles descriptors


PROTOCOLS = {
    # Mooncake's README: 87 GB/s over 4 x 200 Gb/s RoCE (100 GB/s); the floor is an assumption,
    # and so is the descriptor cost (~10 M work requests a second posted per GPU).
    "rdma": Protocol(line_rate_efficiency=0.87, transfer_floor_s=1.0e-3, per_descriptor_s=0.1e-6,
                     sender_posts=True),
    # Mooncake's README: ~36 GB/s over the same NICs; the floor from benchmarks/pd_overhead.py;
    # the descriptor cost from one sender on a quiet machine: 64 MiB as 65,536 head slices of
    # 1 KiB took 0.86 s against 0.035 s as whole pages, 12.6 us a descriptor. Loopback on 2
    # shared cores costs more (benchmarks/transfer_bench.py's last line); `pdsim calibrate`
    # measures the machine's own figure into `network.per_descriptor_s`.
    "tcp": Protocol(line_rate_efficiency=0.36, transfer_floor_s=2.7e-3, per_descriptor_s=12.6e-6,
                    sender_posts=False),
}


@dataclass(frozen=True)
class NetworkModel:
    enabled: bool = True
    message_latency_s: float = 50e-6  # one ZMQ message between instances
    first_contact_s: float = 2e-3  # HTTP bootstrap lookup + registration, once per pair
    handshake_s: float = 0.58e-3  # per request after the first: lookup + receiver set-up
    transfer_floor_s: float = PROTOCOLS["rdma"].transfer_floor_s  # per chunk sent
    sharing: Literal["fair", "fifo"] = "fair"
    per_descriptor_s: float = PROTOCOLS["rdma"].per_descriptor_s
    sender_posts: bool = PROTOCOLS["rdma"].sender_posts
    # Descriptors of a P -> D transfer, all ranks together (`descriptor_counts`): per run of
    # pages contiguous on both sides, and per page (GQA head slices: per token slot).
    descriptors_per_run: float = 0.0
    descriptors_per_page: float = 0.0


def descriptor_counts(layers: int, kv_buffers_per_layer: int, page_size: int, kv_heads: int,
                      src_attn_tp: int, dst_attn_tp: int, mla: bool) -> tuple[float, float]:
    """(per run, per page) descriptors of one P -> D transfer, summed over ranks, as
    runtime/transfer/layout.py writes them: whole pages merge into one descriptor per buffer
    per contiguous run, per receiving rank (MLA: each decode rank gets the replicated latent;
    GQA with equal attention TP: rank to rank). GQA across a TP mismatch writes each
    overlapping (sender, receiver) rank pair's head slice into every token slot: page_size
    descriptors per page per buffer per pair."""
    buffers = layers * kv_buffers_per_layer
    if mla or src_attn_tp == dst_attn_tp:
        return float(buffers * dst_attn_tp), 0.0
    pairs = max(min(src_attn_tp, kv_heads), min(dst_attn_tp, kv_heads))
    return 0.0, float(buffers * page_size * pairs)


def stage_kv_page_bytes(page_bytes: float, num_layers: int, pp: int) -> list[float]:
    """A page's bytes on the wire per pipeline stage of the sending instance: each stage holds
    and sends the KV of its own layers (pdsim.specs.pipeline), to a decode side of any TP or
    none of PP. The stages' shares add up to the page."""
    return [page_bytes * len(layers) / num_layers
            for layers in stage_layer_ranges(num_layers, pp)]


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
    """Runs of pages contiguous on both sides (each run is one descriptor per buffer).

    Plain Python: a request's few dozen pages, once per transfer, cost NumPy more in array
    set-up than the count itself; both sides one run (the common case) is two list compares."""
    n = len(src_pages)
    if n < 2 or n != len(dst_pages):
        return n
    s0, d0 = src_pages[0], dst_pages[0]
    if (list(src_pages) == list(range(s0, s0 + n))
            and list(dst_pages) == list(range(d0, d0 + n))):
        return 1
    return 1 + sum(1 for s, s_next, d, d_next
                   in zip(src_pages, src_pages[1:], dst_pages, dst_pages[1:])
                   if s_next - s != 1 or d_next - d != 1)


class Link:
    """One instance's NICs: `bytes_per_s` for all its `gpus` together (fair sharing reads the
    flows on it, FIFO books `busy_until`)."""

    def __init__(self, bytes_per_s: float, gpus: int = 1):
        self.bytes_per_s = bytes_per_s
        self.gpus = gpus
        self.busy_until = 0.0


def descriptor_s(src: Link, dst: Link, descriptors: float, per_descriptor_s: float,
                 sender_posts: bool) -> float:
    """NIC time of a transfer's descriptors, spread over each handling side's GPUs in parallel:
    the sender's alone when it posts one-sided writes, else both sides' (the side with fewer
    GPUs takes longer)."""
    gpus = src.gpus if sender_posts else min(src.gpus, dst.gpus)
    return descriptors * per_descriptor_s / gpus


def transfer_work_bytes(src: Link, dst: Link, nbytes: float, descriptors: float,
                        per_descriptor_s: float, sender_posts: bool) -> float:
    """A transfer's work in bytes at the pair's pace, min(src, dst) bytes/s: alone on both
    links it lasts as long as the slower side takes for the bytes and the descriptors it
    handles (the receiver none under one-sided writes). Sides of equal per-GPU bandwidth give
    the sender's bytes plus its descriptor time."""
    rate = min(src.bytes_per_s, dst.bytes_per_s)
    alone_s = max(nbytes / link.bytes_per_s
                  + (0.0 if sender_posts and link is dst else
                     descriptors * per_descriptor_s / link.gpus)
                  for link in (src, dst))
    return alone_s * rate


class _Flow:
    __slots__ = ("src", "dst", "remaining", "rate", "on_sent")

    def __init__(self, src: Link, dst: Link, work_bytes: float, on_sent: Callable[[], None]):
        self.src, self.dst = src, dst
        self.remaining = work_bytes
        self.rate = 0.0
        self.on_sent = on_sent


def max_min_rates(flows: Sequence[_Flow]) -> None:
    """Set each flow's rate to its max-min fair share (progressive filling): the link whose
    remaining capacity over its unfixed flows is smallest fixes those flows at that share."""
    f = flows[0]
    src, dst = f.src, f.dst
    if all(g.src is src and g.dst is dst for g in flows):
        # One pair of links (a lone flow, or one prefill rank sending to one decode rank):
        # the filling below gives every flow an equal share of the slower link.
        rate = min(src.bytes_per_s, dst.bytes_per_s) / len(flows)
        for g in flows:
            g.rate = rate
        return
    capacity: dict[Link, float] = {}
    for f in flows:
        capacity[f.src] = f.src.bytes_per_s
        capacity[f.dst] = f.dst.bytes_per_s
    open_flows = list(flows)
    while open_flows:
        count: dict[Link, int] = {}
        for f in open_flows:
            for link in {f.src, f.dst}:
                count[link] = count.get(link, 0) + 1
        bottleneck = min(count, key=lambda link: capacity[link] / count[link])
        share = capacity[bottleneck] / count[bottleneck]
        rest = []
        for f in open_flows:
            if f.src is bottleneck or f.dst is bottleneck:
                f.rate = share
                for link in {f.src, f.dst}:
                    capacity[link] -= share
            else:
                rest.append(f)
        open_flows = rest


class _Room:
    __slots__ = (
        "sender_state", "receiver_state", "dst_manager", "dst_slot", "reason", "chunks_pending",
        "last_sent", "src_manager", "expected_pages", "sent_pages", "metadata_sent", "dst_pages",
        "dst_states", "ready_s",
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
        self.dst_pages: Sequence[int] = ()
        self.dst_states: Sequence[int] = ()
        self.ready_s = math.inf  # when the sender learnt the decode side's pages (WaitingForInput)


class SimFabric:
    """All instances' endpoints meet here by room, as real ones meet through the bootstrap server."""

    def __init__(self, env: simpy.Environment, model: NetworkModel):
        self.env = env
        self.model = model
        self.rooms: dict[int, _Room] = {}
        self.kv_bytes = 0.0  # KV bytes sent over the fabric so far
        self._contacted: set[tuple[int, int]] = set()
        self._contacting: dict[tuple[int, int], list] = {}  # first contacts under way
        self._flows: list[_Flow] = []  # fair sharing: transfers whose bytes are on the wire
        self._flows_at_s = 0.0  # when `remaining` was last brought up to date
        self._next_end = None  # the pending timeout that ends the next flow
        self.faults = None  # a pdsim.sim.faults.SimFaults when faults are injected
        self.host: SharedHost | None = None  # shared host cores, where the cluster has them

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
        """Call `fn()` `delay` seconds from now (ordered as a SimPy timeout made now)."""
        push_after(self.env, delay, Call(call_fn, fn))

    def host_later(self, delay: float, fn: Callable[[], None]) -> None:
        """`later` for a delay that is host CPU work (a handshake's set-up, a transfer's floor):
        on shared host cores it is work among the forwards (pdsim/sim/host.py)."""
        if self.host is None:
            self.later(delay, fn)
        else:
            self.host.after_work(delay, fn)

    def handshake(self, decode_id: int, prefill_id: int, receiver: "SimKVReceiver") -> None:
        """Make `receiver` ready as SGLang's receiver gets ready: at once for a prefill
        instance this decode instance has met (`handshake_s` then delays its TransferInfo);
        after `first_contact_s` (HTTP lookup and registration) for the first request of a
        pair, and for every request of that pair behind it until then, in their order."""
        key = (decode_id, prefill_id)
        waiting = self._contacting.get(key)
        if waiting is not None:
            waiting.append(receiver)
        elif key in self._contacted:
            receiver.setup_s = self.model.handshake_s
            receiver._handshake_done()
        else:
            self._contacted.add(key)
            self._contacting[key] = [receiver]
            self.host_later(self.model.first_contact_s, lambda: self._contact_done(key))

    def _contact_done(self, key: tuple[int, int]) -> None:
        for receiver in self._contacting.pop(key):
            receiver._handshake_done()

    def transfer(self, src: Link, dst: Link, nbytes: float, descriptors: float,
                 on_landed: Callable[[], None]) -> None:
        """Move `nbytes` (plus `descriptors` writes) from `src` to `dst`; `on_landed` runs when
        the last byte has landed and the transfer's floor has passed."""
        self.kv_bytes += nbytes
        floor = self.model.transfer_floor_s
        done = lambda: self.host_later(floor, on_landed)  # noqa: E731
        if not self.model.enabled:
            done()
            return
        if math.isinf(min(src.bytes_per_s, dst.bytes_per_s)):  # a link without a limit
            self.later(descriptor_s(src, dst, descriptors, self.model.per_descriptor_s,
                                    self.model.sender_posts), done)
            return
        work = transfer_work_bytes(src, dst, nbytes, descriptors, self.model.per_descriptor_s,
                                   self.model.sender_posts)
        if self.model.sharing == "fifo":
            now = self.env.now
            start = max(now, src.busy_until, dst.busy_until)
            src.busy_until = dst.busy_until = start + work / min(src.bytes_per_s, dst.bytes_per_s)
            self.later(src.busy_until - now, done)
            return
        self._advance()
        self._flows.append(_Flow(src, dst, work, done))
        self._reshare()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._flows_at_s
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
        self._flows_at_s = now

    def _reshare(self) -> None:
        if not self._flows:
            return
        flows = self._flows
        max_min_rates(flows)
        if len(flows) == 1:  # the usual case: the min below without its generator
            wait = flows[0].remaining / flows[0].rate
        else:
            wait = min(f.remaining / f.rate for f in flows)
        wait = max(0.0, wait)
        self._next_end = Call(self._flow_ends)
        push_after(self.env, wait, self._next_end)

    def _flow_ends(self, ev) -> None:
        if ev is not self._next_end:
            return  # superseded by a later start or end
        self._advance()
        # Done: within a picosecond of its last byte (what float rounding leaves over).
        ended, going = [], []
        for f in self._flows:
            (ended if f.remaining <= f.rate * 1e-12 else going).append(f)
        self._flows = going
        self._reshare()
        for f in ended:
            f.on_sent()

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
        self.state_bytes_per_request = state_bytes_per_request  # lands with the last chunk
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
        # SGLang's receiver is ready within the scheduler iteration that took the request in,
        # so its pages can be taken at once (`SimFabric.handshake`).
        self.fabric.handshake(self.instance_key, req.prefill_instance, receiver)
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

    @property
    def ready_s(self) -> float:
        """When the bootstrap finished (the decode side's pages reached the sender): the
        earliest its request can enter a forward (inf until then)."""
        return self.room.ready_s

    def init(self, num_pages: int, metadata_slot: int) -> None:
        room = self.room
        room.expected_pages = num_pages
        self._metadata_slot = metadata_slot

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        room = self.room
        if room.sender_state is KVPoll.Failed:
            return
        if last and len(state_indices) != len(room.dst_states):
            self.fabric.fail(room, state_mismatch(state_indices, room.dst_states))
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
        nbytes = len(page_indices) * dst.bytes_per_page  # what lands: the receiver's slices
        if last:
            nbytes += dst.state_bytes_per_request
        model = self.fabric.model
        first = room.sent_pages - len(page_indices)
        dst_pages = room.dst_pages[first:room.sent_pages]
        descriptors = (model.descriptors_per_page * len(page_indices)
                       + model.descriptors_per_run * page_runs(page_indices, dst_pages))
        room.chunks_pending += 1
        self.fabric.transfer(self.manager.link, dst.link, nbytes, descriptors, self._chunk_landed)

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
    setup_s = 0.0  # receiver set-up left when it sends its TransferInfo (a known prefill)

    def poll(self) -> KVPoll:
        return self.room.receiver_state

    def _handshake_done(self) -> None:
        room = self.room
        room.receiver_state = advance(room.receiver_state, KVPoll.WaitingForInput)
        self.manager.changed()

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        room = self.room
        room.dst_slot = metadata_slot
        room.dst_pages = page_indices
        room.dst_states = state_indices
        room.receiver_state = advance(room.receiver_state, KVPoll.Transferring)
        self.manager.epoch += 1
        fabric = self.fabric
        if self.setup_s and fabric.host is not None:  # host work, then the message
            fabric.host.after_work(self.setup_s, lambda: fabric.later(
                fabric.model.message_latency_s, self._metadata_arrived))
        else:
            fabric.later(self.setup_s + fabric.model.message_latency_s, self._metadata_arrived)

    def _metadata_arrived(self) -> None:
        room = self.room
        room.sender_state = advance(room.sender_state, KVPoll.WaitingForInput)
        room.ready_s = self.fabric.env.now
        if room.src_manager is not None:
            room.src_manager.changed()
