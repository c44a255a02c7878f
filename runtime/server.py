"""An OpenAI-compatible HTTP server (aiohttp) in front of the engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events
`data: {...}` ending with `data: [DONE]`, or one JSON body), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text).

A request is validated before it reaches the engine; a bad one gets HTTP 400 and an OpenAI-style
body `{"error": {"message", "type": "invalid_request_error", "param", "code"}}` naming the field
and what is allowed. When a client disconnects, its request is aborted and its KV pages and slot
go back to the pool.

Chat prompts use the checkpoint's Jinja `chat_template` when its `tokenizer_config.json` has one
(and jinja2 is installed); otherwise this template, for byte-level models:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

that is, `<|{role}|>` + newline + content + newline per message, then `<|assistant|>` + newline,
after the BOS token.

The engine runs on its own thread; `OpenAIServer` lives on an asyncio loop. `serve(config)` runs
one until SIGINT/SIGTERM (the CLI); `BackgroundServer(config)` runs one on a thread (tests,
notebooks, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from runtime.engine import RETRY_AFTER_S, Engine, EngineStopped, StreamEvent, failure_status
from runtime.http_app import MAX_BODY_BYTES, AppServer, json_errors
from runtime.sampling import SamplingError, SamplingParams, parse_sampling
from runtime.serve_config import PDServeConfig, ServeConfig
from runtime.serve_metrics import CONTENT_TYPE, ServeMetrics
from runtime.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---- chat templates -------------------------------------------------------------------------


class ChatTemplate:
    """Messages -> prompt text. The default is the byte-level template of the module docstring;
    `from_tokenizer_config` uses a checkpoint's Jinja template."""

    def __init__(self, jinja_source: str | None = None, bos_token: str = "",
                 eos_token: str = "") -> None:
        self._template = None
        self.bos_token, self.eos_token = bos_token, eos_token
        if jinja_source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(jinja_source)

    @classmethod
    def from_tokenizer_config(cls, directory: Path) -> ChatTemplate:
        """The Jinja template of `directory/tokenizer_config.json`, else the default."""
        file = directory / "tokenizer_config.json"
        if not file.is_file():
            return cls()
        raw = json.loads(file.read_text())
        source = raw.get("chat_template")
        if not isinstance(source, str):
            return cls()
        if importlib.util.find_spec("jinja2") is None:
            log.warning("%s has a chat_template but jinja2 is not installed; using the default "
                        "template", file)
            return cls()

        def token(key: str) -> str:
            value = raw.get(key) or ""
            return value.get("content", "") if isinstance(value, dict) else str(value)

        return cls(source, token("bos_token"), token("eos_token"))

    @property
    def is_jinja(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return turns + "<|assistant|>\n"
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)


def _raise_template_error(message: str) -> None:
    raise BadRequest("messages", f"the chat template rejected the messages: {message}")


# ---- request parsing ------------------------------------------------------------------------


@dataclass
class GenParams:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool = False  # extension: the ids of the prompt and the output, per choice


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_json(raw: bytes) -> Any:
    """A request body's JSON, or `BadRequest` (also for nesting or numbers too deep or big)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise BadRequest(None, f"the body is not valid JSON: {_short(str(exc), 200)}") from None


def check_token_ids(param: str, ids: Any, vocab: int, *, empty_ok: bool) -> list[int]:
    """`ids` as a list of token ids in `0..vocab-1`, else `BadRequest` naming `param`."""
    if not (isinstance(ids, list) and (ids or empty_ok) and all(_is_int(t) for t in ids)):
        raise BadRequest(param, f"{param}={_short(ids)}; allowed: a "
                         f"{'' if empty_ok else 'non-empty '}list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(param, f"token ids {_short(bad[:5])} are outside the vocabulary; "
                         f"allowed: 0..{vocab - 1}")
    return ids


def check_text(param: str, text: str) -> str:
    """`text`, if it is valid Unicode (JSON's `\\ud800` escapes give unpaired surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(param, f"{param} holds an unpaired surrogate at character {exc.start}; "
                         "allowed: valid UTF-8 text") from None
    return text


@dataclass
class Limits:
    """What one request may ask for.

    max_model_len: prompt + max_tokens at most (the KV pool that holds a whole request, and the
        model's positions).
    pool_tokens: the smallest KV pool a prompt must fit in (PD: the prefill pool as well).
    """

    max_model_len: int
    pool_tokens: int
    max_position: int
    model_vocab: int

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.max_model_len - 1, self.pool_tokens)

    def prompt_limit_text(self) -> str:
        """Why a prompt may hold at most `max_prompt_tokens` tokens: the one limit that binds."""
        if self.pool_tokens < self.max_model_len - 1:
            return f"the prefill KV pool holds {self.pool_tokens} tokens"
        return f"a prompt and one new token must fit in {self.context_text()}"

    def context_text(self) -> str:
        if self.max_model_len < self.max_position:
            return f"the KV pool of {self.max_model_len} tokens"
        return f"the model's {self.max_position} positions"


class RequestParser:
    """JSON bodies -> `GenParams`, raising `BadRequest` naming the field and what is allowed."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits, chat_template: ChatTemplate,
                 eos_ids: Sequence[int], default_chat_max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_template = chat_template
        self.eos_ids = list(eos_ids)
        self.default_chat_max_tokens = default_chat_max_tokens

    def completion(self, body: dict) -> GenParams:
        ids = self._prompt(body.get("prompt"))
        if body.get("echo"):
            raise BadRequest("echo", "echo=true is not supported; allowed: false")
        if body.get("suffix") is not None:
            raise BadRequest("suffix", "suffix is not supported; allowed: null")
        best_of = body.get("best_of")
        if best_of is not None and best_of != 1:
            raise BadRequest("best_of", f"best_of={best_of!r}; allowed: 1")
        logprobs = body.get("logprobs")
        if logprobs is not None and not (_is_int(logprobs)
                                         and 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
            raise BadRequest("logprobs", f"logprobs={logprobs!r}; allowed: null or an integer "
                             f"0..{MAX_COMPLETION_LOGPROBS}")
        return self._common(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens",
                            logprobs is not None, logprobs or 0)

    def chat(self, body: dict) -> GenParams:
        messages = self._messages(body.get("messages"))
        text = self.chat_template.render(messages)
        ids = self.tokenizer.encode(text, add_bos=not self.chat_template.is_jinja)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadRequest("logprobs", f"logprobs={logprobs!r}; allowed: true, false or null")
        top = body.get("top_logprobs")
        if top is not None and not (_is_int(top) and 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
            raise BadRequest("top_logprobs", f"top_logprobs={top!r}; allowed: null or an integer "
                             f"0..{MAX_CHAT_TOP_LOGPROBS}")
        if top and not logprobs:
            raise BadRequest("top_logprobs", "top_logprobs needs logprobs=true")
        field_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        return self._common(body, ids, None, field_name, bool(logprobs), top or 0)

    # ---- pieces ----

    def _prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text("prompt", prompt))
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = list(check_token_ids("prompt", prompt, self.limits.model_vocab, empty_ok=False))
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest("prompt", f"a batch of {len(prompt)} prompts; allowed: one prompt "
                             "per request (a string or a list of token ids)")
        else:
            raise BadRequest("prompt", f"prompt={_short(prompt)}; allowed: a string or a "
                             "non-empty list of token ids")
        if not ids:
            raise BadRequest("prompt", "the prompt encodes to no tokens; allowed: at least one")
        return ids

    def _messages(self, messages: Any) -> list[dict[str, str]]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", f"messages={_short(messages)}; allowed: a non-empty "
                             "list of {role, content} objects")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}]", "each message is an object with role and "
                                 "content")
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise BadRequest(f"messages[{i}].role", f"role={role!r}; allowed: "
                                 f"{', '.join(CHAT_ROLES)}")
            if isinstance(content, list):  # content parts: only text is understood
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):
                        raise BadRequest(f"messages[{i}].content",
                                         "content parts other than {type: text, text} are not "
                                         "supported")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content", f"content={_short(content)}; allowed: "
                                 "a string or a list of text parts")
            check_text(f"messages[{i}].content", content)
            out.append({"role": role, "content": content})
        return out

    def _common(self, body: dict, ids: list[int], default_max: int | None, max_field: str,
                logprobs: bool, top_logprobs: int) -> GenParams:
        lim = self.limits
        if len(ids) > lim.max_prompt_tokens:
            raise BadRequest("prompt" if "prompt" in body else "messages",
                             f"the prompt has {len(ids)} tokens; allowed: at most "
                             f"{lim.max_prompt_tokens} ({lim.prompt_limit_text()})")
        max_tokens = body.get(max_field)
        if max_tokens is None:
            room = lim.max_model_len - len(ids)
            max_tokens = default_max if default_max is not None else min(
                self.default_chat_max_tokens, room)
        elif not _is_int(max_tokens) or max_tokens < 1:
            raise BadRequest(max_field, f"{max_field}={max_tokens!r}; allowed: an integer >= 1")
        if len(ids) + max_tokens > lim.max_model_len:
            raise BadRequest(max_field,
                             f"prompt ({len(ids)} tokens) + {max_field} ({max_tokens}) = "
                             f"{len(ids) + max_tokens} tokens; allowed: at most "
                             f"{lim.max_model_len} ({lim.context_text()}), so {max_field} <= "
                             f"{lim.max_model_len - len(ids)} for this prompt")
        n = body.get("n")
        if n is not None and n != 1:
            raise BadRequest("n", f"n={n!r}; allowed: 1")
        try:
            sampling = parse_sampling(body, default_temperature=1.0)  # the OpenAI default
        except SamplingError as exc:
            raise BadRequest(exc.field, str(exc)) from None
        for name in ("presence_penalty", "frequency_penalty"):
            value = body.get(name)
            if value not in (None, 0):
                raise BadRequest(name, f"{name}={value!r} is not supported; allowed: 0 or null")
        if body.get("logit_bias"):
            raise BadRequest("logit_bias", "logit_bias is not supported; allowed: null or {}")
        if body.get("stop"):
            raise BadRequest("stop", "stop sequences are not supported; allowed: null or [] "
                             "(stop_token_ids lists stop tokens)")
        stop_ids = check_token_ids("stop_token_ids", body.get("stop_token_ids") or [],
                                   lim.model_vocab, empty_ok=True)
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest("ignore_eos", f"ignore_eos={ignore_eos!r}; allowed: true or false")
        if not ignore_eos:
            stop_ids = [*stop_ids, *self.eos_ids]
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream", f"stream={stream!r}; allowed: true or false")
        return_ids = body.get("return_token_ids", False)
        if not isinstance(return_ids, bool):
            raise BadRequest("return_token_ids", f"return_token_ids={return_ids!r}; allowed: true "
                             "or false")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options", "stream_options is an object, e.g. "
                             "{\"include_usage\": true}")
        return GenParams(
            prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop_token_ids=stop_ids,
            stream=stream,
            include_usage=bool(options.get("include_usage")), logprobs=logprobs,
            top_logprobs=top_logprobs, return_token_ids=return_ids)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the server -----------------------------------------------------------------------------


@dataclass
class _Output:
    """A request's output as it streams: text pieces and per-token logprob entries."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


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
        app = web.Application(middlewares=[json_errors, self._count],
                              client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    def counted(self, path: str) -> bool:
        return path.startswith("/v1/")

    async def close(self) -> None:
        """Stop the engine (unfinished requests end with the error "server shutting down", new
        ones get 503), then the HTTP server; then run `on_close` (saving records, say)."""
        await super().close()
        if self.on_close is not None:
            self.on_close()

    def _bad(self, exc: BadRequest) -> web.Response:
        return web.json_response(_error_body(exc.message, "invalid_request_error", exc.param),
                                 status=400)

    async def _body(self, request: web.Request) -> dict:
        body = parse_json(await request.read())
        if not isinstance(body, dict):
            raise BadRequest(None, f"the body is a JSON {type(body).__name__}; allowed: an object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest("model", f"model={_short(model)}; allowed: {self.model_name!r}")
        return body

    # ---- endpoints ----

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pdsim", "max_model_len": self.limits.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        problems = await self.engine.problems()
        if not problems:
            return web.json_response({"status": "ok"})
        message = "; ".join(f"{name}: {why}" for name, why in problems.items())
        return web.json_response({"status": "unhealthy", "problems": problems,
                                  **_error_body(message, "server_error")},
                                 status=503, headers=RETRY_HEADERS)

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(text=self.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            params = self.parser.completion(await self._body(request))
        except BadRequest as exc:
            return self._bad(exc)
        return await self._generate(request, params, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            params = self.parser.chat(await self._body(request))
        except BadRequest as exc:
            return self._bad(exc)
        return await self._generate(request, params, chat=True)

    # ---- generation ----

    async def _generate(self, request: web.Request, params: GenParams,
                        chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def sink(event: StreamEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if self._inflight >= self.max_inflight_requests:
            return busy_response(f"{self._inflight} requests in flight, the most this server "
                                 "takes at once; retry later")
        try:
            self.engine.submit(params.prompt_ids, params.max_tokens, sink,
                               sampling=params.sampling,
                               stop_token_ids=params.stop_token_ids, rid=rid,
                               top_logprobs=params.top_logprobs)
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
                       queue: asyncio.Queue[StreamEvent]) -> web.Response:
        decoder = StreamDecoder(self.tokenizer)
        text, merged, ids = [], None, []
        length = 0
        while True:
            event = await queue.get()
            ids.extend(event.token_ids)
            if event.error:
                return _error_response(event)
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
            "usage": _usage(event)})

    async def _stream(self, request: web.Request, params: GenParams, rid: str, chat: bool,
                      queue: asyncio.Queue[StreamEvent]) -> web.StreamResponse:
        # An error before the first token still gets its own status, not a 200 stream.
        first = await queue.get()
        if first.error:
            return _error_response(first)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}

        async def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

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

        try:
            if chat:
                await send(chunk("", None, None, role=True))
            decoder = StreamDecoder(self.tokenizer)
            length = 0
            event: StreamEvent | None = first
            while True:
                event = event if event is not None else await queue.get()
                if event.error:
                    await send(_error_body(event.error, "server_error"))
                    break
                text, entries = self._pieces(decoder, event, params, length)
                if entries:
                    length += sum(len(self.tokenizer.decode([t])) for t in entries["ids"])
                logprobs = self._format_logprobs(entries, chat)
                if event.finished:
                    if text or logprobs or (params.return_token_ids and event.token_ids):
                        await send(chunk(text, logprobs, None, ids=event.token_ids))
                    await send(chunk(None if chat else "", None, event.finish_reason))
                    if params.include_usage:
                        await send({**head, "choices": [], "usage": _usage(event)})
                    break
                if text or logprobs or (params.return_token_ids and event.token_ids):
                    await send(chunk(text, logprobs, None, ids=event.token_ids))
                event = None
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:  # the client went away mid-stream: one line, no traceback
            log.info("%s: the client disconnected mid-stream", rid)
            self.engine.abort(rid, "client disconnected")
        except Exception as exc:  # noqa: BLE001 - a bug here still ends the stream properly
            log.exception("%s: the stream failed", rid)
            self.engine.abort(rid, f"server error: {exc!r}")
            with contextlib.suppress(ConnectionResetError):
                await send(_error_body(f"server error: {exc!r}", "server_error"))
                await send("[DONE]")
                await response.write_eof()
        return response


RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}


def busy_response(message: str) -> web.Response:
    """503 with Retry-After: overloaded or stopping; the client may try again."""
    return web.json_response(_error_body(message, "server_error"), status=503,
                             headers=RETRY_HEADERS)


def _error_response(event: StreamEvent) -> web.Response:
    status = failure_status(event)
    if status == 503:
        return busy_response(event.error)
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return web.json_response(_error_body(event.error, kind, event.param), status=status)


def _usage(event: StreamEvent) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


# ---- building and running -------------------------------------------------------------------


@dataclass(frozen=True)
class TextSide:
    """What turns requests into token ids and back, for a served model."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    eos_ids: list[int]

    def vocab_limit(self, model_vocab: int) -> int:
        """Sample among the tokenizer's ids only (the tiny presets have more model ids)."""
        return min(self.tokenizer.vocab_size, model_vocab)


def model_config_of(config: ServeConfig | PDServeConfig):
    """The `ModelConfig` a serve config names (the preset or the checkpoint's config.json), with
    its dtype override; no weights are loaded."""
    from runtime.model import ModelConfig

    if config.is_preset:
        model_cfg = ModelConfig.preset(config.model)
    else:
        model_cfg = ModelConfig.from_hf_config(Path(config.model).expanduser())
    return model_cfg.with_(dtype=config.dtype) if config.dtype is not None else model_cfg


def load_text_side(config: ServeConfig | PDServeConfig, model_vocab: int) -> TextSide:
    """The tokenizer (the config's, the checkpoint's tokenizer.json, else byte-level), the chat
    template and the EOS ids of a served model."""
    from runtime.tokenizer import HFTokenizer

    template = ChatTemplate()
    eos_ids: list[int] = []
    directory = None if config.is_preset else Path(config.model).expanduser()
    if directory is not None:
        eos_ids = _generation_eos(directory)
    tok_path = config.tokenizer
    if tok_path is None and directory is not None and (directory / "tokenizer.json").is_file():
        tok_path = str(directory)
    if tok_path is not None:
        tokenizer: Tokenizer = HFTokenizer(tok_path)
        tok_dir = Path(tok_path) if Path(tok_path).is_dir() else Path(tok_path).parent
        template = ChatTemplate.from_tokenizer_config(tok_dir)
    else:
        tokenizer = ByteTokenizer()
        if directory is not None:
            template = ChatTemplate.from_tokenizer_config(directory)
    if tokenizer.vocab_size > model_vocab and tok_path is None:
        raise ValueError(f"model {config.model}: vocab_size {model_vocab} cannot hold the "
                         f"byte tokenizer's {tokenizer.vocab_size} ids; give a tokenizer")
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eos_ids:
        eos_ids.append(tokenizer.eos_id)
    return TextSide(tokenizer, template, eos_ids)


def resolve_device(device: str) -> str:
    """"auto" -> cuda when available, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_served_model(config: ServeConfig | PDServeConfig, device: str):
    """The model a serve config names: a preset's seeded random weights, or a checkpoint."""
    from runtime.model import build_model, load_model

    if config.is_preset:
        return build_model(model_config_of(config), seed=config.seed, device=device)
    return load_model(Path(config.model).expanduser(), device=device, dtype=config.dtype)


def build_server(config: ServeConfig) -> OpenAIServer:
    """Load the model and tokenizer, size the KV cache, build the engine and the server (none
    started yet)."""
    from runtime.executor import ModelExecutor

    model = load_served_model(config, resolve_device(config.device))
    mcfg = model.config
    text = load_text_side(config, mcfg.vocab_size)
    tokenizer, template, eos_ids = text.tokenizer, text.chat_template, text.eos_ids
    sched_cfg = config.scheduler_config()
    executor = ModelExecutor(model, num_pages=config.num_pages, page_size=config.page_size,
                             seed=config.seed, vocab_limit=text.vocab_limit(mcfg.vocab_size))
    executor.warmup()
    engine = Engine(executor, sched_cfg, max_records=config.max_records)
    limits = Limits(max_model_len=min(sched_cfg.pool_tokens, mcfg.max_position),
                    pool_tokens=sched_cfg.pool_tokens, max_position=mcfg.max_position,
                    model_vocab=mcfg.vocab_size)

    def save_results() -> None:
        if config.records_path:
            engine.save_records(config.records_path)
        if config.timings_path:
            executor.save_timings(config.timings_path)

    return OpenAIServer(engine, tokenizer, model_name=config.model_name, limits=limits,
                        chat_template=template, eos_ids=eos_ids,
                        default_chat_max_tokens=config.default_max_tokens,
                        max_inflight_requests=config.max_inflight_requests, on_close=save_results)


def _generation_eos(directory: Path) -> list[int]:
    file = directory / "generation_config.json"
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []


def serve(config: ServeConfig, on_ready: Callable[[OpenAIServer], None] | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, then shut down cleanly."""
    from runtime.security import api_key

    async def main() -> None:
        server = build_server(config)
        server.protect(api_key=api_key(config.security.api_key))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start(config.host, config.port)
        try:
            if on_ready is not None:
                on_ready(server)
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(main())


class BackgroundServer:
    """A server on its own thread and event loop: `with BackgroundServer(cfg) as s: s.url`."""

    def __init__(self, config: ServeConfig | OpenAIServer, host: str | None = None,
                 port: int | None = None) -> None:
        if isinstance(config, OpenAIServer):
            self.server, self._host, self._port = config, host or "127.0.0.1", port or 0
        else:
            self.server = build_server(config)
            self._host = host or config.host
            self._port = config.port if port is None else port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdsim-http",
                                        daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(self._host, self._port),
                                         self.loop).result(60)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def engine(self) -> Engine:
        return self.server.engine
