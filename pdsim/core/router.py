"""Choosing a (prefill, decode) pair for each request, and the room id both sides meet by."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from pdsim.core.radix import PrefixTree

ROOM_BITS = 63


def new_bootstrap_room(rng: random.Random) -> int:
    """A random 63-bit id shared by the prefill and decode side of one request."""
    return rng.getrandbits(ROOM_BITS)


def dp_rank_for_room(room: int, dp_size: int) -> int:
    """The attention-DP rank of an instance that serves `room` when the router does not pick one."""
    return room % dp_size


DP_ASSIGNMENTS = ("room", "round_robin", "shortest_queue")  # and "auto", resolved per role


def pick_dp_rank(assignment: str, room: int, dp_size: int, queue_length: Callable[[int], int],
                 turn: int = 0) -> int:
    """The attention-DP rank of an instance that takes a request, as SGLang's DP controller
    picks it (`--load-balance-method`): `room` follows the bootstrap room (`room % dp_size`, so
    both sides of a PD pair agree without asking), `round_robin` takes turns (`turn`: the
    instance's requests before this one), `shortest_queue` the rank with the fewest requests
    (ties: the lowest rank). A config's `auto` is resolved per role before
    (`InstanceScheduler.auto_dp_assignment`)."""
    if dp_size == 1:
        return 0
    if assignment == "room":
        return room % dp_size
    if assignment == "round_robin":
        return turn % dp_size
    if assignment == "shortest_queue":
        return min(range(dp_size), key=queue_length)
    raise ValueError(f"unknown DP assignment {assignment!r}; allowed: {', '.join(DP_ASSIGNMENTS)}")


class Policy(Protocol):
    """Picks one of `n` instances; `load(i)` is instance i's current load (lower is better);
    `keys` is the request's prompt as a sequence of prefix keys (pages or blocks; empty when
    the caller has none), which only cache-aware policies read."""

    def pick(self, n: int, load: Callable[[int], float], keys: Sequence[Hashable] = ()) -> int: ...


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

    def pick(self, n, load, keys=()):
        return self.rng.randrange(n)


@register_policy("round_robin")
class RoundRobinPolicy:
    def __init__(self, rng: random.Random):
        self.next = 0

    def pick(self, n, load, keys=()):
        i = self.next % n
        self.next = i + 1
        return i


@register_policy("power_of_two")
class PowerOfTwoPolicy:
    """Sample two instances at random, take the less loaded (ties: the first sampled)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, n, load, keys=()):
        if n == 1:
            return 0
        a, b = self.rng.sample(range(n), 2)
        return b if load(b) < load(a) else a


@register_policy("least_loaded")
class LeastLoadedPolicy:
    """The least loaded instance; ties go round robin so equal instances share the work."""

    def __init__(self, rng: random.Random):
        self.offset = 0

    def pick(self, n, load, keys=()):
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


@register_policy("cache_aware")
class CacheAwarePolicy:
    """SGLang router's cache-aware policy, over prefix keys instead of text.

    It keeps one approximate prefix tree per instance: the keys of every request it sent there,
    so it never asks an instance what it holds. When the loads are imbalanced, that is
    `max - min > balance_abs_threshold` and `max > balance_rel_threshold * min`, it sends the
    request to the least loaded instance. Otherwise it finds the instance whose tree holds the
    longest prefix of the request's keys; if that prefix is more than `cache_threshold` of the
    keys the request goes there, else to the least loaded instance (ties: the smaller tree, the
    instance with the most room for a new prefix, which SGLang's fallback picks outright; then
    the lower index). The chosen instance's tree then gets the request's keys. A tree over
    `max_tree_size` keys drops its least recently used leaves, where SGLang prunes on a timer:
    time here is the count of requests routed, so the core stays clock-free.

    The thresholds are in the unit of the load signal the caller passes (SGLang's: requests in
    flight). Defaults are sgl-router's (cache 0.3, absolute 64, relative 1.5); its tree limit
    (2**26) counts characters, this one (2**20) keys (pages or blocks).
    """

    def __init__(self, rng: random.Random, cache_threshold: float = 0.3,
                 balance_abs_threshold: float = 64, balance_rel_threshold: float = 1.5,
                 max_tree_size: int = 1 << 20):
        checks = (("cache_threshold", cache_threshold, 0 <= cache_threshold <= 1, "in [0, 1]"),
                  ("balance_abs_threshold", balance_abs_threshold, balance_abs_threshold >= 0, ">= 0"),
                  ("balance_rel_threshold", balance_rel_threshold, balance_rel_threshold >= 1, ">= 1"),
                  ("max_tree_size", max_tree_size,
                   max_tree_size >= 1 and max_tree_size == int(max_tree_size), "a whole number >= 1"))
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"cache_aware router: {name} must be {allowed}, got {value!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = int(max_tree_size)
        self.trees: list[PrefixTree] = []
        self.routed = 0

    def pick(self, n, load, keys=()):
        while len(self.trees) < n:
            self.trees.append(PrefixTree())
        trees = self.trees
        loads = [load(i) for i in range(n)]
        least = min(range(n), key=lambda i: (loads[i], trees[i].num_values, i))
        choice = least
        if keys and not self.imbalanced(min(loads), max(loads)):
            matched = [trees[i].match_length(keys) for i in range(n)]
            best = min(range(n), key=lambda i: (-matched[i], loads[i], i))
            if matched[best] > self.cache_threshold * len(keys):
                choice = best
        self.routed += 1
        if keys:
            tree = trees[choice]
            tree.insert(keys, [None] * len(keys), float(self.routed))
            if tree.num_values > self.max_tree_size:
                tree.evict(tree.num_values - self.max_tree_size)
        return choice

    def imbalanced(self, lowest: float, highest: float) -> bool:
        return (highest - lowest > self.balance_abs_threshold
                and highest > self.balance_rel_threshold * lowest)


def make_policy(name: str, rng: random.Random, **options) -> Policy:
    """The policy registered as `name`; `options` go to its constructor (its thresholds)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}; choose one of {sorted(POLICIES)}") from None
    takes = policy_option_names(name)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        allowed = ", ".join(takes) if takes else "none"
        raise ValueError(f"router policy {name!r} takes no option {', '.join(unknown)} "
                         f"(its options: {allowed})")
    return factory(rng, **options)


def policy_option_names(name: str) -> list[str]:
    """The options (keyword arguments after the random generator) policy `name` takes."""
    params = list(inspect.signature(POLICIES[name]).parameters.values())[1:]
    return [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]


class InflightLoad:
    """The load signal the policies read, defined once for both backends: what a router itself
    sees of each instance, the work it sent there that has not come back. Per prefill instance,
    the prompt tokens of requests whose prefill call has not returned (computed and its KV sent,
    or failed); per decode (or colocated) instance, the requests that have not ended."""

    def __init__(self, num_prefill: int, num_decode: int):
        self.prefill_tokens = [0] * num_prefill
        self.decode_requests = [0] * num_decode

    def sent(self, prefill: int, decode: int, prompt_tokens: int) -> None:
        """A request went to `prefill` (-1: none, colocated) and `decode`."""
        if prefill >= 0:
            self.prefill_tokens[prefill] += prompt_tokens
        self.decode_requests[decode] += 1

    def prefill_returned(self, prefill: int, prompt_tokens: int) -> None:
        self.prefill_tokens[prefill] -= prompt_tokens

    def decode_returned(self, decode: int) -> None:
        self.decode_requests[decode] -= 1

    def prefill_lost(self, prefill: int) -> None:
        """Every call to `prefill` returned at once (its worker died)."""
        self.prefill_tokens[prefill] = 0


class Router:
    """Pairs a prefill and a decode instance per request, each picked by its own policy state.

    With no prefill instances (colocated serving) it picks only the serving instance and
    returns -1 for the prefill side. Rooms come from `room_rng`, by default a generator seeded
    from `seed` (reproducible simulations); a real router passes `random.SystemRandom()` so
    that several routers in front of the same workers never draw the same rooms.
    """

    def __init__(self, policy: str, num_prefill: int, num_decode: int, seed: int,
                 room_rng: random.Random | None = None, policy_options: dict | None = None):
        if num_prefill < 0 or num_decode < 1:
            raise ValueError(
                f"a router needs at least one decode (or colocated) instance and no negative "
                f"count, got {num_prefill} prefill and {num_decode} decode"
            )
        self.rng = random.Random(seed)
        self.policy_name = policy
        options = policy_options or {}
        self.prefill_policy = make_policy(policy, random.Random(self.rng.getrandbits(64)), **options)
        self.decode_policy = make_policy(policy, random.Random(self.rng.getrandbits(64)), **options)
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.room_rng = room_rng or self.rng
        self._serving: tuple[list[int], list[int]] | None = None  # None: every instance

    def set_serving(self, prefill: Sequence[int], decode: Sequence[int]) -> None:
        """Route only to these instances (indices into each role's instances): an autoscaler
        keeps starting and draining ones out. A policy picks a position in these lists, so a
        stateful policy's per-position state (round robin's turn, cache-aware trees) follows
        the list: add joining instances at the end."""
        if not decode or (self.num_prefill and not prefill):
            raise ValueError(f"a router needs a serving decode instance and, in PD mode, a "
                             f"serving prefill instance; got prefill {list(prefill)}, "
                             f"decode {list(decode)}")
        self._serving = (list(prefill), list(decode))

    def route(
        self, prefill_load: Callable[[int], float], decode_load: Callable[[int], float],
        keys: Sequence[Hashable] = (),
    ) -> tuple[int, int, int]:
        """(prefill instance, decode instance, bootstrap room). `keys` (the prompt's prefix
        keys) go to the side that computes the prompt: the prefill side, or the serving side
        of colocated instances."""
        if self._serving is not None:
            return self._route_serving(prefill_load, decode_load, keys)
        if self.num_prefill:
            p = self.prefill_policy.pick(self.num_prefill, prefill_load, keys)
            d = self.decode_policy.pick(self.num_decode, decode_load)
        else:
            p = -1
            d = self.decode_policy.pick(self.num_decode, decode_load, keys)
        return p, d, new_bootstrap_room(self.room_rng)

    def _route_serving(self, prefill_load: Callable[[int], float],
                       decode_load: Callable[[int], float], keys: Sequence[Hashable]
                       ) -> tuple[int, int, int]:
        pids, dids = self._serving
        p = -1
        if self.num_prefill:
            p = pids[self.prefill_policy.pick(len(pids), lambda k: prefill_load(pids[k]), keys)]
        d = dids[self.decode_policy.pick(len(dids), lambda k: decode_load(dids[k]),
                                         () if self.num_prefill else keys)]
        return p, d, new_bootstrap_room(self.room_rng)
