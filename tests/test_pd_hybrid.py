"""Disaggregated serving of the tiny hybrid model (sliding-window, linear-recurrence and full
layers) on real processes, Mooncake over TCP on loopback: the prefill side's recurrent-state slot
travels with the request's last chunk (runtime/transfer/prefill.py), whole at TP 1->1, as head
slices from each of two prefill ranks at TP 2->1 and into each of two decode ranks at TP 1->2,
and greedy outputs equal colocated serving's token for token. Prompts of 5 to 70 tokens cross
the 16-token window and the 32-token chunks.
"""

from __future__ import annotations

import pytest

from pd_harness import check_greedy_equals_colocated, colocated_outputs, pd_config, worker_cluster

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODEL = "tiny-hybrid"


@pytest.fixture(scope="module")
def cluster():
    configs = {}
    for tp in (1, 2):
        configs["prefill", tp] = pd_config(MODEL, prefill={"tp": tp})
        configs["decode", tp] = pd_config(MODEL, decode={"tp": tp})
    with worker_cluster(configs, while_starting=lambda: colocated_outputs(MODEL)) as started:
        yield started


PAIRS = [(1, 1), (2, 1), (1, 2)]  # (prefill tp, decode tp)


@pytest.mark.parametrize("ptp, dtp", PAIRS, ids=[f"tp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated(cluster, ptp, dtp):
    workers, reference = cluster
    check_greedy_equals_colocated(workers["prefill", ptp], workers["decode", dtp], reference,
                                  f"{MODEL}-{ptp}{dtp}")
