"""Expert parallelism in the real backend: tiny-moe's routed experts split over gloo groups on
loopback, tokens dispatched and combined by all-to-all, against the unsharded model.

Every rank builds the same seeded model, shards it with `apply_tp(model, group, ep)` and runs a
batched prefill of three prompts and greedy decode steps through its own paged cache; the
tokens must equal the unsharded model's, and every dispatch must move only the routed copies.
"""

from __future__ import annotations

import pytest
import torch

from runtime.distributed import TPGroup, run_ranks
from runtime.model import AttentionMetadata, ModelConfig, build_model
from runtime.model.kv_cache import PagedKVCache
from runtime.model.layers import MoE
from runtime.model.moe import ExpertParallelMoE, check_ep, expert_range
from runtime.model.tp import apply_tp

pytestmark = [pytest.mark.real]

TINY_MOE = ModelConfig.preset("tiny-moe")
PROMPT_LENS, DECODE_STEPS, PAGE_SIZE, PAGES_PER_SEQ = (9, 1, 14), 6, 4, 8
SEED = 7


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def generate(model, tp_size: int) -> dict:
    """Greedy prefill of all prompts in one forward, then batched decode steps."""
    kv = PagedKVCache.for_model(TINY_MOE, num_pages=PAGES_PER_SEQ * len(PROMPT_LENS),
                                page_size=PAGE_SIZE, tp_size=tp_size)
    # Scattered pages: sequence i holds pages i, i+3, i+6, ...
    tables = [list(range(i, PAGES_PER_SEQ * len(PROMPT_LENS), len(PROMPT_LENS)))
              for i in range(len(PROMPT_LENS))]
    tokens = prompts()
    new = [list(t) for t in tokens]
    for _ in range(1 + DECODE_STEPS):
        meta = AttentionMetadata.build([len(n) for n in new],
                                       [len(t) - len(n) for t, n in zip(tokens, new)],
                                       tables, PAGE_SIZE)
        ids = torch.tensor([i for n in new for i in n])
        logits = model(ids, meta.positions(), meta, kv)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist()):
            t.append(nxt)
        new = [t[-1:] for t in tokens]
    return {"tokens": [t[n:] for t, n in zip(tokens, PROMPT_LENS)], "logits": logits.tolist()}


def sharded(group: TPGroup, ep: int) -> dict:
    """This rank's generation under `ep`, with every all-to-all's row counts recorded."""
    model = apply_tp(build_model(TINY_MOE, seed=SEED), group, ep)
    calls: list[list[list[int]]] = []
    plain = group.all_to_all

    def recording(rows, send_counts, recv_counts):
        calls.append([list(send_counts), list(recv_counts)])
        return plain(rows, send_counts, recv_counts)

    group.all_to_all = recording
    out = generate(model, group.size)
    group.all_to_all = plain
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, ExpertParallelMoE)]
    held = [[mlp.gate_proj.out_features for mlp in m.experts] for m in moe]
    params = sum(p.numel() for m in moe for p in [*m.experts.parameters(),
                                                   *m.shared_experts.parameters()])
    return {**out, "a2a": calls, "moe_layers": len(moe), "held": held, "expert_params": params}


def sharded_both(group: TPGroup, eps: list[int]) -> dict:
    return {str(ep): sharded(group, ep) for ep in eps}


@pytest.fixture(scope="module")
def reference() -> dict:
    return generate(build_model(TINY_MOE, seed=SEED), 1)


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(sharded_both, 2, [1, 2])


@pytest.fixture(scope="module")
def tp4() -> list[dict]:
    return run_ranks(sharded_both, 4, [4, 2], timeout_s=240)


def _close(got: list, want: list) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


# ---- the preset and the unsharded block ---------------------------------------------------


def test_tiny_moe_is_the_simulators_model():
    """The simulator prices the very model the real backend builds: same parameters."""
    from pdsim.specs.models import model_preset

    spec, model = model_preset("tiny-moe"), build_model(TINY_MOE, seed=SEED)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert (spec.num_experts, spec.experts_per_token, spec.num_shared_experts) == (16, 2, 1)
    assert spec.num_moe_layers == sum(isinstance(layer.mlp, MoE) for layer in model.model.layers)


def test_unsharded_moe_block_is_the_weighted_sum_of_its_top_k_experts():
    """Per token, by hand: softmax over the 16 router logits, the top 2 renormalised, their
    experts' outputs weighted, plus the shared expert."""
    block = build_model(TINY_MOE, seed=SEED).model.layers[1].mlp
    x = torch.randn(5, TINY_MOE.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = block(x)
        for t in range(x.shape[0]):
            probs = block.gate(x[t]).softmax(-1)
            top = probs.argsort(descending=True)[:2]
            want = block.shared_experts(x[t])
            for e in top:
                want = want + probs[e] / probs[top].sum() * block.experts[int(e)](x[t])
            torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)


# ---- expert parallelism --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_greedy_tokens_equal_the_unsharded_model(ep, reference, tp2):
    for rank in (0, 1):
        got = tp2[rank][str(ep)]
        assert got["tokens"] == reference["tokens"]
        _close(got["logits"], reference["logits"])
    assert tp2[0][str(ep)]["logits"] == tp2[1][str(ep)]["logits"]  # all-reduce: same bits


@pytest.mark.slow
@pytest.mark.parametrize("ep", [4, 2])
def test_tp4_greedy_tokens_equal_the_unsharded_model(ep, reference, tp4):
    for rank in range(4):
        assert tp4[rank][str(ep)]["tokens"] == reference["tokens"]
        _close(tp4[rank][str(ep)]["logits"], reference["logits"])


@pytest.mark.slow
def test_ep1_moves_no_token(tp2):
    assert tp2[0]["1"]["moe_layers"] == 0 and tp2[0]["1"]["a2a"] == []


@pytest.mark.slow
@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 4), (4, 2)])
def test_dispatch_moves_only_the_routed_copies_and_combine_returns_them(tp, ep, tp2, tp4):
    """Per MoE layer and forward three all-to-alls: counts, dispatch, combine. A rank sends
    top-k copies of each of its share of the tokens (to each of the tp/ep ranks holding a slice
    of the expert), gets back exactly what it sent, and what it receives the senders sent."""
    ranks = (tp2 if tp == 2 else tp4)
    runs = [r[str(ep)] for r in ranks]
    k, moe_tp = TINY_MOE.experts_per_token, tp // ep
    steps = [sum(PROMPT_LENS)] + [len(PROMPT_LENS)] * DECODE_STEPS  # tokens per forward
    calls_per_forward = 3 * runs[0]["moe_layers"]
    assert runs[0]["moe_layers"] == 2
    for rank, run in enumerate(runs):
        assert len(run["a2a"]) == calls_per_forward * len(steps)
        for step, tokens in enumerate(steps):
            mine = len(torch.tensor_split(torch.arange(tokens), tp)[rank])
            for layer in range(run["moe_layers"]):
                first = (step * run["moe_layers"] + layer) * 3
                counts, dispatch, combine = run["a2a"][first: first + 3]
                assert counts == [[1] * tp, [1] * tp]
                assert sum(dispatch[0]) == k * mine * moe_tp
                assert combine == [dispatch[1], dispatch[0]]
                # What rank r receives from s is what s sent to r.
                for src in range(tp):
                    sent = runs[src]["a2a"][first + 1][0]
                    assert dispatch[1][src] == sent[rank]
    # Some copies really leave their rank.
    assert any(d[0][r] for rank, run in enumerate(runs) for d in run["a2a"][1::3]
               for r in range(tp) if r != rank)


@pytest.mark.slow
@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 4), (4, 2)])
def test_each_rank_holds_its_experts_as_the_simulator_splits_them(tp, ep, tp2, tp4):
    """E/ep whole experts per EP group, sliced over its tp/ep ranks; the shared expert over tp:
    the routed + shared expert parameters per rank that the simulator's weight split counts."""
    from pdsim.specs.models import model_preset

    spec = model_preset("tiny-moe")
    runs = [r[str(ep)] for r in (tp2 if tp == 2 else tp4)]
    per_rank = spec.num_moe_layers * (spec.num_experts * spec.expert_params / ep / (tp // ep)
                                      + spec.num_shared_experts * spec.expert_params / tp)
    for run in runs:
        assert run["held"] == [[TINY_MOE.moe_intermediate_size // (tp // ep)]
                               * (TINY_MOE.num_experts // ep)] * 2
        assert run["expert_params"] == per_rank


def test_expert_ranges_follow_sglangs_rank_order():
    assert [expert_range(TINY_MOE, 2, 2, r) for r in range(2)] == [range(0, 8), range(8, 16)]
    assert [expert_range(TINY_MOE, 4, 2, r) for r in range(4)] == [
        range(0, 8), range(0, 8), range(8, 16), range(8, 16)]
    assert expert_range(TINY_MOE, 4, 4, 3) == range(12, 16)


def test_bad_ep_is_rejected_with_the_reason():
    with pytest.raises(ValueError, match="ep=3 must be >= 1 and divide tp=4"):
        check_ep(TINY_MOE, 4, 3)
    with pytest.raises(ValueError, match="model 'tiny-llama' has none"):
        check_ep(ModelConfig.preset("tiny-llama"), 2, 2)
    with pytest.raises(ValueError, match="num_experts=12 must divide by ep"):
        check_ep(TINY_MOE.with_(num_experts=12), 8, 8)


def test_single_rank_all_to_all_returns_its_rows_and_checks_counts():
    group, rows = TPGroup.single(), torch.arange(6.0).view(3, 2)
    assert torch.equal(group.all_to_all(rows, [3], [3]), rows)
    with pytest.raises(ValueError, match="one count per rank"):
        group.all_to_all(rows, [2], [3])


# ---- disaggregated serving -----------------------------------------------------------------

PD_PROMPT_LENS, PD_MAX_NEW = (5, 17, 40, 70), 10  # 40 and 70: prefilled in chunks of 32


@pytest.fixture(scope="module")
def pd_workers():
    """Prefill and decode workers of tiny-moe, each at tp 1 and at tp 2 with ep 2; KV over
    Mooncake TCP on loopback."""
    from pd_harness import pd_config, worker_cluster

    configs = {(role, ep): pd_config("tiny-moe", **{role: {"tp": ep, "ep": ep}})
               for role in ("prefill", "decode") for ep in (1, 2)}
    with worker_cluster(configs, timeout_s=300) as (workers, _):
        yield workers


@pytest.mark.slow
def test_pd_with_expert_parallel_prefill_or_decode_equals_unsharded(pd_workers):
    """Greedy outputs of ep 2 -> 1, 1 -> 2 and 2 -> 2 equal the unsharded 1 -> 1 deployment's,
    and every page and slot comes back."""
    import random

    from pd_harness import body, generate

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in PD_PROMPT_LENS]
    outputs = {}
    for pep, dep in ((1, 1), (2, 1), (1, 2), (2, 2)):
        prefill, decode = pd_workers["prefill", pep], pd_workers["decode", dep]
        bodies = [body(f"ep{pep}{dep}-{i}", ids, PD_MAX_NEW, prefill)
                  for i, ids in enumerate(prompts)]
        outcomes = generate(prefill, decode, bodies)
        for o in outcomes:
            assert o.prefill_status == 200 and o.decode_status == 200, (o.prefill_body,
                                                                        o.decode_body)
            assert o.last["finish_reason"] == "length" and o.last["error"] is None
        outputs[pep, dep] = [o.token_ids for o in outcomes]
        for w in (prefill, decode):
            assert w.wait_pools_full() == {"full": True, "detail": ""}
    assert all(len(t) == PD_MAX_NEW for t in outputs[1, 1])
    for pair in ((2, 1), (1, 2), (2, 2)):
        assert outputs[pair] == outputs[1, 1], pair


def test_a_colocated_ep_is_refused_for_serving():
    """The colocated server is one process; expert parallelism is served by PD workers."""
    from pdsim.config import ConfigError
    from runtime.serve_config import parse_serve_config

    role = {"instances": 1, "tp": 2, "ep": 2, "scheduler": {"num_pages": 64}}
    with pytest.raises(ConfigError, match="cluster.colocated.ep: 2; the colocated server is one "
                                        "process"):
        parse_serve_config({"model": "tiny-moe", "cluster": {"mode": "colocated",
                                                             "colocated": role}})
    pd = parse_serve_config({"model": "tiny-moe", "cluster": {
        "mode": "disaggregated", "prefill": role, "decode": {**role, "tp": 1, "ep": 1}}})
    assert (pd.prefill.ep, pd.decode.ep) == (2, 1)


# ---- calibration ----------------------------------------------------------------------------

# The profiled cost model against the forwards it prices, each shape the fastest of 10: the
# median error within 25 % over the fitted shapes and over the held-out ones, every shape within
# a factor of 2 (on a shared 2-core machine one shape can still catch a burst of load).
MEDIAN_TOLERANCE, WORST_FACTOR = 0.25, 2.0


@pytest.mark.slow
def test_calibrated_cost_model_prices_the_expert_parallel_forwards(tmp_path):
    """`pdsim calibrate`'s forward profile of tiny-moe decoding at tp 2 ep 2 (two rank processes,
    the forwards with their all-to-alls), fitted as calibrate fits it (the profiled cost model)
    on part of the grid, prices both the fitted shapes and the held-out ones (48-token
    extends, 64-token contexts, batches of 8); the simulator prices that EP deployment's decode
    step with it."""
    import numpy as np

    from pd_harness import pd_config
    from pdsim.config import parse_experiment
    from pdsim.core.batch import BatchShape
    from pdsim.sim.build import build_cluster
    from pdsim.sim.profiled import ProfiledCostModel
    from pdsim.validation.validate import UNUSED_WORKLOAD
    from runtime.calibration import profile_forwards

    config = pd_config("tiny-moe", decode={"tp": 2, "ep": 2})
    frame = profile_forwards(config, repeats=10, prefill_tokens=(16, 48, 128),
                             prefill_context=(0, 64, 128), decode_batch=(1, 4, 8, 16),
                             decode_context=(32, 64, 128))
    extend = frame["prefill_tokens"] > 0
    tokens, reqs = frame["prefill_tokens"].clip(lower=1), frame["decode_reqs"].clip(lower=1)
    context = np.where(extend, frame["prefill_attn_pairs"] / tokens - (tokens + 1) / 2,
                       frame["decode_context_tokens"] / reqs - 1)
    held = ((frame["prefill_tokens"] == 48) | (frame["decode_reqs"] == 8)
            | (context == 64)).to_numpy()
    assert 0 < held.sum() < len(frame) - 8
    model = ProfiledCostModel(None, None, None, timings=frame[~held])
    priced = np.array([model.step_time_s([BatchShape(
        prefill_tokens=int(r.prefill_tokens), prefill_attn_pairs=float(r.prefill_attn_pairs),
        decode_reqs=int(r.decode_reqs), decode_context_tokens=int(r.decode_context_tokens))])
        for r in frame.itertuples()])
    error = priced / frame["duration_s"].to_numpy() - 1
    assert np.abs(np.log1p(error)).max() < np.log(WORST_FACTOR), error.round(3)
    assert np.median(np.abs(error[held])) < MEDIAN_TOLERANCE, error.round(3)
    assert np.median(np.abs(error[~held])) < MEDIAN_TOLERANCE, error.round(3)
    frame[~held].to_csv(tmp_path / "timings.csv", index=False)
    sim = build_cluster(parse_experiment({
        "name": "ep", "model": "tiny-moe", "workload": UNUSED_WORKLOAD,
        "cluster": {"mode": "disaggregated", "decode": {"tp": 2, "ep": 2}},
        "cost_model": {"name": "profiled", "params": {"timings": "timings.csv"}}}, "ep"),
        str(tmp_path))
    shape = [BatchShape(decode_reqs=8, decode_context_tokens=8 * 65)]
    assert sim.decode.cost().step_time_s(shape) == pytest.approx(model.step_time_s(shape))
