"""The OpenAI-compatible server on loopback, driven by the official `openai` client.

Tiny random models on CPU: outputs are gibberish bytes, so correctness is checked token for token
against the model run directly (greedy), through the `return_token_ids` extension.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from configs import colocated_config
from openai import OpenAI
from prom import Scrape

from runtime.model import AttentionMetadata
from runtime.serve_config import load_serve_config
from runtime.colocated import BackgroundServer
from runtime.tokenizer import ByteTokenizer

from pdsim.config import ConfigError

pytestmark = [pytest.mark.real, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()
EOS = TOK.eos_id

# A small pool (64 pages x 8 = 512 tokens), so that a burst of requests needs retraction.
SMALL = dict(num_pages=64, page_size=8, seed=5,
             scheduler=dict(max_running_requests=16, max_prefill_tokens=128,
                            chunked_prefill_size=32, num_reserved_decode_tokens=8))


@pytest.fixture(scope="module", autouse=True)
def _torch_kernels():
    old = os.environ.get("PDSIM_KERNEL_BACKEND")
    os.environ["PDSIM_KERNEL_BACKEND"] = "torch"
    yield
    if old is None:
        os.environ.pop("PDSIM_KERNEL_BACKEND")
    else:
        os.environ["PDSIM_KERNEL_BACKEND"] = old


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mla"])
def server(request):
    with BackgroundServer(colocated_config(request.param, **SMALL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def model_name(server):
    return server.server.model_name


def reference_greedy(server, prompt_ids, max_new, stop=(EOS,)):
    """Greedy tokens of the server's model run directly: recomputed without a cache each step."""
    model = server.engine.executor.model
    tokens, out = list(prompt_ids), []
    for _ in range(max_new):
        meta = AttentionMetadata.without_cache([len(tokens)])
        hidden = model.hidden_states(torch.tensor(tokens), meta.positions(), meta, None)
        token = int(model.compute_logits(hidden[-1:])[0, : TOK.vocab_size].argmax())
        out.append(token)
        tokens.append(token)
        if token in stop:
            break
    return out


def get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read().decode()


def post_raw(url, data: bytes):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- the openai client ----------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [model_name(server)]
    assert client.models.retrieve(model_name(server)).id == model_name(server)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert model_name(server) in info.value.body["message"]
    assert get(server.url + "/health")[0] == 200


def test_completion_non_streaming_and_streaming(server, client):
    kw = dict(model=model_name(server), prompt="The capital of France is", max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(TOK.encode("The capital of France is"))
    assert full.usage.completion_tokens == 12 and len(choice.token_ids) == 12
    assert choice.text == TOK.decode(choice.token_ids)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert [t for c in chunks[:-1] for t in (c.choices[0].token_ids or [])] == choice.token_ids
    assert len(chunks) > 3  # tokens arrive one step at a time


def test_chat_completion(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = dict(model=model_name(server), messages=messages, max_tokens=6, temperature=0,
              extra_body={"return_token_ids": True})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    templated = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert choice.prompt_token_ids == TOK.encode(templated)
    assert out.usage.prompt_tokens == len(TOK.encode(templated))
    expected = reference_greedy(server, TOK.encode(templated), 6)
    assert choice.token_ids == expected
    assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
    stream = client.chat.completions.create(**kw, stream=True, logprobs=True, top_logprobs=3)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    produced = [t for t in expected if t != EOS]
    assert [e.bytes for e in entries] == [[t] for t in produced]
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_completion_logprobs(server, client):
    out = client.completions.create(model=model_name(server), prompt="abc", max_tokens=4,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [0, 1, 2, 3]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(chosen)


def test_greedy_through_the_server_equals_the_model_run_directly(server, client):
    for text in ("Hello, world", "pdsim serves a tiny model", "x"):
        ids = TOK.encode(text)
        out = client.completions.create(model=model_name(server), prompt=text, max_tokens=20,
                                        temperature=0, extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == reference_greedy(server, ids, 20), text
    ids = [TOK.bos_id, 7, 300, 511]  # token-id prompts may use the model's whole vocabulary
    out = client.completions.create(model=model_name(server), prompt=ids, max_tokens=8,
                                    temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == reference_greedy(server, ids, 8)


def test_seeded_temperature_sampling_is_reproducible(server, client):
    kw = dict(model=model_name(server), prompt="Once upon a time", max_tokens=16,
              temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    first = client.completions.create(**kw, seed=1234).choices[0].token_ids
    # Again, this time batched with other sampled requests.
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(client.completions.create, **kw, seed=s) for s in range(5)]
        again = client.completions.create(**kw, seed=1234).choices[0].token_ids
        [f.result() for f in others]
    assert again == first
    assert client.completions.create(**kw, seed=4321).choices[0].token_ids != first


# ---- bad requests ---------------------------------------------------------------------------


def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(server, client):
    name = model_name(server)
    limit = server.server.limits.max_model_len
    cases = [
        (dict(prompt="hi", max_tokens=0), "max_tokens", "allowed: an integer >= 1"),
        (dict(prompt="hi", max_tokens=limit), "max_tokens", f"at most {limit}"),
        (dict(prompt="x" * limit, max_tokens=1), "prompt", f"at most {limit - 1}"),
        (dict(prompt="hi", temperature=-0.5), "temperature", "a number in [0, 2]"),
        (dict(prompt="hi", temperature=2.5), "temperature", "a number in [0, 2]"),
        (dict(prompt="hi", seed=2**64), "seed", "-2**63..2**63-1"),
        (dict(prompt="hi", extra_body={"top_k": 10**20}), "top_k", "an integer in"),
        (dict(prompt="hi", extra_body={"stop_token_ids": [10**20]}), "stop_token_ids",
         "outside the vocabulary"),
        (dict(prompt="hi", top_p=0), "top_p", "[1e-06, 1]"),
        (dict(prompt="hi", top_p=1.5), "top_p", "[1e-06, 1]"),
        (dict(prompt="hi", n=2), "n", "allowed: 1"),
        (dict(prompt="hi", logprobs=9), "logprobs", "0..5"),
        (dict(prompt=["a", "b"]), "prompt", "one prompt per request"),
        (dict(prompt=[1, 2, 9999]), "prompt", "outside the vocabulary"),
        (dict(prompt="hi", stop=["\n"]), "stop", "not supported"),
        (dict(prompt="hi", extra_body={"response_format": {"type": "json_object"}}),
         "response_format", "structured output is not supported"),
        (dict(prompt="hi", extra_body={"tools": [{"type": "function"}]}), "tools",
         "not supported"),
    ]
    for kwargs, param, reason in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=name, **kwargs)
        err = info.value.body
        assert info.value.status_code == 400 and err["param"] == param, (kwargs, err)
        assert reason in err["message"], (kwargs, err["message"])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gpt-4", prompt="hi")
    assert info.value.body["param"] == "model" and name in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=limit)
    assert info.value.body["param"] == "max_tokens"
    for raw in (b'{"model": "x", "prompt": ', b"[1, 2]", b"\xff\xfe"):
        status, body = post_raw(server.url + "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw
    status, body = post_raw(server.url + "/v1/completions", b'{"prompt": "\\ud800 lone"}')
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "unpaired surrogate" in body["error"]["message"]
    status, body = post_raw(server.url + "/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "x\\udfff"}]}')
    assert status == 400 and body["error"]["param"] == "messages[0].content", body
    out = client.completions.create(model=name, prompt="still here", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    server.engine.check_pools_full()


# ---- load, disconnects, records, metrics ----------------------------------------------------


def test_a_burst_of_concurrent_requests_leaves_the_pools_full(server, client):
    """20 requests at once overflow the 512-token pool: the scheduler queues and retracts, and
    every greedy output is still exactly the direct one."""
    prompts = [TOK.encode(f"request number {i}: " + "ab" * i) for i in range(20)]

    def one(ids):
        return client.completions.create(
            model=model_name(server), prompt=ids, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids

    engine = server.engine
    retractions = []

    def count_retractions():  # runs on the engine thread, between forwards
        retract = engine.sched._retract_one
        engine.sched._retract_one = lambda *a: retractions.append(1) or retract(*a)

    engine.call(count_retractions)
    try:
        with ThreadPoolExecutor(20) as pool:
            outs = list(pool.map(one, prompts))
        engine.check_pools_full()
    finally:
        engine.call(lambda: vars(engine.sched).pop("_retract_one"))
    assert retractions, "the burst was meant to overflow the pool"
    for ids, out in zip(prompts, outs):
        assert out == reference_greedy(server, ids, 24, stop=())


def test_a_client_that_disconnects_is_aborted(server, client, caplog):
    name = model_name(server)
    engine = server.engine
    before = len(engine.records)
    # A streaming client that stops reading after the first chunk.
    stream = client.completions.create(model=name, prompt="abandon", max_tokens=480,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    # Its abort first: a request still running would pass for the next one decoding.
    deadline = time.monotonic() + 10
    while len(engine.records) == before:
        assert time.monotonic() < deadline, "the abandoned stream was never aborted"
        time.sleep(0.002)
    # A non-streaming client that hangs up once its request is decoding.
    body = json.dumps({"model": name, "prompt": "hang up", "max_tokens": 480,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not engine.call(lambda: len(engine.sched.running)):
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.002)
    engine.check_pools_full()
    new = list(engine.records)[before:]
    assert len(new) == 2
    for r in new:
        assert r.status == "failed" and r.error == "client disconnected"
        assert r.output_tokens < 480
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text


def test_records_have_the_lifecycle_timestamps(server, client):
    before = len(server.engine.records)
    client.completions.create(model=model_name(server), prompt="timestamps", max_tokens=5,
                              temperature=0, extra_body={"ignore_eos": True})
    (record,) = list(server.engine.records)[before:]
    assert record.ok and record.input_tokens == len(TOK.encode("timestamps"))
    assert record.output_tokens == 5 and len(record.token_times_s) == 5
    chain = [record.arrival_s, record.prefill_start_s, record.prefill_end_s,
             record.first_token_s, record.finish_s]
    assert all(not math.isnan(t) for t in chain) and chain == sorted(chain)
    assert math.isnan(record.transfer_done_s)  # colocated: no KV transfer
    assert record.first_token_s == record.token_times_s[0] == record.prefill_end_s
    assert record.token_times_s == sorted(record.token_times_s)


def test_the_engine_thread_alone_runs_the_forwards_with_the_roles_threads():
    """`pdsim serve` keeps its own threads at one torch thread and hands the role's `threads`
    to the engine's thread alone (ModelExecutor.bind_thread): a second thread opening OpenMP
    regions of more than one thread slows every forward on a small host."""
    from runtime.serve_config import ServeConfig

    cluster = {"mode": "colocated", "colocated": {"instances": 1, "threads": 3, "scheduler": {
        "num_pages": 64, "page_size": 8}}}
    config = ServeConfig(model="tiny-llama", router={"port": 0}, cluster=cluster)
    assert config.forward_threads("colocated") == 3
    del cluster["colocated"]["threads"]
    default = ServeConfig(model="tiny-llama", router={"port": 0}, cluster=cluster)
    assert default.forward_threads("colocated") == (os.cpu_count() or 1)  # tp 1: every CPU
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as serve() sets the process's own
    try:
        with BackgroundServer(config) as srv:
            engine = srv.server.engine
            assert engine.call(torch.get_num_threads) == 3
            assert torch.get_num_threads() == 1
            out = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                model=srv.server.model_name, prompt="threads", max_tokens=3, temperature=0)
            assert out.choices[0].text is not None and out.usage.completion_tokens == 3
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_made_up_paths_and_refusals_count_without_adding_series(server):
    """Requests to no route count as one endpoint, "unmatched", however many paths a client
    makes up; a body refused for its size counts at its endpoint."""
    before = Scrape.of(server.url)
    for i in range(5):
        with pytest.raises(urllib.error.HTTPError) as info:
            get(f"{server.url}/v1/made-up-{i}")
        assert info.value.code == 404
        assert json.loads(info.value.read())["error"]["message"] == \
            f"no route GET /v1/made-up-{i}"
    huge = server.server.http_limits.max_body_bytes + 1
    with socket.create_connection((server.server.host, server.server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {huge}\r\n\r\n{{".encode())
        assert sock.makefile("rb").readline().split()[1] == b"413"
    after = Scrape.of(server.url)
    endpoints = {x.labels["endpoint"] for x in after.samples("pdsim_http_responses_total")}
    assert not any(e.startswith("/v1/made-up") for e in endpoints), endpoints

    def delta(**labels):
        return sum(x.value for x in after.samples("pdsim_http_responses_total", **labels)) - \
            sum(x.value for x in before.samples("pdsim_http_responses_total", **labels))

    assert delta(endpoint="unmatched", code="404") == 5
    assert delta(endpoint="/v1/completions", code="413") == 1


def test_metrics_are_sglangs_and_count_what_happened(server, client):
    before = Scrape.of(server.url)
    assert before.families["sglang:time_to_first_token_seconds"].type == "histogram"
    assert before.families["pdsim_requests"].type == "counter"
    for _ in range(2):
        client.completions.create(model=model_name(server), prompt="count me", max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name(server), prompt="x", max_tokens=-1)
    server.engine.check_pools_full()
    after = Scrape.of(server.url)

    def delta(name, **labels):  # a labelled series appears at its first count
        return sum(x.value for x in after.samples(name, **labels)) - \
            sum(x.value for x in before.samples(name, **labels))

    model = {"model_name": model_name(server)}
    engine = {**model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    assert delta("pdsim_requests_total", status="ok", **model) == 2
    assert delta("pdsim_http_responses_total", endpoint="/v1/completions", code="200") == 2
    assert delta("pdsim_http_responses_total", endpoint="/v1/completions", code="400") == 1
    assert delta("sglang:num_requests_total", **model) == 2
    assert delta("sglang:prompt_tokens_total", **model) == 2 * len(TOK.encode("count me"))
    assert delta("sglang:generation_tokens_total", **model) == 6
    assert delta("sglang:time_to_first_token_seconds_count", **model) == 2
    assert delta("sglang:inter_token_latency_seconds_count", **model) == 4
    assert delta("sglang:queue_time_seconds_count", **engine) == 2
    assert delta("pdsim_forwards_total", kind="extend", **engine) >= 1
    assert after.value("sglang:time_to_first_token_seconds_bucket", le="+Inf", **model) == \
        after.value("sglang:time_to_first_token_seconds_count", **model)
    assert after.value("sglang:num_used_tokens", **engine) == 0
    assert after.value("sglang:token_usage", **engine) == 0
    assert after.value("sglang:max_total_num_tokens", **engine) == \
        SMALL["num_pages"] * SMALL["page_size"]
    assert after.value("sglang:num_running_reqs", **engine) == 0
    assert after.value("sglang:num_queue_reqs", **engine) == 0


# ---- a local checkpoint directory -----------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}{{ bos_token }}[assistant] {% endif %}")


def test_serving_a_local_checkpoint_with_its_chat_template_and_eos(tmp_path):
    from runtime.model import ModelConfig, build_model, save_safetensors

    original = build_model(ModelConfig.preset("tiny-llama").with_(name="my-model"), seed=9)
    directory = save_safetensors(original, tmp_path / "my-model")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "", "eos_token": ""}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 257]}))
    cfg = colocated_config(str(directory), num_pages=64, page_size=16)
    with BackgroundServer(cfg) as srv:
        assert srv.server.model_name == "my-model"
        client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        out = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "hello"}], max_tokens=12,
            temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.prompt_token_ids == TOK.encode("[user] hello\n[assistant] ", add_bos=False)
        expected = reference_greedy(srv, choice.prompt_token_ids, 12, stop=(10, 257))
        assert choice.token_ids == expected
        assert choice.finish_reason == ("stop" if expected[-1] in (10, 257) else "length")
        # The weights are the saved ones: the model run directly gives the same tokens.
        srv.engine.executor.model = original
        again = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "hello"}], max_tokens=12,
            temperature=0, extra_body={"return_token_ids": True})
        assert again.choices[0].token_ids == expected
        srv.engine.check_pools_full()


# ---- config and the CLI ---------------------------------------------------------------------


def test_serve_config_errors_name_file_field_value_and_allowed(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\ncluster: {mode: colocated, colocated: {instances: 1, "
                   "scheduler: {max_running: 4}}}\nrouter: {port: -1}\n")
    with pytest.raises(ConfigError) as info:
        load_serve_config(bad)
    text = str(info.value)
    assert str(bad) in text and "scheduler.max_running: unknown key" in text
    assert "max_running_requests" in text and "router.port:" in text and "(got -1)" in text
    bad.write_text("cluster: {mode: split}\n")
    with pytest.raises(ConfigError, match="mode: unknown mode.*'split'.*colocated, disaggregated"):
        load_serve_config(bad)
    bad.write_text("model: tiny-llama\ncluster: {mode: disaggregated, prefill: {tp: 0}}\n"
                   "pages: 8\n")
    with pytest.raises(ConfigError) as info:
        load_serve_config(bad)
    text = str(info.value)
    assert "prefill.tp: Input should be greater than or equal to 1 (got 0)" in text
    assert "pages: unknown key (allowed: " in text and "cluster, cost_model" in text
    with pytest.raises(ConfigError, match="model: .*allowed: ") as info:
        load_serve_config(None, model="no-such-model")
    named = str(info.value).split("allowed: ")[1]
    assert all(name in named for name in ("tiny-llama", "tiny-mla", "tiny-moe", "tiny-hybrid"))
    cfg = load_serve_config(REPO / "experiments" / "real_colocated.yaml", port=0)
    assert cfg.port == 0 and cfg.scheduler_config().pool_tokens == cfg.num_pages * cfg.page_size


def _read_lines(pipe, out: queue.Queue):
    for line in iter(pipe.readline, ""):
        out.put(line)
    out.put(None)


def test_pdsim_serve_subprocess_streams_and_stops_on_sigterm(tmp_path):
    timings = tmp_path / "timings.csv"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: tiny-mla\ncluster: {mode: colocated, colocated: {instances: 1, scheduler: "
                   f"{{num_pages: 256, page_size: 8}}}}}}\ntimings_path: {timings}\n")
    env = {**os.environ, "PDSIM_KERNEL_BACKEND": "torch", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdsim.cli", "serve", str(cfg), "--port", "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        seen, url = [], None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "pdsim serve exited early:\n" + "".join(seen)
            seen.append(line)
            m = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
            url = m.group(1) if m else None
        assert url, "".join(seen)
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="tiny-mla", prompt="stream", max_tokens=6,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
        assert "pdsim serve: stopped" in "".join(rest)
        assert timings.is_file() and len(timings.read_text().splitlines()) > 6
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
