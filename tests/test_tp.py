"""Tensor parallelism on CPU: real gloo groups of two ranks on loopback against the tp=1 model.

Every rank builds the same seeded model, shards it with `apply_tp`, and runs a prefill and 8 greedy
decode steps through its own paged cache (scattered pages); the results come back as JSON.
"""

from __future__ import annotations

import time

import pytest
import torch

from runtime.distributed import JoinTimeout, RankFailed, TPGroup, free_port, run_ranks
from runtime.model.kv_cache import PagedKVCache
from runtime.model import AttentionMetadata, ModelConfig, build_model
from runtime.model.hybrid import recurrent_state_for
from runtime.model.tp import apply_tp, check_tp, head_range, kv_head_range

pytestmark = [pytest.mark.real, pytest.mark.slow]

TINY_LLAMA, TINY_MLA = ModelConfig.preset("tiny-llama"), ModelConfig.preset("tiny-mla")
CASES = {
    "tiny-llama": TINY_LLAMA,  # 2 KV heads: one per rank
    "mqa-qkv-bias": TINY_LLAMA.with_(name="mqa-qkv-bias", num_kv_heads=1, qkv_bias=True),
    "tiny-mla": TINY_MLA,  # MLA, q LoRA, layer 1 MoE with a shared expert
    "mla-no-q-lora": TINY_MLA.with_(name="mla-no-q-lora", q_lora_rank=None),
    # Sliding-window, linear-recurrence (its state split by heads) and full-attention layers.
    "tiny-hybrid": ModelConfig.preset("tiny-hybrid"),
}
GQA_CASES = [c for c in CASES if not CASES[c].is_mla]
MLA_CASES = [c for c in CASES if CASES[c].is_mla]
PAGES, PAGE_SIZE, NUM_PAGES = [11, 3, 7, 14, 0], 4, 16
PROMPT_LEN, DECODE_STEPS = 9, 8
TP = 2


def generate(group: TPGroup, case: str) -> dict:
    """Greedy prefill + decode on this rank; every step's logits and the used cache pages."""
    config = CASES[case]
    model = apply_tp(build_model(config, seed=7), group)
    kv = PagedKVCache.for_model(config, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                tp_size=group.size)
    kv.state = recurrent_state_for(config, 2 if config.linear_layers else 0, tp_size=group.size)
    slots = [1] if kv.state is not None else []
    tokens = torch.randint(0, 256, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    new, logits_per_step = list(tokens), []
    for _ in range(1 + DECODE_STEPS):
        meta = AttentionMetadata.build([len(new)], [len(tokens) - len(new)], [PAGES], PAGE_SIZE,
                                       state_slots=slots)
        logits = model(torch.tensor(new), meta.positions(), meta, kv)[0]
        logits_per_step.append(logits.tolist())
        tokens.append(int(logits.argmax()))
        new = tokens[-1:]
    return {"tokens": tokens[PROMPT_LEN:], "logits": logits_per_step, "kv_heads": kv.heads,
            "kv": [buffer[PAGES].tolist() for buffer in kv.buffers],
            "state": [] if kv.state is None else kv.state.tensor[slots[0]].tolist()}


def generate_all(group: TPGroup) -> dict:
    return {case: generate(group, case) for case in CASES}


MESSAGE = {"step": 7, "rids": ["a", "b"], "pages": {3: [1, 2]}, "blob": b"\x00\xff", "x": 0.5}


def collectives(group: TPGroup) -> dict:
    rank = group.rank
    polls = [[4, 2, 3, 1], [3, 0, 4, 2]][rank]  # rank 1 reports Failed (0) for request 1
    try:
        group.all_reduce_min_int([1] * (rank + 1))
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    data = torch.tensor([1.5, -2.0]) if rank == 0 else torch.empty(2)
    return {
        "min": group.all_reduce_min_int(polls),
        "empty": group.all_reduce_min_int([]),
        "mismatch": mismatch,
        "sum": group.all_reduce_sum(torch.full((3,), float(rank + 1))).tolist(),
        "tensor": group.broadcast_tensor(data).tolist(),
        "bytes": group.broadcast_bytes(b"" if rank == 0 else None).hex(),
        "msg_round_trips": group.broadcast_msgpack(MESSAGE if rank == 0 else None) == MESSAGE,
    }


def fail_on_rank_1(group: TPGroup) -> int:
    if group.rank == 1:
        raise RuntimeError("boom on purpose")
    group.barrier()  # never completes: rank 1 is gone
    return 0


@pytest.fixture(scope="module")
def tp1() -> dict:
    return generate_all(TPGroup.single())


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(generate_all, TP)


def _tensor(nested: list) -> torch.Tensor:
    return torch.tensor(nested, dtype=torch.float32)


# ---- the sharded model -----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_tp2_greedy_generation_equals_tp1(case, tp1, tp2):
    expected = tp1[case]
    for rank in range(TP):
        got = tp2[rank][case]
        assert got["tokens"] == expected["tokens"]
        torch.testing.assert_close(_tensor(got["logits"]), _tensor(expected["logits"]),
                                   atol=1e-4, rtol=1e-4)
    # The logits (hence the sampled tokens) are bit-identical on every rank.
    assert tp2[0][case]["logits"] == tp2[1][case]["logits"]


@pytest.mark.parametrize("case", GQA_CASES)
def test_gqa_rank_cache_holds_its_head_slice(case, tp1, tp2):
    config = CASES[case]
    full = [_tensor(b) for b in tp1[case]["kv"]]  # [pages, page_size, kv_heads, head_dim]
    for rank in range(TP):
        heads = kv_head_range(config, TP, rank)
        assert tp2[rank][case]["kv_heads"] == len(heads) == max(1, config.num_kv_heads // TP)
        for got, want in zip(tp2[rank][case]["kv"], full):  # K of every layer, then V
            torch.testing.assert_close(_tensor(got), want[:, :, heads.start: heads.stop],
                                       atol=1e-5, rtol=1e-5)


def test_hybrid_rank_state_holds_its_head_slice(tp1, tp2):
    """Each rank's recurrent state (its slot, every linear layer) is its heads of the tp=1
    state: what lets a prefill rank's slot land as a head slice in a decode rank's."""
    full = _tensor(tp1["tiny-hybrid"]["state"])  # [linear layers, heads, floats]
    per_rank = CASES["tiny-hybrid"].linear_num_heads // TP
    for rank in range(TP):
        torch.testing.assert_close(_tensor(tp2[rank]["tiny-hybrid"]["state"]),
                                   full[:, rank * per_rank: (rank + 1) * per_rank],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_every_rank_caches_the_full_latent(case, tp1, tp2):
    assert tp2[0][case]["kv"] == tp2[1][case]["kv"]
    for got, want in zip(tp2[0][case]["kv"], tp1[case]["kv"]):
        torch.testing.assert_close(_tensor(got), _tensor(want), atol=1e-5, rtol=1e-5)
    assert tp2[0][case]["kv_heads"] == 1


def test_head_ranges_split_or_replicate_kv_heads():
    assert [head_range(TINY_LLAMA, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_head_range(TINY_LLAMA, 2, r) for r in range(2)] == [range(0, 1), range(1, 2)]
    # tp=4 > 2 KV heads: each head on two neighbouring ranks, the ones whose queries read it.
    assert [kv_head_range(TINY_LLAMA, 4, r) for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [kv_head_range(TINY_MLA, 4, r) for r in range(4)] == [range(0, 1)] * 4


def test_uneven_splits_are_rejected():
    with pytest.raises(ValueError, match="num_heads=4 must divide by tp"):
        check_tp(TINY_LLAMA, 3)
    with pytest.raises(ValueError, match="num_kv_heads=2 and tp must divide"):
        check_tp(TINY_LLAMA.with_(num_heads=6, num_kv_heads=2), 3)
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):
        check_tp(TINY_MLA.with_(moe_intermediate_size=30), 4)


def test_apply_tp_with_one_rank_leaves_the_model_alone():
    model = build_model(TINY_LLAMA, seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_tp(model, TPGroup.single()) is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---- the group ----------------------------------------------------------------------------


def test_collectives_over_two_ranks():
    results = run_ranks(collectives, TP)
    for got in results:
        assert got["min"] == [3, 0, 3, 1]  # element-wise MIN: rank 1's Failed wins
        assert got["empty"] == []
        assert "between 1 and 2 values" in got["mismatch"]
        assert got["sum"] == [3.0, 3.0, 3.0]
        assert got["tensor"] == [1.5, -2.0]
        assert got["bytes"] == ""
        assert got["msg_round_trips"]


def test_single_group_collectives_return_their_input():
    group = TPGroup.single()
    t = torch.ones(2)
    assert group.all_reduce_sum(t) is t
    assert group.all_reduce_min_int([2, 0]) == [2, 0]
    assert group.broadcast_msgpack(MESSAGE) == MESSAGE
    group.barrier()
    group.destroy()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_missing_from_the_group_times_out(rank):
    """Rank 0 waits for a rank 1 that never starts; rank 1 finds no rank 0 to meet."""
    start = time.monotonic()
    with pytest.raises(JoinTimeout, match=f"tp rank {rank} of 2 .* did not form within 1 s"):
        TPGroup.join(f"tcp://127.0.0.1:{free_port()}", rank, 2, timeout_s=1.0)
    assert time.monotonic() - start < 15


def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 raised.*boom on purpose"):
        run_ranks(fail_on_rank_1, TP, group_timeout_s=10)
