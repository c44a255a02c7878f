"""Speculative decoding in PD on real processes (prefill and decode workers at tp 1, Mooncake
over TCP on loopback, ZMQ): the prefill side extends the MTP draft over the prompt, the draft
layer's KV pages travel with the target's and the request's last hidden state with its last
chunk, and the decode side drafts from its first step.

Greedy outputs equal colocated serving without speculation, token for token, for prompts of 5
to 70 tokens (chunks of 32, pages of 8), with GQA (the draft's K and V pages) and MLA (its
latent pages). The draft is the checked oracle (tests/spec_oracle.py):
it proposes the true continuation only while the hidden state and the draft KV it finds on the
decode side are the reference's, so drafts are accepted when both travelled; with the prefill's
hidden-state write left out, no draft is accepted at all, and the output is still the same.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pd_harness import (MAX_NEW, body, colocated_outputs, generate, pd_config, prompts,
                        start_worker, stop_workers, wait_healthy)

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODELS = ("tiny-llama", "tiny-mla")
SPEC = {"method": "mtp", "num_draft_tokens": 3, "acceptance": {"mean_accept_len": 1.5}}
WORKER = str(Path(__file__).with_name("spec_pd_worker.py"))


def oracle_file(model_name: str, path: Path, reference: list[list[int]]) -> Path:
    """The checked oracle's references for the prompts and their greedy outputs."""
    from runtime.model.draft import build_draft
    from runtime.model.loading import load_served_model
    from spec_oracle import references

    config = pd_config(model_name, speculative=SPEC)
    model = load_served_model(config, "cpu")
    sequences = [p + out for p, out in zip(prompts(), reference)]
    keys = [(t, pos) for seq in sequences for pos, t in enumerate(seq)]
    assert len(set(keys)) == len(keys), "two requests share a (token, position): reseed"
    np.savez(path, **references(model, build_draft(model, seed=config.seed), sequences))
    return path


@pytest.fixture(scope="module", params=MODELS)
def cluster(request, tmp_path_factory):
    model = request.param
    reference = colocated_outputs(model)  # without speculation
    oracle = oracle_file(model, tmp_path_factory.mktemp("spec") / "oracle.npz", reference)
    config = pd_config(model, speculative=SPEC)
    env = {"SPEC_ORACLE": str(oracle)}
    workers = {}
    try:
        for case, extra in (("intact", {}), ("dropped", {"SPEC_DROP_HIDDEN": "1"})):
            for role in ("prefill", "decode"):
                workers[case, role] = start_worker(config, role, script=WORKER,
                                                   env={**env, **extra})
        wait_healthy(list(workers.values()))
        yield workers, reference
    finally:
        stop_workers(list(workers.values()))
        assert all(w.proc.returncode == 0 for w in workers.values()), \
            {k: w.proc.returncode for k, w in workers.items()}


def accept_length(worker) -> float:
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("sglang:spec_accept_length"))
    return float(line.split()[-1])


def serve(workers, case: str) -> list:
    prefill, decode = workers[case, "prefill"], workers[case, "decode"]
    bodies = [body(f"spec-{case}-{i}", ids, n, prefill)
              for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW))]
    outcomes = generate(prefill, decode, bodies)
    for w in (prefill, decode):
        assert w.wait_pools_full() == {"full": True, "detail": ""}
    return outcomes


def check_outputs(outcomes, reference) -> None:
    for i, (o, want) in enumerate(zip(outcomes, reference)):
        assert o.prefill_status == 200 and o.prefill_body["status"] == "ok", o.prefill_body
        assert o.decode_status == 200, o.decode_body
        assert o.token_ids == want, f"prompt {i}"
        assert o.last["finished"] and o.last["error"] is None


def test_pd_speculation_equals_colocated_greedy_and_accepts_drafts(cluster):
    workers, reference = cluster
    check_outputs(serve(workers, "intact"), reference)
    accepted = accept_length(workers["intact", "decode"])
    print(f"PD speculation, checked oracle: {accepted:.3f} tokens per verify step")
    assert accepted > 1.0  # drafts accepted: the hidden state and the draft KV travelled


def test_without_the_hidden_state_no_draft_is_accepted(cluster):
    workers, reference = cluster
    check_outputs(serve(workers, "dropped"), reference)
    assert accept_length(workers["dropped", "decode"]) == 1.0
