"""pdsim's PD workers behind SGLang's own router (`router.impl: sglang`, sglang-router as
installed, unchanged): the OpenAI client and SGLang's `/generate` through it get, greedy, the
very tokens pdsim's router gets from the same workers, streamed or not; its API key is the
bearer token the workers accept on their SGLang routes, while pdsim's internal body and routes
still need the cluster token. With two prefill workers its `cache_aware` policy should keep a
repeated long prefix on one of them; sglang-router 0.3.2 picks PD workers at random under it
instead (a strict xfail: it fails once that is fixed). Plus the config's checks (policies
without a counterpart, open workers off loopback) and the router's command line."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
from openai import OpenAI

from configs import tiny_pd_yaml
from runtime.security import SECRET_ENV, ClusterKey, new_secret

PROMPT = "Hello, disaggregated world"


def serve(*args: str):
    """`pdsim serve ARGS` as a subprocess (pd_harness.Proc)."""
    from pd_harness import Proc

    return Proc(*args)


def post(url: str, payload: dict, headers: dict | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def declared_body_status(url: str, path: str, length: int) -> int:
    """The status a server answers a POST whose headers declare a `length`-byte JSON body, of
    which only the first bytes are sent: a server that refuses by Content-Length answers
    before the rest would arrive (a client writing it all would meet a closed socket)."""
    import socket

    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {length}\r\n\r\n{{".encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


def get_json(url: str, headers: dict | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=30) as resp:
        return json.loads(resp.read())


def sse_bodies(text: str) -> list:
    """The `data:` payloads of an SSE answer, `[DONE]` as the string."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def outputs(url: str, api_key: str) -> dict:
    """Greedy outputs of the same prompts through one router's OpenAI API, streamed and not."""
    client = OpenAI(base_url=url, api_key=api_key, max_retries=0)
    plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                      temperature=0, extra_body={"return_token_ids": True})
    streamed = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                         temperature=0, stream=True,
                                         extra_body={"return_token_ids": True})
    stream_ids = [t for chunk in streamed for t in (chunk.choices[0].token_ids or [])
                  if chunk.choices]
    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8,
                                          temperature=0)
    chat_stream = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
    return {"ids": plain.choices[0].token_ids, "stream_ids": stream_ids,
            "chat": chat.choices[0].message.content, "chat_stream": chat_stream}


@pytest.mark.real
@pytest.mark.slow
def test_sglang_router_gives_pdsim_routers_tokens(tmp_path, monkeypatch):
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)  # the deployment's, for pdsim's router alone
    cfg, pdsim_cfg = tmp_path / "pd.yaml", tmp_path / "pdsim_router.yaml"
    cfg.write_text(tiny_pd_yaml().replace("router: {port: 0}",
                                          "router: {port: 0, impl: sglang, policy: round_robin}"))
    pdsim_cfg.write_text(tiny_pd_yaml())  # the same deployment, pdsim's router
    launcher = serve(str(cfg))
    try:
        prefill = launcher.wait_for(r"prefill worker 0 \(tiny-llama, tp 1\) at (http://[^\s,]+)")
        decode = launcher.wait_for(r"decode worker 0 \(tiny-llama, tp 1\) at (http://[^\s,]+)")
        sglang_url = launcher.wait_for(r"tiny-llama \(disaggregated: .*\) at (http://\S+)/v1")
        sglang_url = sglang_url.group(1)
        pdsim = serve(str(pdsim_cfg), "--role", "router", "--port", "0",
                     "--prefill-url", prefill.group(1), "--decode-url", decode.group(1))
        try:
            pdsim_url = pdsim.wait_for(r"router for tiny-llama at (http://\S+)/v1").group(1)
            ours = outputs(f"{pdsim_url}/v1", "unused")
        finally:
            assert pdsim.stop() == 0
        theirs = outputs(f"{sglang_url}/v1", "unused")
        assert theirs == ours
        assert ours["stream_ids"] == ours["ids"] and ours["chat_stream"] == ours["chat"]

        # SGLang's own /generate, through its router: the same greedy ids, streamed or not
        request = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        status, body = post(f"{sglang_url}/generate", request)
        assert status == 200, body
        assert body["output_ids"] == ours["ids"]
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert body["meta_info"]["completion_tokens"] == 12
        status, text = post(f"{sglang_url}/generate", {**request, "stream": True})
        chunks = sse_bodies(text)
        assert status == 200 and chunks[-1] == "[DONE]" and len(chunks) > 2
        assert chunks[-2]["output_ids"] == ours["ids"]
        assert chunks[-2]["text"] == body["text"]
        assert [len(c["output_ids"]) for c in chunks[:-1]] == sorted(
            len(c["output_ids"]) for c in chunks[:-1])  # the output so far, growing
        # a request it cannot serve: the worker's 400 and reason, through SGLang's router
        status, body = post(f"{sglang_url}/generate", {
            "text": PROMPT, "sampling_params": {"max_new_tokens": 8, "regex": "[a-z]+"}})
        assert status == 400 and "regex" in json.dumps(body)
        # a body over the workers' limit: SGLang's router refuses it itself, twice, and the
        # workers stay in its rotation (a forwarded one came back as a failure that opened
        # their circuit breakers)
        for _ in range(2):
            assert declared_body_status(sglang_url, "/v1/completions", 9 << 20) == 413
        assert post(f"{sglang_url}/generate", request)[0] == 200

        # Without an API key the workers' SGLang routes are open (on loopback only), their
        # internal ones are not: pdsim's versioned body and /records still need the token.
        status, body = post(f"{decode.group(1)}/generate", {
            "version": 3, "rid": "x", "input_ids": [1, 2], "max_new_tokens": 1,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1})
        assert status == 401 and "X-PDSIM-Auth" in body["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            get_json(f"{decode.group(1)}/records")
        assert refused.value.code == 401
        records = get_json(f"{decode.group(1)}/records", ClusterKey.from_secret(secret).headers())
        assert len(records) >= 8  # every request above reached this decode worker
        assert launcher.stop() == 0
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()


def two_prefill_deployment(tmp_path, extra: str = "") -> str:
    """The tiny deployment with two prefill workers behind SGLang's router, cache_aware."""
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(tiny_pd_yaml().replace("  prefill:\n", "  prefill:\n    instances: 2\n")
                   .replace("router: {port: 0}", "router: {port: 0, impl: sglang, policy: "
                            "cache_aware}\n" + extra))
    return str(cfg)


def launched(launcher) -> tuple[list[str], str]:
    """The two prefill workers' URLs and the router's."""
    prefill = [launcher.wait_for(rf"prefill worker {i} \(tiny-llama, tp 1\) at "
                                 r"(http://[^\s,]+)").group(1) for i in (0, 1)]
    url = launcher.wait_for(r"tiny-llama \(disaggregated: .*\) at (http://\S+)/v1").group(1)
    return prefill, url


@pytest.mark.real
@pytest.mark.slow
def test_api_key_is_the_workers_bearer_token(tmp_path, monkeypatch):
    secret, key = new_secret(), "router-key-for-the-test"
    monkeypatch.setenv(SECRET_ENV, secret)
    launcher = serve(two_prefill_deployment(tmp_path, "security: {api_key: " + key + "}"))
    try:
        prefill, url = launched(launcher)
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        for stream in (False, True):
            reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                              temperature=0, stream=stream)
            last = [c for c in reply][-1] if stream else reply
            assert last.choices[0].finish_reason == "length"
        # The router's clients need its key; the workers take it as a bearer token on their
        # SGLang routes (past the guard: the missing bootstrap fields are what is refused) and
        # refuse everything else without the cluster token.
        status, _ = post(f"{url}/v1/completions", {"model": "tiny-llama", "prompt": "x"})
        assert status == 401
        request = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
        assert post(f"{prefill[0]}/v1/completions", request)[0] == 401
        status, body = post(f"{prefill[0]}/v1/completions", request,
                            {"Authorization": "Bearer wrong"})
        assert status == 401
        status, body = post(f"{prefill[0]}/v1/completions", request,
                            {"Authorization": f"Bearer {key}"})
        assert status == 400 and body["error"]["param"] == "bootstrap_host", body
        with pytest.raises(urllib.error.HTTPError) as refused:
            get_json(f"{prefill[0]}/records", {"Authorization": f"Bearer {key}"})
        assert refused.value.code == 401
        auth = ClusterKey.from_secret(secret).headers()
        assert sum(len(get_json(f"{u}/records", auth)) for u in prefill) == 2
        assert launcher.stop() == 0
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="sglang-router 0.3.2 never seeds the prefix trees of its "
                   "PD cache_aware policies with the workers it registers, so it picks a prefill "
                   "worker at random (its debug log: 'No tree found for model ..., using random "
                   "worker selection'); measured 2/2 and 3/1 splits of four requests")
def test_cache_aware_keeps_a_prefix_on_one_prefill_worker(tmp_path, monkeypatch):
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    launcher = serve(two_prefill_deployment(tmp_path))
    try:
        prefill, url = launched(launcher)
        auth = ClusterKey.from_secret(secret).headers()

        def served() -> list[int]:
            return [len(get_json(f"{u}/records", auth)) for u in prefill]

        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        long_prefix = "The quick brown fox jumps over the lazy dog. " * 5
        for i in range(16):  # at random, all on one worker 1 time in 32,768
            reply = client.completions.create(model="tiny-llama", prompt=f"{long_prefix}{i}",
                                              max_tokens=2, temperature=0, stream=i % 2 == 1)
            last = [c for c in reply][-1] if i % 2 else reply
            assert last.choices[0].finish_reason == "length"
        counts = served()
        assert sorted(counts) == [0, 16], counts  # one worker holds the prefix
        other = counts.index(0)
        client.completions.create(model="tiny-llama", prompt="An unrelated prompt, " * 6,
                                  max_tokens=2, temperature=0)
        assert served()[other] == 1  # no match: the worker with the smaller tree
    finally:
        launcher.stop()
        if launcher.proc.poll() is None:
            launcher.proc.kill()


# ---- the config and the command line (no servers) ------------------------------------------


def pd_serve_config(router: dict, **roles):
    from runtime.serve_config import PDServeConfig

    knobs = {"page_size": 8, "num_pages": 64}
    cluster = {"mode": "disaggregated",
               "prefill": {"scheduler": knobs, **roles.get("prefill", {})},
               "decode": {"scheduler": knobs, **roles.get("decode", {})}}
    return PDServeConfig(model="tiny-llama", cluster=cluster, router=router)


def test_a_policy_without_counterpart_is_refused_naming_the_allowed():
    from pdsim.config import ConfigError
    from runtime.serve_config import parse_serve_config

    with pytest.raises(ConfigError) as err:
        parse_serve_config({"model": "tiny-llama", "router": {"impl": "sglang",
                                                                "policy": "least_loaded"},
                            "cluster": {"mode": "disaggregated",
                                        "prefill": {"scheduler": {"num_pages": 64}},
                                        "decode": {"scheduler": {"num_pages": 64}}}})
    text = str(err.value)
    assert "least_loaded" in text
    assert "random, round_robin, cache_aware, power_of_two" in text
    assert pd_serve_config({"policy": "least_loaded"}).router.impl == "pdsim"  # pdsim's: fine


def test_router_command_line_maps_the_policy_and_its_options():
    from runtime.sglang_router import router_args

    cfg = pd_serve_config({"impl": "sglang", "policy": "cache_aware", "policy_options": {
        "cache_threshold": 0.5, "balance_abs_threshold": 16.0}})
    args = router_args(cfg, [("http://127.0.0.1:9001", 8998), ("http://127.0.0.1:9002", 8999)],
                       ["http://127.0.0.1:9003"], port=30000, metrics_port=29001)
    text = " ".join(args)
    assert text.startswith("--pd-disaggregation --prefill http://127.0.0.1:9001 8998 "
                           "--prefill http://127.0.0.1:9002 8999 --decode http://127.0.0.1:9003 ")
    assert "--policy cache_aware" in text and "--cache-threshold 0.5" in text
    assert "--balance-abs-threshold 16" in text and "--port 30000" in text
    assert "--prometheus-host 127.0.0.1 --prometheus-port 29001" in text
    assert f"--max-payload-size {8 << 20}" in text  # the workers' body limit
    assert "--api-key" not in text  # it travels in the environment
    # SGLang's own parser takes every flag
    from sglang_router.launch_router import parse_router_args

    parsed = parse_router_args(args)
    assert parsed.prefill_urls == [("http://127.0.0.1:9001", 8998),
                                   ("http://127.0.0.1:9002", 8999)]
    assert parsed.policy == "cache_aware" and parsed.cache_threshold == 0.5
    odd = pd_serve_config({"impl": "sglang", "policy": "cache_aware",
                           "policy_options": {"balance_abs_threshold": 2.5}})
    with pytest.raises(ValueError, match="balance_abs_threshold: 2.5; SGLang's router takes an "
                                         "integer"):
        router_args(odd, [], [], port=1, metrics_port=2)


def test_open_workers_must_stay_on_loopback_without_an_api_key():
    from runtime.sglang_router import check_exposure

    wide = pd_serve_config({"impl": "sglang"}, decode={"host": "0.0.0.0"})
    with pytest.raises(ValueError, match=r"cluster\.decode\.host: 0\.0\.0\.0, with router\.impl "
                                         r"sglang and no API key"):
        check_exposure(wide, None)
    check_exposure(wide, "a-key")  # the router sends it: the workers check it
    check_exposure(pd_serve_config({"impl": "sglang"}, prefill={"host": "localhost"}), None)


def test_sglang_generate_body_is_parsed_and_refused_by_field():
    from runtime.checks import BadRequest
    from runtime.sglang_compat import parse_sglang_generate
    from runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    where = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}

    def parse(body):
        return parse_sglang_generate({**where, **body}, tokenizer=tok, eos_ids=[tok.eos_id],
                                     model_vocab=tok.vocab_size, max_position=64)

    g = parse({"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                 "sampling_seed": 3}, "stream": True,
               "rid": "r1", "log_metrics": True, "model": None})
    assert g.stream and g.params.rid == "r1" and g.params.input_ids == tok.encode("hi")
    assert g.params.max_new_tokens == 4 and g.params.sampling.seed == 3
    assert g.params.stop_token_ids == [tok.eos_id] and g.params.bootstrap_room == 7
    assert parse({"input_ids": [1, 2], "sampling_params": {"ignore_eos": True,
                                                           "max_new_tokens": 4}}).params \
        .stop_token_ids == []
    with pytest.raises(BadRequest, match=r"max_new_tokens \(128\)"):  # SGLang's default
        parse({"input_ids": [1, 2]})
    refusals = {
        "sampling_params.stop": {"text": "a", "sampling_params": {"stop": ["x"]}},
        "return_logprob": {"text": "a", "return_logprob": True},
        "input_ids": {"input_ids": [[1], [2]]},
        "text": {"text": ["a", "b"]},
        "sampling_params.max_new_tokens": {"text": "a", "sampling_params":
                                           {"max_new_tokens": 100}},
    }
    for field, body in refusals.items():
        with pytest.raises(BadRequest) as err:
            parse(body)
        assert err.value.param == field, (field, err.value.message)
    with pytest.raises(BadRequest) as err:
        parse_sglang_generate({"text": "a"}, tokenizer=tok, eos_ids=[], model_vocab=259,
                              max_position=64)
    assert err.value.param == "bootstrap_host"
