"""Router policies by name, bootstrap rooms and DP ranks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdsim.core import router as router_mod
from pdsim.core.router import (
    InflightLoad,
    POLICIES,
    ROOM_BITS,
    Router,
    dp_rank_for_room,
    make_policy,
    new_bootstrap_room,
    register_policy,
)

NO_LOAD = lambda i: 0.0  # noqa: E731


def picks(policy, n, load, k):
    return [policy.pick(n, load) for _ in range(k)]


def test_registered_names():
    assert {"random", "round_robin", "power_of_two", "least_loaded"} <= set(POLICIES)


def test_round_robin_cycles():
    p = make_policy("round_robin", random.Random(0))
    assert picks(p, 3, NO_LOAD, 7) == [0, 1, 2, 0, 1, 2, 0]
    assert picks(p, 2, lambda i: [100, 0][i], 3) == [1, 0, 1]  # load is ignored; n may change


def test_least_loaded_picks_the_minimum():
    p = make_policy("least_loaded", random.Random(0))
    loads = [5.0, 2.0, 9.0, 2.5]
    assert picks(p, 4, loads.__getitem__, 5) == [1] * 5


def test_least_loaded_breaks_ties_in_rotation():
    p = make_policy("least_loaded", random.Random(0))
    assert picks(p, 3, NO_LOAD, 6) == [0, 1, 2, 0, 1, 2]
    # A tie between 1 and 2 only: the scan starts one further each call and keeps the first
    # minimum it meets from there.
    p = make_policy("least_loaded", random.Random(0))
    loads = [1.0, 0.0, 0.0, 1.0]
    assert picks(p, 4, loads.__getitem__, 8) == [1, 1, 2, 1] * 2


def test_least_loaded_follows_a_changing_load():
    p = make_policy("least_loaded", random.Random(0))
    load = [0, 0, 0]
    chosen = []
    for _ in range(9):
        i = p.pick(3, load.__getitem__)
        chosen.append(i)
        load[i] += 1
    assert Counter(chosen) == {0: 3, 1: 3, 2: 3}


def test_power_of_two_never_picks_the_more_loaded_of_its_samples():
    class Spy(random.Random):
        def sample(self, population, k):
            out = super().sample(population, k)
            self.last = out
            return out

    rng = Spy(7)
    p = make_policy("power_of_two", rng)
    loads = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for _ in range(300):
        i = p.pick(6, loads.__getitem__)
        a, b = rng.last
        assert i in (a, b)
        assert loads[i] == min(loads[a], loads[b])
    assert make_policy("power_of_two", random.Random(0)).pick(1, NO_LOAD) == 0


def test_power_of_two_ties_go_to_the_first_sample():
    class Fixed(random.Random):
        def sample(self, population, k):
            return [2, 0]

    assert make_policy("power_of_two", Fixed()).pick(3, NO_LOAD) == 2


def test_power_of_two_never_picks_the_global_maximum():
    p = make_policy("power_of_two", random.Random(1))
    loads = [0.0, 1.0, 2.0, 3.0]
    assert 3 not in picks(p, 4, loads.__getitem__, 500)


def test_random_is_reproducible_for_a_seed_and_covers_all():
    a = picks(make_policy("random", random.Random(42)), 5, NO_LOAD, 200)
    b = picks(make_policy("random", random.Random(42)), 5, NO_LOAD, 200)
    c = picks(make_policy("random", random.Random(43)), 5, NO_LOAD, 200)
    assert a == b and a != c
    assert set(a) == {0, 1, 2, 3, 4}


def test_unknown_policy_lists_the_allowed_names():
    with pytest.raises(ValueError) as err:
        make_policy("fastest", random.Random(0))
    msg = str(err.value)
    assert "unknown router policy 'fastest'" in msg
    for name in ("least_loaded", "power_of_two", "random", "round_robin"):
        assert repr(name) in msg


def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="router policy 'random' is already registered"):
        register_policy("random")(object)
    assert POLICIES["random"] is router_mod.RandomPolicy  # the first stays

    name = "test_only_first_instance"
    try:
        @register_policy(name)
        class First:
            def __init__(self, rng):
                pass

            def pick(self, n, load):
                return n - 1

        assert make_policy(name, random.Random(0)).pick(4, NO_LOAD) == 3
        with pytest.raises(ValueError, match="already registered"):
            register_policy(name)(First)
    finally:
        POLICIES.pop(name, None)


def test_rooms_are_63_bit_and_reproducible():
    rooms = [new_bootstrap_room(random.Random(s)) for s in range(200)]
    assert ROOM_BITS == 63
    assert all(0 <= r < 2**63 for r in rooms)
    assert max(rooms) >= 2**62  # the top bit is used
    assert len(set(rooms)) == 200
    assert new_bootstrap_room(random.Random(3)) == new_bootstrap_room(random.Random(3))


def test_router_is_reproducible_per_seed():
    def run(seed):
        r = Router("power_of_two", 3, 4, seed)
        return [r.route(lambda i: i, lambda i: -i) for _ in range(50)]

    a, b, c = run(11), run(11), run(12)
    assert a == b and a != c
    assert all(0 <= p < 3 and 0 <= d < 4 and 0 <= room < 2**63 for p, d, room in a)
    assert len({room for _, _, room in a}) == 50


def test_router_keeps_separate_state_per_role():
    r = Router("round_robin", 2, 3, seed=0)
    pairs = [r.route(NO_LOAD, NO_LOAD)[:2] for _ in range(6)]
    assert pairs == [(0, 0), (1, 1), (0, 2), (1, 0), (0, 1), (1, 2)]
    assert r.policy_name == "round_robin"


def test_router_least_loaded_uses_each_sides_load():
    r = Router("least_loaded", 3, 3, seed=0)
    p, d, _ = r.route([4, 0, 4].__getitem__, [0, 4, 4].__getitem__)
    assert (p, d) == (1, 0)


def test_router_without_prefill_instances_serves_colocated():
    r = Router("round_robin", 0, 2, seed=0)
    routes = [r.route(NO_LOAD, NO_LOAD) for _ in range(3)]
    assert [(p, d) for p, d, _ in routes] == [(-1, 0), (-1, 1), (-1, 0)]
    assert all(0 <= room < 2**63 for _, _, room in routes)


def test_router_needs_a_decode_instance_and_no_negative_count():
    with pytest.raises(ValueError, match="at least one decode .* got 1 prefill and 0 decode"):
        Router("random", 1, 0, seed=0)
    with pytest.raises(ValueError, match="got -1 prefill and 2 decode"):
        Router("random", -1, 2, seed=0)
    with pytest.raises(ValueError, match="unknown router policy"):
        Router("nope", 1, 1, seed=0)


@pytest.mark.parametrize("room,dp,rank", [(0, 4, 0), (7, 4, 3), (2**63 - 1, 8, 7), (12345, 1, 0), (10, 3, 1)])
def test_dp_rank_for_room(room, dp, rank):
    assert dp_rank_for_room(room, dp) == rank


def test_dp_rank_spreads_random_rooms():
    rng = random.Random(0)
    counts = Counter(dp_rank_for_room(new_bootstrap_room(rng), 4) for _ in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 900


def test_inflight_load_counts_what_was_sent_until_it_comes_back():
    load = InflightLoad(2, 3)
    load.sent(1, 2, 100)
    load.sent(1, 0, 30)
    load.sent(-1, 2, 50)  # colocated: no prefill side
    assert load.prefill_tokens == [0, 130] and load.decode_requests == [1, 0, 2]
    load.prefill_returned(1, 100)  # its KV is on the decode side: the prefill call returned
    assert load.prefill_tokens == [0, 30] and load.decode_requests == [1, 0, 2]
    load.decode_returned(2)
    load.prefill_lost(1)  # the worker died: every call to it returned at once
    assert load.prefill_tokens == [0, 0] and load.decode_requests == [1, 0, 1]
