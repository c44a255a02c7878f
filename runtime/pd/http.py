"""The HTTP API of a prefill or decode worker (rank 0 of its instance; aiohttp). The router
(runtime/router.py) is its client; docs/serving.md documents it.

- `POST /generate` `{"version": 3, "rid", "input_ids", "max_new_tokens", "sampling":
  {"temperature", "top_p", "top_k", "seed"}, "stop_token_ids", "top_logprobs", "bootstrap_host",
  "bootstrap_port", "bootstrap_room"}`, a `GenerateParams` (runtime/protocol/worker.py, which
  the router encodes with `to_body()`); `sampling`, `stop_token_ids` and `top_logprobs` may be
  left out; other keys and other versions are refused.
  Prefill: answers when the request is done on this side (its KV sent, or failed):
  `200 {"rid", "status": "ok", "token_ids", "logprobs", "top_logprobs"}` (the first token, for
  information: the decode side streams it), else an error status.
  Decode: `200` and a server-sent-event stream, one `data: {"version", "token_ids", "logprobs",
  "top_logprobs", "finished", "finish_reason", "error", "prompt_tokens", "completion_tokens",
  "cached_tokens", "status", "param"}` (a `StreamEvent`, runtime/protocol/stream.py) per engine
  event (the first carries the first token, from the prefill side's metadata), then
  `data: [DONE]`; a request's events that are ready at once (those that piled up while the
  event loop was busy) go out in one write. A request that fails before its first token gets an
  error status instead.
  Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed request or
  one the instance can never hold, 409 for a request id in use, 503 with Retry-After while
  shutting down, too busy, or when the peer worker of the transfer was lost (killed or
  restarting: `PEER_LOST` in the reason, runtime/streams.py), 500 for another failure on the
  way (a failed transfer, crossed metadata), the reason in the message.
- `POST /abort` `{"rid", "reason"}`: fail the request wherever it is (the other side learns
  through the transfer layer).
- `GET /health` (also `/info`): role, instance, tp, dp, model, a hybrid model's recurrent-state
  bytes per slot, and a prefill worker's bootstrap server; 503 once the engine stopped.
- `GET /load` `{"load", "num_active", "pending_tokens", "queues"}` (`load`: the scheduler's
  `load()`, the signal the simulator's router uses), `GET /metrics` (Prometheus),
  `GET /records` (the finished requests' `RequestRecord`s), `GET /pools` `{"full", "detail"}`
  (every rank: are all pages, request, metadata and state slots back?).

SGLang's router (runtime/sglang_compat.py) is a client too, with a `SGLangFront`: `POST
/generate` without `version` is SGLang's body, answered as SGLang answers it; `POST
/v1/completions` and `/v1/chat/completions` with the bootstrap fields it injects; `GET
/server_info`, `/model_info` (and their `/get_` names) and `/get_load`. pdsim's own versioned
body needs the cluster token whatever credentials admitted the call.

When a client goes away before its answer, the request is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from pdsim.deployment import HttpLimits
from runtime.checks import BadRequest, parse_json
from runtime.http_app import AppServer
from runtime.pd.lockstep_engine import PDEngine
from runtime.protocol.stream import StreamEvent, to_sse_data
from runtime.protocol.worker import GenerateParams, parse_generate
from runtime.security import ClusterKey
from runtime.serve_metrics import CONTENT_TYPE
from runtime.sglang_compat import (
    GenerateOutput, SGLangFront, load_rows, parse_sglang_generate, server_info, sse_line,
    worker_guard,
)
from runtime.streams import (
    RETRY_AFTER_S, ROUTER_ABORT, EngineStopped, EventQueue, failure_status, for_running_loop,
)

log = logging.getLogger(__name__)

def _error(message: str, status: int, param: str | None = None) -> web.Response:
    """The JSON error answer; a 503 (busy, stopping) says when to retry."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


def _failed(event: StreamEvent) -> web.Response:
    """A request that failed before its answer began: a refusal names `input_ids`."""
    return _error(event.error, failure_status(event), "input_ids" if event.param else None)


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
    dp: int = 1  # attention-DP ranks of the instance
    state_bytes_per_slot: int = 0  # a hybrid model's recurrent state per request, on one rank


class WorkerServer(AppServer):
    """Rank 0's HTTP front: `port = await server.start(host, port)`, `await server.close()`."""

    def __init__(self, engine: PDEngine, info: WorkerInfo, *,
                 max_inflight_requests: int = 4096, sglang: SGLangFront | None = None) -> None:
        super().__init__(engine, engine.metrics)
        self.metrics.name_model(info.model)
        self.info = info
        self.max_inflight_requests = max_inflight_requests
        self.sglang = sglang
        self._inflight = 0

    def counted(self, path: str) -> bool:
        return path in ("/generate", "/abort", "/v1/completions", "/v1/chat/completions")

    def protect(self, *, cluster_key: ClusterKey | None = None,
                limits: HttpLimits | None = None) -> None:
        """The cluster token on every path but `/health` and `/info`; with a `SGLangFront`,
        its SGLang routes also admit what it allows (runtime/sglang_compat.py)."""
        if cluster_key is not None:
            front = self.sglang
            self._guards.append(worker_guard(
                cluster_key, router_key=front.router_key if front else None,
                open_sglang=front.open_sglang if front else False))
        super().protect(limits=limits)

    def make_app(self) -> web.Application:
        app = self.new_app()
        app.router.add_post("/generate", self.generate)
        if self.sglang is not None:
            app.router.add_post("/v1/completions", self.sglang.openai.completions)
            app.router.add_post("/v1/chat/completions", self.sglang.openai.chat_completions)
            for path in ("/server_info", "/get_server_info"):
                app.router.add_get(path, self.server_info)
            for path in ("/model_info", "/get_model_info"):
                app.router.add_get(path, self.model_info)
            app.router.add_get("/get_load", self.get_load)
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
        stream = None  # pdsim's body; else SGLang's, streamed or not
        try:
            body = parse_json(await request.read())
            if self.sglang is not None and isinstance(body, dict) and "version" not in body:
                s = parse_sglang_generate(body, tokenizer=self.sglang.tokenizer,
                                          eos_ids=self.sglang.eos_ids,
                                          model_vocab=self.info.model_vocab,
                                          max_position=self.info.max_position)
                g, stream = s.params, s.stream
            elif request.get("internal", True) is False:
                return _error("pdsim's internal /generate body needs the deployment's "
                              "X-PDSIM-Auth token", 401)
            else:
                g = parse_generate(body, model_vocab=self.info.model_vocab,
                                   max_position=self.info.max_position)
        except BadRequest as exc:
            return _error(exc.message, 400, exc.param)
        if self._inflight >= self.max_inflight_requests:
            return _error(f"{self._inflight} requests in flight, the most this worker takes at "
                          "once; retry later", 503)
        queue = EventQueue()
        try:
            self.engine.submit(g.input_ids, g.max_new_tokens, for_running_loop().sink(queue),
                               sampling=g.sampling, stop_token_ids=g.stop_token_ids,
                               top_logprobs=g.top_logprobs,
                               rid=g.rid, bootstrap_host=g.bootstrap_host,
                               bootstrap_port=g.bootstrap_port, bootstrap_room=g.bootstrap_room)
        except EngineStopped:
            return _error("the worker is shutting down", 503)
        except ValueError as exc:
            return _error(str(exc), 400)
        answered = False
        self._inflight += 1
        try:
            if stream is not None:
                response = await self._sglang_reply(request, g, stream, queue)
            elif self.info.role == "prefill":
                response = await self._prefill_reply(g, queue)
            else:
                response = await self._decode_stream(request, g.rid, queue)
            answered = True
            return response
        finally:
            self._inflight -= 1
            if not answered:  # the client went away (or writing to it failed)
                self.engine.abort(g.rid, "client disconnected")

    async def _prefill_reply(self, g: GenerateParams,
                             queue: EventQueue) -> web.Response:
        ids, logprobs, tops = [], [], []
        while True:
            event = await queue.get()
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            tops.extend([[i, v] for i, v in top] for top in event.top_logprobs)
            if event.finished:
                break
        if event.error:
            return _failed(event)
        return web.json_response({"rid": g.rid, "status": "ok", "token_ids": ids,
                                  "logprobs": _finite(logprobs), "top_logprobs": tops})

    async def _decode_stream(self, request: web.Request, rid: str,
                             queue: EventQueue) -> web.StreamResponse:
        events = await queue.get_ready()
        if events[0].finished and events[0].error and not events[0].token_ids:
            return _failed(events[0])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            while True:  # the events ready at once go in one write; the last one ends it
                data = "".join([f"data: {to_sse_data(e)}\n\n" for e in events])
                if events[-1].finished:
                    await response.write(f"{data}data: [DONE]\n\n".encode())
                    break
                await response.write(data.encode())
                events = await queue.get_ready()
            await response.write_eof()
        except ConnectionResetError:  # the router went away mid-stream: one line, no traceback
            log.info("%s: the client disconnected mid-stream", rid)
            self.engine.abort(rid, "client disconnected")
        except Exception as exc:  # noqa: BLE001 - a bug here still ends the stream properly
            log.exception("%s: the stream failed", rid)
            self.engine.abort(rid, f"worker error: {exc!r}")
            end = to_sse_data(StreamEvent(finished=True, error=f"worker error: {exc!r}"))
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {end}\n\ndata: [DONE]\n\n".encode())
                await response.write_eof()
        return response

    async def _sglang_reply(self, request: web.Request, g: GenerateParams, stream: bool,
                            queue: EventQueue) -> web.StreamResponse:
        """SGLang's answer (runtime/sglang_compat.py) on either side: one JSON body, or a
        stream of the output so far. A failure before the first token gets its status."""
        output = GenerateOutput(self.sglang.tokenizer, g.rid)
        event = await queue.get()
        if event.finished and event.error and not event.token_ids:
            return _failed(event)
        if not stream:
            body = output.push(event)
            while not event.finished:
                event = await queue.get()
                body = output.push(event)
            return web.json_response(body, status=failure_status(event) if event.error else 200)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            events = [event]
            while True:
                data = b"".join([sse_line(output.push(e)) for e in events])
                if events[-1].finished:
                    await response.write(data + sse_line("[DONE]"))
                    break
                await response.write(data)
                events = await queue.get_ready()
            await response.write_eof()
        except ConnectionResetError:
            log.info("%s: the client disconnected mid-stream", g.rid)
            self.engine.abort(g.rid, "client disconnected")
        return response

    async def server_info(self, request: web.Request) -> web.Response:
        i = self.info
        return web.json_response(server_info(role=i.role, tp=i.tp, dp=i.dp,
                                             bootstrap_port=i.bootstrap_port))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"is_generation": True})

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response(load_rows(self.engine.load, self.engine.queues))

    async def abort(self, request: web.Request) -> web.Response:
        """Fail a request in flight here; 404 for an id this worker does not hold (unknown, or
        already finished)."""
        try:
            body = parse_json(await request.read())
        except BadRequest as exc:
            return _error(exc.message, 400)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            return _error("the body must be an object with a string rid", 400, "rid")
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            return _error("reason must be a string", 400, "reason")
        reason = f"{ROUTER_ABORT}: {reason}" if reason else ROUTER_ABORT
        rid = body["rid"]
        try:
            known = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.has_request, rid)
        except EngineStopped:
            return _error("the worker is shutting down", 503)
        if not known:
            return _error(f"no request {rid!r:.80} in flight here", 404, "rid")
        self.engine.abort(rid, reason)
        return web.json_response({"rid": rid, "status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        body = {"status": "ok" if self.engine.running else "stopped", "url": self.url,
                **asdict(self.info)}
        return web.json_response(body, status=200 if self.engine.running else 503)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({**self.engine.load, "queues": self.engine.queues})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

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
