"""The HTTP bootstrap server of a prefill instance: a directory of its ranks, no data.

Each prefill rank registers itself with `PUT /route` (a JSON `RankRegistration`). A decode rank
looks one up with `GET /route?prefill_dp_rank=&target_tp_rank=&target_pp_rank=`; all three `-1`
returns the instance's `ParallelInfo` (sizes, page size, KV dtype) instead. Until every expected
rank (tp_size * dp_size * pp_size, learned from the first registration) has registered, every
`GET /route` answers 503, so a decode rank never talks to half an instance. `GET /health` is 200.

It is served like every HTTP listener of the backend (runtime/http_app.py: JSON errors,
`HttpLimits`). With a `ClusterKey`, `/route` needs the deployment's `X-PDSIM-Auth` token (401
without it). A rank registers once: the same registration again is a no-op, a different one for
a registered rank is refused with 409 (a restarted prefill instance starts a new bootstrap
server, so a registered rank never moves while its server lives; anything else is a mistake or
an attack).

`BootstrapServer` runs aiohttp on its own event loop in a background thread (`start` / `stop`);
`BootstrapClient` is a small synchronous client (urllib) that retries with backoff while the
server is unreachable or still answers 503 (a restarting prefill instance), until its timeout or
until the caller's `cancelled()` says the answer is no longer wanted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields

from aiohttp import web

from pdsim.deployment import HttpLimits
from runtime.checks import BadRequest, parse_json
from runtime.http_app import HttpListener, new_app
from runtime.security import ClusterKey, cluster_middleware


class BootstrapError(RuntimeError):
    """The bootstrap server refused a request, or did not become ready in time (`unavailable`:
    it was unreachable or not ready, as while its prefill instance restarts)."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class RankConflict(ValueError):
    """A rank registered again with a different address or layout."""


class BootstrapMismatchError(ValueError):
    """The decode side's KV layout does not match the prefill instance's."""


@dataclass(frozen=True, slots=True)
class ParallelInfo:
    """What a decode rank must know about a prefill instance before talking to its ranks."""

    tp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_dtype: str
    is_mla: bool = False
    total_kv_heads: int = 0


@dataclass(frozen=True, slots=True)
class RankRegistration:
    """One prefill rank: where its ZMQ socket listens and where it sits in the instance."""

    ip: str
    zmq_port: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    page_size: int
    kv_dtype: str
    is_mla: bool = False
    total_kv_heads: int = 0
    session_id: str = ""  # the rank's transfer-engine session ("host:rpc_port"), if any

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.dp_rank, self.tp_rank, self.pp_rank)

    def info(self) -> ParallelInfo:
        return ParallelInfo(
            tp_size=self.tp_size, dp_size=self.dp_size, pp_size=self.pp_size,
            page_size=self.page_size, kv_dtype=self.kv_dtype, is_mla=self.is_mla,
            total_kv_heads=self.total_kv_heads,
        )

    @classmethod
    def from_json(cls, obj: object) -> RankRegistration:
        """Strict parse: every field present with its type, nothing extra (`ValueError` if not)."""
        if not isinstance(obj, dict):
            raise ValueError(f"registration must be a JSON object, got {type(obj).__name__}")
        allowed = {f.name: f for f in fields(cls)}
        extra = sorted(set(obj) - set(allowed))
        if extra:
            raise ValueError(f"unknown registration fields {extra}; allowed: {sorted(allowed)}")
        kwargs = {}
        for name, f in allowed.items():
            if name not in obj:
                if f.default is MISSING:
                    raise ValueError(f"registration is missing field {name!r}")
                continue
            kwargs[name] = _check_type(name, obj[name], _FIELD_TYPES[name])
        reg = cls(**kwargs)
        reg._validate()
        return reg

    def _validate(self) -> None:
        for size, rank, what in (
            (self.tp_size, self.tp_rank, "tp"), (self.dp_size, self.dp_rank, "dp"),
            (self.pp_size, self.pp_rank, "pp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what}_rank must be in 0..{what}_size-1, got {rank} of {size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 < self.zmq_port < 65536:
            raise ValueError(f"zmq_port must be in 1..65535, got {self.zmq_port}")
        if not self.ip:
            raise ValueError("ip must not be empty")


_FIELD_TYPES = {
    "ip": str, "zmq_port": int, "tp_rank": int, "tp_size": int, "dp_rank": int, "dp_size": int,
    "pp_rank": int, "pp_size": int, "page_size": int, "kv_dtype": str, "is_mla": bool,
    "total_kv_heads": int, "session_id": str,
}


def _check_type(name: str, value: object, want: type) -> object:
    # bool is an int in Python; keep the two apart so `"tp_rank": true` is an error.
    if type(value) is not want:
        raise ValueError(f"field {name!r} must be {want.__name__}, got {value!r}")
    return value


def check_compatible(info: ParallelInfo, *, page_size: int, kv_dtype: str) -> None:
    """Raise `BootstrapMismatchError` unless a decode rank's page size and KV dtype match."""
    problems = []
    if info.page_size != page_size:
        problems.append(f"page_size: prefill {info.page_size}, decode {page_size}")
    if info.kv_dtype != kv_dtype:
        problems.append(f"kv_dtype: prefill {info.kv_dtype!r}, decode {kv_dtype!r}")
    if problems:
        raise BootstrapMismatchError(
            "prefill and decode KV layouts differ (" + "; ".join(problems) + "); "
            "KV pages can only be copied between identical layouts"
        )


# ---- server ------------------------------------------------------------------------------


class _Directory:
    """The registered ranks of one prefill instance (touched only on the server's loop)."""

    def __init__(self) -> None:
        self.info: ParallelInfo | None = None
        self.ranks: dict[tuple[int, int, int], RankRegistration] = {}

    @property
    def expected(self) -> int:
        return 0 if self.info is None else self.info.tp_size * self.info.dp_size * self.info.pp_size

    @property
    def complete(self) -> bool:
        return self.info is not None and len(self.ranks) == self.expected

    def register(self, reg: RankRegistration) -> None:
        if self.info is None:
            self.info = reg.info()
        elif reg.info() != self.info:
            raise ValueError(
                f"rank {reg.key} registers {reg.info()}, but the instance already has {self.info}"
            )
        known = self.ranks.get(reg.key)
        if known is not None and known != reg:
            raise RankConflict(
                f"rank (dp, tp, pp) = {reg.key} is registered at {known.ip}:{known.zmq_port} "
                f"(session {known.session_id!r}); refusing {reg.ip}:{reg.zmq_port} (session "
                f"{reg.session_id!r}): a restarted instance starts a new bootstrap server")
        self.ranks[reg.key] = reg


def _error(status: int, message: str, **extra: object) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _int_param(query, name: str) -> int:
    raw = query.get(name)
    if raw is None:
        raise ValueError(f"missing query parameter {name!r}")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name!r} must be an integer, got {raw!r}") from None


class BootstrapServer:
    """`PUT/GET /route` and `GET /health` on `host:port` (port 0 picks a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 key: ClusterKey | None = None, limits: HttpLimits | None = None) -> None:
        self.host = host
        self.port = port
        self._key = key
        self.limits = limits or HttpLimits()
        self._dir = _Directory()
        self.answer_delay_s = 0.0  # fault injection: every GET /route answers this much later
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: HttpListener | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> BootstrapServer:
        if self._thread is not None:
            raise RuntimeError("bootstrap server already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # reported to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._listener.close())
            loop.close()

        self._thread = threading.Thread(target=run, name="bootstrap-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise BootstrapError(f"bootstrap server did not start within {timeout_s} s")
        if failure:
            self._thread = None
            raise BootstrapError(f"bootstrap server failed to start on {self.host}:{self.port}: "
                                 f"{failure[0]}") from failure[0]
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> BootstrapServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self) -> None:
        app = new_app(self.limits, [] if self._key is None else [cluster_middleware(self._key)])
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_get("/health", self._health)
        self._listener = HttpListener(app, self.limits)
        self.port = await self._listener.start(self.host, self.port)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "registered": len(self._dir.ranks),
                                  "expected": self._dir.expected})

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = parse_json(await request.read())
        except BadRequest as exc:
            return _error(400, exc.message)
        try:
            reg = RankRegistration.from_json(body)
            self._dir.register(reg)
        except RankConflict as exc:
            return _error(409, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response({"status": "registered", "registered": len(self._dir.ranks),
                                  "expected": self._dir.expected})

    async def _get_route(self, request: web.Request) -> web.Response:
        if self.answer_delay_s:
            await asyncio.sleep(self.answer_delay_s)
        try:
            key = tuple(_int_param(request.query, n)
                        for n in ("prefill_dp_rank", "target_tp_rank", "target_pp_rank"))
        except ValueError as exc:
            return _error(400, str(exc))
        d = self._dir
        wants_info = key == (-1, -1, -1)
        if not wants_info and min(key) < 0:
            return _error(400, f"ranks must all be >= 0, or all -1 for the parallel info; "
                               f"got {key}")
        if d.info is not None and not wants_info:
            dp, tp, pp = key
            if dp >= d.info.dp_size or tp >= d.info.tp_size or pp >= d.info.pp_size:
                return _error(404, f"no prefill rank (dp, tp, pp) = {key}; the instance has "
                                   f"dp={d.info.dp_size} tp={d.info.tp_size} pp={d.info.pp_size}")
        if not d.complete:
            return _error(503, f"prefill instance not ready: {len(d.ranks)} of "
                               f"{d.expected or '?'} ranks registered",
                          registered=len(d.ranks), expected=d.expected)
        if wants_info:
            return web.json_response(asdict(d.info))
        return web.json_response(asdict(d.ranks[key]))


# ---- client ------------------------------------------------------------------------------


class BootstrapClient:
    """Synchronous access to one bootstrap server, retrying while it is not ready."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 30.0,
                 backoff_s: float = 0.05, max_backoff_s: float = 1.0,
                 key: ClusterKey | None = None) -> None:
        self.base = f"http://{host}:{port}"
        self._headers = {"Content-Type": "application/json",
                         **({} if key is None else key.headers())}
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def register(self, reg: RankRegistration) -> None:
        self._request("PUT", "/route", body=asdict(reg))

    def parallel_info(self, cancelled: Callable[[], bool] | None = None) -> ParallelInfo:
        return ParallelInfo(**self._get_route(-1, -1, -1, cancelled))

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int = 0,
             cancelled: Callable[[], bool] | None = None) -> RankRegistration:
        return RankRegistration.from_json(self._get_route(dp_rank, tp_rank, pp_rank, cancelled))

    def health(self) -> bool:
        try:
            self._request("GET", "/health", retry=False)
        except BootstrapError:
            return False
        return True

    def _get_route(self, dp: int, tp: int, pp: int,
                   cancelled: Callable[[], bool] | None) -> dict:
        q = urllib.parse.urlencode(
            {"prefill_dp_rank": dp, "target_tp_rank": tp, "target_pp_rank": pp})
        return self._request("GET", f"/route?{q}", cancelled=cancelled)

    def _request(self, method: str, path: str, body: dict | None = None,
                 retry: bool = True, cancelled: Callable[[], bool] | None = None) -> dict:
        """One call; 503 and connection errors are retried with backoff until `timeout_s`, or
        until `cancelled()` is true."""
        deadline = time.monotonic() + self.timeout_s
        delay = self.backoff_s
        data = None if body is None else json.dumps(body).encode()
        while True:
            req = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers=self._headers)
            try:
                with urllib.request.urlopen(req, timeout=max(0.1, self.timeout_s)) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                reason = _error_text(exc)
                if exc.code != 503:
                    raise BootstrapError(
                        f"{method} {self.base}{path} -> {exc.code}: {reason}") from None
                last = f"503: {reason}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = f"unreachable: {getattr(exc, 'reason', exc)}"
            if not retry or time.monotonic() + delay > deadline:
                raise BootstrapError(f"{method} {self.base}{path} not answered within "
                                     f"{self.timeout_s} s (last: {last})", unavailable=True)
            if cancelled is not None and cancelled():
                raise BootstrapError(f"{method} {self.base}{path}: no longer wanted (last: "
                                     f"{last})", unavailable=True)
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        error = json.loads(exc.read()).get("error", "")
        return error.get("message", "") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        return exc.reason or ""
