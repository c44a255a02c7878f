"""The HTTP API of a prefill or decode worker (rank 0 of its instance; aiohttp). The router
(runtime/router.py) is its client; docs/serving.md documents it.

- `POST /generate` `{"rid", "input_ids", "max_new_tokens", "sampling": {"temperature", "top_p",
  "top_k", "seed"}, "stop_token_ids", "top_logprobs", "bootstrap_host", "bootstrap_port",
  "bootstrap_room"}` (`sampling`, `stop_token_ids` and `top_logprobs` may be left out; other
  keys are refused).
  Prefill: answers when the request is done on this side (its KV sent, or failed):
  `200 {"rid", "status": "ok", "token_ids", "logprobs", "top_logprobs"}` (the first token, for
  information: the decode side streams it), else an error status.
  Decode: `200` and a server-sent-event stream, one `data: {"token_ids", "logprobs",
  "top_logprobs", "finished", "finish_reason", "error", "prompt_tokens", "completion_tokens"}`
  per engine event (the first carries the first token, from the prefill side's metadata), then
  `data: [DONE]`. A request that fails before its first token gets an error status instead.
  Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed request or
  one the instance can never hold, 409 for a request id in use, 503 while shutting down, 500 for
  a failure on the way (transfer, timeout, crossed metadata), the reason in the message.
- `POST /abort` `{"rid", "reason"}`: fail the request wherever it is (the other side learns
  through the transfer layer).
- `GET /health` (also `/info`): role, instance, tp, model, and a prefill worker's bootstrap
  server; 503 once the engine stopped.
- `GET /load` `{"num_active", "pending_tokens", "queues"}`, `GET /metrics` (Prometheus),
  `GET /records` (the finished requests' `RequestRecord`s), `GET /pools` `{"full", "detail"}`
  (every rank: are all pages, request slots and metadata slots back?).

When a client goes away before its answer, the request is aborted.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from runtime.engine import EngineStopped, StreamEvent
from runtime.executor import MAX_TOP_LOGPROBS
from runtime.http_app import AppServer
from runtime.pd.engine import PDEngine
from runtime.sampling import SamplingParams
from runtime.serve_metrics import CONTENT_TYPE
from runtime.server import BadRequest

ROOM_LIMIT = 2**63
GENERATE_FIELDS = ("rid", "input_ids", "max_new_tokens", "sampling", "stop_token_ids",
                   "top_logprobs", "bootstrap_host", "bootstrap_port", "bootstrap_room")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


@dataclass(frozen=True)
class GenerateParams:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int]
    top_logprobs: int
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_generate(body: Any, *, model_vocab: int, max_position: int) -> GenerateParams:
    """A `/generate` body, checked field by field (`BadRequest` names the field)."""
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body is a JSON {type(body).__name__}; allowed: an object")
    extra = sorted(set(body) - set(GENERATE_FIELDS))
    if extra:
        raise BadRequest(extra[0], f"unknown fields {extra}; allowed: {list(GENERATE_FIELDS)}")
    for name in ("rid", "input_ids", "max_new_tokens", "bootstrap_host", "bootstrap_port",
                 "bootstrap_room"):
        if name not in body:
            raise BadRequest(name, f"{name} is required")
    rid = body["rid"]
    if not isinstance(rid, str) or not rid:
        raise BadRequest("rid", f"rid={rid!r}; allowed: a non-empty string")
    ids = body["input_ids"]
    if not (isinstance(ids, list) and ids and all(_int(t) for t in ids)):
        raise BadRequest("input_ids", "input_ids must be a non-empty list of token ids")
    bad = [t for t in ids if not 0 <= t < model_vocab]
    if bad:
        raise BadRequest("input_ids", f"token ids {bad[:5]} are outside the vocabulary; "
                         f"allowed: 0..{model_vocab - 1}")
    max_new = body["max_new_tokens"]
    if not _int(max_new) or max_new < 1:
        raise BadRequest("max_new_tokens", f"max_new_tokens={max_new!r}; allowed: an integer >= 1")
    if len(ids) + max_new > max_position:
        raise BadRequest("max_new_tokens", f"input ({len(ids)} tokens) + max_new_tokens "
                         f"({max_new}) = {len(ids) + max_new}; allowed: at most {max_position} "
                         "(the model's max position)")
    sampling = _sampling(body.get("sampling"))
    stop = body.get("stop_token_ids") or []
    if not (isinstance(stop, list) and all(_int(t) for t in stop)):
        raise BadRequest("stop_token_ids", "stop_token_ids must be a list of token ids")
    top = body.get("top_logprobs") or 0
    if not _int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest("top_logprobs", f"top_logprobs={top!r}; allowed: an integer "
                         f"0..{MAX_TOP_LOGPROBS}")
    host, port, room = body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]
    if not isinstance(host, str) or not host:
        raise BadRequest("bootstrap_host", f"bootstrap_host={host!r}; allowed: a host name")
    if not _int(port) or not 0 < port < 65536:
        raise BadRequest("bootstrap_port", f"bootstrap_port={port!r}; allowed: 1..65535")
    if not _int(room) or not 0 <= room < ROOM_LIMIT:
        raise BadRequest("bootstrap_room", f"bootstrap_room={room!r}; allowed: 0..2**63-1")
    return GenerateParams(rid, ids, max_new, sampling, stop, top, host, port, room)


def _sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("sampling", "sampling must be an object {temperature, top_p, top_k, "
                         "seed}")
    extra = sorted(set(raw) - set(SAMPLING_FIELDS))
    if extra:
        raise BadRequest(f"sampling.{extra[0]}", f"unknown sampling fields {extra}; allowed: "
                         f"{list(SAMPLING_FIELDS)}")
    temperature, top_p = raw.get("temperature", 0.0), raw.get("top_p", 1.0)
    top_k, seed = raw.get("top_k", 0), raw.get("seed")
    if not _number(temperature) or temperature < 0:
        raise BadRequest("sampling.temperature", f"temperature={temperature!r}; allowed: >= 0")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise BadRequest("sampling.top_p", f"top_p={top_p!r}; allowed: a number in (0, 1]")
    if top_k == -1:
        top_k = 0
    if not _int(top_k) or top_k < 0:
        raise BadRequest("sampling.top_k", f"top_k={top_k!r}; allowed: an integer >= 0 "
                         "(0 or -1 disable it)")
    if seed is not None and not _int(seed):
        raise BadRequest("sampling.seed", f"seed={seed!r}; allowed: an integer or null")
    return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                          seed=seed)


def event_json(event: StreamEvent) -> dict:
    """One engine event as the decode stream's JSON object."""
    return {
        "token_ids": list(event.token_ids), "logprobs": list(event.logprobs),
        "top_logprobs": [[[i, v] for i, v in top] for top in event.top_logprobs],
        "finished": event.finished, "finish_reason": event.finish_reason, "error": event.error,
        "prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
    }


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def error_status(event: StreamEvent) -> int:
    if event.status:
        return event.status
    return 503 if event.error and "shutting down" in event.error else 500


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True)
class WorkerInfo:
    """What `/health` reports about this worker."""

    role: str
    instance: int
    tp: int
    model: str
    model_vocab: int
    max_position: int
    bootstrap_host: str = ""  # prefill workers only
    bootstrap_port: int = 0


class WorkerServer(AppServer):
    """Rank 0's HTTP front: `port = await server.start(host, port)`, `await server.close()`."""

    def __init__(self, engine: PDEngine, info: WorkerInfo) -> None:
        super().__init__(engine, engine.metrics)
        self.info = info

    def counted(self, path: str) -> bool:
        return path in ("/generate", "/abort")

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._count], client_max_size=64 << 20)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/records", self.records)
        app.router.add_get("/pools", self.pools)
        return app

    # ---- endpoints ----

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = json.loads(await request.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(None, f"the body is not valid JSON: {exc}") from None
            g = parse_generate(body, model_vocab=self.info.model_vocab,
                               max_position=self.info.max_position)
        except BadRequest as exc:
            return _error(exc.message, 400, exc.param)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def sink(event: StreamEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            self.engine.submit(g.input_ids, g.max_new_tokens, sink, sampling=g.sampling,
                               stop_token_ids=g.stop_token_ids, top_logprobs=g.top_logprobs,
                               rid=g.rid, bootstrap_host=g.bootstrap_host,
                               bootstrap_port=g.bootstrap_port, bootstrap_room=g.bootstrap_room)
        except EngineStopped:
            return _error("the worker is shutting down", 503)
        except ValueError as exc:
            return _error(str(exc), 400)
        answered = False
        try:
            if self.info.role == "prefill":
                response = await self._prefill_reply(g, queue)
            else:
                response = await self._decode_stream(request, queue)
            answered = True
            return response
        finally:
            if not answered:  # the client went away (or writing to it failed)
                self.engine.abort(g.rid, "client disconnected")

    async def _prefill_reply(self, g: GenerateParams,
                             queue: asyncio.Queue[StreamEvent]) -> web.Response:
        ids, logprobs, tops = [], [], []
        while True:
            event = await queue.get()
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            tops.extend([[i, v] for i, v in top] for top in event.top_logprobs)
            if event.finished:
                break
        if event.error:
            return _error(event.error, error_status(event))
        return web.json_response({"rid": g.rid, "status": "ok", "token_ids": ids,
                                  "logprobs": _finite(logprobs), "top_logprobs": tops})

    async def _decode_stream(self, request: web.Request,
                             queue: asyncio.Queue[StreamEvent]) -> web.StreamResponse:
        event = await queue.get()
        if event.finished and event.error and not event.token_ids:
            return _error(event.error, error_status(event))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        while True:
            data = json.dumps(event_json(event), separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())
            if event.finished:
                break
            event = await queue.get()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"the body is not valid JSON: {exc}", 400)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            return _error("the body must be an object with a string rid", 400, "rid")
        reason = body.get("reason") or "aborted by the router"
        if not isinstance(reason, str):
            return _error("reason must be a string", 400, "reason")
        self.engine.abort(body["rid"], reason)
        return web.json_response({"rid": body["rid"], "status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        body = {"status": "ok" if self.engine.running else "stopped", "url": self.url,
                **asdict(self.info)}
        return web.json_response(body, status=200 if self.engine.running else 503)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({**self.engine.load, "queues": self.engine.queues})

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(text=self.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    async def records(self, request: web.Request) -> web.Response:
        try:
            rows = await self._on_engine(lambda: [asdict(r) for r in self.engine.records])
        except EngineStopped:
            return _error("the worker is shutting down", 503)
        return web.json_response([{k: _finite(v) for k, v in row.items()} for row in rows])

    async def pools(self, request: web.Request) -> web.Response:
        try:
            state = await asyncio.get_running_loop().run_in_executor(None, self.engine.pools)
        except EngineStopped:
            return _error("the worker is shutting down", 503)
        return web.json_response(state)

    async def _on_engine(self, fn):
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.call, fn)
