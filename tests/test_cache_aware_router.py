"""Cache-aware routing: a repeated prefix follows the instance that holds it, unless that
instance is over the load-balance threshold."""

from __future__ import annotations

import random

import pytest

from pdsim.core.router import CacheAwarePolicy, Router, make_policy


def prompt(prefix: str, n_shared: int, tail: str, n_tail: int = 2) -> list[tuple[str, int]]:
    return [(prefix, i) for i in range(n_shared)] + [(tail, i) for i in range(n_tail)]


def policy(**options) -> CacheAwarePolicy:
    return make_policy("cache_aware", random.Random(0), **options)


def loads(values):
    return lambda i: values[i]


def test_a_repeated_prefix_goes_to_the_instance_that_holds_it():
    p = policy()
    flat = loads([0, 0, 0, 0])
    first = p.pick(4, flat, prompt("sys-A", 8, "u1"))
    other = p.pick(4, flat, prompt("sys-B", 8, "u2"))
    assert other != first  # no match: the least loaded with the smallest tree
    for k in range(5):
        assert p.pick(4, flat, prompt("sys-A", 8, f"q{k}")) == first
        assert p.pick(4, flat, prompt("sys-B", 8, f"r{k}")) == other


def test_below_the_cache_threshold_the_least_loaded_wins():
    p = policy(cache_threshold=0.5)
    first = p.pick(2, loads([0, 0]), prompt("sys", 4, "a", n_tail=6))
    # 4 of 10 keys match on `first` (0.4 <= 0.5): the less loaded instance gets it
    busy = [0, 0]
    busy[first] = 5
    assert p.pick(2, loads(busy), prompt("sys", 4, "b", n_tail=6)) == 1 - first
    # 6 of 10 match on `first` (> 0.5): it goes back there despite the small imbalance
    q = policy(cache_threshold=0.5)
    first = q.pick(2, loads([0, 0]), prompt("sys", 6, "a", n_tail=4))
    assert q.pick(2, loads(busy if first == 0 else busy[::-1]), prompt("sys", 6, "b", n_tail=4)) == first


def test_an_instance_over_the_load_threshold_loses_its_prefix():
    p = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = p.pick(2, loads([0, 0]), prompt("sys", 8, "a"))
    held = [0, 0]
    held[first] = 4  # 4 - 0 is not over the absolute threshold: still balanced
    assert p.pick(2, loads(held), prompt("sys", 8, "b")) == first
    held[first], held[1 - first] = 10, 7  # 3 apart: balanced
    assert p.pick(2, loads(held), prompt("sys", 8, "c")) == first
    held[first], held[1 - first] = 12, 7  # 5 apart and 12 > 1.5 * 7: imbalanced
    assert p.pick(2, loads(held), prompt("sys", 8, "d")) == 1 - first
    held[first], held[1 - first] = 12, 8.5  # 3.5 apart: balanced again; both hold the prefix
    assert p.pick(2, loads(held), prompt("sys", 8, "e")) == 1 - first  # equal match: lower load
    assert p.pick(2, loads(held), prompt("sys", 8, "a")) == first  # a's tail is only on `first`


def test_the_relative_threshold_alone_keeps_big_loads_balanced():
    p = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = p.pick(2, loads([0, 0]), prompt("sys", 8, "a"))
    held = [0, 0]
    held[first], held[1 - first] = 100, 90  # 10 apart, but 100 < 1.5 * 90
    assert p.pick(2, loads(held), prompt("sys", 8, "b")) == first


def test_the_less_loaded_instance_learns_the_prefix_it_was_sent():
    p = policy(balance_abs_threshold=1, balance_rel_threshold=1.0)
    first = p.pick(2, loads([0, 0]), prompt("sys", 8, "a"))
    held = [0, 0]
    held[first] = 5
    second = p.pick(2, loads(held), prompt("sys", 8, "b"))
    assert second == 1 - first
    # both now hold the prefix; balanced loads: the longest match, then the lower load
    held = [3, 3]
    held[first] = 2
    assert p.pick(2, loads(held), prompt("sys", 8, "b", n_tail=2)) == second  # 10 of 10 keys
    assert p.pick(2, loads(held), prompt("sys", 8, "zz")) == first  # 8 on both: lower load


def test_the_approximate_trees_forget_least_recently_routed_prefixes():
    p = policy(max_tree_size=10)
    flat = loads([0])
    p.pick(1, flat, prompt("old", 3, "x", n_tail=2))
    p.pick(1, flat, prompt("new", 5, "y", n_tail=0))
    p.pick(1, flat, prompt("old", 3, "z", n_tail=2))  # old's run splits: "old" + tails x and z
    assert p.trees[0].num_values == 12 - 2  # over 10: x, the least recently used leaf, went
    tree = p.trees[0]
    assert tree.match_length(prompt("old", 3, "x", n_tail=2)) == 3
    assert tree.match_length(prompt("old", 3, "z", n_tail=2)) == 5
    assert tree.match_length(prompt("new", 5, "y", n_tail=0)) == 5


def test_without_keys_it_is_least_loaded():
    p = policy()
    assert p.pick(3, loads([5, 1, 3])) == 1
    assert p.trees[1].num_values == 0


def test_router_sends_keys_to_the_side_that_computes_the_prompt():
    pd = Router("cache_aware", 2, 2, seed=0)
    flat = loads([0, 0])
    p1, _, _ = pd.route(flat, flat, prompt("sys", 8, "a"))
    p2, _, _ = pd.route(flat, flat, prompt("sys", 8, "b"))
    assert p1 == p2
    assert sum(t.num_values for t in pd.prefill_policy.trees) == 8 + 2 + 2  # one tree, two tails
    assert sum(t.num_values for t in pd.decode_policy.trees) == 0
    colocated = Router("cache_aware", 0, 3, seed=0)
    d1 = colocated.route(flat, loads([0, 0, 0]), prompt("sys", 8, "a"))[1]
    assert colocated.route(flat, loads([0, 0, 0]), prompt("sys", 8, "b"))[1] == d1


def test_bad_options_name_the_field_and_the_allowed_range():
    with pytest.raises(ValueError, match=r"cache_threshold must be in \[0, 1\], got 1.5"):
        policy(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold must be >= 1, got 0.5"):
        policy(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match=r"'round_robin' does not take options \['cache_threshold'\]"):
        make_policy("round_robin", random.Random(0), cache_threshold=0.5)
