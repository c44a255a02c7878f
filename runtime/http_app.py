"""An aiohttp server in front of a backend (an `Engine` or the router's client): the lifecycle,
the response counting and the authentication shared by the OpenAI server and the PD workers.

`protect(...)` before `start()`: with a `ClusterKey` every path but `/health` (and `/info`) needs
the deployment's `X-PDSIM-Auth` token (the workers' internal API); with an API key every path but
`/health` needs `Authorization: Bearer KEY` (the public API). Refused calls get a 401 JSON error
and never reach a handler.
"""

from __future__ import annotations

import logging

from aiohttp import web

from runtime.security import ClusterKey, api_key_middleware, cluster_middleware

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a larger request body gets 413


class AppServer:
    """Subclasses give `make_app()` (built on `new_app()`, which installs the JSON errors and
    the response counting) and `counted(path)`, naming the paths whose response codes go to
    `metrics`."""

    def __init__(self, engine, metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._runner: web.AppRunner | None = None
        self.host = ""
        self.port = 0
        self._guards: list = []

    def make_app(self) -> web.Application:
        raise NotImplementedError

    def new_app(self) -> web.Application:
        """An app with the JSON error format, the response counting and the body limit."""
        return web.Application(middlewares=[json_errors, self._count],
                               client_max_size=MAX_BODY_BYTES)

    def counted(self, path: str) -> bool:
        raise NotImplementedError

    def protect(self, *, cluster_key: ClusterKey | None = None, api_key: str | None = None,
                open_paths: tuple[str, ...] = ("/health", "/info")) -> None:
        """Require the cluster token and/or the API key on every path but `open_paths`."""
        if cluster_key is not None:
            self._guards.append(cluster_middleware(cluster_key, open_paths))
        if api_key:
            self._guards.append(api_key_middleware(api_key, open_paths))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the engine (if needed) and listen; returns the bound port (`port=0`: any). If
        listening fails (the port is taken, say) nothing is left running."""
        if not self.engine.running:
            self.engine.start()
        app = self.make_app()
        app.middlewares[0:0] = self._guards  # before anything else runs
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=5.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            await self.engine.shutdown()
            raise
        bound = runner.addresses
        self._runner, self.host, self.port = runner, host, (bound[0][1] if bound else port)
        return self.port

    async def close(self) -> None:
        """Stop the engine (unfinished requests fail with "server shutting down"), then HTTP."""
        await self.engine.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = request.path if self.counted(request.path) else None
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if endpoint:
                self.metrics.observe_http(endpoint, exc.status)
            raise
        if endpoint:
            self.metrics.observe_http(endpoint, response.status)
        return response


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (404 no such path, 405 wrong method, 413 body too large) in the
    JSON error format `{"error": {"message", "type", "param", "code"}}`, headers (Allow) kept."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = f"{exc.status} {exc.reason}: {exc.text}" if exc.text else exc.reason
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        return web.json_response(
            {"error": {"message": message, "type": kind, "param": None, "code": None}},
            status=exc.status, headers=headers)
    except Exception as exc:  # noqa: BLE001 - a bug in a handler: logged, answered in JSON
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": {"message": f"server error: {exc!r}",
                                            "type": "server_error", "param": None,
                                            "code": None}}, status=500)
