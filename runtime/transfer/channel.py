"""ZMQ point to point: one PULL socket bound per rank, one PUSH socket per peer it writes to.

Frames are `messages.encode` output (msgpack), one message per frame. `send` may be called from
any thread (a lock guards the PUSH sockets); `recv` only from the one service thread.
"""

from __future__ import annotations

import logging
import threading

import zmq

from runtime.transfer.messages import Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """A message could not be handed to ZMQ: the peer's queue is full (it is gone or stuck)."""


class ZmqChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.port = port
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._closed = False

    def send(self, endpoint: str, msg: Message) -> None:
        """Queue `msg` for `endpoint` without blocking (ZMQ delivers it once connected)."""
        frame = encode(msg)
        with self._lock:
            if self._closed:
                raise ChannelError("channel is closed")
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 100)  # on close, a moment to flush the last aborts
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise ChannelError(f"{type(msg).__name__} to {endpoint}: its queue is full "
                                   "(peer gone or not reading)") from None

    def recv(self, timeout_ms: int) -> Message | None:
        """The next valid message, or None after `timeout_ms`; bad frames are logged and dropped."""
        if not self._pull.poll(timeout_ms):
            return None
        frame = self._pull.recv(copy=True)
        try:
            return decode(frame)
        except ProtocolError as exc:
            log.warning("dropping a bad frame on %s: %s", self.endpoint, exc)
            return None

    def forget(self, endpoint: str) -> None:
        """Drop the PUSH socket to a peer that is gone (and whatever is queued for it)."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in self._push.values():
                sock.close()
            self._push.clear()
            self._pull.close()
            self._ctx.term()
