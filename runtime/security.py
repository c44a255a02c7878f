"""The cluster secret, the public API key, and what this process listens on.

One secret per deployment authenticates everything internal: every ZMQ frame of the transfer
backend carries an HMAC-SHA256 tag, and every internal HTTP call (worker `/generate`, `/abort`,
`/records`, ..., bootstrap `/route`) carries a token in `X-PDSIM-Auth`. Both are derived from the
secret (`ClusterKey`), so the secret itself never travels; the token is the same for every call,
so anyone who can read the cluster's traffic can replay it: run the internal network where only
the deployment can read it (docs/serving.md, "Security").

The secret comes from the environment (`PDSIM_CLUSTER_SECRET`, how the launcher hands it to every
process it starts: never on a command line) or the config (`security.cluster_secret`). A
deployment without one must say `security.insecure: true` (`--insecure`), and gets a warning.

The public router API takes an optional API key (`Authorization: Bearer KEY`, as SGLang and vLLM
do), from `security.api_key` or `PDSIM_API_KEY`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger(__name__)

SECRET_ENV = "PDSIM_CLUSTER_SECRET"
API_KEY_ENV = "PDSIM_API_KEY"
AUTH_HEADER = "X-PDSIM-Auth"
TAG_BYTES = 32  # HMAC-SHA256
MIN_SECRET_CHARS = 16


class SecurityError(ValueError):
    """No usable secret where one is required."""


def new_secret() -> str:
    """A fresh random cluster secret (256 bits, hex)."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ClusterKey:
    """Keys derived from one cluster secret: one for ZMQ frames, one token for HTTP."""

    frame_key: bytes
    http_token: str

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKey:
        if len(secret) < MIN_SECRET_CHARS:
            raise SecurityError(f"the cluster secret has {len(secret)} characters; allowed: at "
                                f"least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
        raw = secret.encode()
        return cls(frame_key=hmac.digest(raw, b"pdsim zmq frames v1", "sha256"),
                   http_token=hmac.new(raw, b"pdsim internal http v1", "sha256").hexdigest())

    def seal(self, body: bytes) -> bytes:
        """`tag || body`: the frame as it goes on the wire."""
        return hmac.digest(self.frame_key, body, "sha256") + body

    def open(self, frame: bytes) -> bytes | None:
        """The body of a sealed frame, or None if its tag does not match."""
        if len(frame) < TAG_BYTES:
            return None
        tag, body = frame[:TAG_BYTES], frame[TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self.frame_key, body, "sha256")):
            return None
        return body

    def headers(self) -> dict[str, str]:
        return {AUTH_HEADER: self.http_token}

    def accepts(self, token: bytes | str | None) -> bool:
        """Whether `token` (best: the header's bytes as sent) is this deployment's, in constant
        time; any bytes or text at all, never an exception."""
        if isinstance(token, str):
            token = token.encode("utf-8", "surrogateescape")  # how aiohttp decoded the bytes
        return token is not None and hmac.compare_digest(token, self.http_token.encode())


def resolve_secret(config_secret: str | None = None, *, insecure: bool = False,
                   what: str = "this process") -> str | None:
    """The deployment's secret: `PDSIM_CLUSTER_SECRET`, else the config's; None (with a loud
    warning) only when `insecure`; else `SecurityError` saying how to give one."""
    secret = os.environ.get(SECRET_ENV) or config_secret
    if secret:
        ClusterKey.from_secret(secret)  # too short: say so now
        return secret
    if insecure:
        log.warning("INSECURE: %s runs without a cluster secret: anyone who can reach its ports "
                    "can submit and abort requests, register ranks and send transfer messages",
                    what)
        return None
    raise SecurityError(
        f"{what} needs the deployment's cluster secret: set {SECRET_ENV} (the same value in "
        "every process of the deployment) or security.cluster_secret in the config, or run "
        "with --insecure (security.insecure: true) on a machine no one else can reach")


def deployment_secret(config_secret: str | None = None) -> str:
    """What a launcher of a whole deployment uses: the given secret, else a fresh one."""
    secret = os.environ.get(SECRET_ENV) or config_secret or new_secret()
    ClusterKey.from_secret(secret)
    return secret


def key_of(secret: str | None) -> ClusterKey | None:
    return None if secret is None else ClusterKey.from_secret(secret)


def secret_env(secret: str | None) -> dict[str, str]:
    """The environment entry that hands `secret` to a child process (never its command line)."""
    return {} if secret is None else {SECRET_ENV: secret}


def api_key(config_key: str | None = None) -> str | None:
    """The public API key: `security.api_key`, else `PDSIM_API_KEY`, else None (open API)."""
    return config_key or os.environ.get(API_KEY_ENV) or None


# ---- HTTP ----------------------------------------------------------------------------------


def _json_error(status: int, message: str) -> web.Response:
    kind = "authentication_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": status}}, status=status,
                             headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def header_bytes(request: web.Request, name: str) -> bytes | None:
    """A header's value as sent, undecoded (any bytes at all: nothing to fail on), or None."""
    wanted = name.lower().encode()
    for key, value in request.raw_headers:
        if key.lower() == wanted:
            return value
    return None


def cluster_middleware(key: ClusterKey, open_paths: Iterable[str] = ("/health",)) -> Callable:
    """aiohttp middleware: every path but `open_paths` needs `X-PDSIM-Auth` (401 JSON if not)."""
    open_paths = frozenset(open_paths)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths and not key.accepts(header_bytes(request, AUTH_HEADER)):
            return _json_error(401, f"{request.method} {request.path} is internal: it needs the "
                                    f"deployment's {AUTH_HEADER} token")
        return await handler(request)

    return check


def api_key_middleware(key: str, open_paths: Iterable[str] = ("/health",)) -> Callable:
    """aiohttp middleware: `Authorization: Bearer KEY` on every path but `open_paths`."""
    open_paths = frozenset(open_paths)
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths and not hmac.compare_digest(
                header_bytes(request, "Authorization") or b"", expected):
            return _json_error(401, "missing or wrong API key: send Authorization: Bearer KEY")
        return await handler(request)

    return check


_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://[^\s,;'\")]+"  # a URL (http://..., tcp://...)
    r"|\[[0-9a-fA-F:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b")  # IPv4[:port]


def redact_addresses(text: str) -> str:
    """`text` with every URL and IP address (and port) replaced by `<address>`: what a client
    may read of an internal error."""
    return _ADDRESS.sub("<address>", text)


# ---- what listens where --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # a listening socket's local address as /proc lists it (IPv4, IPv6, IPv4-mapped)
    port: int

    @property
    def loopback(self) -> bool:
        addr = ipaddress.ip_address(self.address)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return addr.is_loopback


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _parse_address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listeners(pid: int | None = None) -> list[Listener]:
    """The TCP sockets process `pid` (default: this one) listens on (Linux, from /proc)."""
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table.rsplit('/', 1)[1]}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or int(cols[9]) not in inodes:  # 0A: LISTEN
                continue
            host, port = cols[1].split(":")
            found.add(Listener(_parse_address(host), int(port, 16)))
    return sorted(found, key=lambda x: (x.port, x.address))


def exposed(pid: int | None = None) -> list[Listener]:
    """The listeners of `pid` that are reachable from other machines (not on loopback)."""
    return [x for x in listeners(pid) if not x.loopback]
