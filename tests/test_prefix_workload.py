"""Workloads with prefixes: Mooncake hash_ids as prefix blocks, shared system prompts and
multi-turn conversations, and the hit rate of an unbounded cache computed from the blocks."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from pdsim.core.pool import PagePool
from pdsim.core.radix import RadixCache, block_page_keys, max_match_pages
from pdsim.workload import Workload, WorkloadError, generate, read_trace
from pdsim.workload.arrays import PrefixBlocks
from pdsim.workload.prefix import ideal_cached_blocks, ideal_cached_tokens, ideal_hit_rate

CONV = "conversation_trace.jsonl"  # in the `traces` folder (tests/conftest.py)
SYNTH = "synthetic_trace.jsonl"


def synthetic(**extra) -> dict:
    config = {
        "num_requests": 200, "seed": 3,
        "arrival": {"process": "poisson", "rate_rps": 2.0},
        "input_len": {"dist": "fixed", "value": 100},
        "output_len": {"dist": "fixed", "value": 50},
    }
    config.update(extra)
    return config


# ---- the value -----------------------------------------------------------------------------------


def test_prefix_blocks_take_and_equality():
    p = PrefixBlocks.from_lists(4, [[1, 2], [3], [4, 5, 6]])
    assert [p.ids_of(i).tolist() for i in range(3)] == [[1, 2], [3], [4, 5, 6]]
    t = p.take(np.array([2, 0]))
    assert [t.ids_of(i).tolist() for i in range(2)] == [[4, 5, 6], [1, 2]]
    assert p.take(slice(1, 3)) == PrefixBlocks.from_lists(4, [[3], [4, 5, 6]])
    assert p != PrefixBlocks.from_lists(8, [[1, 2], [3], [4, 5, 6]])


def test_workload_keeps_its_prefix_through_head_and_scaling():
    p = PrefixBlocks.from_lists(4, [[1, 2], [1, 3], [1, 2, 5]])
    w = Workload([0.0, 1.0, 2.0], [8, 5, 9], [1, 1, 1], prefix=p)
    assert w.head(2).prefix == p.take(slice(0, 2))
    assert w.scaled(2.0).prefix == p
    assert w != Workload([0.0, 1.0, 2.0], [8, 5, 9], [1, 1, 1])


def test_prefix_blocks_must_cover_every_prompt():
    p = PrefixBlocks.from_lists(4, [[1, 2], [1]])
    with pytest.raises(WorkloadError, match="request 1: 1 prefix blocks of 4 tokens cannot cover its 5"):
        Workload([0.0, 1.0], [8, 5], [1, 1], prefix=p)
    with pytest.raises(WorkloadError, match="prefix holds blocks of 2 requests, the workload has 1"):
        Workload([0.0], [8], [1], prefix=p)


# ---- the unbounded cache -------------------------------------------------------------------------


def test_ideal_cached_blocks_counts_whole_prefixes_seen_before():
    p = PrefixBlocks.from_lists(512, [[0, 1, 2], [0, 1, 3], [0, 4], [5, 1], [0, 1, 2, 6]])
    np.testing.assert_array_equal(ideal_cached_blocks(p), [0, 2, 1, 0, 3])
    assert ideal_hit_rate(p) == pytest.approx(6 / 14)


@pytest.mark.parametrize("name, rate", [(CONV, 0.366), (SYNTH, 0.640)])
def test_mooncake_hash_ids_become_prefix_blocks_with_the_published_reuse(traces, name, rate):
    w = read_trace(traces / name)
    assert w.prefix is not None and w.prefix.block_tokens == 512
    np.testing.assert_array_equal(w.prefix.num_blocks(), -(-w.input_tokens // 512))
    assert ideal_hit_rate(w.prefix) == pytest.approx(rate, abs=5e-4)  # traces/README.md


def test_a_replay_window_keeps_each_request_with_its_blocks(traces):
    full = read_trace(traces / CONV)
    w = generate({"trace": str(traces / CONV), "start_s": 600, "max_input_tokens": 8000, "num_requests": 300,
                  "target_rate_rps": 5.0})
    rows = np.flatnonzero((full.arrival_s >= 600) & (full.input_tokens <= 8000))[:300]
    np.testing.assert_array_equal(w.input_tokens, full.input_tokens[rows])
    for k in (0, 17, 299):
        np.testing.assert_array_equal(w.prefix.ids_of(k), full.prefix.ids_of(rows[k]))


@pytest.mark.parametrize("page_size", [16, 512, 96])
def test_ideal_cached_tokens_is_what_a_radix_cache_gives_requests_run_in_order(traces, page_size):
    w = read_trace(traces / CONV).head(400)
    expected = ideal_cached_tokens(w, page_size)
    cache = RadixCache(PagePool(10**6, page_size))
    for i, n_in in enumerate(w.input_tokens.tolist()):
        keys = block_page_keys(w.prefix.ids_of(i).tolist(), 512, n_in, page_size)
        m = cache.match_prefix(keys[:max_match_pages(n_in, page_size)], float(i))
        assert m.cached_tokens == expected[i]
        cache.lock(m.node)
        pages = m.pages + cache.alloc(-(-n_in // page_size) - len(m.pages))
        cache.cache_finished(keys, pages, m.node, float(i))
    cache.check_full()
    # a whole page is cached only inside blocks seen before, and never the last token
    bound = np.minimum(ideal_cached_blocks(w.prefix) * 512, w.input_tokens - 1)
    assert np.all(expected <= bound)
    assert expected.sum() >= 0.95 * bound.sum() > 0  # lost only to page rounding


# ---- synthetic prefixes and conversations --------------------------------------------------------


def test_one_shared_system_prompt_is_hit_by_every_later_request():
    w = generate(synthetic(prefix={"system_prompts": 1, "system_prompt_len": 512, "share": 1.0}))
    assert np.all(w.input_tokens == 612)
    blocks = ideal_cached_blocks(w.prefix)  # 512 / 64 = 8 whole blocks of system prompt
    assert blocks[0] == 0 and np.all(blocks[1:] == 8)
    assert ideal_hit_rate(w.prefix) == pytest.approx(8 * 199 / (200 * 10))


def test_share_sets_the_fraction_of_requests_with_a_system_prompt():
    w = generate(synthetic(num_requests=2000,
                           prefix={"system_prompts": 5, "system_prompt_len": 256, "share": 0.8}))
    with_prompt = w.input_tokens == 356
    assert np.all(with_prompt | (w.input_tokens == 100))
    assert with_prompt.mean() == pytest.approx(0.8, abs=0.03)
    # requests without a system prompt share nothing; with one, they share its 4 blocks
    blocks = ideal_cached_blocks(w.prefix)
    assert np.all(blocks[~with_prompt] == 0)
    assert np.all(blocks[with_prompt][50:] == 4)  # every prompt seen by then
    assert generate(synthetic(prefix={"system_prompts": 5, "system_prompt_len": 256,
                                      "share": 0.0})).input_tokens.max() == 100


def test_each_turn_extends_the_previous_prompt_and_answer():
    w = generate(synthetic(num_requests=9, arrival={"process": "constant", "rate_rps": 0.01},
                           conversation={"turns": 3, "think_time_s": 10.0}))
    np.testing.assert_allclose(w.arrival_s, [0, 10, 20, 100, 110, 120, 200, 210, 220])
    np.testing.assert_array_equal(w.input_tokens, [100, 250, 400] * 3)
    for c in range(3):
        t0, t1, t2 = (w.prefix.ids_of(3 * c + k).tolist() for k in range(3))
        assert t1[:1] == t0[:1] and t1[1] != t0[1]  # 100 tokens: one whole block, one partial
        assert t2[:3] == t1[:3]  # 250 tokens: three whole blocks
    first_turns = [w.prefix.ids_of(i)[0] for i in (0, 3, 6)]
    assert len(set(first_turns)) == 3  # no system prompt: conversations share nothing
    assert np.all(ideal_cached_blocks(w.prefix) == [0, 1, 3] * 3)


def test_conversations_interleave_in_arrival_order():
    w = generate(synthetic(num_requests=300, conversation={"turns": 5, "think_time_s": 30.0},
                           prefix={"system_prompts": 2, "system_prompt_len": 1000, "share": 0.5}))
    assert len(w) == 300 and np.all(np.diff(w.arrival_s) >= 0)
    assert 0.5 < ideal_hit_rate(w.prefix) < 1.0


def test_same_seed_same_workload_other_seed_other_prompts():
    config = synthetic(prefix={"system_prompts": 3, "system_prompt_len": 300, "share": 0.5},
                       conversation={"turns": 2, "think_time_s": 5.0})
    assert generate(config) == generate(config)
    other = generate({**config, "seed": 4})
    assert other.prefix != generate(config).prefix


def test_bad_prefix_configs_name_the_field():
    with pytest.raises(ValidationError, match="share"):
        generate(synthetic(prefix={"system_prompts": 3, "system_prompt_len": 300, "share": 1.5}))
    with pytest.raises(ValidationError, match="turn"):
        generate(synthetic(conversation={"turns": 2, "think_time_s": 5.0, "turn": 3}))
    with pytest.raises(ValidationError, match="conversation needs an open-loop arrival process"):
        generate(synthetic(arrival={"process": "closed", "concurrency": 4},
                           conversation={"turns": 2, "think_time_s": 5.0}))
