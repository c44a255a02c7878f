"""The prefill half of the Mooncake backend: per-room transfer info from decode, and the workers
that write KV pages into the decode side's registered buffers.

A room waits in `Bootstrapping` until every decode rank that will read from this rank has sent
its `TransferInfo` (one, or decode_tp / prefill_tp of them), then `WaitingForInput`. Each `send`
queues one chunk on the room's worker (rooms are pinned to a worker, so chunks run in order);
the worker writes the chunk to every real target and, on the last chunk, the metadata slot and
the request's recurrent-state slot (hybrid models) or last hidden state (speculative decoding)
too, then reports `Success` (or `Failed`) to every target over ZMQ.

Peer state stays bounded whatever arrives: heartbeats and aborts count only from decode ranks that
registered (`RegisterDecode`), and a heartbeat's echo goes to the endpoint the rank registered,
never to one a message names. A room that a message creates before this rank's sender exists
(transfer info or an abort that overtook the request) is "unclaimed": at most
`MAX_UNCLAIMED_ROOMS` are kept, each for `unclaimed_ttl_s`. A registered rank silent for the
heartbeat timeout, with no unfinished room, is forgotten and its ZMQ socket closed. A write that
fails fails the room with `WRITE_FAILED` in the reason (and `PEER_LOST` when its decode rank
died: its ZMQ connection is gone too): an HTTP 503, which the router retries once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdsim.core.kvpoll import KVPoll
from runtime.transfer.channel import ChannelError, ZmqChannel
from runtime.transfer.mooncake_engine import MooncakeEngine
from runtime.transfer.layout import (
    HeadSlice, KVArgs, decode_ranks_per_prefill_rank, head_range, head_slice,
    head_slice_descriptors, hidden_descriptors, num_state_slots, page_descriptors,
    state_descriptors,
)
from runtime.protocol.transfer import Abort, Heartbeat, RegisterDecode, Status, TransferInfo
from runtime.streams import PEER_LOST, WRITE_FAILED
from runtime.transfer.state import Epoch, RoomState

log = logging.getLogger(__name__)

MAX_FAILED_ROOMS = 4096  # failed rooms remembered after their sender is gone
MAX_UNCLAIMED_ROOMS = 4096  # rooms messages created before their sender, at most
MAX_PEER_ERRORS = 256  # why recent decode ranks could not register
GONE_CHECK_MS = 50  # after a failed write: how long a decode rank's connection gets to drop
CONNECT_WAIT_MS = 100  # ... and a new socket to it to connect, if it had none


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """How this prefill rank writes into one registered decode rank."""

    reg: RegisterDecode
    piece: HeadSlice | None  # None: whole pages (same heads, or MLA)
    state_piece: HeadSlice | None = None  # None: whole state slots (same heads, or no state)


def plan_peer(local: KVArgs, reg: RegisterDecode) -> PeerPlan:
    """Check that a decode rank's layout is compatible with ours; `ValueError` says why not."""
    problems = []
    for name in ("page_size", "kv_dtype", "is_mla"):
        if getattr(local, name) != getattr(reg, name):
            problems.append(f"{name}: prefill {getattr(local, name)!r}, decode "
                            f"{getattr(reg, name)!r}")
    if not local.is_mla and local.total_kv_heads != reg.total_kv_heads:
        problems.append(f"total_kv_heads: prefill {local.total_kv_heads}, decode "
                        f"{reg.total_kv_heads}")
    n = len(reg.kv_data_ptrs)
    if n != len(local.kv_data_ptrs) or len(reg.kv_item_lens) != n or len(reg.kv_data_lens) != n:
        problems.append(f"KV buffers: prefill {len(local.kv_data_ptrs)}, decode {n} pointers, "
                        f"{len(reg.kv_data_lens)} lengths, {len(reg.kv_item_lens)} item lens")
    if reg.metadata_item_len != local.metadata_item_len:
        problems.append(f"metadata slot: prefill {local.metadata_item_len} bytes, decode "
                        f"{reg.metadata_item_len}")
    for name in ("state_layers", "total_state_heads"):
        if getattr(local, name) != getattr(reg, name):
            problems.append(f"recurrent state {name}: prefill {getattr(local, name)}, decode "
                            f"{getattr(reg, name)}")
    if local.hidden_slot_len != reg.hidden_slot_len:
        problems.append(f"draft hidden state: prefill {local.hidden_slot_len} bytes per "
                        f"request, decode {reg.hidden_slot_len} (0: not speculating)")
    if local.state_len and not local.is_mla and local.tp_size > local.total_kv_heads:
        problems.append(f"prefill TP {local.tp_size} above {local.total_kv_heads} KV heads "
                        "(replicated heads) with a recurrent state is not supported")
    if problems:
        raise ValueError("incompatible decode rank " + reg.session_id + ": " + "; ".join(problems))
    src_heads = (0, 1) if local.is_mla else head_range(local.tp_rank, local.tp_size,
                                                       local.total_kv_heads)
    dst_heads = (0, 1) if reg.is_mla else head_range(reg.tp_rank, reg.tp_size, reg.total_kv_heads)
    state_piece = _plan_state(local, reg)
    if src_heads == dst_heads:
        if tuple(reg.kv_item_lens) != local.kv_item_lens:
            raise ValueError(f"decode rank {reg.session_id} has pages of {reg.kv_item_lens} bytes, "
                             f"prefill {list(local.kv_item_lens)}")
        return PeerPlan(reg, None, state_piece)
    head_bytes = {item // local.page_size // src_heads[1] for item in local.kv_item_lens}
    dst_bytes = {item // reg.page_size // dst_heads[1] for item in reg.kv_item_lens}
    if len(head_bytes) != 1 or head_bytes != dst_bytes:
        raise ValueError(f"head sizes differ: prefill {sorted(head_bytes)} bytes, decode "
                         f"{sorted(dst_bytes)}")
    piece = head_slice(src_heads, dst_heads, head_bytes.pop())
    if piece is None:
        raise ValueError(f"prefill heads {src_heads} and decode rank {reg.tp_rank} heads "
                         f"{dst_heads} do not overlap")
    return PeerPlan(reg, piece, state_piece)


def _plan_state(local: KVArgs, reg: RegisterDecode) -> HeadSlice | None:
    """Where this rank's recurrent-state heads go in the decode rank's slot (None: the whole
    slot, or no state)."""
    if not local.state_len:
        return None
    src = (local.tp_rank * local.state_heads_per_rank, local.state_heads_per_rank)
    dst_count = reg.total_state_heads // reg.tp_size
    dst = (reg.tp_rank * dst_count, dst_count)
    src_head = local.state_slot_len // (local.state_layers * src[1])
    dst_head = reg.state_slot_len // (reg.state_layers * dst[1])
    if src_head != dst_head:
        raise ValueError(f"recurrent-state heads differ: prefill {src_head} bytes, decode "
                         f"{dst_head}")
    if src == dst:
        return None
    piece = head_slice(src, dst, src_head)
    if piece is None:
        raise ValueError(f"prefill state heads {src} and decode rank {reg.tp_rank} state heads "
                         f"{dst} do not overlap")
    return piece


def _state_out_of_range(slots, num_slots: int, who: str) -> str:
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad and not num_slots:
        return f"{who} state slots {bad}, but it keeps no per-request state"
    return f"{who} state slots {bad} outside 0..{num_slots - 1}" if bad else ""


def _out_of_range(pages: np.ndarray, slot: int, data_lens, item_lens, metadata_len: int,
                  metadata_item_len: int) -> str:
    """Why `pages` / `slot` fall outside one side's buffers, or "" if they do not."""
    num_pages = min(length // item for length, item in zip(data_lens, item_lens))
    if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
        return f"pages {pages.min()}..{pages.max()} outside 0..{num_pages - 1}"
    if not 0 <= slot < metadata_len // metadata_item_len:
        return f"metadata slot {slot} outside 0..{metadata_len // metadata_item_len - 1}"
    return ""


@dataclass
class _Room(RoomState):
    room: int = -1
    expected: int = 0  # decode ranks that will send transfer info (0: not known yet)
    infos: dict[int, TransferInfo] = field(default_factory=dict)  # decode tp rank → info
    num_pages: int = -1
    metadata_slot: int = -1
    queued_pages: int = 0
    claimed: bool = True  # False while only messages, no sender, know the room


@dataclass(frozen=True, slots=True)
class _Chunk:
    room: int
    src_pages: np.ndarray
    offset: int  # index of the chunk's first page in the request's page list
    last: bool
    src_states: tuple[int, ...] = ()  # the request's state slots (last chunk only)


class PrefillSide:
    def __init__(self, args: KVArgs, engine: MooncakeEngine, channel: ZmqChannel, epoch: Epoch,
                 num_workers: int, *, unclaimed_ttl_s: float) -> None:
        self.args = args
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self._engine = engine
        self._channel = channel
        self._epoch = epoch
        self._lock = threading.Lock()  # guards everything below; never held across a KV write
        self._rooms: dict[int, _Room] = {}
        self._failed: OrderedDict[int, _Room] = OrderedDict()  # forgotten failed rooms, newest last
        self._peers: dict[str, PeerPlan] = {}  # decode session id → plan
        self._peer_errors: OrderedDict[str, str] = OrderedDict()
        self._last_seen: dict[str, float] = {}
        self._unclaimed: OrderedDict[int, float] = OrderedDict()  # room → created, oldest first
        self.dropped_messages = 0  # heartbeats and aborts from unregistered decode ranks
        self.faults = None  # runtime.faults.TransferFaults: injected failures and a slow NIC
        self._queues = [queue.SimpleQueue() for _ in range(num_workers)]
        self._workers = [threading.Thread(target=self._work, args=(q,), daemon=True,
                                          name=f"kv-send-{i}") for i, q in enumerate(self._queues)]
        for t in self._workers:
            t.start()

    # ---- the sender's view -----------------------------------------------------------------

    def poll(self, room: int) -> KVPoll:
        with self._lock:
            return self._room(room).state

    def failure_reason(self, room: int) -> str:
        with self._lock:
            return self._room(room).reason

    def init(self, room: int, num_pages: int, metadata_slot: int) -> None:
        with self._lock:
            r = self._room(room)
            if r.state is KVPoll.Failed:
                return
            if r.state is KVPoll.Bootstrapping:
                raise RuntimeError(f"room {room}: init before the decode side sent where to write")
            r.num_pages, r.metadata_slot = num_pages, metadata_slot
            a = self.args
            if bad := _out_of_range(np.empty(0), metadata_slot, a.kv_data_lens, a.kv_item_lens,
                                    a.metadata_len, a.metadata_item_len):
                self._fail(r, f"prefill side: {bad}")
                return
            for info in r.infos.values():
                n = len(info.pages())
                if not info.is_dummy and n != num_pages:
                    self._fail(r, f"decode rank {info.decode_tp_rank} allocated {n} pages, "
                                  f"prefill sends {num_pages}")
                    return

    def send(self, room: int, pages, last: bool, state_indices=()) -> None:
        src = np.asarray(pages, dtype=np.int64)
        states = tuple(int(s) for s in state_indices)
        if states and not last:
            raise ValueError(f"room {room}: state_indices {list(states)} go with the last chunk")
        with self._lock:
            r = self._room(room)
            if r.state is KVPoll.Failed:
                return
            if r.num_pages < 0:
                raise RuntimeError(f"room {room}: send before init")
            if r.queued_pages + len(src) > r.num_pages:
                self._fail(r, f"sent {r.queued_pages + len(src)} pages, init said {r.num_pages}")
                return
            a = self.args
            if bad := _out_of_range(src, r.metadata_slot, a.kv_data_lens, a.kv_item_lens,
                                    a.metadata_len, a.metadata_item_len):
                self._fail(r, f"prefill side: {bad}")
                return
            if last and (bad := self._state_mismatch(r, states)):
                self._fail(r, bad)
                return
            chunk = _Chunk(room, src, r.queued_pages, last, states)
            r.queued_pages += len(src)
            self._update(r, KVPoll.Transferring)
        self._queues[hash(room) % len(self._queues)].put(chunk)

    def _state_mismatch(self, r: _Room, states: tuple[int, ...]) -> str:
        """Why the request's state slots do not fit its decode ranks', or "" (lock held)."""
        if bad := _state_out_of_range(states, self.args.num_state_slots, "prefill side:"):
            return bad
        for info in r.infos.values():
            want = len(info.dst_state_slots)
            if not info.is_dummy and want != len(states):
                return (f"prefill sends {len(states)} state slots, the decode side expects "
                        f"{want} (decode rank {info.decode_tp_rank})")
        return ""

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            self._fail(self._room(room), reason)

    def forget(self, room: int) -> None:
        if self.faults is not None:
            self.faults.forget(room)
        with self._lock:
            self._unclaimed.pop(room, None)
            r = self._rooms.pop(room, None)
            if r is not None and r.state is KVPoll.Failed:
                # A decode rank that has not written yet still learns why (its transfer info
                # gets the failure back), instead of waiting for its timeout.
                self._failed[room] = r
                while len(self._failed) > MAX_FAILED_ROOMS:
                    self._failed.popitem(last=False)

    # ---- messages from decode ranks ----------------------------------------------------------

    def on_register(self, msg: RegisterDecode) -> None:
        try:
            plan = plan_peer(self.args, msg)
        except ValueError as exc:
            with self._lock:
                self._peer_errors[msg.session_id] = str(exc)
                while len(self._peer_errors) > MAX_PEER_ERRORS:
                    self._peer_errors.popitem(last=False)
            log.warning("%s", exc)
            return
        with self._lock:
            self._peers[msg.session_id] = plan
            self._peer_errors.pop(msg.session_id, None)
            self._last_seen[msg.session_id] = time.monotonic()

    def on_transfer_info(self, msg: TransferInfo) -> None:
        with self._lock:
            failed = self._failed.get(msg.room)
            if failed is not None:  # this side gave up and forgot the room: say why
                self._report(failed, [msg])
                return
            peer = self._peers.get(msg.session_id)
            if peer is None and msg.session_id not in self._peer_errors \
                    and msg.room not in self._rooms:
                self.dropped_messages += 1  # no sender waits for it, and no one to tell
                return
            r = self._message_room(msg.room)
            r.infos[msg.decode_tp_rank] = msg
            if peer is not None:
                self._last_seen[msg.session_id] = time.monotonic()
            if peer is None:
                self._fail(r, self._peer_errors.get(
                    msg.session_id, f"decode session {msg.session_id} never registered"))
            elif r.state is KVPoll.Failed:
                self._report(r, [msg])  # it arrived after this side gave up: tell it
            elif not msg.is_dummy and (bad := _out_of_range(
                    msg.pages(), msg.metadata_slot, peer.reg.kv_data_lens, peer.reg.kv_item_lens,
                    peer.reg.metadata_len, peer.reg.metadata_item_len)):
                self._fail(r, f"decode rank {msg.decode_tp_rank}: {bad}")
            elif not msg.is_dummy and (bad := _state_out_of_range(
                    msg.dst_state_slots, num_state_slots(peer.reg), "its")):
                self._fail(r, f"decode rank {msg.decode_tp_rank}: {bad}")
            else:
                r.expected = decode_ranks_per_prefill_rank(self.args.tp_size, peer.reg.tp_size)
                if len(r.infos) >= r.expected:
                    self._update(r, KVPoll.WaitingForInput)

    def on_abort(self, msg: Abort) -> None:
        with self._lock:
            if msg.session_id not in self._peers:
                self.dropped_messages += 1
                return
            if msg.room in self._failed:
                return
            r = self._message_room(msg.room)  # an abort may overtake its request
            if not r.done:  # the decode side already knows: no status back
                self._update(r, KVPoll.Failed, f"decode side aborted: {msg.reason}")

    def on_heartbeat(self, msg: Heartbeat) -> None:
        with self._lock:
            peer = self._peers.get(msg.session_id)
            if peer is None:
                self.dropped_messages += 1
                return
            self._last_seen[msg.session_id] = time.monotonic()
        try:
            self._channel.send(peer.reg.endpoint, Heartbeat(
                session_id=self._engine.session_id, endpoint=self._channel.endpoint, reply=True))
        except ChannelError:
            pass

    def check_liveness(self, timeout_s: float) -> None:
        """Fail unfinished rooms whose decode session has been silent for `timeout_s`; forget
        silent decode ranks that no unfinished room needs, and expired unclaimed rooms."""
        now = time.monotonic()
        gone = []
        with self._lock:
            busy = set()
            for r in self._rooms.values():
                silent = max((now - self._last_seen.get(i.session_id, now)
                              for i in r.infos.values()), default=0.0)
                if not r.done and silent > timeout_s:
                    self._fail(r, f"decode side silent for {silent:.1f} s (heartbeat timeout "
                                  f"{timeout_s} s); {PEER_LOST}")
                if not r.done:
                    busy.update(i.session_id for i in r.infos.values())
            for sid, seen in list(self._last_seen.items()):
                if now - seen > timeout_s and sid not in busy:
                    del self._last_seen[sid]
                    peer = self._peers.pop(sid, None)
                    if peer is not None:
                        gone.append(peer.reg.endpoint)
            self._expire_unclaimed(now)
        for endpoint in gone:
            self._channel.forget(endpoint)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @property
    def num_rooms(self) -> int:
        return len(self._rooms)

    # ---- internals (the caller holds the lock) -----------------------------------------------

    def _room(self, room: int) -> _Room:
        """The sender's room (created, or claimed from the messages that came first)."""
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = _Room(room=room)
        elif not r.claimed:
            r.claimed = True
            del self._unclaimed[room]
        return r

    def _message_room(self, room: int) -> _Room:
        """The room a message names; a new one is unclaimed until its sender asks for it."""
        r = self._rooms.get(room)
        if r is None:
            now = time.monotonic()
            self._expire_unclaimed(now)
            r = self._rooms[room] = _Room(room=room, claimed=False)
            self._unclaimed[room] = now
            while len(self._unclaimed) > MAX_UNCLAIMED_ROOMS:
                old, _ = self._unclaimed.popitem(last=False)
                del self._rooms[old]
        return r

    def _expire_unclaimed(self, now: float) -> None:
        while self._unclaimed:
            room, born = next(iter(self._unclaimed.items()))
            if now - born <= self.unclaimed_ttl_s:
                break
            del self._unclaimed[room]
            del self._rooms[room]

    def _update(self, r: _Room, new: KVPoll, reason: str = "") -> None:
        if r.update(new, reason):
            self._epoch.bump()

    def _fail(self, r: _Room, reason: str) -> None:
        """Fail an unfinished room and tell every decode rank we know of."""
        if not r.done:
            self._update(r, KVPoll.Failed, reason)
            self._report(r, list(r.infos.values()))

    def _report(self, r: _Room, infos: list[TransferInfo]) -> None:
        for info in infos:
            peer = self._peers.get(info.session_id)
            if peer is None:
                continue
            try:
                self._channel.send(peer.reg.endpoint, Status(
                    room=r.room, poll=int(r.state), reason=r.reason,
                    prefill_tp_rank=self.args.tp_rank))
            except ChannelError as exc:
                log.warning("room %d: could not report %s: %s", r.room, r.state.name, exc)

    # ---- the workers -------------------------------------------------------------------------

    def _work(self, q: queue.SimpleQueue) -> None:
        while (chunk := q.get()) is not None:
            with self._lock:
                r = self._rooms.get(chunk.room)
                if r is None or r.state is KVPoll.Failed:
                    continue
                targets = [(i, self._peers.get(i.session_id)) for i in r.infos.values()]
                slot = r.metadata_slot
                if any(peer is None for _, peer in targets):
                    self._fail(r, f"a decode rank of this room is no longer registered; "
                                  f"{PEER_LOST}")
                    continue
            try:
                if self.faults is not None:
                    self.faults.before_write(chunk.room)  # raises for an injected failure
                started = time.monotonic()
                for info, peer in targets:
                    if not info.is_dummy:
                        self._write(chunk, info, peer, slot)
                if self.faults is not None:
                    self.faults.after_write(time.monotonic() - started)  # a slow NIC
            except Exception as exc:  # any failure fails the room, never the worker
                gone = self._gone([peer for _, peer in targets])
                with self._lock:
                    self._fail(r, f"{WRITE_FAILED}: {exc}" + (f"; {PEER_LOST}" if gone else ""))
                continue
            if chunk.last:
                with self._lock:
                    if r.state is not KVPoll.Failed:
                        self._update(r, KVPoll.Success)
                        self._report(r, list(r.infos.values()))

    def _gone(self, peers: list[PeerPlan]) -> bool:
        """Whether a decode rank of a failed write has lost its connection (killed or
        restarting). Its death shows the write and the ZMQ connection at about the same moment,
        so a connection still up gets a moment to drop."""
        endpoints = {p.reg.endpoint for p in peers}
        for wait_ms in (0, GONE_CHECK_MS):
            if wait_ms:
                time.sleep(wait_ms / 1000)
            if not all(self._channel.connected(ep, CONNECT_WAIT_MS) for ep in endpoints):
                return True
        return False

    def _write(self, chunk: _Chunk, info: TransferInfo, peer: PeerPlan, slot: int) -> None:
        a, reg = self.args, peer.reg
        dst = info.pages()[chunk.offset:chunk.offset + len(chunk.src_pages)]
        if len(dst) != len(chunk.src_pages):
            raise ValueError(f"decode rank {info.decode_tp_rank} has {len(info.pages())} pages, "
                             f"chunk needs {chunk.offset + len(chunk.src_pages)}")
        if peer.piece is None:
            srcs, dsts, lens = page_descriptors(a.kv_data_ptrs, reg.kv_data_ptrs,
                                                a.kv_item_lens, chunk.src_pages, dst)
        else:
            srcs, dsts, lens = head_slice_descriptors(
                a.kv_data_ptrs, a.kv_item_lens, reg.kv_data_ptrs, reg.kv_item_lens, a.page_size,
                chunk.src_pages, dst, peer.piece)
        if chunk.last:
            srcs.append(a.metadata_ptr + slot * a.metadata_item_len)
            dsts.append(reg.metadata_ptr + info.metadata_slot * reg.metadata_item_len)
            lens.append(a.metadata_item_len)
            s_srcs, s_dsts, s_lens = state_descriptors(
                a.state_ptr, a.state_slot_len, reg.state_ptr, reg.state_slot_len,
                a.state_layers, chunk.src_states, info.dst_state_slots,
                peer.state_piece) if a.state_len else ([], [], [])
            h_srcs, h_dsts, h_lens = hidden_descriptors(
                a.hidden_ptr, reg.hidden_ptr, a.hidden_slot_len, chunk.src_states,
                info.dst_state_slots) if a.hidden_len else ([], [], [])
            srcs += s_srcs + h_srcs
            dsts += s_dsts + h_dsts
            lens += s_lens + h_lens
        self._engine.write(reg.session_id, srcs, dsts, lens)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._workers:
            t.join(timeout=10)
