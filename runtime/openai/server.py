"""An OpenAI-compatible HTTP server (aiohttp) in front of the engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events
`data: {...}` ending with `data: [DONE]`, or one JSON body), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, SGLang's names: runtime/serve_metrics.py).

A request is validated before it reaches the engine; a bad one gets HTTP 400 and an OpenAI-style
body `{"error": {"message", "type": "invalid_request_error", "param", "code"}}` naming the field
and what is allowed. When a client disconnects, its request is aborted and its KV pages and slot
go back to the pool.

Request parsing and the wire bodies are in `protocol.py`; chat templates in
runtime/chat_template.py; model and tokenizer loading in runtime/model/loading.py.

`OpenAIServer` lives on an asyncio loop in front of a `Backend`: the colocated engine
(runtime/colocated.py builds it and runs the server) or the PD router's client of remote workers
(runtime/router.py). This module loads no model and imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from runtime.chat_template import ChatTemplate
from runtime.checks import BadRequest, parse_json, short_repr
from runtime.http_app import AppServer
from runtime.openai.protocol import (
    RETRY_HEADERS, GenParams, Limits, RequestParser, busy_response, error_body, error_response,
    usage,
)
from runtime.protocol.stream import StreamEvent
from runtime.sampling import SamplingParams
from runtime.serve_metrics import CONTENT_TYPE, ServeMetrics
from runtime.streams import EngineStopped, EventQueue, for_running_loop
from runtime.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer

log = logging.getLogger(__name__)
_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per chunk


# ---- the server -----------------------------------------------------------------------------


class Backend(Protocol):
    """What the OpenAI front needs from whatever generates tokens: the local `Engine`, or the PD
    router's client of remote prefill and decode workers (runtime/router.py)."""

    metrics: ServeMetrics

    @property
    def running(self) -> bool: ...

    def start(self) -> object: ...

    async def shutdown(self) -> None: ...

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: Callable, *,
               sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
               top_logprobs: int = 0, rid: str | None = None) -> str: ...

    def abort(self, rid: str, reason: str = "aborted by the client") -> None: ...

    async def problems(self) -> dict[str, str]:
        """What keeps it from serving now (a stopped engine, a worker down), by name; empty
        when healthy."""
        ...


class OpenAIServer(AppServer):
    """max_inflight_requests: requests being answered at once at most; more get 503 with
    Retry-After."""

    def __init__(self, engine: Backend, tokenizer: Tokenizer, *, model_name: str, limits: Limits,
                 chat_template: ChatTemplate | None = None, eos_ids: Sequence[int] = (),
                 default_chat_max_tokens: int = 256, max_inflight_requests: int = 4096,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(engine, engine.metrics)
        self.metrics.name_model(model_name)
        self.max_inflight_requests = max_inflight_requests
        self._inflight = 0
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.parser = RequestParser(tokenizer, limits, chat_template or ChatTemplate(), eos_ids,
                                    default_chat_max_tokens)
        self.created = int(time.time())
        self.on_close = on_close

    # ---- lifecycle ----

    def make_app(self) -> web.Application:
        app = self.new_app()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    def counted(self, path: str) -> bool:
        return path in ("/v1/completions", "/v1/chat/completions", "/v1/models")

    async def close(self) -> None:
        """Stop the engine (unfinished requests end with the error "server shutting down", new
        ones get 503), then the HTTP server; then run `on_close` (saving records, say)."""
        await super().close()
        if self.on_close is not None:
            self.on_close()

    def _bad(self, exc: BadRequest) -> web.Response:
        return web.json_response(error_body(exc.message, "invalid_request_error", exc.param),
                                 status=400)

    def _body(self, raw: bytes) -> dict:
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise BadRequest(None, f"the body is a JSON {type(body).__name__}; allowed: an object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest("model", f"model={short_repr(model)}; allowed: {self.model_name!r}")
        return body

    async def _answer(self, request: web.Request, parse: Callable[[dict], GenParams],
                      chat: bool) -> web.StreamResponse:
        """Parse and tokenise on a worker thread (a body of megabytes takes a while: the other
        clients' streams keep flowing meanwhile), then generate."""
        raw = await request.read()

        def parsed() -> tuple[GenParams, dict[str, Any]]:
            body = self._body(raw)
            return parse(body), self.submit_options(body)

        try:
            params, options = await asyncio.to_thread(parsed)
        except BadRequest as exc:
            return self._bad(exc)
        return await self._generate(request, params, chat=chat, options=options)

    # ---- endpoints ----

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pdsim", "max_model_len": self.limits.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's `GET /v1/models/{model}`: the served model, or 404 naming it."""
        name = request.match_info["model"]
        if name != self.model_name:
            return web.json_response(error_body(
                f"no model {name!r:.80}; this server serves {self.model_name!r}",
                "invalid_request_error", "model"), status=404)
        return web.json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        problems = await self.engine.problems()
        if not problems:
            return web.json_response({"status": "ok"})
        message = "; ".join(f"{name}: {why}" for name, why in problems.items())
        return web.json_response({"status": "unhealthy", "problems": problems,
                                  **error_body(message, "server_error")},
                                 status=503, headers=RETRY_HEADERS)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, self.parser.completion, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, self.parser.chat, chat=True)

    def submit_options(self, body: dict) -> dict[str, Any]:
        """What a request body adds to the backend's `submit` beyond the OpenAI parameters:
        nothing here; a PD worker's front (runtime/sglang_compat.py) takes the bootstrap fields
        SGLang's router injects."""
        return {}

    # ---- generation ----

    async def _generate(self, request: web.Request, params: GenParams, chat: bool,
                        options: dict[str, Any] | None = None) -> web.StreamResponse:
        queue = EventQueue()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if self._inflight >= self.max_inflight_requests:
            return busy_response(f"{self._inflight} requests in flight, the most this server "
                                 "takes at once; retry later")
        try:
            self.engine.submit(params.prompt_ids, params.max_tokens,
                               for_running_loop().sink(queue),
                               sampling=params.sampling,
                               stop_token_ids=params.stop_token_ids, rid=rid,
                               top_logprobs=params.top_logprobs, **(options or {}))
        except EngineStopped:
            return busy_response("the server is shutting down")
        finished = False
        self._inflight += 1
        try:
            if params.stream:
                response = await self._stream(request, params, rid, chat, queue)
            else:
                response = await self._collect(params, rid, chat, queue)
            finished = True
            return response
        finally:
            self._inflight -= 1
            if not finished:  # the client went away (or writing to it failed)
                self.engine.abort(rid, "client disconnected")

    def _pieces(self, decoder: StreamDecoder, event: StreamEvent, params: GenParams,
                offset: int) -> tuple[str, dict | None]:
        """The text `event` adds, and its logprobs in the endpoint's format (or None)."""
        ids = list(event.token_ids)
        if event.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the stop token's text is not returned
        text = "".join(decoder.push(t) for t in ids)
        if event.finished:
            text += decoder.flush()
        if not params.logprobs:
            return text, None
        n = len(ids)
        if n == 0:
            return text, None
        tokens = [self._token_text(t) for t in ids]
        tops = list(event.top_logprobs[:n]) + [()] * (n - len(event.top_logprobs[:n]))
        return text, {"ids": ids, "tokens": tokens, "logprobs": list(event.logprobs[:n]),
                      "top": tops, "offset": offset}

    def _format_logprobs(self, entries: dict | None, chat: bool) -> dict | None:
        if entries is None:
            return None
        dec = self._token_text
        if chat:
            return {"content": [
                {"token": tok, "logprob": lp, "bytes": self._token_bytes(tid),
                 "top_logprobs": [{"token": dec(i), "logprob": v, "bytes": self._token_bytes(i)}
                                  for i, v in top]}
                for tid, tok, lp, top in zip(entries["ids"], entries["tokens"],
                                             entries["logprobs"], entries["top"])]}
        offsets, pos = [], entries["offset"]
        for tid in entries["ids"]:
            offsets.append(pos)
            pos += len(self.tokenizer.decode([tid]))
        return {"tokens": entries["tokens"], "token_logprobs": entries["logprobs"],
                "top_logprobs": [{dec(i): v for i, v in top} for top in entries["top"]],
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        """A token as a logprobs entry names it: its text, or `bytes:\\xNN` for a byte that is
        not a whole UTF-8 character (so that distinct tokens keep distinct names)."""
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text
        if isinstance(self.tokenizer, ByteTokenizer) and 0 <= token_id < 256:
            return f"bytes:\\x{token_id:02x}"
        return f"token_id:{token_id}"

    def _token_bytes(self, token_id: int) -> list[int]:
        """The token's bytes: a byte-level token is one raw byte, which may not be UTF-8."""
        if isinstance(self.tokenizer, ByteTokenizer) and 0 <= token_id < 256:
            return [token_id]
        return list(self.tokenizer.decode([token_id]).encode())

    async def _collect(self, params: GenParams, rid: str, chat: bool,
                       queue: EventQueue) -> web.Response:
        decoder = StreamDecoder(self.tokenizer)
        text, merged, ids = [], None, []
        length = 0
        while True:
            event = await queue.get()
            ids.extend(event.token_ids)
            if event.error:
                return error_response(event)
            piece, entries = self._pieces(decoder, event, params, length)
            text.append(piece)
            length += sum(len(self.tokenizer.decode([t])) for t in entries["ids"]) if entries else 0
            if entries is not None:
                if merged is None:
                    merged = entries
                else:
                    for key in ("ids", "tokens", "logprobs", "top"):
                        merged[key] = merged[key] + entries[key]
            if event.finished:
                break
        if params.logprobs and merged is None:
            merged = {"ids": [], "tokens": [], "logprobs": [], "top": [], "offset": 0}
        logprobs = self._format_logprobs(merged, chat)
        content = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "logprobs": logprobs, "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": logprobs,
                      "finish_reason": event.finish_reason}
        if params.return_token_ids:
            choice.update(prompt_token_ids=params.prompt_ids, token_ids=ids)
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": usage(event)})

    async def _stream(self, request: web.Request, params: GenParams, rid: str, chat: bool,
                      queue: EventQueue) -> web.StreamResponse:
        # An error before the first token still gets its own status, not a 200 stream.
        events = await queue.get_ready()
        if events[0].error:
            return error_response(events[0])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}

        def line(obj: dict | str) -> str:
            return f"data: {obj if isinstance(obj, str) else _JSON.encode(obj)}\n\n"

        async def send(*lines: str) -> None:
            await response.write("".join(lines).encode())

        def chunk(text: str | None, logprobs: dict | None, finish: str | None,
                  role: bool = False, ids: Sequence[int] = ()) -> dict:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                          "finish_reason": finish}
            if params.return_token_ids:
                choice["token_ids"] = list(ids)
            body = {**head, "choices": [choice]}
            if params.include_usage:
                body["usage"] = None
            return body

        decoder = StreamDecoder(self.tokenizer)
        length = 0

        def add_lines(event: StreamEvent, out: list[str]) -> bool:
            """Append the chunks `event` makes to `out`; True when it ends the stream."""
            nonlocal length
            if event.error:
                out.append(line(error_body(event.error, "server_error")))
                return True
            text, entries = self._pieces(decoder, event, params, length)
            if entries:
                length += sum(len(self.tokenizer.decode([t])) for t in entries["ids"])
            logprobs = self._format_logprobs(entries, chat)
            if text or logprobs or (params.return_token_ids and event.token_ids):
                out.append(line(chunk(text, logprobs, None, ids=event.token_ids)))
            if not event.finished:
                return False
            out.append(line(chunk(None if chat else "", None, event.finish_reason)))
            if params.include_usage:
                out.append(line({**head, "choices": [], "usage": usage(event)}))
            return True

        try:  # the chunks of the events ready at once go in one write
            out = [line(chunk("", None, None, role=True))] if chat else []
            while not any(add_lines(event, out) for event in events):
                if out:  # (a token may add no text yet: part of a character)
                    await send(*out)
                    out = []
                events = await queue.get_ready()
            await send(*out, line("[DONE]"))
            await response.write_eof()
        except ConnectionResetError:  # the client went away mid-stream: one line, no traceback
            log.info("%s: the client disconnected mid-stream", rid)
            self.engine.abort(rid, "client disconnected")
        except Exception as exc:  # noqa: BLE001 - a bug here still ends the stream properly
            log.exception("%s: the stream failed", rid)
            self.engine.abort(rid, f"server error: {exc!r}")
            with contextlib.suppress(ConnectionResetError):
                await send(line(error_body(f"server error: {exc!r}", "server_error")),
                           line("[DONE]"))
                await response.write_eof()
        return response
