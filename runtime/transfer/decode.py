"""The decode half of the Mooncake backend: find the prefill ranks of a room, register with them
once, tell them where to write, and collect their status reports.

A room starts in `Bootstrapping` while a background thread asks the prefill instance's bootstrap
server for its parallel info and rank addresses (cached per server), checks the KV layouts match
and sends this rank's one-time `RegisterDecode` to each new prefill rank; then `WaitingForInput`.
A room whose prefill ranks are all cached and registered with starts in `WaitingForInput`.
`send_metadata` sends a `TransferInfo` to every target (`Transferring`); the room is `Success`
once every target prefill rank has reported success.

A prefill rank is lost when a frame to it cannot be handed over (the channel queues frames only
while connected: a killed or restarted rank fails the next heartbeat or transfer info at once) or
when it stops echoing heartbeats for `heartbeat_timeout_s`. Then its registration, its cached
bootstrap answers and its socket are dropped; rooms whose transfer info went to it fail with
`PEER_LOST` in the reason (an HTTP 503: retry), and a room about to send to it looks its prefill
instance up again instead: a restarted instance registers anew with its bootstrap server (same
address, new rank endpoints), and the room's transfer info goes to the new ranks, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdsim.core.kvpoll import KVPoll
from runtime.transfer.bootstrap_server import (
    BootstrapClient, BootstrapError, ParallelInfo, RankRegistration, check_compatible,
)
from runtime.security import ClusterKey
from runtime.streams import PEER_LOST
from runtime.transfer.channel import ChannelError, ZmqChannel
from runtime.transfer.layout import KVArgs, Target, plan_targets
from runtime.protocol.transfer import (
    Abort, Heartbeat, RegisterDecode, Status, TransferInfo, pack_pages,
)
from runtime.transfer.state import Epoch, RoomState

log = logging.getLogger(__name__)

MAX_LOST_ENDPOINTS = 1024  # lost prefill endpoints remembered, so nothing waits on them again


@dataclass(frozen=True, slots=True)
class _Peer:
    target: Target
    endpoint: str  # the prefill rank's ZMQ PULL socket


@dataclass
class _Room(RoomState):
    host: str = ""  # the prefill instance's bootstrap server
    port: int = 0
    peers: list[_Peer] = field(default_factory=list)
    succeeded: set[int] = field(default_factory=set)  # prefill tp ranks that reported success
    resolving: bool = True  # a bootstrap lookup (the first, or after a lost peer) is running
    forgotten: bool = False  # its receiver is gone: drop the room once the lookup ends


def _endpoint(reg: RankRegistration) -> str:
    return f"tcp://{reg.ip}:{reg.zmq_port}"


class _Server:
    """What one prefill instance's bootstrap server told us (filled lazily, then cached)."""

    def __init__(self, client: BootstrapClient) -> None:
        self.client = client
        self.info: ParallelInfo | None = None
        self.ranks: dict[tuple[int, int], RankRegistration] = {}


class DecodeSide:
    def __init__(self, args: KVArgs, session_id: str, channel: ZmqChannel, epoch: Epoch, *,
                 handshake_timeout_s: float, bootstrap_threads: int = 4,
                 key: ClusterKey | None = None) -> None:
        self.args = args
        self._key = key
        self._session_id = session_id
        self._channel = channel
        self._epoch = epoch
        self._timeout_s = handshake_timeout_s  # transfer.handshake_timeout_s
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._servers: dict[tuple[str, int], _Server] = {}
        self._server_lock = threading.Lock()
        self._registered: set[str] = set()  # prefill endpoints that have our RegisterDecode
        self._register_lock = threading.Lock()
        self._last_echo: dict[str, float] = {}
        self._lost: OrderedDict[str, None] = OrderedDict()  # lost endpoints, newest last
        self._pool = ThreadPoolExecutor(bootstrap_threads, thread_name_prefix="kv-bootstrap")

    # ---- the receiver's view ---------------------------------------------------------------

    def start(self, room: int, host: str, port: int) -> None:
        """A receiver for a prefill instance this rank has met and registered with is ready at
        once, as SGLang's (`MooncakeKVReceiver.__init__` finds it in its cache and ends in
        `WaitingForInput`), so the scheduler can take its pages in the same iteration; any
        other is looked up on a thread."""
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} already has a receiver on this rank")
            r = self._rooms[room] = _Room(host=host, port=port)
        peers = self._known_peers(room, host, port)
        if peers is None:
            self._pool.submit(self._bootstrap, room, host, port)
            return
        with self._lock:
            r.peers = peers
            self._update(r, KVPoll.WaitingForInput)
            self._resolved(room, r)

    def poll(self, room: int) -> KVPoll:
        with self._lock:
            return self._rooms[room].state

    def failure_reason(self, room: int) -> str:
        with self._lock:
            return self._rooms[room].reason

    def send_metadata(self, room: int, pages, metadata_slot: int, state_indices=()) -> None:
        data, dtype = pack_pages(pages)
        states = [int(s) for s in state_indices]
        with self._lock:
            r = self._rooms[room]
            if r.state is KVPoll.Failed:
                return
            if r.state is not KVPoll.WaitingForInput:
                raise RuntimeError(f"room {room}: send_metadata in state {r.state.name}, "
                                   "expected WaitingForInput")
            self._update(r, KVPoll.Transferring)
            peers = list(r.peers)
        lost = self._send_info(room, peers, data, dtype, metadata_slot, states)
        if not lost:
            return
        with self._lock:
            if r.done:
                return
            r.resolving = True  # the lookup thread owns it now; `_lose` leaves it alone
        self._lose(lost)
        self._pool.submit(self._resend, room, data, dtype, metadata_slot, states)

    def _send_info(self, room: int, peers: list[_Peer], data: bytes, dtype: str,
                   metadata_slot: int, states: list[int]) -> dict[str, str]:
        """Send a room's `TransferInfo` to each peer; the lost ones (endpoint: why)."""
        lost = {}
        for p in peers:
            why = self._send(p.endpoint, TransferInfo(
                room=room, session_id=self._session_id, decode_tp_rank=self.args.tp_rank,
                dst_pages=b"" if p.target.is_dummy else data, page_dtype=dtype,
                metadata_slot=metadata_slot, is_dummy=p.target.is_dummy,
                dst_state_slots=[] if p.target.is_dummy else states))
            if why:
                lost[p.endpoint] = why
        return lost

    def _send(self, endpoint: str, msg) -> str:
        """Hand `msg` to a prefill rank: "" if done, else why not (a lost rank is not tried:
        a new socket to it would wait for a connection that never comes)."""
        with self._lock:
            if endpoint in self._lost:
                return "lost earlier"
        try:
            self._channel.send(endpoint, msg)
        except ChannelError as exc:
            return str(exc)
        return ""

    def _resend(self, room: int, data: bytes, dtype: str, metadata_slot: int,
                states: list[int]) -> None:
        """A room's transfer info met a lost peer: look the prefill instance up afresh (a
        restarted one has registered its new ranks) and send it there. Once: a room sends its
        transfer info from `WaitingForInput` only."""
        with self._lock:
            r = self._rooms[room]  # kept while `resolving`
            host, port = r.host, r.port
        try:
            peers = self._peers(room, host, port)
            lost = self._send_info(room, peers, data, dtype, metadata_slot, states)
            if lost:
                self._lose(lost)
                raise ChannelError(next(iter(lost.values())))
        except Exception as exc:  # the room fails; the thread lives on
            with self._lock:
                self._update(r, KVPoll.Failed, f"prefill instance at {host}:{port} lost and not "
                                               f"back: {exc}; {PEER_LOST}")
                self._resolved(room, r)
            return
        log.info("room %d: transfer info sent again, to the prefill ranks now registered at "
                 "%s:%d", room, host, port)
        with self._lock:
            r.peers = peers
            aborted = r.state is KVPoll.Failed
            reason = r.reason
            self._resolved(room, r)
        if aborted:  # the receiver gave up meanwhile
            self._tell_abort(room, reason, peers)

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms[room]
            if r.done:
                return
            self._update(r, KVPoll.Failed, reason)
            peers = list(r.peers)
        self._tell_abort(room, reason, peers)

    def forget(self, room: int) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.resolving:
                # The lookup still has to tell the prefill ranks if the room was aborted
                # meanwhile (a request refused or cancelled during its handshake).
                r.forgotten = True
                return
            self._rooms.pop(room, None)

    # ---- messages from prefill ranks ---------------------------------------------------------

    def on_status(self, msg: Status) -> None:
        with self._lock:
            r = self._rooms.get(msg.room)
            if r is None:
                return
            if msg.poll == KVPoll.Failed:
                self._update(r, KVPoll.Failed, f"prefill rank {msg.prefill_tp_rank}: {msg.reason}")
            elif msg.poll == KVPoll.Success:
                r.succeeded.add(msg.prefill_tp_rank)
                if r.peers and r.succeeded >= {p.target.prefill_tp_rank for p in r.peers}:
                    self._update(r, KVPoll.Success)

    def on_heartbeat(self, msg: Heartbeat) -> None:
        with self._lock:
            if msg.endpoint in self._last_echo:  # not one we already gave up on
                self._last_echo[msg.endpoint] = time.monotonic()

    def send_heartbeats(self) -> None:
        with self._register_lock:
            endpoints = list(self._registered)
        beat = Heartbeat(session_id=self._session_id, endpoint=self._channel.endpoint, reply=False)
        lost = {}
        for endpoint in endpoints:
            if why := self._send(endpoint, beat):
                lost[endpoint] = why
        if lost:  # not connected any more: killed or restarted, no need to wait for the timeout
            self._lose(lost)

    def check_liveness(self, timeout_s: float) -> None:
        """Lose the prefill ranks that stopped echoing heartbeats for `timeout_s`."""
        now = time.monotonic()
        with self._lock:
            silent = {ep: now - seen for ep, seen in self._last_echo.items()
                      if now - seen > timeout_s}
        if silent:
            self._lose({ep: f"silent for {s:.1f} s (heartbeat timeout {timeout_s} s)"
                        for ep, s in silent.items()})

    def _lose(self, lost: dict[str, str]) -> None:
        """Stop talking to prefill ranks that are gone (endpoint: why): fail the unfinished
        rooms whose transfer info went to them, drop their registration, the bootstrap answers
        that named them (a restarted instance listens elsewhere: ask again) and their sockets.
        Rooms not yet sent, or being looked up anew, are left to find the new ranks."""
        with self._lock:
            for ep in lost:
                self._last_echo.pop(ep, None)
                self._lost[ep] = None
                self._lost.move_to_end(ep)
            while len(self._lost) > MAX_LOST_ENDPOINTS:
                self._lost.popitem(last=False)
            for r in self._rooms.values():
                if r.state is not KVPoll.Transferring or r.resolving:
                    continue
                for p in r.peers:
                    if p.endpoint in lost:
                        self._update(r, KVPoll.Failed, (
                            f"prefill rank {p.target.prefill_tp_rank} at {p.endpoint} lost "
                            f"({lost[p.endpoint]}); {PEER_LOST}"))
                        break
        for ep, why in lost.items():
            log.warning("prefill rank at %s lost: %s", ep, why)
        with self._register_lock:
            self._registered -= set(lost)
        with self._server_lock:
            for key, server in list(self._servers.items()):
                if any(_endpoint(reg) in lost for reg in server.ranks.values()):
                    del self._servers[key]
        for ep in lost:
            self._channel.forget(ep)

    # ---- bootstrap ---------------------------------------------------------------------------

    def _bootstrap(self, room: int, host: str, port: int) -> None:
        try:
            peers = self._peers(room, host, port)
        except Exception as exc:  # the room fails; the thread lives on
            gone = isinstance(exc, ChannelError) or (isinstance(exc, BootstrapError)
                                                     and exc.unavailable)
            with self._lock:
                r = self._rooms.get(room)
                if r is not None:
                    self._update(r, KVPoll.Failed, f"bootstrap with {host}:{port} failed: {exc}"
                                                   + (f"; {PEER_LOST}" if gone else ""))
                    self._resolved(room, r)
            return
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            r.peers = peers
            aborted = r.state is KVPoll.Failed
            self._update(r, KVPoll.WaitingForInput)
            reason = r.reason
            self._resolved(room, r)
        if aborted:  # the receiver gave up while we were looking the peers up
            self._tell_abort(room, reason, peers)

    def _resolved(self, room: int, r: _Room) -> None:
        """The lookup ended (the caller holds `_lock`): a forgotten room goes now."""
        r.resolving = False
        if r.forgotten:
            del self._rooms[room]

    def _peers(self, room: int, host: str, port: int) -> list[_Peer]:
        """The room's prefill ranks, registered with; looked up afresh once if a cached one
        turns out to be lost."""
        try:
            return self._resolve(room, host, port)
        except ChannelError:
            return self._resolve(room, host, port)

    def _cancelled(self, room: int) -> Callable[[], bool]:
        """Whether the room's lookup is still wanted (a bootstrap server that is down is
        retried until then)."""
        def cancelled() -> bool:
            with self._lock:
                r = self._rooms.get(room)
                return r is None or r.forgotten or r.state is KVPoll.Failed
        return cancelled

    def _targets(self, info: ParallelInfo) -> list[Target]:
        if info.pp_size != 1:
            raise NotImplementedError(f"prefill pipeline parallelism (pp_size={info.pp_size}) is "
                                      "not supported by the Mooncake backend yet")
        return plan_targets(self.args.tp_rank, self.args.tp_size, info.tp_size,
                            is_mla=self.args.is_mla, total_heads=self.args.total_kv_heads)

    def _known_peers(self, room: int, host: str, port: int) -> list[_Peer] | None:
        """The room's peers from the cache alone, or None if anything would need the network:
        the instance not looked up yet, a rank not asked for, or one not registered with."""
        with self._server_lock:
            server = self._servers.get((host, port))
            if server is None or server.info is None or server.info.pp_size != 1:
                return None
            dp_rank = room % server.info.dp_size
            targets = self._targets(server.info)
            regs = [server.ranks.get((dp_rank, t.prefill_tp_rank)) for t in targets]
        if None in regs:
            return None
        peers = [_Peer(t, _endpoint(reg)) for t, reg in zip(targets, regs)]
        with self._register_lock:  # a lost rank is dropped from it (`_lose`)
            known = all(p.endpoint in self._registered for p in peers)
        return peers if known else None

    def _resolve(self, room: int, host: str, port: int) -> list[_Peer]:
        cancelled = self._cancelled(room)
        server = self._server(host, port, cancelled)
        info = server.info
        dp_rank = room % info.dp_size
        peers = []
        for t in self._targets(info):
            key = (dp_rank, t.prefill_tp_rank)
            reg = server.ranks.get(key)
            if reg is None:
                reg = server.client.rank(dp_rank, t.prefill_tp_rank, 0, cancelled)
                with self._server_lock:
                    server.ranks[key] = reg
                with self._lock:  # the bootstrap server's answer is the truth now
                    self._lost.pop(_endpoint(reg), None)
            endpoint = _endpoint(reg)
            try:
                self._ensure_registered(endpoint)
            except ChannelError as exc:
                self._lose({endpoint: str(exc)})
                raise
            peers.append(_Peer(t, endpoint))
        return peers

    def _server(self, host: str, port: int, cancelled: Callable[[], bool]) -> _Server:
        with self._server_lock:
            server = self._servers.get((host, port))
            if server is not None and server.info is not None:
                return server
        server = _Server(BootstrapClient(host, port, timeout_s=self._timeout_s, key=self._key))
        info = server.client.parallel_info(cancelled)
        check_compatible(info, page_size=self.args.page_size, kv_dtype=self.args.kv_dtype)
        if info.is_mla != self.args.is_mla:
            raise ValueError(f"prefill is_mla={info.is_mla}, decode is_mla={self.args.is_mla}")
        if not info.is_mla and info.total_kv_heads != self.args.total_kv_heads:
            raise ValueError(f"prefill has {info.total_kv_heads} KV heads, decode "
                             f"{self.args.total_kv_heads}")
        server.info = info
        with self._server_lock:
            return self._servers.setdefault((host, port), server)

    def _ensure_registered(self, endpoint: str) -> None:
        a = self.args
        with self._register_lock:  # held while sending, so no TransferInfo can overtake it
            if endpoint in self._registered:
                return
            self._channel.send(endpoint, RegisterDecode(
                session_id=self._session_id, endpoint=self._channel.endpoint, tp_rank=a.tp_rank,
                tp_size=a.tp_size, kv_data_ptrs=list(a.kv_data_ptrs),
                kv_data_lens=list(a.kv_data_lens), kv_item_lens=list(a.kv_item_lens),
                metadata_ptr=a.metadata_ptr, metadata_len=a.metadata_len,
                metadata_item_len=a.metadata_item_len, page_size=a.page_size,
                kv_dtype=a.kv_dtype, is_mla=a.is_mla, total_kv_heads=a.total_kv_heads,
                kv_heads_per_rank=a.kv_heads_per_rank, state_ptr=a.state_ptr,
                state_len=a.state_len, state_slot_len=a.state_slot_len,
                state_layers=a.state_layers, total_state_heads=a.total_state_heads,
                hidden_ptr=a.hidden_ptr, hidden_len=a.hidden_len,
                hidden_slot_len=a.hidden_slot_len))
            self._registered.add(endpoint)
            with self._lock:
                self._last_echo.setdefault(endpoint, time.monotonic())

    def _update(self, r: _Room, new: KVPoll, reason: str = "") -> None:
        """Caller holds `_lock`."""
        if r.update(new, reason):
            self._epoch.bump()

    def _tell_abort(self, room: int, reason: str, peers: list[_Peer]) -> None:
        for p in peers:
            if why := self._send(p.endpoint, Abort(room=room, reason=reason,
                                                   session_id=self._session_id)):
                log.info("room %d: abort not sent to %s: %s", room, p.endpoint, why)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
