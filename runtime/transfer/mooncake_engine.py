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
- Over TCP, more than about 2,000 slices in flight on one engine overflow the transport's lane
  queue ("TCP lane queue-full rejection"): that batch fails and so does every later write to the
  same peer. So writes go out in batches of at most `max_batch` descriptors, with at most
  `max_inflight` descriptors in flight over all threads.
"""

from __future__ import annotations

import re
import threading
from importlib import metadata

from runtime.security import exposed

MIN_VERSION = (0, 3, 12)
MAX_BATCH = 512  # descriptors per batch_transfer_sync_write call
MAX_INFLIGHT = 1024  # descriptors in flight over all threads
_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


class TransferEngineError(RuntimeError):
    """Mooncake is missing, too old, or refused an operation."""


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
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        self.exposed = sorted(set(exposed()) - before, key=lambda x: x.port)
        if rc != 0:
            raise TransferEngineError(
                f"TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {rc}")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
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
