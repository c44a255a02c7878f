"""A PD worker as SGLang's own router sees it: the routes and bodies of an SGLang server, so
pdsim's prefill and decode workers run behind `python -m sglang_router.launch_router
--pd-disaggregation` unchanged (docs/serving.md, "Behind SGLang's router").

What that router (sglang-router 0.3.2, measured) calls on a worker, and what it gets here:

- registering it: `GET /health` (no credentials), `GET /server_info`, `GET /model_info`
  (`/get_server_info`, `/get_model_info` after a 404); then `GET /health` every health-check
  interval, and `GET /get_load` (its `num_tokens`) for the `power_of_two` policy.
- each request: the client's body for `POST /generate`, `/v1/completions` or
  `/v1/chat/completions`, re-serialised with SGLang's defaults plus `bootstrap_host` (the prefill
  URL's host), `bootstrap_port` (the one given for that prefill on the router's command line)
  and `bootstrap_room` (a random 63-bit integer), posted to the prefill and the decode worker at
  once. It relays the decode worker's answer (a stream as it comes) and reads the prefill
  worker's for its status only. The room names the request on both sides, as pdsim's own router
  draws it.

`/v1/*` is the OpenAI server's own handling (runtime/openai/server.py: parsing, limits, wire
format), with the bootstrap fields passed to the engine. `/generate` without a `version` is
SGLang's body: `text` or `input_ids`, `sampling_params` {max_new_tokens (default 128),
temperature (1.0), top_p, top_k, sampling_seed, stop_token_ids, ignore_eos}, `stream`, `rid`;
its answer is SGLang's: `{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens"}}`, streamed as `data:` lines each holding
the text and ids so far, then `data: [DONE]`. Options that would change the output and are not
implemented (logprobs, stop strings, penalties, n > 1, batches, constrained decoding) are refused
with 400 naming the field.

Credentials: SGLang's router cannot send pdsim's `X-PDSIM-Auth` token. Its `--api-key KEY` is
both what its own clients must send and the `Authorization: Bearer KEY` it sends workers with
its registration probes and every request it routes (not with `/health`, nor with the
`/get_model_info` and `/get_server_info` it passes through from its clients). `worker_guard` admits, on the routes above, either the cluster token
or that bearer key (`router_key`), or -- with no key -- anyone (the launcher then keeps the
workers on loopback); every other route (pdsim's versioned `/generate` body included) still
needs the cluster token.
"""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from runtime.checks import BadRequest, check_text, check_token_ids, is_int, short_repr
from runtime.openai.protocol import Limits
from runtime.openai.server import OpenAIServer
from runtime.protocol.stream import StreamEvent
from runtime.protocol.worker import GenerateParams, check_bootstrap, check_rid
from runtime.sampling import SamplingError, parse_sampling
from runtime.security import AUTH_HEADER, ClusterKey, header_bytes
from runtime.tokenizer import StreamDecoder, Tokenizer

SGLANG_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/server_info",
                 "/model_info", "/get_server_info", "/get_model_info", "/get_load")
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# sampling_params SGLang knows that would change the output: (default, what is allowed)
UNSUPPORTED_SAMPLING = {"stop": (None, "null or []"), "n": (1, "1"),
                        "frequency_penalty": (0.0, "0"), "presence_penalty": (0.0, "0"),
                        "repetition_penalty": (1.0, "1"), "min_new_tokens": (0, "0"),
                        "regex": (None, "null"), "json_schema": (None, "null"),
                        "ebnf": (None, "null"), "structural_tag": (None, "null"),
                        "logit_bias": (None, "null")}
UNSUPPORTED_FLAGS = ("return_logprob", "return_hidden_states")


@dataclass(frozen=True)
class SGLangGenerate:
    """A parsed SGLang `/generate` body."""

    params: GenerateParams
    stream: bool


def parse_sglang_generate(body: dict, *, tokenizer: Tokenizer, eos_ids: Sequence[int],
                          model_vocab: int, max_position: int) -> SGLangGenerate:
    """SGLang's `/generate` body (one request, bootstrap fields set) as `GenerateParams`;
    `BadRequest` names the field."""
    for name in UNSUPPORTED_FLAGS:
        if body.get(name):
            raise BadRequest(name, f"{name}=true is not supported; allowed: false")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("text", "give exactly one of text (a string) and input_ids (a list of "
                         "token ids)")
    if isinstance(text, str):
        ids = tokenizer.encode(check_text("text", text))
    elif text is not None:
        raise BadRequest("text", f"text={short_repr(text)}; allowed: one string (no batches)")
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise BadRequest("input_ids", "a batch of prompts; allowed: one list of token ids")
    ids = check_token_ids("text" if text is not None else "input_ids", ids, model_vocab,
                          empty_ok=False)
    for name in BOOTSTRAP_FIELDS:
        if name not in body:
            raise BadRequest(name, f"{name} is missing: a PD worker serves a request its router "
                             "paired (bootstrap_host, bootstrap_port, bootstrap_room)")
    host, port, room = check_bootstrap(body)
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params", "sampling_params is an object")
    for name, (default, allowed) in UNSUPPORTED_SAMPLING.items():
        if raw.get(name, default) not in (default, [], {}):
            raise BadRequest(f"sampling_params.{name}", f"{name}={short_repr(raw[name])} is not "
                             f"supported; allowed: {allowed}")
    max_new = raw.get("max_new_tokens")
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    if not is_int(max_new) or max_new < 1:
        raise BadRequest("sampling_params.max_new_tokens", f"max_new_tokens={max_new!r}; "
                         "allowed: an integer >= 1")
    if len(ids) + max_new > max_position:
        raise BadRequest("sampling_params.max_new_tokens", f"input ({len(ids)} tokens) + "
                         f"max_new_tokens ({max_new}) = {len(ids) + max_new}; allowed: at most "
                         f"{max_position} (the model's max position)")
    try:
        sampling = parse_sampling({**raw, "seed": raw.get("sampling_seed")},
                                  default_temperature=1.0)  # SGLang's default
    except SamplingError as exc:
        raise BadRequest(f"sampling_params.{exc.field}", str(exc)) from None
    stop = list(check_token_ids("sampling_params.stop_token_ids",
                                raw.get("stop_token_ids") or [], model_vocab, empty_ok=True))
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("sampling_params.ignore_eos", f"ignore_eos={ignore_eos!r}; allowed: "
                         "true or false")
    if not ignore_eos:
        stop += [t for t in eos_ids if t not in stop]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"stream={stream!r}; allowed: true or false")
    rid = body.get("rid")
    rid = uuid.uuid4().hex if rid is None else check_rid(rid)
    return SGLangGenerate(GenerateParams(rid, list(ids), max_new, sampling, stop, 0, host, port,
                                         room), stream)


class GenerateOutput:
    """SGLang's answer to `/generate`, built from a request's events: `push(event)` returns
    the body so far (`{"text", "output_ids", "meta_info"}`, cumulative, as each streamed chunk
    is) or, for a failure, SGLang's `{"error": {"message"}}`."""

    def __init__(self, tokenizer: Tokenizer, rid: str) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.rid = rid
        self.ids: list[int] = []
        self.text = ""

    def push(self, event: StreamEvent) -> dict:
        if event.error:
            return {"error": {"message": event.error}}
        self.ids.extend(event.token_ids)
        shown = list(event.token_ids)
        if event.finish_reason == "stop" and shown:
            shown = shown[:-1]  # the stop token's text is not returned
        self.text += "".join(self.decoder.push(t) for t in shown)
        if event.finished:
            self.text += self.decoder.flush()
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": {
            "id": self.rid, "finish_reason": _finish_reason(event, self.ids),
            "prompt_tokens": event.prompt_tokens, "completion_tokens": len(self.ids),
            "cached_tokens": event.cached_tokens}}


def _finish_reason(event: StreamEvent, ids: list[int]) -> dict | None:
    if not event.finished:
        return None
    if event.finish_reason == "stop" and ids:
        return {"type": "stop", "matched": ids[-1]}
    return {"type": "length", "length": len(ids)}


class WorkerOpenAI(OpenAIServer):
    """The OpenAI routes of a PD worker: the OpenAI server's handling in front of this worker's
    engine, each request's bootstrap fields (set by SGLang's router) passed to `submit`. Its
    handlers are mounted on the worker's app; it never listens itself."""

    def submit_options(self, body: dict) -> dict[str, Any]:
        for name in BOOTSTRAP_FIELDS:
            if name not in body:
                raise BadRequest(name, f"{name} is missing: a PD worker serves a request its "
                                 "router paired (bootstrap_host, bootstrap_port, bootstrap_room)")
        host, port, room = check_bootstrap(body)
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def sse_line(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def server_info(*, role: str, tp: int, dp: int, bootstrap_port: int) -> dict:
    """`/server_info`: what SGLang's router reads of it (tp_size, dp_size: the role's
    attention-DP ranks, disaggregation_mode) and SGLang's name for the bootstrap port. No
    model_path (the router would load a tokenizer from it) and no served_model_name: a worker
    with a model id puts sglang-router 0.3.2's PD `cache_aware` policy off its prefix trees
    (random picks, measured), so the router lists the model as "unknown"."""
    info = {"tp_size": tp, "dp_size": dp, "disaggregation_mode": role, "version": "pdsim"}
    if bootstrap_port:
        info["disaggregation_bootstrap_port"] = bootstrap_port
    return info


def load_rows(load: dict[str, float], queues: dict[str, int]) -> list[dict]:
    """`/get_load` as SGLang answers it, one row per DP rank (here one): the router's
    power_of_two sums `num_tokens`, here the scheduler's load (the simulator's router signal)."""
    return [{"dp_rank": 0, "num_reqs": int(load.get("num_active", 0)),
             "num_waiting_reqs": int(queues.get("waiting", 0)),
             "num_tokens": int(load.get("load", 0))}]


# ---- credentials ---------------------------------------------------------------------------


def worker_guard(cluster_key: ClusterKey, *, router_key: str | None = None,
                 open_sglang: bool = False,
                 open_paths: tuple[str, ...] = ("/health", "/info")) -> Callable:
    """aiohttp middleware of a worker: `open_paths` need nothing; every path needs the cluster
    token, except that `SGLANG_ROUTES` also admit `Authorization: Bearer router_key` (or, with
    `open_sglang` and no key, anyone). A request admitted without the cluster token is marked
    `request["internal"] = False`: handlers refuse it pdsim's own internal bodies."""
    expected = f"Bearer {router_key}".encode() if router_key else None
    sglang = frozenset(SGLANG_ROUTES)
    open_paths = frozenset(open_paths)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path in open_paths or cluster_key.accepts(header_bytes(request,
                                                                         AUTH_HEADER)):
            return await handler(request)
        if request.path in sglang:
            bearer = header_bytes(request, "Authorization") or b""
            if (expected is not None and hmac.compare_digest(bearer, expected)) or (
                    expected is None and open_sglang):
                request["internal"] = False
                return await handler(request)
        return web.json_response(
            {"error": {"message": f"{request.method} {request.path} is internal: it needs the "
                                  f"deployment's {AUTH_HEADER} token"
                                  + (" or the router's API key" if request.path in sglang
                                     and expected is not None else ""),
                       "type": "authentication_error", "param": None, "code": 401}},
            status=401, headers={"WWW-Authenticate": "Bearer"})

    return check


@dataclass(frozen=True)
class SGLangFront:
    """What a worker needs to answer SGLang's router: the text side (tokenizer, chat template,
    EOS ids), the request limits, and who may call its SGLang routes."""

    openai: WorkerOpenAI
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    router_key: str | None
    open_sglang: bool


def sglang_front(config, engine, *, model_vocab: int, max_position: int) -> SGLangFront:
    """The SGLang front of a worker of `config` (a `PDServeConfig`) over `engine`. Its SGLang
    routes are open to SGLang's router only with `router.impl: sglang`: the API key (if any)
    as a bearer token, else anyone (the launcher keeps such workers on loopback)."""
    from runtime.model.loading import load_text_side
    from runtime.security import api_key

    text = load_text_side(config, model_vocab)
    limits: Limits = config.request_limits(model_vocab, max_position)
    openai = WorkerOpenAI(engine, text.tokenizer, model_name=config.model_name, limits=limits,
                          chat_template=text.chat_template, eos_ids=text.eos_ids,
                          default_chat_max_tokens=config.default_max_tokens,
                          max_inflight_requests=config.max_inflight_requests)
    behind_sglang = config.router.impl == "sglang"
    key = api_key(config.security.api_key) if behind_sglang else None
    return SGLangFront(openai, text.tokenizer, tuple(text.eos_ids), key,
                       open_sglang=behind_sglang and key is None)
