"""Disaggregated serving on real processes: prefill and decode worker instances (gloo TP groups,
Mooncake over TCP on loopback), driven through the worker HTTP API exactly as the router drives
it. Greedy outputs are token-identical to colocated serving for GQA and MLA with TP 1->1, 2->1,
1->2 (and 2->2), and every page, slot and metadata slot comes back.

One cluster per model (module scope): prefill instances with tp 1 and tp 2, decode instances with
tp 1 and tp 2 -- six rank processes -- paired every way.
"""

from __future__ import annotations

import queue
import random

import pytest

from pd_harness import (
    body, generate, pd_config, post_json, start_worker, stop_workers, wait_healthy,
)
from prom import Scrape

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODELS = ("tiny-llama", "tiny-mla")
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (prefill tp, decode tp)
# Page 8, chunks of 32: the 70-token prompt is prefilled (and sent) in three chunks.
PROMPT_LENS = (5, 17, 40, 70, 9)
MAX_NEW = (12, 12, 12, 12, 1)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENS]


def colocated_outputs(model: str) -> list[list[int]]:
    """The reference: the colocated engine (the same scheduler knobs) on the same prompts."""
    from runtime.driver import Engine
    from runtime.executor import ModelExecutor
    from runtime.model.hybrid import with_state_slots
    from runtime.model.loading import load_served_model, load_text_side
    from runtime.serve_config import ServeConfig

    cfg = pd_config(model)
    colo = ServeConfig(model=model, seed=cfg.seed, cluster={
        "mode": "colocated", "colocated": {"instances": 1, "scheduler": cfg.decode.scheduler}})
    net = load_served_model(colo, "cpu")
    text = load_text_side(colo, net.config.vocab_size)
    sched = with_state_slots(colo.scheduler_config(), net.config)
    executor = ModelExecutor(net, num_pages=colo.num_pages, page_size=colo.page_size,
                             seed=colo.seed, vocab_limit=text.vocab_limit(net.config.vocab_size),
                             state_slots=sched.state_slots)
    engine = Engine(executor, sched).start()
    events: queue.Queue = queue.Queue()
    try:
        for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW)):
            engine.submit(ids, n, lambda e, i=i: events.put((i, e)), rid=f"ref{i}")
        out: dict[int, list[int]] = {i: [] for i in range(len(PROMPT_LENS))}
        finished = 0
        while finished < len(PROMPT_LENS):
            i, e = events.get(timeout=60)
            assert e.error is None, e.error
            out[i].extend(e.token_ids)
            finished += e.finished
        engine.check_pools_full()
    finally:
        engine.stop()
    return [out[i] for i in range(len(PROMPT_LENS))]


@pytest.fixture(scope="module", params=MODELS)
def cluster(request):
    model = request.param
    workers = {}
    try:
        for tp in (1, 2):
            workers["prefill", tp] = start_worker(pd_config(model, prefill={"tp": tp}), "prefill")
            workers["decode", tp] = start_worker(pd_config(model, decode={"tp": tp}), "decode")
        reference = colocated_outputs(model)  # while the workers start
        wait_healthy(list(workers.values()))
        yield model, workers, reference
    finally:
        stop_workers(list(workers.values()))
        assert all(w.proc.returncode == 0 for w in workers.values()), \
            {k: w.proc.returncode for k, w in workers.items()}


@pytest.mark.parametrize("ptp, dtp", PAIRS, ids=[f"tp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated(cluster, ptp, dtp):
    model, workers, reference = cluster
    prefill, decode = workers["prefill", ptp], workers["decode", dtp]
    bodies = [body(f"{model}-{ptp}{dtp}-{i}", ids, n, prefill)
              for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW))]
    outcomes = generate(prefill, decode, bodies)
    for i, (o, want) in enumerate(zip(outcomes, reference)):
        assert o.prefill_status == 200 and o.prefill_body["status"] == "ok", o.prefill_body
        assert o.decode_status == 200, o.decode_body
        assert o.token_ids == want, f"prompt {i}"
        # The first event carries the first token alone: the one prefill computed.
        assert o.events[0]["token_ids"] == [o.prefill_body["token_ids"][0]] == want[:1]
        assert o.last["finished"] and o.last["finish_reason"] == "length"
        assert o.last["completion_tokens"] == len(want) and o.last["error"] is None
        assert o.last["prompt_tokens"] == PROMPT_LENS[i]
    for w in (prefill, decode):
        assert w.wait_pools_full() == {"full": True, "detail": ""}


def test_seeded_sampling_and_top_logprobs_agree_across_tp(cluster):
    model, workers, _ = cluster
    runs = []
    for ptp, dtp in ((1, 1), (2, 2)):
        prefill, decode = workers["prefill", ptp], workers["decode", dtp]
        b = body(f"{model}-seeded-{ptp}", prompts(1)[2], 10, prefill, top_logprobs=3,
                 sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 11})
        (o,) = generate(prefill, decode, [b])
        assert o.decode_status == 200, o.decode_body
        tops = [t for e in o.events for t in e["top_logprobs"]]
        assert len(tops) == len(o.token_ids) == 10
        # The first token's top logprobs stay on the prefill side (its answer has them).
        assert tops[0] == [] and all(len(t) == 3 for t in tops[1:])
        assert len(o.prefill_body["top_logprobs"][0]) == 3
        runs.append(o.token_ids)
    assert runs[0] == runs[1]


def test_worker_endpoints(cluster):
    model, workers, _ = cluster
    prefill, decode = workers["prefill", 2], workers["decode", 1]
    health = prefill.get("/health")
    assert health["role"] == "prefill" and health["tp"] == 2 and health["model"] == model
    assert (health["bootstrap_host"], health["bootstrap_port"]) == ("127.0.0.1",
                                                                    prefill.bootstrap_port)
    assert decode.get("/info")["bootstrap_port"] == 0
    load = decode.get("/load")
    assert load["load"] == load["num_active"] == load["pending_tokens"] == 0
    assert "transfer" in load["queues"]
    rows = decode.get("/records")
    assert rows and all(r["status"] == "ok" for r in rows)
    assert all(r["decode_instance"] == 0 and len(r["token_times_s"]) == r["output_tokens"]
               for r in rows)
    assert any(r["prefill_instance"] == 0 for r in prefill.get("/records"))
    metrics = Scrape.of(decode.url)
    engine = {"model_name": model, "engine_type": "decode"}
    assert metrics.value("pdsim_requests_total", status="ok", model_name=model) >= 1
    assert metrics.value("sglang:num_decode_transfer_queue_reqs", **engine) == 0
    assert metrics.value("pdsim_transfers_pending", **engine) == 0
    # A malformed request never reaches the engine; the error names the field.
    status, err = post_json(prefill.url + "/generate", body("x", [1, 2], 4, prefill, colour=1))
    assert status == 400 and err["error"]["param"] == "colour"
    status, err = post_json(decode.url + "/generate", {**body("x", [1, 2], 4, prefill),
                                                       "input_ids": [1, 9999]})
    assert status == 400 and "outside the vocabulary" in err["error"]["message"]
    status, err = post_json(decode.url + "/abort", {"rid": "nobody", "reason": "test"})
    assert status == 404 and err["error"]["param"] == "rid"  # no such request here
