"""Choosing a (prefill, decode) pair for each request, and the room id both sides meet by."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

ROOM_BITS = 63


def new_bootstrap_room(rng: random.Random) -> int:
    """A random 63-bit id shared by the prefill and decode side of one request."""
    return rng.getrandbits(ROOM_BITS)


def dp_rank_for_room(room: int, dp_size: int) -> int:
    """The attention-DP rank of an instance that serves `room` when the router does not pick one."""
    return room % dp_size


DP_ASSIGNMENTS = ("room", "shortest_queue")


def pick_dp_rank(assignment: str, room: int, dp_size: int, queue_length: Callable[[int], int]) -> int:
    """The attention-DP rank of an instance that takes a request, as SGLang's DP controller
    picks it: `room` follows the bootstrap room (`room % dp_size`, the PD default, so both sides
    agree without asking), `shortest_queue` the rank with the fewest requests (ties: the
    lowest rank)."""
    if dp_size == 1:
        return 0
    if assignment == "room":
        return room % dp_size
    if assignment == "shortest_queue":
        return min(range(dp_size), key=queue_length)
    raise ValueError(f"unknown DP assignment {assignment!r}; allowed: {', '.join(DP_ASSIGNMENTS)}")


class Policy(Protocol):
    """Picks one of `n` instances; `load(i)` is instance i's current load (lower is better)."""

    def pick(self, n: int, load: Callable[[int], float]) -> int: ...


POLICIES: dict[str, Callable[[random.Random], Policy]] = {}


def register_policy(name: str):
    def deco(factory):
        if name in POLICIES:
            raise ValueError(f"router policy {name!r} is already registered")
        POLICIES[name] = factory
        return factory

    return deco


@register_policy("random")
class RandomPolicy:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, n, load):
        return self.rng.randrange(n)


@register_policy("round_robin")
class RoundRobinPolicy:
    def __init__(self, rng: random.Random):
        self.next = 0

    def pick(self, n, load):
        i = self.next % n
        self.next = i + 1
        return i


@register_policy("power_of_two")
class PowerOfTwoPolicy:
    """Sample two instances at random, take the less loaded (ties: the first sampled)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, n, load):
        if n == 1:
            return 0
        a, b = self.rng.sample(range(n), 2)
        return b if load(b) < load(a) else a


@register_policy("least_loaded")
class LeastLoadedPolicy:
    """The least loaded instance; ties go round robin so equal instances share the work."""

    def __init__(self, rng: random.Random):
        self.offset = 0

    def pick(self, n, load):
        start = self.offset % n
        self.offset = start + 1
        best = start
        best_load = load(start)
        for k in range(1, n):
            i = (start + k) % n
            li = load(i)
            if li < best_load:
                best, best_load = i, li
        return best


def make_policy(name: str, rng: random.Random) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return factory(rng)


class Router:
    """Pairs a prefill and a decode instance per request, each picked by its own policy state.

    With no prefill instances (colocated serving) it picks only the serving instance and
    returns -1 for the prefill side. Rooms come from `room_rng`, by default a generator seeded
    from `seed` (reproducible simulations); a real router passes `random.SystemRandom()` so
    that several routers in front of the same workers never draw the same rooms.
    """

    def __init__(self, policy: str, num_prefill: int, num_decode: int, seed: int,
                 room_rng: random.Random | None = None):
        if num_prefill < 0 or num_decode < 1:
            raise ValueError(
                f"a router needs at least one decode (or colocated) instance and no negative "
                f"count, got {num_prefill} prefill and {num_decode} decode"
            )
        self.rng = random.Random(seed)
        self.policy_name = policy
        self.prefill_policy = make_policy(policy, random.Random(self.rng.getrandbits(64)))
        self.decode_policy = make_policy(policy, random.Random(self.rng.getrandbits(64)))
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.room_rng = room_rng or self.rng

    def route(
        self, prefill_load: Callable[[int], float], decode_load: Callable[[int], float]
    ) -> tuple[int, int, int]:
        """(prefill instance, decode instance, bootstrap room)."""
        p = self.prefill_policy.pick(self.num_prefill, prefill_load) if self.num_prefill else -1
        d = self.decode_policy.pick(self.num_decode, decode_load)
        return p, d, new_bootstrap_room(self.room_rng)
