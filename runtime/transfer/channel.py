"""ZMQ point to point: one PULL socket bound per rank, one PUSH socket per peer it writes to.

Frames are runtime/protocol/transfer.py messages (msgpack), one per frame; with a `ClusterKey` each
frame is sealed (an HMAC-SHA256 tag before the body) and a frame whose tag does not match is
dropped and counted in `rejected_frames`, never decoded. `send` may be called from any thread (a
lock guards the PUSH sockets); `recv` only from the one service thread.

The PULL socket takes frames of at most `MAX_FRAME_BYTES` (ZMQ's MAXMSGSIZE): a peer that
sends a larger one is disconnected by ZMQ before the frame is buffered (it reconnects, and
others are served meanwhile).

A PUSH socket queues frames only while its peer is connected (ZMQ_IMMEDIATE): a peer that died
or restarted (its process gone, its socket closed) fails the next `send` at once with
`ChannelError`, instead of filling a queue nobody will read. A new socket waits up to
`connect_timeout_s` for its first connection before it gives up on the peer.

At most `max_peers` PUSH sockets stay open: the least recently used one is closed (with whatever
is still queued for it) when a new peer needs a socket, and `forget` closes a peer's at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import zmq

from runtime.security import ClusterKey
from runtime.protocol.transfer import Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

MAX_PEERS = 256
# The largest legitimate frame is a `TransferInfo` naming every KV page of one request: 8 bytes
# a page (int64 indices) for up to 2**22 pages (a 4M-token request at page_size 1), plus the tag
# and a few hundred bytes of fields. Twice that leaves margin; anything larger is not ours.
MAX_REQUEST_PAGES = 1 << 22
MAX_FRAME_BYTES = 2 * (8 * MAX_REQUEST_PAGES + (64 << 10))
CONNECT_TIMEOUT_S = 1.0  # a new peer socket's first connection (loopback: about 1 ms)
_CONNECT_POLL_MS = 10


class ChannelError(RuntimeError):
    """A message could not be handed to ZMQ: the peer is not connected (gone or restarting) or
    its queue is full (stuck)."""


class ZmqChannel:
    def __init__(self, host: str = "127.0.0.1", key: ClusterKey | None = None, *,
                 max_peers: int = MAX_PEERS, max_frame_bytes: int = MAX_FRAME_BYTES,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers={max_peers}; allowed: >= 1")
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes={max_frame_bytes}; allowed: >= 1")
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.port = port
        self.endpoint = f"tcp://{host}:{port}"
        self._key = key
        self._max_peers = max_peers
        self._connect_timeout_s = connect_timeout_s
        self._push: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._fresh: set[str] = set()  # endpoints whose socket has not delivered a frame yet
        self._lock = threading.Lock()
        self._closed = False
        self.rejected_frames = 0  # unauthenticated (bad or missing tag)
        self.bad_frames = 0  # authenticated (or no key) but not a valid message

    @property
    def num_peers(self) -> int:
        """PUSH sockets open now."""
        return len(self._push)

    def send(self, endpoint: str, msg: Message) -> None:
        """Queue `msg` for a connected `endpoint` without blocking; the first frame to a new
        peer waits (up to `connect_timeout_s`) for the connection."""
        frame = encode(msg)
        if self._key is not None:
            frame = self._key.seal(frame)
        deadline = time.monotonic() + self._connect_timeout_s
        while True:
            with self._lock:
                if self._closed:
                    raise ChannelError("channel is closed")
                sock = self._socket(endpoint)
                try:
                    sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                    self._fresh.discard(endpoint)
                    return
                except zmq.Again:
                    if endpoint not in self._fresh:
                        raise ChannelError(f"{type(msg).__name__} to {endpoint}: not connected "
                                           "or its queue is full (peer gone, restarting or not "
                                           "reading)") from None
                    left_ms = (deadline - time.monotonic()) * 1000
                    if left_ms <= 0:
                        raise ChannelError(f"{type(msg).__name__} to {endpoint}: no connection "
                                           f"within {self._connect_timeout_s:g} s (peer gone "
                                           "or restarting)") from None
                    # brief slices, so the lock is free for other peers' frames in between
                    sock.poll(min(_CONNECT_POLL_MS, left_ms), zmq.POLLOUT)

    def connected(self, endpoint: str, timeout_ms: int = 0) -> bool:
        """Whether a frame to `endpoint` could go now (a connection is up and its queue not full),
        waiting up to `timeout_ms` for one."""
        with self._lock:
            if self._closed:
                return False
            return bool(self._socket(endpoint).poll(timeout_ms, zmq.POLLOUT))

    def _socket(self, endpoint: str) -> zmq.Socket:
        """The PUSH socket to `endpoint`, made (and connecting) if it has none; caller holds
        the lock."""
        sock = self._push.get(endpoint)
        if sock is not None:
            self._push.move_to_end(endpoint)
            return sock
        while len(self._push) >= self._max_peers:
            old_endpoint, old = self._push.popitem(last=False)
            self._fresh.discard(old_endpoint)
            old.close()
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 100)  # on close, a moment to flush the last aborts
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only while connected
        sock.connect(endpoint)
        self._push[endpoint] = sock
        self._fresh.add(endpoint)
        return sock

    def recv(self, timeout_ms: int) -> Message | None:
        """The next valid message, or None after `timeout_ms`; bad frames are counted, logged
        (the first and every 1000th) and dropped."""
        if not self._pull.poll(timeout_ms):
            return None
        frame = self._pull.recv(copy=True)
        if self._key is not None:
            body = self._key.open(frame)
            if body is None:
                self.rejected_frames += 1
                if self.rejected_frames % 1000 == 1:
                    log.warning("dropping an unauthenticated frame of %d bytes on %s (%d so far):"
                                " its sender does not hold this deployment's cluster secret",
                                len(frame), self.endpoint, self.rejected_frames)
                return None
            frame = body
        try:
            return decode(frame)
        except (ProtocolError, TypeError, ValueError) as exc:  # whatever the bytes, never raise
            self.bad_frames += 1
            if self.bad_frames % 1000 == 1:
                log.warning("dropping a bad frame on %s (%d so far): %s", self.endpoint,
                            self.bad_frames, exc)
            return None

    def forget(self, endpoint: str) -> None:
        """Drop the PUSH socket to a peer that is gone (and whatever is queued for it)."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
            self._fresh.discard(endpoint)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in self._push.values():
                sock.close()
            self._push.clear()
            self._fresh.clear()
            self._pull.close()
            self._ctx.term()
