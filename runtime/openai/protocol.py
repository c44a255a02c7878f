"""The OpenAI wire format: request bodies -> `GenParams` (a `BadRequest` names the field and
what is allowed), and the error, usage and 503 bodies the server answers with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from runtime.chat_template import ChatTemplate
from runtime.checks import BadRequest, check_text, check_token_ids, is_int, short_repr
from runtime.protocol.stream import StreamEvent
from runtime.sampling import SamplingError, SamplingParams, parse_sampling
from runtime.streams import RETRY_AFTER_S, failure_status
from runtime.tokenizer import Tokenizer

MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


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
        if logprobs is not None and not (is_int(logprobs)
                                         and 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
            raise BadRequest("logprobs", f"logprobs={logprobs!r}; allowed: null or an integer "
                             f"0..{MAX_COMPLETION_LOGPROBS}")
        return self._common(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens",
                            logprobs is not None, logprobs or 0)

    def chat(self, body: dict) -> GenParams:
        messages = self._messages(body.get("messages"))
        text = self.chat_template.render(messages)
        ids = self._encode("messages", text, add_bos=not self.chat_template.is_jinja)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadRequest("logprobs", f"logprobs={logprobs!r}; allowed: true, false or null")
        top = body.get("top_logprobs")
        if top is not None and not (is_int(top) and 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
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
            ids = self._encode("prompt", check_text("prompt", prompt), add_bos=True)
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            self._check_prompt_length("prompt", len(prompt))  # before checking every id
            ids = list(check_token_ids("prompt", prompt, self.limits.model_vocab, empty_ok=False))
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest("prompt", f"a batch of {len(prompt)} prompts; allowed: one prompt "
                             "per request (a string or a list of token ids)")
        else:
            raise BadRequest("prompt", f"prompt={short_repr(prompt)}; allowed: a string or a "
                             "non-empty list of token ids")
        if not ids:
            raise BadRequest("prompt", "the prompt encodes to no tokens; allowed: at least one")
        return ids

    def _messages(self, messages: Any) -> list[dict[str, str]]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", f"messages={short_repr(messages)}; allowed: a non-empty "
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
                raise BadRequest(f"messages[{i}].content",
                                 f"content={short_repr(content)}; allowed: "
                                 "a string or a list of text parts")
            check_text(f"messages[{i}].content", content)
            out.append({"role": role, "content": content})
        return out

    def _encode(self, field: str, text: str, add_bos: bool) -> list[int]:
        """`text` tokenised, unless it is too long for any tokenisation to fit: a text of n
        characters holds at least n / max_bytes_per_token tokens, so a huge one is refused in
        no time instead of after seconds of tokenising."""
        lim, per_token = self.limits, self.tokenizer.max_bytes_per_token
        if per_token is not None and len(text) > lim.max_prompt_tokens * per_token:
            raise BadRequest(field, f"the prompt has {len(text)} characters, so more than "
                             f"{lim.max_prompt_tokens} tokens (a token of this tokenizer holds "
                             f"at most {per_token} byte{'s' if per_token != 1 else ''}); "
                             f"allowed: at most "
                             f"{lim.max_prompt_tokens} tokens ({lim.prompt_limit_text()})")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def _check_prompt_length(self, field: str, n_tokens: int) -> None:
        lim = self.limits
        if n_tokens > lim.max_prompt_tokens:
            raise BadRequest(field, f"the prompt has {n_tokens} tokens; allowed: at most "
                             f"{lim.max_prompt_tokens} ({lim.prompt_limit_text()})")

    def _common(self, body: dict, ids: list[int], default_max: int | None, max_field: str,
                logprobs: bool, top_logprobs: int) -> GenParams:
        lim = self.limits
        self._check_prompt_length("prompt" if "prompt" in body else "messages", len(ids))
        max_tokens = body.get(max_field)
        if max_tokens is None:
            room = lim.max_model_len - len(ids)
            max_tokens = default_max if default_max is not None else min(
                self.default_chat_max_tokens, room)
        elif not is_int(max_tokens) or max_tokens < 1:
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
        fmt = body.get("response_format")
        if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise BadRequest("response_format", f"response_format={short_repr(fmt)}: "
                             "structured output is not supported; allowed: null or "
                             "{\"type\": \"text\"}")
        for name in ("tools", "functions"):
            if body.get(name):
                raise BadRequest(name, f"{name} (tool calling) is not supported; allowed: null "
                                 "or []")
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


RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}


def busy_response(message: str) -> web.Response:
    """503 with Retry-After: overloaded or stopping; the client may try again."""
    return web.json_response(error_body(message, "server_error"), status=503,
                             headers=RETRY_HEADERS)


def error_response(event: StreamEvent) -> web.Response:
    status = failure_status(event)
    if status == 503:
        return busy_response(event.error)
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return web.json_response(error_body(event.error, kind, event.param), status=status)


def usage(event: StreamEvent) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}
