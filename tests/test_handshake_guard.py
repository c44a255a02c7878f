"""Mooncake's handshake port under idle and slow peers, with and without the handshake guard
(runtime/transfer/bindshim.c): real engines on loopback (TCP, P2P handshake), the receiving one
in a process started with the wrapper preloaded, as the launcher starts its workers."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from runtime.transfer import bindshim
from runtime.transfer.mooncake_engine import MooncakeEngine

pytestmark = [pytest.mark.real]

# The receiving rank: one engine, 1 MiB registered; each line on stdin asks for the buffer's sum.
TARGET = """
import json, sys
import numpy as np
from runtime.transfer.mooncake_engine import MooncakeEngine
engine = MooncakeEngine("127.0.0.1")
buf = np.zeros(1 << 20, dtype=np.uint8)
engine.register(buf.ctypes.data, buf.nbytes, owner=buf)
print(json.dumps({"session": engine.session_id, "addr": buf.ctypes.data,
                  "guarded": engine.handshake_guarded}), flush=True)
for _ in sys.stdin:
    print(int(buf.sum()), flush=True)
"""

WRITE_BOUND_S = 1.0  # a guarded handshake + 4 KiB write on loopback (measured: 2-5 ms)
PAYLOAD = 7


class Target:
    def __init__(self, guard: bool) -> None:
        env = bindshim.preload_env("127.0.0.1")
        if not env:
            pytest.skip("no C compiler to build the bind() wrapper")
        env[bindshim.GUARD_ENV] = "on" if guard else "off"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TARGET], env={**os.environ, **env}, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=bindshim.SOURCE.parents[2])
        info = json.loads(self.proc.stdout.readline())
        self.session, self.addr, self.guarded = info["session"], info["addr"], info["guarded"]
        self.port = int(self.session.rsplit(":", 1)[1])

    def received(self) -> int:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def connect(self, send: bytes = b"") -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        if send:
            s.sendall(send)
        return s

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def writer():
    engine = MooncakeEngine("127.0.0.1")
    src = np.full(4096, PAYLOAD, dtype=np.uint8)
    engine.register(src.ctypes.data, src.nbytes, owner=src)
    return engine, src


def timed_write(writer, target: Target) -> float:
    engine, src = writer
    start = time.monotonic()
    engine.write(target.session, [src.ctypes.data], [target.addr], [src.nbytes])
    return time.monotonic() - start


def frame(body: bytes) -> bytes:
    """A handshake request as Mooncake frames it: a host-order uint64 length, then the body."""
    return struct.pack("=Q", len(body)) + body


def test_a_process_without_the_wrapper_is_not_guarded():
    assert bindshim.guard_handshake_port(12345) is False


@pytest.mark.slow
def test_idle_and_slow_peers_do_not_hold_up_a_handshake(writer):
    target = Target(guard=True)
    try:
        assert target.guarded
        peers = [target.connect() for _ in range(300)]  # idle: more than the guard keeps (128)
        peers += [target.connect(b"\x10\x00\x00") for _ in range(5)]  # part of the length
        peers += [target.connect(frame(b"\x03{" + b" " * 98)[:12]) for _ in range(5)]  # part body
        whole = [target.connect(frame(b'\x03{}')) for _ in range(5)]  # a probe, then never close
        cpu_before = target.cpu_s()
        time.sleep(1.0)
        assert target.cpu_s() - cpu_before < 0.2  # waiting on them does not spin

        took_s = timed_write(writer, target)
        assert took_s < WRITE_BOUND_S, took_s
        assert target.received() == PAYLOAD * 4096
        assert target.open_fds() < 200  # at most 128 waiting connections held

        for s in whole:  # answered, although they never closed
            s.settimeout(5)
            assert b'"status"' in s.recv(4096)
        # Every connection that sent no whole request is closed within the guard's 5 s (reset
        # where it had sent part of one).
        deadline = time.monotonic() + 8
        for s in peers:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        target.close()


@pytest.mark.slow
def test_without_the_guard_one_idle_peer_holds_up_a_handshake_for_5_s(writer):
    target = Target(guard=False)
    try:
        assert not target.guarded
        idle = target.connect()
        time.sleep(0.2)  # Mooncake has taken it in and waits on it
        took_s = timed_write(writer, target)
        assert 4.0 < took_s < 8.0, took_s
        assert target.received() == PAYLOAD * 4096
        idle.close()
    finally:
        target.close()


# ---- a whole deployment ----------------------------------------------------------------------


class IdleFlood:
    """Keeps `per_port` idle connections open to every port the processes `pids()` lists listen
    on, opening new ones every 0.5 s for those a server closed."""

    def __init__(self, pids, per_port: int) -> None:
        from runtime.security import listeners

        self._targets = lambda: {x.port for pid in pids() for x in listeners(pid)}
        self.per_port = per_port
        self.held: dict[int, list[socket.socket]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for port in self._targets():
                alive = [s for s in self.held.get(port, []) if _open(s)]
                while len(alive) < self.per_port and not self._stop:
                    try:
                        alive.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                        alive[-1].settimeout(None)
                    except OSError:
                        break
                self.held[port] = alive
            time.sleep(0.5)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        for socks in self.held.values():
            for s in socks:
                s.close()


def _open(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):  # a ZMQ greeting, say
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_restarted_prefill_reaches_a_decode_worker_flooded_with_idle_connections(tmp_path):
    """The finding this guards against: idle connections on the decode worker's handshake port,
    the prefill worker restarted (so its new engine must handshake again), requests failed with
    "KV did not arrive". Here 40 idle connections are kept on every port of the decode worker."""
    from configs import tiny_pd_yaml
    from pd_harness import Proc
    from test_pd_launcher import complete, descendants

    if bindshim.build() is None:
        pytest.skip("no C compiler to build the bind() wrapper")
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(tiny_pd_yaml(extra="faults:\n  kill: [{role: prefill, instance: 0, at_s: 1, "
                                      "restart_after_s: 1}]\n"))
    launcher = Proc(str(cfg))
    flood = None
    try:
        decode_port = int(launcher.wait_for(r"decode worker 0 .* at http://[\d.]+:(\d+)").group(1))
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+/v1)").group(1)
        from runtime.security import listeners

        def decode_pids():
            return [p for p in descendants(launcher.proc.pid)
                    if any(x.port == decode_port for x in listeners(p))]

        flood = IdleFlood(decode_pids, per_port=40)
        launcher.wait_for(r"fault injection: restart prefill worker 0", timeout_s=60)
        prefill = launcher.wait_for(r"prefill worker 0 .* at (http://[\d.:]+)").group(1)
        deadline = time.monotonic() + 120
        while True:  # until the restarted prefill worker is loaded
            try:
                with urllib.request.urlopen(prefill + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the prefill worker did not come back"
            time.sleep(0.5)
        assert len(flood.held) >= 3 and all(len(v) == 40 for v in flood.held.values()), \
            {port: len(v) for port, v in flood.held.items()}
        start = time.monotonic()
        complete(url)  # its KV goes from the new prefill engine to the flooded decode worker
        assert time.monotonic() - start < 20.0
    finally:
        if flood is not None:
            flood.close()
        launcher.stop()
