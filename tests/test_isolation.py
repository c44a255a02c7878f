"""One bad request fails alone (issue 8): among concurrent innocent requests, a poison one gets a
400 naming its field -- or, if it gets past validation, fails by itself -- and every innocent one
completes with exactly its greedy tokens. On the colocated server here; through the router in
front of real workers (prefill tp 2) in tests/test_pd_ends.py. Also the typed per-step TP
broadcast (runtime/pd/step_messages.py): what does not fit is refused before it is sent."""

from __future__ import annotations

import json
import os
import queue
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from runtime.engine import StreamEvent
from runtime.pd import step_messages as steps
from runtime.sampling import SamplingParams
from runtime.serve_config import ServeConfig
from runtime.server import BackgroundServer
from runtime.tokenizer import ByteTokenizer

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
    cfg = ServeConfig(model="tiny-llama", num_pages=64, page_size=8, port=0, seed=5,
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


# ---- the per-step TP broadcast ---------------------------------------------------------------

ADD = steps.AddRequest(rid="r", prompt_ids=[1, 2, 3], max_new_tokens=4, arrival_s=0.25,
                       stop_token_ids=[7], temperature=0.7, top_k=0, top_p=1.0, seed=None,
                       bootstrap_host="127.0.0.1", bootstrap_port=1234, bootstrap_room=5,
                       top_logprobs=0)


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
