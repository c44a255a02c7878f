"""Keep Mooncake's listeners on the configured host, and its handshake port free of idle peers.

Mooncake's transfer engine binds its handshake and TCP data ports to every interface and has no
setting for the address (runtime/transfer/mooncake_engine.py). `bindshim.c` wraps `bind()`: loaded with
LD_PRELOAD into a worker process, it turns a wildcard bind made by Mooncake's own code into a
bind to `PDSIM_BIND_HOST`, and passes every other bind through.

Mooncake's handshake listener also serves one connection at a time and gives each up to 5 s to
send its request, so a few idle connections stall every peer's handshake (one costs 5 s; twelve,
a minute: a peer's handshake then times out). The same wrapper guards it (`guard_handshake_port`):
Mooncake's `accept()` returns only connections whose whole request has arrived, idle ones wait
apart, concurrently, and are closed after 5 s. The launcher starts its workers
with it (`preload_env`), a rank 0 starts its other ranks with it, and `pdsim serve --role`
re-executes itself once with it (`reexec_with_preload`). It is compiled on first use with the
system's C compiler into ~/.cache/pdsim; without a compiler, or for a host that is not an IPv4
address, nothing is preloaded and each rank warns that Mooncake listens on every interface.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bindshim.c")
HOST_ENV = "PDSIM_BIND_HOST"
GUARD_ENV = "PDSIM_HANDSHAKE_GUARD"  # "off": leave Mooncake's handshake listener as it is


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdsim"


def build() -> Path | None:
    """The compiled wrapper (built once per version of its source), or None without a compiler
    or when compiling fails (logged)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = _cache_dir() / f"bindshim-{digest}.so"
    if target.is_file():
        return target
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        log.warning("no C compiler (cc) to build %s: Mooncake will listen on every interface",
                    SOURCE.name)
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)  # atomic: processes building at once all get a whole file
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("could not build %s (%s): Mooncake will listen on every interface",
                    SOURCE.name, str(detail).strip()[:500])
        partial.unlink(missing_ok=True)
        return None
    return target


def preload_env(host: str) -> dict[str, str]:
    """Environment entries that keep a child process's Mooncake ports on `host`; {} when that
    cannot be done (`host` is not an IPv4 address, or no wrapper could be built)."""
    try:
        if not isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address):
            return {}
    except ValueError:  # a host name
        return {}
    shim = build()
    if shim is None:
        return {}
    preload = os.environ.get("LD_PRELOAD", "")
    if str(shim) not in preload.split():
        preload = f"{shim} {preload}".strip()
    return {"LD_PRELOAD": preload, HOST_ENV: host}


def reexec_with_preload(host: str) -> None:
    """Replace this process with itself, the wrapper preloaded, unless it already is (or cannot
    be): for a rank 0 started from the command line."""
    if os.environ.get(HOST_ENV):
        return
    env = preload_env(host)
    if env:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})


def guard_handshake_port(port: int, *, settle_s: float = 2.0) -> bool:
    """Guard Mooncake's handshake listener on `port` in this process (bindshim.c), waiting (at
    most `settle_s`) until its listener thread is in a guarded accept(); False where the wrapper
    is not preloaded here, $PDSIM_HANDSHAKE_GUARD is "off", or the listener did not come by."""
    if os.environ.get(GUARD_ENV, "").lower() == "off":
        return False
    shim = ctypes.CDLL(None)
    try:
        guard, active = shim.pdsim_guard_port, shim.pdsim_guard_active
    except AttributeError:  # not preloaded into this process
        return False
    if guard(ctypes.c_int(port)) != 0:
        return False
    deadline = time.monotonic() + settle_s
    while not active(ctypes.c_int(port)):
        if time.monotonic() > deadline:
            log.warning("Mooncake's handshake listener on port %d did not enter the guard "
                        "within %.1f s: it runs unguarded", port, settle_s)
            return False
        time.sleep(0.01)
    return True
