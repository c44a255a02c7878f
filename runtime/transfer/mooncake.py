"""The Mooncake transfer backend: `KVManager`, `KVSender`, `KVReceiver` over a Mooncake transfer
engine (P2P handshake; "tcp" here, "rdma" with a device name on clusters), ZMQ and the HTTP
bootstrap server.

One `MooncakeKVManager` per rank owns the engine (with this rank's KV and metadata buffers, and
a hybrid model's recurrent-state buffer or a speculating one's hidden states, registered
once), a ZMQ PULL socket, and a service
thread that dispatches incoming messages and sends heartbeats. A prefill rank uses its senders
(see `prefill.py`), a decode rank its receivers (see `decode.py`); one manager can do both, so
no role flag is needed.

    metadata = MetadataBuffer.allocate(num_slots)
    args = KVArgs.for_cache(cache, metadata, tp_rank=r, tp_size=n, total_kv_heads=heads)
    manager = MooncakeKVManager(args, deployment.transfer, key=cluster_key)
    manager.register_with_bootstrap(bootstrap_host, bootstrap_port)   # prefill ranks only

The manager reads the deployment's `transfer` section (`pdsim.deployment.TransferConfig`) as it
is. `transfer.host` is both the ZMQ bind address and the engine's hostname that peers connect to,
so on a cluster it must be this host's routable IP. The caller keeps the KV and metadata memory
alive until `close()`. With `key` (the deployment's `ClusterKey`) every ZMQ frame and bootstrap
call is sealed and checked; frames without the key are dropped and counted (`rejected_frames`).

The Mooncake engine itself cannot be told where to listen: its handshake (RPC) port and its TCP
data port bind every interface whatever `host` says, and peers that reach them can read and
write the registered KV memory. Worker processes started with the bind() wrapper
(runtime/transfer/bindshim.py) keep them on `host`; otherwise (`MooncakeEngine.exposed`) the
manager logs at start-up which ports are open to every interface; docs/serving.md says what to
firewall. The same wrapper keeps idle connections from stalling the engine's handshake port;
without it the manager warns of that too.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence

from pdsim.core.kvpoll import KVPoll
from pdsim.deployment import TransferConfig
from runtime.transfer.bootstrap_server import BootstrapClient, RankRegistration
from runtime.security import ClusterKey
from runtime.transfer.channel import ZmqChannel
from runtime.transfer.decode import DecodeSide
from runtime.transfer.mooncake_engine import MooncakeEngine
from runtime.transfer.layout import KVArgs
from runtime.protocol.transfer import Abort, Heartbeat, RegisterDecode, Status, TransferInfo
from runtime.transfer.metadata import SLOT_BYTES, MetadataBuffer
from runtime.transfer.prefill import PrefillSide
from runtime.transfer.state import Epoch

log = logging.getLogger(__name__)


class MooncakeKVManager:
    def __init__(self, args: KVArgs, config: TransferConfig = TransferConfig(), *,
                 key: ClusterKey | None = None) -> None:
        self.args = args
        self.config = config
        self.key = key  # seals every ZMQ frame and bootstrap call; None: insecure
        if args.metadata_item_len != SLOT_BYTES:
            raise ValueError(f"metadata_item_len must be {SLOT_BYTES} (one MetadataBuffer slot), "
                             f"got {args.metadata_item_len}")
        self.engine = MooncakeEngine(config.host, config.protocol, config.device_name)
        if self.engine.exposed:
            log.warning(
                "the Mooncake transfer engine listens on %s (every interface) although the "
                "configured host is %s: Mooncake has no setting for it, and this process runs "
                "without the bind() wrapper (runtime/transfer/bindshim.py). Anyone who reaches "
                "these ports can read and write this rank's registered KV memory; firewall them "
                "(docs/serving.md, Security)",
                ", ".join(f"{x.address}:{x.port}" for x in self.engine.exposed), config.host)
        if not self.engine.handshake_guarded:
            log.warning(
                "Mooncake's handshake port %d serves one connection at a time and waits 5 s on "
                "each idle one, and this process runs without the handshake guard "
                "(runtime/transfer/bindshim.py): a few idle connections to it delay every "
                "peer's handshake, a dozen make them time out (docs/serving.md, Security)",
                self.engine.handshake_port)
        for ptr, length in zip(args.kv_data_ptrs, args.kv_data_lens):
            self.engine.register(ptr, length, owner=args.owners)
        self.engine.register(args.metadata_ptr, args.metadata_len, owner=args.owners)
        for ptr, length in ((args.state_ptr, args.state_len),
                            (args.hidden_ptr, args.hidden_len)):
            if length:
                self.engine.register(ptr, length, owner=args.owners)
        self.metadata = MetadataBuffer.at_address(args.metadata_ptr, args.metadata_len)
        self.channel = ZmqChannel(config.host, key)
        self._epoch = Epoch()
        self.prefill = PrefillSide(args, self.engine, self.channel, self._epoch,
                                   config.num_workers, unclaimed_ttl_s=config.handshake_timeout_s)
        self.decode = DecodeSide(args, self.engine.session_id, self.channel, self._epoch,
                                 handshake_timeout_s=config.handshake_timeout_s, key=key)
        self._stop = threading.Event()
        self._service = threading.Thread(target=self._serve, name="kv-service", daemon=True)
        self._service.start()

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    def register_with_bootstrap(self, host: str, port: int, *, pp_rank: int = 0,
                                pp_size: int = 1) -> RankRegistration:
        """Announce this prefill rank to its instance's bootstrap server."""
        a = self.args
        reg = RankRegistration(
            ip=self.channel.host, zmq_port=self.channel.port, tp_rank=a.tp_rank,
            tp_size=a.tp_size, dp_rank=a.dp_rank, dp_size=a.dp_size, pp_rank=pp_rank,
            pp_size=pp_size, page_size=a.page_size, kv_dtype=a.kv_dtype, is_mla=a.is_mla,
            total_kv_heads=a.total_kv_heads, session_id=self.session_id)
        BootstrapClient(host, port, timeout_s=self.config.handshake_timeout_s,
                        key=self.key).register(reg)
        return reg

    def poll_epoch(self) -> int:
        """Changes (after the fact) whenever any sender's or receiver's poll may answer anew."""
        return self._epoch.value

    def on_progress(self, callback) -> None:
        """Call `callback()` after every change of `poll_epoch()`, so a driver can sleep until
        something happens. It runs on a transfer thread, with the backend's locks held: it must
        be quick (set an event, notify a condition) and must not call the manager."""
        self._epoch.listen(callback)

    def create_sender(self, req) -> MooncakeKVSender:
        if self.prefill.faults is not None:  # fault injection (runtime/faults.py)
            self.prefill.faults.sender_created(req.rid, req.bootstrap_room)
        return MooncakeKVSender(self.prefill, req.bootstrap_room)

    def create_receiver(self, req) -> MooncakeKVReceiver:
        self.decode.start(req.bootstrap_room, req.bootstrap_host, req.bootstrap_port)
        return MooncakeKVReceiver(self.decode, req.bootstrap_room)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._service.join(timeout=10)
        self.prefill.close()
        self.decode.close()
        self.channel.close()
        self.engine.unregister_all()

    def __enter__(self) -> MooncakeKVManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_beat = time.monotonic()
        handlers = {
            RegisterDecode: self.prefill.on_register,
            TransferInfo: self.prefill.on_transfer_info,
            Abort: self.prefill.on_abort,
            Status: self.decode.on_status,
        }
        while not self._stop.is_set():
            msg = self.channel.recv(timeout_ms=20)
            if isinstance(msg, Heartbeat):
                handler = self.decode.on_heartbeat if msg.reply else self.prefill.on_heartbeat
            else:
                handler = handlers.get(type(msg))
            if handler is not None:
                try:
                    handler(msg)
                except Exception:  # a bad message must not stop the service thread
                    log.exception("handling %s", type(msg).__name__)
            if interval > 0 and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + interval
                self.decode.send_heartbeats()
                self.decode.check_liveness(self.config.heartbeat_timeout_s)
                self.prefill.check_liveness(self.config.heartbeat_timeout_s)


class _Endpoint:
    """What a sender and a receiver share: one room on one side (`PrefillSide`/`DecodeSide`)."""

    def __init__(self, side: PrefillSide | DecodeSide, room: int) -> None:
        self._side = side
        self.room = room
        self._forget = weakref.finalize(self, side.forget, room)  # on close() or when dropped

    def poll(self) -> KVPoll:
        return self._side.poll(self.room)

    def abort(self, reason: str) -> None:
        self._side.abort(self.room, reason)

    def failure_reason(self) -> str:
        return self._side.failure_reason(self.room)

    def close(self) -> None:
        """Forget the room (after Success or Failed has been handled)."""
        self._forget()


class MooncakeKVSender(_Endpoint):
    """Prefill side of one request; see `prefill.PrefillSide` for the states."""

    def init(self, num_pages: int, metadata_slot: int) -> None:
        self._side.init(self.room, num_pages, metadata_slot)

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        self._side.send(self.room, page_indices, last, state_indices)


class MooncakeKVReceiver(_Endpoint):
    """Decode side of one request; see `decode.DecodeSide` for the states."""

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        self._side.send_metadata(self.room, page_indices, metadata_slot, state_indices)
