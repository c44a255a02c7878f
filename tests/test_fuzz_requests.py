"""Fuzzing what comes in from outside (Hypothesis): request bodies of the OpenAI API and of the
worker API get a result or a 4xx naming the problem, never another exception (a 500); the wire
decoders (the transfer backend's ZMQ messages, the per-step TP broadcast) reject random bytes and
random msgpack with their own error and nothing else."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import msgpack
import pytest
from configs import colocated_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.protocol import codec
from runtime.protocol import step as step_messages
from runtime.protocol.worker import GENERATE_FIELDS, parse_generate
from runtime.chat_template import ChatTemplate
from runtime.checks import BadRequest
from runtime.openai.protocol import GenParams, Limits, RequestParser
from runtime.colocated import BackgroundServer
from runtime.tokenizer import ByteTokenizer
from runtime.protocol import transfer as messages

pytestmark = [pytest.mark.real, pytest.mark.slow]

LIMITS = Limits(max_model_len=512, pool_tokens=256, max_position=2048, model_vocab=512)
PARSER = RequestParser(ByteTokenizer(), LIMITS, ChatTemplate(), [257], 16)

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.sampled_from(["\ud800", "user", "text", "tiny-llama", "\x00"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
OPENAI_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                 "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "best_of", "echo",
                 "logprobs", "top_logprobs", "stream", "stream_options", "ignore_eos",
                 "return_token_ids", "logit_bias", "presence_penalty", "suffix", "model"]
messages_value = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | json_values},
    optional={"content": st.text(max_size=30) | json_values}), max_size=3)
openai_bodies = st.fixed_dictionaries({}, optional={
    **{name: json_values for name in OPENAI_FIELDS},
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 600), max_size=8) | json_values,
    "messages": messages_value | json_values,
    "max_tokens": st.integers(-3, 600) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
})


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=openai_bodies, chat=st.booleans())
def test_the_openai_parser_returns_params_or_a_bad_request(body, chat):
    try:
        params = (PARSER.chat if chat else PARSER.completion)(body)
    except BadRequest as exc:
        assert exc.message
        return
    assert isinstance(params, GenParams)
    assert 1 <= len(params.prompt_ids) <= LIMITS.max_prompt_tokens
    assert len(params.prompt_ids) + params.max_tokens <= LIMITS.max_model_len


generate_bodies = st.fixed_dictionaries({}, optional={
    **{name: json_values for name in GENERATE_FIELDS},
    "input_ids": st.lists(st.integers(-2, 600), max_size=6) | json_values,
    "sampling": st.fixed_dictionaries({}, optional={
        k: json_values | st.floats(-1, 3) for k in ("temperature", "top_p", "top_k", "seed")})
    | json_values,
    "bootstrap_room": st.integers(-1, 2**64) | json_values,
    "version": st.just(codec.VERSION) | json_values,
})


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=generate_bodies | json_values)
def test_the_worker_parser_returns_params_or_a_bad_request(body):
    try:
        g = parse_generate(body, model_vocab=512, max_position=2048)
    except BadRequest as exc:
        assert exc.message
        return
    step_messages.AddRequest(  # what passes the API also fits the TP broadcast
        rid=g.rid, prompt_ids=g.input_ids, max_new_tokens=g.max_new_tokens, arrival_s=0.0,
        stop_token_ids=g.stop_token_ids, temperature=g.sampling.temperature,
        top_k=g.sampling.top_k, top_p=g.sampling.top_p, seed=g.sampling.seed,
        bootstrap_host=g.bootstrap_host, bootstrap_port=g.bootstrap_port,
        bootstrap_room=g.bootstrap_room, top_logprobs=g.top_logprobs)


# ---- over HTTP: 200 or a 4xx JSON error, never a 500 ------------------------------------------


@pytest.fixture(scope="module")
def server():
    old = os.environ.get("PDSIM_KERNEL_BACKEND")
    os.environ["PDSIM_KERNEL_BACKEND"] = "torch"
    try:
        with BackgroundServer(colocated_config(num_pages=64, page_size=8, seed=1)) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("PDSIM_KERNEL_BACKEND")
        else:
            os.environ["PDSIM_KERNEL_BACKEND"] = old


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=openai_bodies, chat=st.booleans())
def test_random_bodies_over_http_get_200_or_a_json_4xx(server, body, chat):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # keep the valid ones quick
    body.pop("max_completion_tokens", None)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    req = urllib.request.Request(server.url + path, data=raw,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    assert status == 200 or 400 <= status < 500, (status, text[:300])
    if status != 200:
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


# ---- the wire decoders ----------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=12) | st.sampled_from(["type", "version", "op", "ops", "now", "stop",
                                                "room", "rid"]), inner, max_size=6),
    max_leaves=16)
typed_maps = st.fixed_dictionaries({
    "type": st.sampled_from(sorted(cls.TYPE for cls in messages.MESSAGE_TYPES)) | msgpack_values,
    "version": st.just(codec.VERSION) | msgpack_values,
}, optional={name: msgpack_values for name in ("room", "reason", "session_id", "endpoint",
                                               "reply", "poll", "prefill_tp_rank")})
steps_maps = st.fixed_dictionaries({
    "type": st.just("step") | msgpack_values,
    "version": st.just(codec.VERSION) | msgpack_values,
    "now": st.floats() | msgpack_values, "stop": st.booleans() | msgpack_values,
    "ops": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["add_request", "abort_request", "check_pools"])},
                                          optional={"rid": msgpack_values,
                                                    "reason": msgpack_values}), max_size=3)
    | msgpack_values})


def frames(structured):
    return st.binary(max_size=64) | structured.map(
        lambda v: msgpack.packb(v, use_bin_type=True))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(frame=frames(msgpack_values | typed_maps))
def test_the_transfer_decoder_raises_only_protocol_errors(frame):
    try:
        msg = messages.decode(frame)
    except codec.ProtocolError:
        return
    assert type(msg) in messages.MESSAGE_TYPES


@settings(max_examples=300, deadline=None, derandomize=True)
@given(frame=frames(msgpack_values | steps_maps))
def test_the_step_decoder_raises_only_step_message_errors(frame):
    try:
        step = step_messages.decode(frame)
    except codec.ProtocolError:
        return
    assert step_messages.decode(step_messages.encode(step)) == step
