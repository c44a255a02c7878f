"""The core router's instances change while it routes (`add_instance` / `remove_instance`):
the policy picks among the instances there now, and what it keeps per instance (cache_aware's
prefix trees) follows the instance whose index moved."""

from __future__ import annotations

import pytest

from pdsim.core.router import Router


def test_instances_added_and_removed_are_what_round_robin_cycles_over():
    r = Router("round_robin", 1, 2, seed=0)
    picks = [r.route(lambda i: 0, lambda i: 0)[1] for _ in range(2)]
    assert picks == [0, 1]
    r.add_instance("decode")
    assert [r.route(lambda i: 0, lambda i: 0)[1] for _ in range(3)] == [2, 0, 1]
    r.remove_instance("decode", 0)
    assert (r.num_prefill, r.num_decode) == (1, 2)
    assert {r.route(lambda i: 0, lambda i: 0)[1] for _ in range(4)} == {0, 1}


def test_cache_aware_keeps_each_remaining_instances_tree_when_one_leaves():
    r = Router("cache_aware", 3, 1, seed=0)
    for target, keys in enumerate((["a", "b"], ["c", "d"], ["x", "y"])):
        loads = {i: 0 if i == target else 5 for i in range(3)}
        assert r.route(loads.__getitem__, lambda i: 0, keys)[0] == target  # least loaded
    r.remove_instance("prefill", 1)  # instance 2 is index 1 now, its tree (x, y) with it
    assert r.route(lambda i: 0, lambda i: 0, ["x", "y", "z"])[0] == 1
    assert r.route(lambda i: 0, lambda i: 0, ["a", "b", "e"])[0] == 0
    assert r.route(lambda i: 0, lambda i: 0, ["c", "d"])[0] == 0  # held nowhere now: the
    # least loaded, ties to the smaller tree (both hold 3 keys), then the lower index


def test_bad_membership_changes_name_the_problem():
    r = Router("round_robin", 1, 1, seed=0)
    with pytest.raises(ValueError, match="the last one"):
        r.remove_instance("decode", 0)
    with pytest.raises(ValueError, match="allowed: 0 to 0"):
        r.remove_instance("prefill", 3)
    with pytest.raises(ValueError, match="allowed: prefill, decode"):
        r.add_instance("colocated")
