"""Every HTTP listener of the real backend (the OpenAI server, the router, the PD workers, the
bootstrap servers): the app, the limits, the JSON errors, the lifecycle.

`new_app(limits, middlewares)` makes an aiohttp app whose every error is the JSON error
`{"error": {"message", "type", "param", "code"}}` (`json_errors`: 404, 405, 413, a handler's
bug), whose bodies are limited while they are read, and `HttpListener` serves it under the
`HttpLimits` of the config (`security.limits`): the idle keep-alive timeout, the header limits,
the accept backlog and the connection cap (`_ConnectionGate`), and answers requests aiohttp
cannot even parse (a header too long, a bad request line) in the same JSON. A client's error never
names an internal address; a server's bug is logged and answered "internal server error".

`AppServer` puts an `Engine`-like backend behind such an app: `protect(...)` before `start()`:
with a `ClusterKey` every path but `/health` (and `/info`) needs the deployment's `X-PDSIM-Auth`
token (the workers' internal API); with an API key every path but `/health` needs
`Authorization: Bearer KEY` (the public API). Refused calls get a 401 JSON error and never reach
a handler.

Logging: repeated identical lines of these servers (and of asyncio's accept loop, which logs
"Too many open files" for every refused accept) go out at most once a second each, with the
count of the ones held back (`RateLimit`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable

from aiohttp import web

from pdsim.deployment import HttpLimits
from runtime.checks import short_repr
from runtime.security import ClusterKey, api_key_middleware, cluster_middleware

log = logging.getLogger(__name__)


# ---- logs ----------------------------------------------------------------------------------


class RateLimit(logging.Filter):
    """At most one record per `interval_s` for each (logger, level, message template); the next
    one that passes says how many were held back meanwhile."""

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._seen: dict[tuple, list] = {}  # key -> [time of the last line out, held back]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.interval_s:
                seen[1] += 1
                return False
            held = seen[1] if seen is not None else 0
            if len(self._seen) >= self._max_keys:  # forget the quiet ones
                self._seen = {k: v for k, v in self._seen.items()
                              if now - v[0] < self.interval_s or v[1]}
            self._seen[key] = [now, 0]
        if held:
            record.msg = f"{record.getMessage()} [{held} more like this in the last " \
                         f"{now - seen[0]:.1f} s not logged]"
            record.args = ()
        return True


LOG_RATE_LIMIT = RateLimit()
RATE_LIMITED_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.web", __name__)


def rate_limit_logs(names: Iterable[str] = RATE_LIMITED_LOGGERS) -> None:
    """Put `LOG_RATE_LIMIT` on these loggers (once)."""
    for name in names:
        logger = logging.getLogger(name)
        if LOG_RATE_LIMIT not in logger.filters:
            logger.addFilter(LOG_RATE_LIMIT)


# ---- the app -------------------------------------------------------------------------------


def error_json(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": None}}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (404 no such path, 405 wrong method, 413 body too large, ...) and
    any other `HTTPException` in the JSON error format, headers (Allow) kept; a bug in a handler
    is logged and answered 500 "internal server error" (its text may name internals)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = _refusal_text(request, exc)
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        return error_json(exc.status, message, headers)
    except Exception:  # noqa: BLE001 - a bug in a handler: logged, answered in JSON
        log.exception("%s %s failed", request.method, request.path)
        return error_json(500, "internal server error")


def _refusal_text(request: web.Request, exc: web.HTTPException) -> str:
    """What aiohttp's own refusal says, without its default "404: Not Found" body: no such
    path, or the methods a path takes."""
    if exc.status == 404:
        return f"no route {request.method} {request.path}"
    if exc.status == 405:
        return (f"{request.method} is not allowed on {request.path}; allowed: "
                f"{exc.headers.get('Allow', '')}")
    default = f"{exc.status}: {exc.reason}"
    return f"{exc.reason}: {exc.text}" if exc.text and exc.text != default else exc.reason


def _admission(limits: HttpLimits) -> Callable:
    """Marks the connection busy while its request is handled (the connection cap evicts idle
    ones only) and refuses a body whose Content-Length is over the limit before reading any of
    it (a chunked body is cut by aiohttp's `client_max_size` once that much has been read)."""

    @web.middleware
    async def admit(request: web.Request, handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > limits.max_body_bytes:
            return error_json(413, f"the body has {length} bytes; allowed: at most "
                                   f"{limits.max_body_bytes} (security.limits.max_body_bytes)")
        conn = request.protocol
        if isinstance(conn, _Handler):
            conn.busy += 1
        try:
            return await handler(request)
        finally:
            if isinstance(conn, _Handler):
                conn.busy -= 1
                conn.idle_since = time.monotonic()

    return admit


def new_app(limits: HttpLimits, middlewares: Iterable[Callable] = (),
            count: Callable | None = None) -> web.Application:
    """An app with the JSON errors and the body limit; `middlewares` run inside them, `count`
    outside them all (it sees every answer, refusals included)."""
    outer = [count] if count is not None else []
    return web.Application(middlewares=[*outer, json_errors, _admission(limits), *middlewares],
                           client_max_size=limits.max_body_bytes)


# ---- the listener --------------------------------------------------------------------------


class _Handler(web.RequestHandler):
    """aiohttp's per-connection protocol, plus: requests it cannot parse are answered in JSON,
    and every new connection passes the gate."""

    def __init__(self, manager: web.Server, gate: _ConnectionGate, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.gate = gate
        self.busy = 0  # requests in a handler now
        self.idle_since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.gate.admit(self)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            log.error("a request from %s failed: %r", request.remote, exc)
            text = "internal server error"
        else:  # a malformed request (a header too long, a bad request line, ...)
            text = f"malformed HTTP request: {short_repr(message or repr(exc), 200)}"
            log.info("refused a malformed HTTP request from %s: %s", request.remote, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has begun: no error answer can follow")
        response = error_json(status, text)
        response.force_close()
        return response


class _ConnectionGate:
    """At most `max_connections` open: one more closes the connection idle the longest (no
    request in a handler, a new one that sent nothing included), or -- every one is busy -- is
    closed itself. So a flood of idle connections cannot keep a real client out."""

    def __init__(self, server: web.Server, max_connections: int) -> None:
        self.server = server
        self.max_connections = max_connections
        self.evicted = 0
        self.refused = 0

    def admit(self, new: _Handler) -> None:
        open_ = [h for h in self.server.connections if h.transport is not None]
        if len(open_) <= self.max_connections:
            return
        idle = [h for h in open_ if h is not new and getattr(h, "busy", 0) == 0]
        if idle:
            min(idle, key=lambda h: h.idle_since).force_close()
            self.evicted += 1
        else:
            new.force_close()
            self.refused += 1
            log.warning("refused a connection: all %d connections have a request in progress "
                        "(security.limits.max_connections)", self.max_connections)


class HttpListener:
    """`app` served on one TCP socket under `limits`: `port = await listener.start(host, port)`
    (port 0: any free one), `await listener.close()`."""

    def __init__(self, app: web.Application, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits
        self.port = 0
        self.gate: _ConnectionGate | None = None
        self._runner: web.AppRunner | None = None
        self._socket_server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        rate_limit_logs()
        lim = self.limits
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=5.0)
        await runner.setup()
        loop = asyncio.get_running_loop()
        gate = _ConnectionGate(runner.server, lim.max_connections)

        def connection() -> _Handler:
            return _Handler(runner.server, gate, loop=loop, access_log=None,
                            keepalive_timeout=lim.keepalive_timeout_s,
                            max_line_size=lim.max_line_bytes, max_field_size=lim.max_field_bytes)

        try:
            self._socket_server = await loop.create_server(connection, host, port,
                                                           backlog=lim.backlog)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self.gate = runner, gate
        self.port = self._socket_server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, finish or cut the connections (5 s), release the socket."""
        if self._socket_server is None:
            return
        self._socket_server.close()
        await self._runner.cleanup()
        await self._socket_server.wait_closed()
        self._socket_server = self._runner = None


# ---- a backend behind an app ---------------------------------------------------------------


class AppServer:
    """Subclasses give `make_app()` (built on `new_app()`, which installs the JSON errors, the
    limits, the guards of `protect` and the response counting) and `counted(path)`, naming the
    paths whose response codes go to `metrics`."""

    def __init__(self, engine, metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.http_limits = HttpLimits()
        self._listener: HttpListener | None = None
        self.host = ""
        self.port = 0
        self._guards: list = []

    def make_app(self) -> web.Application:
        raise NotImplementedError

    def new_app(self) -> web.Application:
        """An app with the JSON error format, the limits, the guards and the response counting
        (outermost: refusals by the guards and the limits count too)."""
        return new_app(self.http_limits, self._guards, count=self._count)

    def counted(self, path: str) -> bool:
        raise NotImplementedError

    def protect(self, *, cluster_key: ClusterKey | None = None, api_key: str | None = None,
                open_paths: tuple[str, ...] = ("/health", "/info"),
                limits: HttpLimits | None = None) -> None:
        """Require the cluster token and/or the API key on every path but `open_paths`; serve
        under `limits` (default: `HttpLimits()`)."""
        if cluster_key is not None:
            self._guards.append(cluster_middleware(cluster_key, open_paths))
        if api_key:
            self._guards.append(api_key_middleware(api_key, open_paths))
        if limits is not None:
            self.http_limits = limits

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the engine (if needed) and listen; returns the bound port (`port=0`: any). If
        listening fails (the port is taken, say) nothing is left running."""
        if not self.engine.running:
            self.engine.start()
        listener = HttpListener(self.make_app(), self.http_limits)
        try:
            await listener.start(host, port)
        except BaseException:
            await self.engine.shutdown()
            raise
        self._listener, self.host, self.port = listener, host, listener.port
        return self.port

    async def close(self) -> None:
        """Stop the engine (unfinished requests fail with "server shutting down"), then HTTP."""
        await self.engine.shutdown()
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    @web.middleware
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        """Each counted path's answers by code; requests to no route count as one endpoint,
        "unmatched", so that clients cannot add series at will."""
        if self.counted(request.path):
            endpoint = request.path
        elif request.match_info.http_exception is not None:
            endpoint = "unmatched"
        else:
            endpoint = None
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if endpoint:
                self.metrics.observe_http(endpoint, exc.status)
            raise
        if endpoint:
            self.metrics.observe_http(endpoint, response.status)
        return response
