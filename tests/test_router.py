"""The PD router against scripted workers: real HTTP servers on loopback that speak the worker
API (docs/serving.md), so routing, streaming, error pass-through and aborts can be checked in
isolation. tests/test_pd_*.py run the router in front of real prefill and decode workers."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from aiohttp import web

from pdsim.core.router import Router
from pdsim.deployment import Deployment, RouterConfig
from runtime.protocol.codec import VERSION, to_dict
from runtime.protocol.stream import StreamEvent
from runtime.router import PDRouter, WorkerAddress
from runtime.openai.protocol import Limits
from runtime.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.real]


class ScriptedWorker:
    """A prefill or decode worker whose answers the test decides."""

    def __init__(self, role: str, *, prefill_status: int = 200, decode_status: int = 200,
                 token_delay_s: float = 0.0, die_after: int | None = None,
                 hold_s: float = 0.0, junk_token_at: int | None = None,
                 stream_version: int = VERSION, mistyped: dict | None = None):
        self.role = role
        self.prefill_status = prefill_status
        self.decode_status = decode_status
        self.token_delay_s = token_delay_s
        self.die_after = die_after  # decode: cut the connection after this many events
        self.hold_s = hold_s  # decode: no answer at all this long (a real one waits for the KV)
        self.junk_token_at = junk_token_at  # decode: this event carries an id no tokenizer has
        self.stream_version = stream_version  # decode: the protocol version its events carry
        self.mistyped = mistyped or {}  # decode: fields every event carries with a wrong type
        self.generated: list[dict] = []
        self.aborted: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort", self.abort)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)  # like the real workers
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": self.role})

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.append(await request.json())
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generated.append(body)
        if self.role == "prefill":
            await asyncio.sleep(0.01)
            if self.prefill_status != 200:
                return web.json_response({"error": {"message": "prompt too long for the pool",
                                                    "type": "invalid_request_error",
                                                    "param": "input_ids"}},
                                         status=self.prefill_status)
            return web.json_response({"rid": body["rid"], "status": "ok"})
        await asyncio.sleep(self.hold_s)
        if self.decode_status != 200:
            return web.json_response({"error": {"message": "decode refused"}},
                                     status=self.decode_status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.prefill_wait:
            await asyncio.sleep(0.2)  # the first token waits for the KV
        # Echo the prompt's bytes back (no BOS), one token per event, then finish by length.
        ids = [t for t in body["input_ids"] if t < 256][: body["max_new_tokens"]]
        for i, tok in enumerate(ids):
            if i == self.die_after:  # as if killed: the connection drops mid-stream
                request.transport.close()
                return resp
            await asyncio.sleep(self.token_delay_s)
            last = i == len(ids) - 1
            tok = 10**6 if i == self.junk_token_at else tok
            event = to_dict(StreamEvent(
                token_ids=(tok,), logprobs=(-0.5,), finished=last,
                finish_reason="length" if last else None, prompt_tokens=len(body["input_ids"]),
                completion_tokens=i + 1), typed=False)
            event["version"] = self.stream_version
            event.update(self.mistyped)
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    prefill_wait = False


class Cluster:
    """Scripted workers and a router, all on one background event loop."""

    def __init__(self, prefill: list[ScriptedWorker], decode: list[ScriptedWorker]):
        self.prefill, self.decode = prefill, decode
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        for w in self.prefill + self.decode:
            await w.start()
        self.router = PDRouter(
            [WorkerAddress(w.url, "127.0.0.1", 9999) for w in self.prefill],
            [WorkerAddress(w.url) for w in self.decode], Deployment(),
            tokenizer=ByteTokenizer(), model_name="tiny",
            limits=Limits(max_model_len=4096, pool_tokens=4096, max_position=4096, model_vocab=512),
        )
        await self.router.start()

    def wait_for(self, condition, timeout_s: float = 10.0) -> None:
        for _ in range(int(timeout_s / 0.02)):
            if condition():
                return
            self.run(asyncio.sleep(0.02))
        raise AssertionError("condition not reached in time")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router.url}/v1", api_key="x", max_retries=0)

    def close(self):
        async def stop():
            await self.router.close()
            for w in self.prefill + self.decode:
                await w.runner.cleanup()
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def cluster(request):
    spec = getattr(request, "param", {})
    c = Cluster([ScriptedWorker("prefill", **spec.get("prefill", {}))],
                [ScriptedWorker("decode", **spec.get("decode", {})) for _ in range(2)])
    yield c
    c.close()


def test_both_workers_get_the_request_with_one_room_and_tokens_stream_back(cluster):
    stream = cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5,
                                                 stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == "hello"  # the scripted decode echoes the prompt
    (pre,) = cluster.prefill[0].generated
    dec = cluster.decode[0].generated[0]
    assert pre["bootstrap_room"] == dec["bootstrap_room"] and 0 <= pre["bootstrap_room"] < 2**63
    assert pre["version"] == dec["version"] == VERSION  # the typed body (runtime/protocol/)
    assert pre["bootstrap_host"] == dec["bootstrap_host"] == "127.0.0.1"
    assert pre["bootstrap_port"] == dec["bootstrap_port"] == 9999
    assert pre["input_ids"][-5:] == list(b"hello") and pre["max_new_tokens"] == 5
    cluster.wait_for(lambda: len(cluster.router.records) == 1)
    (record,) = cluster.router.records
    assert record.ok and record.output_tokens == 5 and len(record.token_times_s) == 5
    assert record.arrival_s <= record.first_token_s <= record.finish_s


def test_the_policies_load_signal_is_the_simulators(cluster):
    """Prefill: prompt tokens whose prefill has not returned; decode: requests in flight (the
    core schedulers' load())."""
    events = []

    async def start():
        cluster.router.client.submit([104, 105, 106, 107], 3, events.append)
        await asyncio.sleep(0)  # the request is routed and its worker calls are under way
        return cluster.router.client.loads()

    prefill, decode = cluster.run(start())
    assert prefill == [4] and sorted(decode) == [0, 1]
    cluster.wait_for(lambda: events and events[-1].finished)
    # the router counts the request out after it has delivered the last event
    cluster.wait_for(lambda: cluster.router.client.loads() == ([0], [0, 0]))


def test_round_robin_spreads_requests_over_decode_workers(cluster):
    client = cluster.client()
    for _ in range(4):
        client.completions.create(model="tiny", prompt="ab", max_tokens=2)
    assert [len(w.generated) for w in cluster.decode] == [2, 2]


@pytest.mark.parametrize("cluster", [{"prefill": {"prefill_status": 400}}], indirect=True)
def test_a_prefill_refusal_before_the_first_token_reaches_the_client_with_its_status(cluster):
    for d in cluster.decode:
        d.prefill_wait = True
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert "prompt too long for the pool" in str(e.value)
    with pytest.raises(openai.BadRequestError):  # streaming gets the status too, not a 200
        list(cluster.client().completions.create(model="tiny", prompt="x", max_tokens=1,
                                                 stream=True))
    cluster.wait_for(lambda: sum(len(d.aborted) for d in cluster.decode) == 2)  # the decode side was told to drop both


@pytest.mark.parametrize("cluster", [{"prefill": {"prefill_status": 400},
                                      "decode": {"hold_s": 30.0}}], indirect=True)
def test_a_prefill_refusal_does_not_wait_for_a_decode_side_that_waits_for_kv(cluster):
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert time.monotonic() - start < 2.0
    assert e.value.body["param"] == "prompt"  # the worker's input_ids, in the client's terms
    cluster.wait_for(lambda: sum(len(d.aborted) for d in cluster.decode) == 1)


@pytest.mark.parametrize("cluster", [{"decode": {"decode_status": 503}}], indirect=True)
def test_a_decode_refusal_passes_through(cluster):
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert e.value.status_code == 503 and "decode refused" in str(e.value)
    cluster.wait_for(lambda: cluster.prefill[0].aborted)  # prefill told to drop it


@pytest.mark.parametrize("cluster", [{"decode": {"stream_version": VERSION - 1}}],
                         indirect=True)
def test_a_decode_stream_of_another_protocol_version_is_a_502_naming_it(cluster):
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert e.value.status_code == 502
    assert (f"stream_event: protocol version {VERSION - 1} is not supported; allowed: {VERSION}"
            in str(e.value))
    cluster.wait_for(lambda: cluster.prefill[0].aborted)  # prefill told to drop it
    cluster.wait_for(lambda: len(cluster.router.records) == 1)
    assert not cluster.router.records[0].ok


@pytest.mark.parametrize("cluster", [{"decode": {"mistyped": {"logprobs": ["-0.5"]}}}],
                         indirect=True)
def test_a_decode_stream_event_with_a_mistyped_field_is_a_502_naming_it(cluster):
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert e.value.status_code == 502
    assert ("stream_event.logprobs must be a list of (a finite number or -inf), got ['-0.5']"
            in str(e.value))
    cluster.wait_for(lambda: len(cluster.router.records) == 1)
    assert not cluster.router.records[0].ok


def test_an_unreachable_decode_worker_is_a_503_with_retry_after():
    c = Cluster([ScriptedWorker("prefill")], [ScriptedWorker("decode")])
    try:
        c.run(c.decode[0].runner.cleanup())  # the decode worker goes away
        with pytest.raises(openai.APIStatusError) as e:
            c.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "unreachable" in str(e.value)
        assert e.value.response.headers["Retry-After"] == "1"
    finally:
        c.run(c.router.close())
        c.run(c.prefill[0].runner.cleanup())
        c.loop.call_soon_threadsafe(c.loop.stop)


@pytest.mark.parametrize("cluster", [{"decode": {"token_delay_s": 0.05}}], indirect=True)
def test_a_client_that_goes_away_aborts_both_sides(cluster, caplog):
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(cluster.router.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": "tiny", "prompt": "abcdefghij", "max_tokens": 10,
                                  "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data:"):
        pass  # read one chunk, then hang up
    conn.sock.close()
    conn.close()
    cluster.wait_for(lambda: cluster.prefill[0].aborted and any(d.aborted for d in cluster.decode))
    assert cluster.prefill[0].aborted[0]["reason"] == "client disconnected"
    assert any(d.aborted for d in cluster.decode)
    assert "Traceback" not in caplog.text and "never retrieved" not in caplog.text


@pytest.mark.slow
def test_three_hundred_concurrent_streams_complete_with_none_lost(cluster):
    client = openai.AsyncOpenAI(base_url=f"{cluster.router.url}/v1", api_key="x", max_retries=0)

    async def one(i: int) -> str:
        stream = await client.completions.create(model="tiny", prompt=f"req{i:03d}",
                                                 max_tokens=6, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(300)))

    texts = asyncio.run(all_of_them())
    assert texts == [f"req{i:03d}" for i in range(300)]
    assert sum(len(w.generated) for w in cluster.decode) == 300
    cluster.wait_for(lambda: len(cluster.router.records) == 300)
    assert all(r.ok for r in cluster.router.records)


# ---- every client gets an end; health; overload ----------------------------------------------


def sse(url: str, body: dict, timeout_s: float = 10.0) -> tuple[int, list]:
    """POST a streaming request; its status and every `data:` payload up to the end."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            lines = [line.decode().strip() for line in resp]
            return resp.status, [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    except urllib.error.HTTPError as exc:
        return exc.code, [json.loads(exc.read())]


@pytest.mark.parametrize("cluster", [{"decode": {"die_after": 0}}], indirect=True)
def test_a_decode_stream_cut_before_its_first_token_is_a_503_tried_once_more(cluster):
    """A decode worker killed after it began its answer but before a token: the router's read
    fails mid-body, which is the worker going away (a 503 before any token, tried once more
    as a fresh pair), not a worker error (502)."""
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client().with_options(max_retries=0).completions.create(
            model="tiny", prompt="hello", max_tokens=5)
    assert e.value.status_code == 503 and "dropped the connection" in str(e.value)
    assert e.value.response.headers["Retry-After"] == "1"
    assert sum(len(w.generated) for w in cluster.decode) == 2  # the try and the one retry


@pytest.mark.parametrize("cluster", [{"decode": {"die_after": 2, "token_delay_s": 0.02}}],
                         indirect=True)
def test_a_decode_worker_dying_mid_stream_ends_every_stream_with_an_error_and_done(
        cluster, caplog):
    url = f"{cluster.router.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abcdefgh", "max_tokens": 8, "stream": True}
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: sse(url, body), range(8)))
    for status, data in outs:
        assert status == 200 and data[-1] == "[DONE]", data
        error = json.loads(data[-2])["error"]
        assert "decode worker" in error["message"] and error["type"] == "server_error", error
    cluster.wait_for(lambda: len(cluster.router.records) == 8)
    assert not any(r.ok for r in cluster.router.records)
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text


@pytest.mark.parametrize("cluster", [{"decode": {"junk_token_at": 2}}], indirect=True)
def test_a_stream_that_breaks_in_the_server_still_ends_with_an_error_and_done(cluster):
    """A token id the tokenizer cannot decode (a broken worker): the client gets an error event
    and `[DONE]`, not a cut connection; the non-streaming form gets a JSON 500."""
    url = f"{cluster.router.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abcdef", "max_tokens": 6}
    status, data = sse(url, {**body, "stream": True})
    assert status == 200 and data[-1] == "[DONE]"
    assert "server error" in json.loads(data[-2])["error"]["message"]
    status, answer = get_json_post(url, body)
    assert status == 500 and answer["error"]["type"] == "server_error"


def get_json_post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_names_a_worker_that_is_down_and_requests_to_it_fail_fast():
    c = Cluster([ScriptedWorker("prefill")], [ScriptedWorker("decode")])
    try:
        status, body = get_json(c.router.url + "/health")
        assert status == 200 and body["status"] == "ok"
        c.run(c.prefill[0].runner.cleanup())  # the prefill worker goes away
        time.sleep(c.router.client.health_ttl_s)  # the last probe's answers expire
        status, body = get_json(c.router.url + "/health")
        assert status == 503 and body["error"]["type"] == "server_error"
        assert list(body["problems"]) == ["prefill worker 0"], body
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            c.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "prefill worker" in str(e.value)
        assert time.monotonic() - start < 2.0
    finally:
        c.run(c.router.close())
        c.run(c.decode[0].runner.cleanup())
        c.loop.call_soon_threadsafe(c.loop.stop)


@pytest.mark.parametrize("cluster", [{"decode": {"token_delay_s": 0.3}}], indirect=True)
def test_more_requests_than_the_bound_get_503_with_retry_after(cluster):
    cluster.router.server.max_inflight_requests = 2
    url = f"{cluster.router.url}/v1/completions"
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(sse, url, body) for _ in range(2)]
        cluster.wait_for(lambda: len(cluster.router.client._tasks) == 2)
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert "in flight" in json.loads(e.value.read())["error"]["message"]
        assert [f.result()[1][-1] for f in slow] == ["[DONE]", "[DONE]"]


def test_aiohttp_refusals_are_json_errors(cluster):
    url = cluster.router.url
    status, body = get_json(url + "/v1/completions")  # GET where only POST is served
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = get_json(url + "/nowhere")
    assert status == 404 and "error" in body
    status, body = post_reading_early(url + "/v1/completions", 70 << 20)
    assert status == 413 and body["error"]["type"] == "invalid_request_error", body


def post_reading_early(url: str, body_bytes: int, timeout_s: float = 30.0) -> tuple[int, dict]:
    """POST a body of `body_bytes`, reading the answer as soon as the server sends one. A server
    that refuses a body answers before it has read all of it, and may close the connection:
    urllib, sending the whole body first, would then fail on the write and never read the answer."""
    where = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((where.hostname, where.port), timeout=timeout_s) as sock:
        sock.sendall(f"POST {where.path} HTTP/1.1\r\nHost: {where.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {body_bytes}\r\n\r\n"
                     .encode())
        chunk, sent = b"x" * (1 << 20), 0
        while sent < body_bytes:
            readable, writable, _ = select.select([sock], [sock], [],
                                                  max(0.0, deadline - time.monotonic()))
            if readable:
                break  # the answer has come
            assert writable, f"no answer and no room to send within {timeout_s} s"
            try:
                sent += sock.send(chunk[: body_bytes - sent])
            except (BrokenPipeError, ConnectionResetError):
                break  # closed by the server, whose answer is already in the receive buffer
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_router_section_reaches_both_sides_of_the_real_router():
    """The deployment's `router` section goes to the real router whole: its policy with
    `policy_options` on both sides, and `read_timeout_s`; with the deployment's seed and page
    size. The options are checked as the simulator's are (a wrong name is an error naming the
    options)."""
    config = Deployment(seed=7, cluster={"decode": {"scheduler": {"page_size": 32}},
                                         "prefill": {"scheduler": {"page_size": 32}}},
                        router={"policy": "cache_aware", "read_timeout_s": 900.0,
                                "policy_options": {"cache_threshold": 0.9,
                                                   "balance_abs_threshold": 8}})
    workers = ([WorkerAddress("http://127.0.0.1:1", "127.0.0.1", 9999)],
               [WorkerAddress("http://127.0.0.1:2")])
    router = PDRouter(*workers, config, tokenizer=ByteTokenizer(), model_name="tiny",
                      limits=Limits(max_model_len=512, pool_tokens=512, max_position=4096,
                                    model_vocab=ByteTokenizer.vocab_size))
    client = router.client
    assert (client._read_timeout_s, client.page_size) == (900.0, 32)
    assert client.router.rng.getstate() == Router("cache_aware", 1, 1, 7).rng.getstate()
    for side in (client.router.prefill_policy, client.router.decode_policy):
        assert (side.cache_threshold, side.balance_abs_threshold, side.balance_rel_threshold) == (0.9, 8, 1.5)
    with pytest.raises(ValueError, match=r"takes no option threshold \(its options: cache_threshold"):
        RouterConfig(policy="cache_aware", policy_options={"threshold": 0.9})
