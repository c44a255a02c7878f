"""Disaggregated serving of the tiny hybrid model (sliding-window, linear-recurrence and full
layers) on real processes, Mooncake over TCP on loopback: the prefill side's recurrent-state slot
travels with the request's last chunk (runtime/transfer/prefill.py), whole at TP 1->1, as head
slices from each of two prefill ranks at TP 2->1 and into each of two decode ranks at TP 1->2,
and greedy outputs equal colocated serving's token for token. Prompts of 5 to 70 tokens cross
the 16-token window and the 32-token chunks.
"""

from __future__ import annotations

import pytest

from pd_harness import body, generate, pd_config, start_worker, stop_workers, wait_healthy
from test_pd_serving import MAX_NEW, colocated_outputs, prompts

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODEL = "tiny-hybrid"


@pytest.fixture(scope="module")
def cluster():
    workers = {}
    try:
        for tp in (1, 2):
            workers["prefill", tp] = start_worker(pd_config(MODEL, prefill={"tp": tp}), "prefill")
            workers["decode", tp] = start_worker(pd_config(MODEL, decode={"tp": tp}), "decode")
        reference = colocated_outputs(MODEL)  # while the workers start
        wait_healthy(list(workers.values()))
        yield workers, reference
    finally:
        stop_workers(list(workers.values()))
        assert all(w.proc.returncode == 0 for w in workers.values()), \
            {k: w.proc.returncode for k, w in workers.items()}


PAIRS = [(1, 1), (2, 1), (1, 2)]  # (prefill tp, decode tp)


@pytest.mark.parametrize("ptp, dtp", PAIRS, ids=[f"tp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated(cluster, ptp, dtp):
    workers, reference = cluster
    prefill, decode = workers["prefill", ptp], workers["decode", dtp]
    bodies = [body(f"{MODEL}-{ptp}{dtp}-{i}", ids, n, prefill)
              for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW))]
    outcomes = generate(prefill, decode, bodies)
    for i, (o, want) in enumerate(zip(outcomes, reference)):
        assert o.prefill_status == 200 and o.prefill_body["status"] == "ok", o.prefill_body
        assert o.decode_status == 200, o.decode_body
        assert o.token_ids == want, f"prompt {i}"
        assert o.last["finished"] and o.last["error"] is None
    for w in (prefill, decode):
        assert w.wait_pools_full() == {"full": True, "detail": ""}
