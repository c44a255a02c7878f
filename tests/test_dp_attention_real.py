"""Attention data parallelism in the real backend: PD worker instances whose `tp` rank processes
form `dp_attention` DP ranks (gloo over loopback, Mooncake over TCP for the KV), each with its
own core scheduler. Greedy outputs are token-identical to colocated tp 1 for GQA and MLA with
prefill DP 2 -> decode DP 1, 1 -> 2 and 2 -> 2; requests land on both DP ranks (rooms 0..4),
one rank idles while the other runs (the idle batch), and every page and slot of every DP rank
comes back.

Per model one cluster: prefill with dp 1 and dp 2, decode with dp 1 and dp 2 (six processes).
The MLA cluster's DP prefill runs its dense MLP per process (`moe_dense_tp: 1`); the others
gather the DP ranks' tokens for it. Decode DP 2 picks ranks by shortest queue, so a request's
decode rank need not be its prefill rank.
"""

from __future__ import annotations

import pytest

from pd_harness import body, generate, pd_config, start_worker, stop_workers, wait_healthy
from test_pd_serving import MAX_NEW, PROMPT_LENS, colocated_outputs, prompts

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODELS = ("tiny-llama", "tiny-mla")
PAIRS = [(2, 1), (1, 2), (2, 2)]  # (prefill dp, decode dp)


def dp_role(model: str, role: str, dp: int) -> dict:
    extra = {"moe_dense_tp": 1} if dp > 1 and role == "prefill" and model == "tiny-mla" else {}
    return {role: {"tp": dp, "dp_attention": dp, **extra}}


@pytest.fixture(scope="module", params=MODELS)
def cluster(request):
    model = request.param
    workers = {}
    try:
        for dp in (1, 2):
            workers["prefill", dp] = start_worker(
                pd_config(model, **dp_role(model, "prefill", dp)), "prefill")
            router = {"dp_assignment": "shortest_queue"} if dp > 1 else {}
            workers["decode", dp] = start_worker(
                pd_config(model, router=router, **dp_role(model, "decode", dp)), "decode")
        reference = colocated_outputs(model)  # while the workers start
        wait_healthy(list(workers.values()))
        yield model, workers, reference
    finally:
        stop_workers(list(workers.values()))
        assert all(w.proc.returncode == 0 for w in workers.values()), \
            {k: w.proc.returncode for k, w in workers.items()}


@pytest.mark.parametrize("pdp, ddp", PAIRS, ids=[f"dp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated_tp1(cluster, pdp, ddp):
    model, workers, reference = cluster
    prefill, decode = workers["prefill", pdp], workers["decode", ddp]
    # Rooms 0..4: the prefill DP rank is room % dp, so both ranks get requests.
    bodies = [body(f"{model}-dp{pdp}{ddp}-{i}", ids, n, prefill, room=i)
              for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW))]
    outcomes = generate(prefill, decode, bodies)
    for i, (o, want) in enumerate(zip(outcomes, reference)):
        assert o.prefill_status == 200 and o.prefill_body["status"] == "ok", o.prefill_body
        assert o.decode_status == 200, o.decode_body
        assert o.token_ids == want, f"prompt {i}"
        assert o.events[0]["token_ids"] == [o.prefill_body["token_ids"][0]] == want[:1]
        assert o.last["finish_reason"] == "length" and o.last["error"] is None
        assert o.last["prompt_tokens"] == PROMPT_LENS[i]
    for w in (prefill, decode):
        assert w.wait_pools_full() == {"full": True, "detail": ""}
    assert decode.get("/load")["num_active"] == 0


def test_prefill_dp_ranks_register_for_the_bootstrap_lookup(cluster):
    from runtime.transfer.bootstrap_server import BootstrapClient

    _, workers, _ = cluster
    client = BootstrapClient("127.0.0.1", workers["prefill", 2].bootstrap_port)
    info = client.parallel_info()
    assert (info.dp_size, info.tp_size) == (2, 1)
    ports = {client.rank(dp_rank, 0).zmq_port for dp_rank in (0, 1)}
    assert len(ports) == 2  # each DP rank's process transfers its own KV


def test_seeded_sampling_and_top_logprobs_on_the_second_dp_rank(cluster):
    model, workers, _ = cluster
    runs = []
    for pdp, ddp in ((1, 1), (2, 2)):
        prefill, decode = workers["prefill", pdp], workers["decode", ddp]
        b = body(f"{model}-seeded-dp{pdp}", prompts(1)[2], 8, prefill, room=1, top_logprobs=3,
                 sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 11})
        (o,) = generate(prefill, decode, [b])
        assert o.decode_status == 200, o.decode_body
        tops = [t for e in o.events for t in e["top_logprobs"]]
        assert tops[0] == [] and all(len(t) == 3 for t in tops[1:])
        assert len(o.prefill_body["top_logprobs"][0]) == 3
        runs.append((o.token_ids, tops))
    (ids1, tops1), (ids2, tops2) = runs
    assert ids1 == ids2
    # The same candidates; their logprobs up to the MLP's summation order over two processes.
    for a, b in zip(tops1, tops2):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)
