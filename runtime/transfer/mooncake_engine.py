"""A thin, checked wrapper around one Mooncake `TransferEngine`.

Facts about the Mooncake Python API this relies on (checked against 0.3.13.post1, non-CUDA wheel):

- `initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)` returns 0 on success and
  picks a free RPC port; the session id a peer writes to is `f"{local_hostname}:{get_rpc_port()}"`.
  With protocol "tcp" and no RDMA device it needs only Debian's `libibverbs1`.
- Several engines can live in one process (each with its own RPC and TCP ports).
- `register_memory(addr, len)` returns 0; registering a region that overlaps a registered one
  returns -7 ("does not support overlapped memory region"). Writing into an unregistered
  destination returns -1.
- A peer's write into a registered region is checked only against the registration, so memory
  freed while still registered gets written anyway (heap corruption): a region keeps its owner
  alive until it is unregistered.
- `batch_transfer_sync_write(target, srcs, dsts, lens)` returns 0 once the bytes are in place
  (since 0.3.12; earlier TCP writes completed when the bytes left the sender). It returns -1 for
  an unreachable peer.
- It listens on every interface, whatever `local_hostname` says: the P2P handshake (RPC) port on
  0.0.0.0 and the TCP transport's data port on `::` (dual stack). Mooncake's source binds both
  to INADDR_ANY / in6addr_any and has no setting for the address (MC_TCP_BIND_ADDRESS only names
  the address it advertises, outside P2P mode); MC_MIN_RPC_PORT / MC_MAX_RPC_PORT narrow the
  port range, which helps a firewall rule. `exposed` lists what this engine opened.
- The handshake port serves one connection at a time: it waits up to 5 s (fixed, no setting) for
  a connection's request and then up to 5 s for the peer to close, so each idle connection
  delays every later handshake by 5 s. In a process started with the bind() wrapper the wrapper
  guards the port (runtime/transfer/bindshim.py); `handshake_guarded` says whether it does. The
  guard starts with Mooncake's next accept(), within 1 s of `initialize` (its listening socket
  times out every second), and the constructor waits for that.
- It logs through glog but never calls InitGoogleLogging, so glog writes every line to fd 2
  whatever GLOG_log_dir says; `initialize` alone writes a dozen, one of them an `E` line
  ("Local segment descriptor not found") on every healthy start. So fd 2 goes to a log file
  per process while `initialize` runs (`startup_log`); later lines (a failing transfer) still
  reach stderr.
- Over TCP, more than about 2,000 slices in flight on one engine overflow the transport's lane
  queue ("TCP lane queue-full rejection"): that batch fails and so does every later write to the
  same peer. So writes go out in batches of at most `max_batch` descriptors, with at most
  `max_inflight` descriptors in flight over all threads.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from runtime.security import exposed
from runtime.transfer.bindshim import guard_handshake_port

MIN_VERSION = (0, 3, 12)
MAX_BATCH = 512  # descriptors per batch_transfer_sync_write call
MAX_INFLIGHT = 1024  # descriptors in flight over all threads
_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


class TransferEngineError(RuntimeError):
    """Mooncake is missing, too old, or refused an operation."""


LOG_DIR_ENV = "PDSIM_MOONCAKE_LOG_DIR"


def startup_log() -> Path:
    """This process's file for Mooncake's start-up lines: $PDSIM_MOONCAKE_LOG_DIR (default
    <tmp>/pdsim-mooncake)/mooncake-<pid>.log."""
    folder = Path(os.environ.get(LOG_DIR_ENV) or Path(tempfile.gettempdir()) / "pdsim-mooncake")
    return folder / f"mooncake-{os.getpid()}.log"


_FD2_LOCK = threading.Lock()  # engines started by two threads at once: one redirect at a time


@contextmanager
def _stderr_appended_to(path: Path) -> Iterator[int]:
    """fd 2 appended to `path` meanwhile (also whatever another thread writes to stderr then);
    yields the offset this part of the file starts at."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _FD2_LOCK:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(path, "ab") as log:
                os.dup2(log.fileno(), 2)
                try:
                    yield log.tell()
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
        finally:
            os.close(saved)


def mooncake_version() -> str:
    for dist in _DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise TransferEngineError(
        "the Mooncake transfer engine is not installed: pip install "
        "mooncake-transfer-engine-non-cuda (CPU machines) or mooncake-transfer-engine (CUDA)")


def _parse_version(text: str) -> tuple[int, ...]:
    """`"0.3.13.post1"` → `(0, 3, 13)`; the leading numeric release parts only."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    if match is None:
        raise TransferEngineError(f"cannot read the Mooncake version {text!r}")
    return tuple(int(p) for p in match.group().split("."))


def check_version(version: str | None = None) -> str:
    """The installed version, or `TransferEngineError` if it is older than 0.3.12."""
    version = version or mooncake_version()
    if _parse_version(version) < MIN_VERSION:
        raise TransferEngineError(
            f"Mooncake {version} is too old: pdsim needs >= 0.3.12, because before it a TCP write "
            "reported completion once the bytes left the sender, so the receiver could read a "
            "half-written page. Upgrade the mooncake-transfer-engine package.")
    return version


class _Budget:
    """A counting semaphore that admits a request for `n` units at once."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._used + n <= self._limit)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class MooncakeEngine:
    """One initialised engine: memory registration (each region once) and batched writes."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 *, max_batch: int = MAX_BATCH, max_inflight: int = MAX_INFLIGHT) -> None:
        check_version()
        from mooncake.engine import TransferEngine  # after the version check, on purpose

        if not 1 <= max_batch <= max_inflight:
            raise ValueError(
                f"need 1 <= max_batch <= max_inflight, got {max_batch}, {max_inflight}")
        self._engine = TransferEngine()
        before = set(exposed())
        log = startup_log()
        with _stderr_appended_to(log) as start:
            rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        self.exposed = sorted(set(exposed()) - before, key=lambda x: x.port)
        if rc != 0:  # Mooncake's own error and fatal lines say why
            with open(log, "rb") as f:
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines()
            errors = [line for line in lines if re.match(r"[EF]\d{4} ", line)]
            raise TransferEngineError(
                f"TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {rc}; Mooncake said: {' | '.join(errors) or '-'} "
                f"(its whole start-up log: {log})")
        self.handshake_port = self._engine.get_rpc_port()
        self.handshake_guarded = guard_handshake_port(self.handshake_port)
        self.session_id = f"{hostname}:{self.handshake_port}"
        self.max_batch = max_batch
        self._budget = _Budget(max_inflight)
        self._regions: dict[int, tuple[int, object]] = {}  # base → (length, owner kept alive)
        self._lock = threading.Lock()

    def register(self, addr: int, length: int, owner: object = None) -> None:
        """Register `[addr, addr + length)`: again the same region is a no-op, an overlap an
        error. `owner` (the array or tensor holding the memory) is kept alive until the region
        is unregistered, because peers write into registered memory without asking."""
        if length <= 0:
            raise ValueError(f"cannot register {length} bytes at {addr:#x}")
        with self._lock:
            if addr in self._regions and self._regions[addr][0] == length:
                return
            for base, (size, _) in self._regions.items():
                if addr < base + size and base < addr + length:
                    raise TransferEngineError(
                        f"region [{addr:#x}, +{length}) overlaps registered region "
                        f"[{base:#x}, +{size}); Mooncake cannot register overlapping memory")
            rc = self._engine.register_memory(addr, length)
            if rc != 0:
                raise TransferEngineError(f"register_memory({addr:#x}, {length}) returned {rc}")
            self._regions[addr] = (length, owner)

    def unregister(self, addr: int) -> None:
        with self._lock:
            if self._regions.pop(addr, None) is not None:
                self._engine.unregister_memory(addr)

    def unregister_all(self) -> None:
        with self._lock:
            for addr in list(self._regions):
                self._engine.unregister_memory(addr)
            self._regions.clear()

    def write(self, target: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        """Copy `lengths[i]` bytes from local `srcs[i]` to `dsts[i]` on `target`, or raise."""
        for start in range(0, len(srcs), self.max_batch):
            end = start + self.max_batch
            n = len(srcs[start:end])
            self._budget.acquire(n)
            try:
                rc = self._engine.batch_transfer_sync_write(
                    target, srcs[start:end], dsts[start:end], lengths[start:end])
            finally:
                self._budget.release(n)
            if rc != 0:
                raise TransferEngineError(
                    f"batch_transfer_sync_write to {target} failed (rc={rc}) on descriptors "
                    f"{start}..{start + n - 1} of {len(srcs)}")
