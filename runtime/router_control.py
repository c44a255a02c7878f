"""The router's internal control routes: workers join and leave while it serves.

- `GET /workers`: `{"workers": [{"name", "role", "url", "state": "serving" | "draining",
  "requests"}]}`.
- `POST /workers` `{"role": "prefill" | "decode", "url", "bootstrap_host", "bootstrap_port"}`
  (bootstrap: prefill only, default: what the worker's `/health` names): the worker joins once
  it answers `/health` as that role and takes the router's cluster token; 200 with its entry.
- `POST /workers/remove` `{"url"}`: the worker drains (no new requests; its calls in flight
  finish), then leaves; 200 with its entry once it has, after which it may be stopped.

Like the workers' internal API, these need the deployment's cluster token (`X-PDSIM-Auth`,
runtime/security.py) and never the public API key. Bad input is a 400 naming the field and
what is allowed; an unknown worker 404; one already there, already draining or the last of its
role 409. The launcher adds `POST /scale` here (runtime/launcher.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from runtime.checks import BadRequest, parse_json, short_repr
from runtime.http_app import error_json
from runtime.security import ClusterKey, cluster_middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def internal_guard(key: ClusterKey | None, paths: frozenset[str]) -> Callable:
    """aiohttp middleware: `paths` need the cluster token (none: open, as an insecure
    deployment's workers are); every other path passes untouched."""
    check = None if key is None else cluster_middleware(key, open_paths=())

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        if check is not None and request.path in paths:
            return await check(request, handler)
        return await handler(request)

    return guard


async def read_object(request: web.Request, fields: dict[str, type | tuple[type, ...]],
                      required: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object in `request`'s body, holding only `fields` (each of its type), the
    `required` ones given; `BadRequest` naming the field otherwise."""
    body = parse_json(await request.read())
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body is a JSON {type(body).__name__}; allowed: an object "
                               f"with {', '.join(fields)}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field {unknown[0]!r}; allowed: "
                                     f"{', '.join(fields)}")
    for name in required:
        if name not in body:
            raise BadRequest(name, f"{name}: missing; required: {', '.join(required)}")
    for name, value in body.items():
        kind = fields[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (
                kind if isinstance(kind, tuple) else (kind,))):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise BadRequest(name, f"{name}: {short_repr(value)}; allowed: a {names}")
    return body


def worker_url(value: str) -> str:
    """`http://host:port` (a trailing slash dropped), or `BadRequest` naming `url`."""
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if parts is None or parts.scheme != "http" or not parts.hostname or port is None \
            or parts.path or parts.query or parts.fragment:
        raise BadRequest("url", f"url: {short_repr(value)}; allowed: http://HOST:PORT, the "
                                "worker's HTTP API")
    return url


class MembershipError(Exception):
    """A worker cannot be added or removed: `status` (400 bad input, 404 unknown, 409 in
    conflict with the deployment now) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class WorkerRoutes:
    """`/workers` over a `PDClient` (runtime/router.py)."""

    def __init__(self, client) -> None:
        self.client = client

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [("GET", "/workers", self.list), ("POST", "/workers", self.add),
                ("POST", "/workers/remove", self.remove)]

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [m.describe() for m in self.client.members()]})

    async def add(self, request: web.Request) -> web.Response:
        try:
            body = await read_object(request, {"role": str, "url": str, "bootstrap_host": str,
                                               "bootstrap_port": int}, ("role", "url"))
            url = worker_url(body["url"])
            port = body.get("bootstrap_port", 0)
            if not 0 <= port <= 65535:
                raise BadRequest("bootstrap_port", f"bootstrap_port: {port}; allowed: 1 to 65535")
            if ("bootstrap_host" in body) != ("bootstrap_port" in body):
                raise BadRequest("bootstrap_port", "bootstrap_host and bootstrap_port: give "
                                                   "both or neither")
        except BadRequest as exc:
            return error_json(400, exc.message)
        try:
            member = await self.client.add_worker(body["role"], url,
                                                  body.get("bootstrap_host", ""), port)
        except MembershipError as exc:
            return error_json(exc.status, exc.message)
        return web.json_response(member.describe())

    async def remove(self, request: web.Request) -> web.Response:
        try:
            body = await read_object(request, {"url": str}, ("url",))
            url = worker_url(body["url"])
        except BadRequest as exc:
            return error_json(400, exc.message)
        try:
            member = await self.client.remove_worker(url)
        except MembershipError as exc:
            return error_json(exc.status, exc.message)
        return web.json_response({**member.describe(), "state": "left"})
