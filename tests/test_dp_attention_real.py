"""Attention data parallelism in the real backend: PD worker instances whose `tp` rank processes
form `dp_attention` DP ranks (gloo over loopback, Mooncake over TCP for the KV), each with its
own core scheduler. Greedy outputs are token-identical to colocated tp 1 for GQA and MLA with
prefill DP 2 -> decode DP 1, 1 -> 2 and 2 -> 2; requests land on both DP ranks (rooms 0..4),
one rank idles while the other runs (the idle batch), and every page and slot of every DP rank
comes back.

Per model one cluster: prefill with dp 1 and dp 2, decode with dp 1 and dp 2 (six processes).
The MLA cluster's DP prefill runs its dense MLP per process (`moe_dense_tp: 1`); the others
gather the DP ranks' tokens for it. DP prefill splits its LM head by vocabulary over the
instance's processes (dp_lm_head false), DP decode runs it whole per DP rank (dp_lm_head true).
Decode DP 2 picks ranks by shortest queue, so a request's decode rank need not be its prefill
rank. Each worker's `/server_info` reports its role's dp_attention as `dp_size`.

The transfer snapshot alone: two processes as two DP ranks, each moving only its own rank's
transfers, agree on both ranks' states and first-token metadata.

`pdsim validate` serves and simulates experiments/real_pd_dp_attention.yaml (DP 2 -> DP 2).

The model alone: four gloo processes as two DP ranks of two attention-TP processes each, the
ranks' prompts and lengths differing and one rank idling while the other decodes, against the
unsharded model, with the LM head split by vocabulary over the four processes or whole per DP
rank (`dp_lm_head`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from pd_harness import (
    body, check_greedy_equals_colocated, colocated_outputs, generate, pd_config, prompts,
    worker_cluster,
)
from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.transfer import FirstTokenMetadata
from runtime.distributed import TPGroup, free_port, run_ranks
from runtime.model import AttentionMetadata, ModelConfig, PagedKVCache, build_model
from runtime.model.tp import DPRanks, apply_dp_attention, check_dp_attention, run_idle
from runtime.pd.kv import OTHER_RANK, SnapshotKV
from test_pd_snapshot import ScriptedManager

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODELS = ("tiny-llama", "tiny-mla")
PAIRS = [(2, 1), (1, 2), (2, 2)]  # (prefill dp, decode dp)


def dp_role(model: str, role: str, dp: int) -> dict:
    extra = {"moe_dense_tp": 1} if dp > 1 and role == "prefill" and model == "tiny-mla" else {}
    if dp > 1 and role == "decode":  # prefill DP splits its LM head by vocabulary, decode not
        extra["dp_lm_head"] = True
    return {role: {"tp": dp, "dp_attention": dp, **extra}}


@pytest.fixture(scope="module", params=MODELS)
def cluster(request):
    model = request.param
    configs = {}
    for dp in (1, 2):
        configs["prefill", dp] = pd_config(model, **dp_role(model, "prefill", dp))
        router = {"dp_assignment": "shortest_queue"} if dp > 1 else {}
        configs["decode", dp] = pd_config(model, router=router, **dp_role(model, "decode", dp))
    with worker_cluster(configs, while_starting=lambda: colocated_outputs(model),
                        timeout_s=300) as started:  # six processes on a shared CPU
        yield model, *started


@pytest.mark.parametrize("pdp, ddp", PAIRS, ids=[f"dp{p}to{d}" for p, d in PAIRS])
def test_greedy_outputs_equal_colocated_tp1(cluster, pdp, ddp):
    model, workers, reference = cluster
    prefill, decode = workers["prefill", pdp], workers["decode", ddp]
    # Rooms 0..4: the prefill DP rank is room % dp, so both ranks get requests.
    check_greedy_equals_colocated(prefill, decode, reference, f"{model}-dp{pdp}{ddp}",
                                  rooms=True)
    assert decode.get("/load")["num_active"] == 0


def test_server_info_reports_the_roles_dp_attention(cluster):
    _, workers, _ = cluster
    for (role, dp), worker in workers.items():
        for path in ("/server_info", "/get_server_info"):
            info = worker.get(path)
            assert (info["tp_size"], info["dp_size"]) == (dp, dp), (role, path)
            assert info["disaggregation_mode"] == role


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


# ---- the model alone: DP 2 x attention TP 2 -------------------------------------------------

# (model, dense MLP over tp?, dp_lm_head)
MODEL_CASES = [("tiny-llama", True, False), ("tiny-llama", True, True), ("tiny-mla", True, False),
               ("tiny-mla", False, True)]
PAGE_SIZE, NUM_PAGES = 4, 16
RANK_PAGES = ([11, 3, 7, 14, 0], [2, 9, 5])
RANK_PROMPTS = (9, 5)  # prompt tokens per DP rank
RANK_DECODES = (8, 3)  # decode steps per DP rank: rank 1 idles through the last five


def rank_prompt(r: int) -> list[int]:
    gen = torch.Generator().manual_seed(10 + r)
    return torch.randint(0, 256, (RANK_PROMPTS[r],), generator=gen).tolist()


def tokens_in(r: int, step: int) -> int:
    return RANK_PROMPTS[r] if step == 0 else (1 if step <= RANK_DECODES[r] else 0)


def greedy(model, kv, r: int, steps: int, tokens_at=None):
    """Rank r's prompt then `steps` greedy decode steps; (tokens, per-step logits). `tokens_at`
    is called before each step with the step number (the DP ranks' token counts)."""
    tokens = rank_prompt(r)
    new, logits = list(tokens), []
    for step in range(1 + steps):
        if tokens_at is not None:
            tokens_at(step)
        meta = AttentionMetadata.build([len(new)], [len(tokens) - len(new)], [RANK_PAGES[r]],
                                       PAGE_SIZE)
        out = model(torch.tensor(new), meta.positions(), meta, kv)[0]
        logits.append(out.tolist())
        tokens.append(int(out.argmax()))
        new = tokens[-1:]
    return tokens[RANK_PROMPTS[r]:], logits


def dp_generate(world: TPGroup, attn_methods: list[str]) -> dict:
    attn = TPGroup.join(attn_methods[world.rank // 2], world.rank % 2, 2)
    out = {}
    try:
        for name, dense_tp, dp_lm_head in MODEL_CASES:
            config = ModelConfig.preset(name)
            dp = DPRanks(world, attn, 2)
            model = apply_dp_attention(build_model(config, seed=7), dp, dense_tp=dense_tp,
                                       dp_lm_head=dp_lm_head)
            kv = PagedKVCache.for_model(config, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                        tp_size=attn.size)
            r = dp.dp_rank

            def counts(step: int) -> None:
                dp.token_counts = [tokens_in(e, step) for e in range(2)]
                dp.row_counts = [min(1, n) for n in dp.token_counts]  # one segment per rank

            tokens, logits = greedy(model, kv, r, RANK_DECODES[r], counts)
            for step in range(1 + RANK_DECODES[r], 1 + max(RANK_DECODES)):  # the idle batch
                counts(step)
                run_idle(model)
            out[f"{name}-{dense_tp}-{dp_lm_head}"] = {
                "rank": r, "tokens": tokens, "logits": logits,
                "lm_head_rows": model.lm_head.weight.shape[0]}
    finally:
        attn.destroy()
    return out


def test_dp_ranks_of_two_attention_tp_processes_match_the_unsharded_model():
    methods = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    results = run_ranks(dp_generate, 4, methods, timeout_s=300)
    for name, dense_tp, dp_lm_head in MODEL_CASES:
        config = ModelConfig.preset(name)
        for r in range(2):
            kv = PagedKVCache.for_model(config, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
            want_tokens, want_logits = greedy(build_model(config, seed=7), kv, r, RANK_DECODES[r])
            for proc in (2 * r, 2 * r + 1):
                got = results[proc][f"{name}-{dense_tp}-{dp_lm_head}"]
                assert got["rank"] == r
                # dp_lm_head: the whole head on every process; else a quarter of the vocabulary
                want_rows = config.vocab_size if dp_lm_head else config.vocab_size // 4
                assert got["lm_head_rows"] == want_rows
                assert got["tokens"] == want_tokens, (name, dense_tp, dp_lm_head, proc)
                for a, b in zip(got["logits"], want_logits):
                    assert a == pytest.approx(b, abs=2e-4)


def test_an_lm_head_split_by_vocabulary_needs_the_vocabulary_to_divide():
    config = ModelConfig.preset("tiny-llama").with_(vocab_size=510)
    with pytest.raises(ValueError, match=r"vocab_size=510 must divide by tp \(or set dp_lm_head"):
        check_dp_attention(config, 4, 2)
    check_dp_attention(config, 4, 2, dp_lm_head=True)  # whole per DP rank
    check_dp_attention(config, 4, 1)  # without attention DP the head stays whole


# ---- pdsim validate ------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_validate_a_dp_attention_deployment(tmp_path):
    raw = yaml.safe_load((REPO / "experiments" / "real_pd_dp_attention.yaml").read_text())
    raw["workload"]["num_requests"] = 12
    raw["cost_model"]["params"]["timings"] = str(
        REPO / "experiments" / "calibration" / "tiny_llama_cpu_timings.csv")
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(raw))
    calibration = REPO / "experiments" / "validation" / "calibration" / "pd.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "pdsim.cli", "validate", "dp.yaml", "--calibration",
         str(calibration), "--tolerance", "10", "--out", "out"], cwd=tmp_path,
        env={**os.environ, "GLOG_minloglevel": "2"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_csv(tmp_path / "out" / "validation.csv").set_index("metric")
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == 12
    real = pd.read_csv(tmp_path / "out" / "real_requests.csv")
    assert len(real) == 12 and (real["status"] == "ok").all()


# ---- the transfer snapshot of two DP ranks -------------------------------------------------


def mirrored(group: TPGroup) -> dict:
    """DP rank r (this process) owns request r's receiver; the other one is mirrored."""
    rank = group.rank
    inner = ScriptedManager()
    kv = SnapshotKV(inner, group)
    ports = [kv if r == rank else kv.mirror() for r in range(2)]
    reqs = [Request(f"r{r}", 4, 2, bootstrap_room=100 + r) for r in range(2)]
    recvs = [ports[r].create_receiver(reqs[r]) for r in range(2)]
    for recv in recvs:
        recv.send_metadata([0], 3)  # slot 3 of each rank's own pool
    seen = []

    def step() -> None:
        kv.refresh()
        seen.append([int(r.poll()) for r in recvs])

    step()
    if rank == 0:  # rank 0's KV and first token arrive; rank 1's transfer fails
        inner.made["r0"].state = KVPoll.Success
        inner.metadata.write(3, FirstTokenMetadata(100, 7, -0.25, 4))
    else:
        inner.made["r1"].state, inner.made["r1"].reason = KVPoll.Failed, "boom"
    step()
    meta = ports[0].metadata.read(3)
    return {"seen": seen, "meta": None if meta is None else [
        meta.bootstrap_room, meta.first_token_id, meta.first_logprob, meta.cached_tokens],
        "reason": recvs[1].failure_reason(), "moved": sorted(inner.made)}


def test_each_dp_rank_moves_its_own_transfers_and_both_see_them():
    rank0, rank1 = run_ranks(mirrored, 2)
    B, S, F = KVPoll.Bootstrapping, KVPoll.Success, KVPoll.Failed
    assert rank0["seen"] == rank1["seen"] == [[B, B], [S, F]]
    assert rank0["meta"] == rank1["meta"] == [100, 7, -0.25, 4]  # rank 1 reads rank 0's token
    assert (rank0["reason"], rank1["reason"]) == (OTHER_RANK, "boom")
    assert (rank0["moved"], rank1["moved"]) == (["r0"], ["r1"])  # no process touches the other's
