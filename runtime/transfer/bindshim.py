"""Keep Mooncake's listeners on the configured host.

Mooncake's transfer engine binds its handshake and TCP data ports to every interface and has no
setting for the address (runtime/transfer/mooncake_engine.py). `bindshim.c` wraps `bind()`: loaded with
LD_PRELOAD into a worker process, it turns a wildcard bind made by Mooncake's own code into a
bind to `PDSIM_BIND_HOST`, and passes every other bind through. The launcher starts its workers
with it (`preload_env`), a rank 0 starts its other ranks with it, and `pdsim serve --role`
re-executes itself once with it (`reexec_with_preload`). It is compiled on first use with the
system's C compiler into ~/.cache/pdsim; without a compiler, or for a host that is not an IPv4
address, nothing is preloaded and each rank warns that Mooncake listens on every interface.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bindshim.c")
HOST_ENV = "PDSIM_BIND_HOST"


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
