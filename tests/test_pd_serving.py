"""Disaggregated serving on real processes: prefill and decode worker instances (gloo TP groups,
Mooncake over TCP on loopback), driven through the worker HTTP API exactly as the router drives
it. Greedy outputs are token-identical to colocated serving for GQA and MLA with TP 1->1, 2->1,
1->2 (and 2->2), and every page, slot and metadata slot comes back.

One cluster per model (module scope): prefill instances with tp 1 and tp 2, decode instances with
tp 1 and tp 2 -- six rank processes -- paired every way.
"""

from __future__ import annotations

import pytest

from pd_harness import (
    body, check_greedy_equals_colocated, colocated_outputs, generate, pd_config, post_json,
    prompts, worker_cluster,
)
from prom import Scrape

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODELS = ("tiny-llama", "tiny-mla")
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (prefill tp, decode tp)


@pytest.fixture(scope="module", params=MODELS)
def cluster(request):
    model = request.param
    configs = {}
    for tp in (1, 2):
        configs["prefill", tp] = pd_config(model, prefill={"tp": tp})
        configs["decode", tp] = pd_config(model, decode={"tp": tp})
    with worker_cluster(configs, while_starting=lambda: colocated_outputs(model)) as started:
        yield model, *started


@pytest.mark.parametrize("ptp, dtp", PAIRS, ids=[f"tp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated(cluster, ptp, dtp):
    model, workers, reference = cluster
    check_greedy_equals_colocated(workers["prefill", ptp], workers["decode", dtp], reference,
                                  f"{model}-{ptp}{dtp}")


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
