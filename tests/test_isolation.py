"""One bad request fails alone (issue 8): among concurrent innocent requests, a poison one gets a
400 naming its field -- or, if it gets past validation, fails by itself -- and every innocent one
completes with all its tokens: on the colocated server, and through the router of a real
deployment (`pdsim serve`, prefill tp 2). Then that deployment's decode worker is killed (-9)
mid-stream: every client still gets an error event and `data: [DONE]`. Also the typed per-step
TP broadcast (runtime/protocol/step.py): what does not fit is refused before it is sent, on a
real tp-2 decode instance whose ranks stay in step."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import aiohttp
import pytest

from configs import colocated_config
from pd_harness import Proc
from runtime.protocol.stream import StreamEvent
from runtime.protocol import step as steps
from runtime.sampling import SamplingParams
from runtime.colocated import BackgroundServer
from runtime.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.real, pytest.mark.slow]

TOK = ByteTokenizer()
INNOCENT = 24
TOKENS = 4
# (raw JSON body text of the poison's extra fields or prompt, the field its 400 names)
POISONS = [
    ('"prompt": "a", "seed": 18446744073709551616', "seed"),
    ('"prompt": "a", "stop_token_ids": [100000000000000000000]', "stop_token_ids"),
    ('"prompt": "a", "temperature": 2.5', "temperature"),
    ('"prompt": "a", "top_k": 100000000000000000000', "top_k"),
    ('"prompt": "a \\ud800 b"', "prompt"),
    ('"prompt": "a", "temperature": 1e999', "temperature"),  # JSON's 1e999 parses as inf
]


@pytest.fixture(scope="module")
def server():
    old = os.environ.get("PDSIM_KERNEL_BACKEND")
    os.environ["PDSIM_KERNEL_BACKEND"] = "torch"
    cfg = colocated_config(num_pages=64, page_size=8, seed=5,
                           scheduler=dict(max_running_requests=32, max_prefill_tokens=256,
                                          chunked_prefill_size=64))
    try:
        with BackgroundServer(cfg) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("PDSIM_KERNEL_BACKEND")
        else:
            os.environ["PDSIM_KERNEL_BACKEND"] = old


def post(url: str, raw: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def innocent(i: int) -> bytes:
    return json.dumps({"prompt": f"innocent {i}", "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()


def test_poison_requests_among_innocent_ones_fail_alone(server):
    url = server.url + "/v1/completions"
    bodies = [innocent(i) for i in range(INNOCENT)]
    bodies[3::4] = [("{" + p + ', "max_tokens": 4}').encode() for p, _ in POISONS]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(url, b), bodies))
    for raw, (status, body) in zip(bodies, answers):
        poison = [param for p, param in POISONS if ("{" + p).encode() in raw]
        if poison:
            assert status == 400 and body["error"]["param"] == poison[0], (raw, body)
            assert body["error"]["type"] == "invalid_request_error"
        else:
            assert status == 200, body
            assert len(body["choices"][0]["token_ids"]) == TOKENS
    server.engine.check_pools_full()


def test_temperature_below_the_floor_is_greedy(server):
    """1e-300 would overflow float32 logits / temperature; below 1e-5 it is greedy (SGLang)."""
    url = server.url + "/v1/completions"
    outs = [post(url, json.dumps({"prompt": "floor", "max_tokens": 6, "temperature": t,
                                  "seed": 1, "ignore_eos": True,
                                  "return_token_ids": True}).encode()) for t in (0, 1e-300)]
    assert [s for s, _ in outs] == [200, 200]
    assert outs[0][1]["choices"][0]["token_ids"] == outs[1][1]["choices"][0]["token_ids"]


def test_a_request_whose_sampling_fails_fails_alone_in_the_engine(server):
    """A seed torch cannot take, smuggled past validation into the engine: that request fails
    with the reason; the others of its batch finish with all their tokens."""
    engine = server.engine
    bad = SamplingParams(temperature=1.0, seed=1)
    object.__setattr__(bad, "seed", 2**64)  # what validation keeps out
    events: queue.Queue = queue.Queue()
    for i in range(12):
        sampling = bad if i == 5 else SamplingParams(temperature=0.8, seed=i)
        engine.submit(TOK.encode(f"batch {i}"), 5, lambda e, i=i: events.put((i, e)),
                      sampling=sampling, rid=f"iso-{i}")
    tokens = [0] * 12
    finals: dict[int, StreamEvent] = {}
    while len(finals) < 12:
        i, event = events.get(timeout=60)
        tokens[i] += len(event.token_ids)
        if event.finished:
            finals[i] = event
    assert "sampling failed" in finals[5].error
    for i in set(range(12)) - {5}:
        assert finals[i].error is None and finals[i].finish_reason == "length", finals[i]
        assert tokens[i] == 5
    engine.check_pools_full()


def test_a_prompt_too_long_for_the_prefill_pool_states_one_limit():
    from runtime.chat_template import ChatTemplate
    from runtime.checks import BadRequest
    from runtime.openai.protocol import Limits, RequestParser

    pd = RequestParser(TOK, Limits(max_model_len=1024, pool_tokens=256, max_position=2048,
                                   model_vocab=512), ChatTemplate(), [], 16)
    with pytest.raises(BadRequest) as info:
        pd.completion({"prompt": [1] * 300, "max_tokens": 1})
    assert (info.value.param, info.value.message) == (
        "prompt", "the prompt has 300 tokens; allowed: at most 256 (the prefill KV pool holds "
        "256 tokens)")
    assert len(pd.completion({"prompt": [1] * 256, "max_tokens": 1}).prompt_ids) == 256
    colocated = RequestParser(TOK, Limits(max_model_len=512, pool_tokens=512, max_position=2048,
                                          model_vocab=512), ChatTemplate(), [], 16)
    with pytest.raises(BadRequest) as info:
        colocated.completion({"prompt": [1] * 512, "max_tokens": 1})
    assert info.value.message.endswith("at most 511 (a prompt and one new token must fit in the "
                                       "KV pool of 512 tokens)")


# ---- the per-step TP broadcast ---------------------------------------------------------------

ADD = steps.AddRequest(rid="r", prompt_ids=[1, 2, 3], max_new_tokens=4, arrival_s=0.25,
                       stop_token_ids=[7], temperature=0.7, top_k=0, top_p=1.0, seed=None,
                       bootstrap_host="127.0.0.1", bootstrap_port=1234, bootstrap_room=5,
                       top_logprobs=0)


def _tp2_decode_instance(group) -> dict:
    """One rank of a tp-2 decode instance of tiny-llama. Rank 0 submits two requests that do not
    fit a step message (a seed beyond 64 bits smuggled past validation; a stop id beyond msgpack)
    and one that does, then asks every rank whether its pools are full: a collective that only
    answers if both ranks are still in step."""
    from pd_harness import pd_config
    from runtime.pd.worker import RankSpec, build_rank

    rank = build_rank(pd_config("tiny-llama", decode={"tp": 2}),
                      RankSpec("decode", 0, group.rank, 2), group)
    engine = rank.engine.start()
    try:
        if group.rank != 0:
            engine.join(120)  # until rank 0 broadcasts the stop
            return {"stopped": not engine.running}
        bad_seed = SamplingParams(temperature=1.0, seed=1)
        object.__setattr__(bad_seed, "seed", 2**64)
        events: queue.Queue = queue.Queue()
        meet = dict(bootstrap_host="127.0.0.1", bootstrap_port=9)  # nobody there
        engine.submit([1, 2, 3], 4, lambda e: events.put(("seed", e)), sampling=bad_seed,
                      rid="seed", bootstrap_room=1, **meet)
        engine.submit([1, 2, 3], 4, lambda e: events.put(("stop", e)), stop_token_ids=[10**20],
                      rid="stop", bootstrap_room=2, **meet)
        engine.submit([1, 2, 3], 4, lambda e: events.put(("ok", e)), rid="ok",
                      bootstrap_room=3, **meet)
        engine.abort("ok", "aborted by the test")  # broadcast to rank 1 like the add
        ends = {}
        while len(ends) < 3:
            name, event = events.get(timeout=60)
            ends[name] = [event.status, event.error]
        engine.check_pools_full(timeout=30)
        return {"ends": ends, "pools": engine.pools(30)}
    finally:
        engine.stop()
        rank.manager.close()
        # Mooncake's destructor holds an exiting process up for many seconds (the workers leave
        # with os._exit for this, runtime/pd/worker.py): leave soon after the result is out.
        threading.Timer(3.0, os._exit, (0,)).start()


def test_requests_that_do_not_fit_the_tp_step_fail_alone_before_the_broadcast():
    from runtime.distributed import run_ranks

    lead, follower = run_ranks(_tp2_decode_instance, 2, timeout_s=180)
    for name in ("seed", "stop"):
        status, error = lead["ends"][name]
        assert status == 400 and error.startswith("invalid request: "), (name, error)
    assert lead["ends"]["ok"] == [None, "aborted by the test"]  # broadcast, then aborted
    assert lead["pools"] == {"full": True, "detail": ""} and follower == {"stopped": True}


def test_a_step_round_trips():
    step = steps.Step(now=1.5, stop=False,
                      ops=[ADD, steps.AbortRequest("r", "why"), steps.CheckPools()])
    assert steps.decode(steps.encode(step)) == step


@pytest.mark.parametrize("change", [
    {"seed": 2**64}, {"stop_token_ids": [10**20]}, {"bootstrap_room": 2**63},
    {"temperature": 1e300}, {"temperature": float("nan")}, {"top_logprobs": 21},
    {"prompt_ids": []}, {"max_new_tokens": 0}, {"top_k": True},
])
def test_what_does_not_fit_a_step_is_refused_when_built(change):
    with pytest.raises(steps.StepMessageError):
        replace(ADD, **change)


# ---- through the router of a real deployment ---------------------------------------------------

PD_CONFIG = """\
model: tiny-llama
seed: 0
device: cpu
cluster:
  mode: disaggregated
  prefill:
    tp: 2
    threads: 1
    scheduler: &knobs {page_size: 8, num_pages: 128, max_running_requests: 48,
                       max_prefill_tokens: 512, chunked_prefill_size: 256,
                       num_reserved_decode_tokens: 8}
  decode: {threads: 1, scheduler: {<<: *knobs, num_pages: 512}}
router: {port: 0}
transfer: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 5.0}
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("iso") / "pd.yaml"
    cfg.write_text(PD_CONFIG)
    launcher = Proc(str(cfg))
    try:
        url = launcher.wait_for(r"at (http://\S+)/v1$").group(1)
        decode = launcher.wait_for(r"decode worker 0 \(tiny-llama, tp 1\) at (http://\S+)")
        yield launcher, url, decode.group(1)
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
        launcher.proc.wait(30)


async def post_all(url: str, bodies: list[bytes]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(raw: bytes):
            async with session.post(url, data=raw,
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json(content_type=None)

        return await asyncio.gather(*(one(b) for b in bodies))


def test_poison_requests_through_the_router_with_prefill_tp2_fail_alone(deployment):
    _, url, _ = deployment
    bodies = [innocent(i) for i in range(30)]
    bodies[2::5] = [("{" + p + ', "max_tokens": 4}').encode() for p, _ in POISONS]
    answers = asyncio.run(post_all(url + "/v1/completions", bodies))
    for raw, (status, body) in zip(bodies, answers):
        poison = [param for p, param in POISONS if ("{" + p).encode() in raw]
        if poison:
            assert status == 400 and body["error"]["param"] == poison[0], (raw, body)
        else:
            assert status == 200 and len(body["choices"][0]["token_ids"]) == TOKENS, body
    status, health = asyncio.run(get(url + "/health"))
    assert status == 200 and health["status"] == "ok", health


async def get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url) as resp:
            return resp.status, await resp.json(content_type=None)


def worker_pid(launcher: Proc, role: str) -> int:
    """The pid of the launcher's `role` worker instance process (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher.proc.pid and "--instance" in cmd and f'"role": "{role}"' in cmd:
            return int(entry.name)
    raise AssertionError(f"no {role} worker below the launcher")


def test_killing_the_decode_worker_mid_stream_ends_every_stream(deployment):
    """Under the launcher: kill -9 of the decode worker once every stream has a token; each
    client gets an error event and `[DONE]` (the launcher then stops the deployment)."""
    launcher, url, _ = deployment
    n = 12
    ends: list[list[str]] = []

    async def run() -> None:
        first = asyncio.Semaphore(0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one(i: int) -> list[str]:
                body = {"prompt": f"stream {i}", "max_tokens": 1500, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                data: list[str] = []
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data:"):
                            if not data:
                                first.release()
                            data.append(line[5:].strip())
                return data

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            for _ in range(n):
                await asyncio.wait_for(first.acquire(), 30)
            os.kill(worker_pid(launcher, "decode"), signal.SIGKILL)
            killed = time.monotonic()
            ends.extend(await asyncio.gather(*tasks))
            assert time.monotonic() - killed < 15

    asyncio.run(run())
    for data in ends:
        assert data[-1] == "[DONE]", data[-3:]
        assert "error" in json.loads(data[-2]), data[-3:]
    assert launcher.proc.wait(60) == 1  # a worker died: the launcher stopped everything
