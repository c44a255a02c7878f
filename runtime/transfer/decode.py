"""The decode half of the Mooncake backend: find the prefill ranks of a room, register with them
once, tell them where to write, and collect their status reports.

A room starts in `Bootstrapping` while a background thread asks the prefill instance's bootstrap
server for its parallel info and rank addresses (cached per server), checks the KV layouts match
and sends this rank's one-time `RegisterDecode` to each new prefill rank; then `WaitingForInput`.
`send_metadata` sends a `TransferInfo` to every target (`Transferring`); the room is `Success`
once every target prefill rank has reported success.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdsim.core.kvpoll import KVPoll
from runtime.transfer.bootstrap_server import (
    BootstrapClient, ParallelInfo, RankRegistration, check_compatible,
)
from runtime.security import ClusterKey
from runtime.transfer.channel import ChannelError, ZmqChannel
from runtime.transfer.layout import KVArgs, Target, plan_targets
from runtime.protocol.transfer import (
    Abort, Heartbeat, RegisterDecode, Status, TransferInfo, pack_pages,
)
from runtime.transfer.state import Epoch, RoomState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Peer:
    target: Target
    endpoint: str  # the prefill rank's ZMQ PULL socket


@dataclass
class _Room(RoomState):
    peers: list[_Peer] = field(default_factory=list)
    succeeded: set[int] = field(default_factory=set)  # prefill tp ranks that reported success
    resolving: bool = True  # the bootstrap lookup is still running
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
        self._pool = ThreadPoolExecutor(bootstrap_threads, thread_name_prefix="kv-bootstrap")

    # ---- the receiver's view ---------------------------------------------------------------

    def start(self, room: int, host: str, port: int) -> None:
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} already has a receiver on this rank")
            self._rooms[room] = _Room()
        self._pool.submit(self._bootstrap, room, host, port)

    def poll(self, room: int) -> KVPoll:
        with self._lock:
            return self._rooms[room].state

    def failure_reason(self, room: int) -> str:
        with self._lock:
            return self._rooms[room].reason

    def send_metadata(self, room: int, pages, metadata_slot: int) -> None:
        data, dtype = pack_pages(pages)
        with self._lock:
            r = self._rooms[room]
            if r.state is KVPoll.Failed:
                return
            if r.state is not KVPoll.WaitingForInput:
                raise RuntimeError(f"room {room}: send_metadata in state {r.state.name}, "
                                   "expected WaitingForInput")
            self._update(r, KVPoll.Transferring)
            peers = list(r.peers)
        try:
            for p in peers:
                self._channel.send(p.endpoint, TransferInfo(
                    room=room, session_id=self._session_id, decode_tp_rank=self.args.tp_rank,
                    dst_pages=b"" if p.target.is_dummy else data, page_dtype=dtype,
                    metadata_slot=metadata_slot, is_dummy=p.target.is_dummy))
        except ChannelError as exc:
            self.abort(room, f"could not send transfer info: {exc}")

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
        for endpoint in endpoints:
            try:
                self._channel.send(endpoint, beat)
            except ChannelError:
                pass  # check_liveness notices the missing echo

    def check_liveness(self, timeout_s: float) -> None:
        """Fail unfinished rooms on prefill ranks that stopped echoing heartbeats, and stop
        talking to those ranks (a room that needs one again registers anew)."""
        now = time.monotonic()
        with self._lock:
            dead = {ep: now - seen for ep, seen in self._last_echo.items()
                    if now - seen > timeout_s}
            for ep in dead:
                del self._last_echo[ep]
            for r in self._rooms.values():
                for p in r.peers:
                    if p.endpoint in dead and not r.done:
                        self._update(r, KVPoll.Failed, (
                            f"prefill rank {p.target.prefill_tp_rank} at {p.endpoint} silent for "
                            f"{dead[p.endpoint]:.1f} s (heartbeat timeout {timeout_s} s)"))
        if dead:
            with self._register_lock:
                self._registered -= set(dead)
            with self._server_lock:  # a restarted prefill instance listens elsewhere: ask again
                for key, server in list(self._servers.items()):
                    if any(_endpoint(reg) in dead for reg in server.ranks.values()):
                        del self._servers[key]
            for ep in dead:
                self._channel.forget(ep)

    # ---- bootstrap ---------------------------------------------------------------------------

    def _bootstrap(self, room: int, host: str, port: int) -> None:
        try:
            peers = self._resolve(room, host, port)
        except Exception as exc:  # the room fails; the thread lives on
            with self._lock:
                r = self._rooms.get(room)
                if r is not None:
                    self._update(r, KVPoll.Failed, f"bootstrap with {host}:{port} failed: {exc}")
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

    def _resolve(self, room: int, host: str, port: int) -> list[_Peer]:
        server = self._server(host, port)
        info = server.info
        dp_rank = room % info.dp_size
        if info.pp_size != 1:
            raise NotImplementedError(f"prefill pipeline parallelism (pp_size={info.pp_size}) is "
                                      "not supported by the Mooncake backend yet")
        targets = plan_targets(self.args.tp_rank, self.args.tp_size, info.tp_size,
                               is_mla=self.args.is_mla, total_heads=self.args.total_kv_heads)
        peers = []
        for t in targets:
            key = (dp_rank, t.prefill_tp_rank)
            reg = server.ranks.get(key)
            if reg is None:
                reg = server.client.rank(dp_rank, t.prefill_tp_rank, 0)
                with self._server_lock:
                    server.ranks[key] = reg
            endpoint = _endpoint(reg)
            self._ensure_registered(endpoint)
            peers.append(_Peer(t, endpoint))
        return peers

    def _server(self, host: str, port: int) -> _Server:
        with self._server_lock:
            server = self._servers.get((host, port))
            if server is not None and server.info is not None:
                return server
        server = _Server(BootstrapClient(host, port, timeout_s=self._timeout_s, key=self._key))
        info = server.client.parallel_info()
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
                kv_heads_per_rank=a.kv_heads_per_rank))
            self._registered.add(endpoint)
            with self._lock:
                self._last_echo.setdefault(endpoint, time.monotonic())

    def _update(self, r: _Room, new: KVPoll, reason: str = "") -> None:
        """Caller holds `_lock`."""
        if r.update(new, reason):
            self._epoch.bump()

    def _tell_abort(self, room: int, reason: str, peers: list[_Peer]) -> None:
        for p in peers:
            try:
                self._channel.send(p.endpoint, Abort(room=room, reason=reason,
                                                     session_id=self._session_id))
            except ChannelError as exc:
                log.warning("room %d: could not send abort to %s: %s", room, p.endpoint, exc)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
