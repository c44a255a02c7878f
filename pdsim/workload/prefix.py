"""Shared prefixes: synthetic system prompts and multi-turn conversations as prefix blocks, and
the hit rate an unbounded prefix cache would reach on a workload.

A prompt is a run of *segments* (a content id and a length in tokens): a system prompt, a
user's text, a model's answer. Blocks of `block_tokens` tokens get ids interned by (the id of
the block before, the segment pieces in the block), so equal ids mean equal prefixes, as a
Mooncake trace's `hash_ids` do; a partial last block gets its own id.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np
from pydantic import Field

from pdsim.core.radix import PrefixTree, block_page_keys, max_match_pages
from pdsim.workload.arrays import PrefixBlocks, Workload
from pdsim.workload.registry import Spec


class SharedPrefix(Spec):
    """`share` of the conversations (of the requests, without `conversation`) open with one of
    `system_prompts` system prompts of `system_prompt_len` tokens, drawn uniformly; the rest
    open with their own text."""

    system_prompts: int = Field(ge=1)
    system_prompt_len: int = Field(ge=1, description="tokens")
    share: float = Field(ge=0, le=1, allow_inf_nan=False)


class Conversation(Spec):
    """Requests come in conversations of `turns` turns. Turn k's prompt is turn k-1's prompt,
    its answer (its output tokens) and new user text (drawn from `input_len`); it arrives
    `think_time_s` after turn k-1 *arrived* (open loop: pick a think time longer than a turn's
    latency, or turn k may arrive before turn k-1's answer exists)."""

    turns: int = Field(ge=1)
    think_time_s: float = Field(ge=0, allow_inf_nan=False)


class _BlockChain:
    """Interns block ids: a block is (the previous block's id, its segment pieces)."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._ids: dict[tuple, int] = {}

    def ids(self, segments: list[tuple[int, int]], known: list[int]) -> list[int]:
        """Block ids of the prompt made of `segments`; `known` holds the ids of its leading
        whole blocks already computed (an earlier turn of the same conversation)."""
        bt = self.block_tokens
        starts = [0, *accumulate(length for _, length in segments)]
        total = starts[-1]
        ids = list(known)
        for b in range(len(known), -(-total // bt)):
            lo, hi = b * bt, min((b + 1) * bt, total)
            pieces = []
            s = bisect_right(starts, lo) - 1
            while lo < hi:
                cid, length = segments[s]
                take = min(hi, starts[s] + length) - lo
                pieces.append((cid, lo - starts[s], take))
                lo += take
                s += 1
            key = (ids[-1] if ids else -1, tuple(pieces))
            ids.append(self._ids.setdefault(key, len(self._ids)))
        return ids


def prefixed_requests(
    user_tokens: np.ndarray, output_tokens: np.ndarray, prefix: SharedPrefix | None,
    turns: int, block_tokens: int, rng: np.random.Generator,
) -> tuple[np.ndarray, PrefixBlocks]:
    """Prompt lengths and prefix blocks of requests in conversation order (request i is turn
    `i % turns` of conversation `i // turns`), from each turn's new user text and answer."""
    n = len(user_tokens)
    num_conv = -(-n // turns)
    shared = np.zeros(num_conv, dtype=bool)
    which = np.zeros(num_conv, dtype=np.int64)
    if prefix is not None:
        shared = rng.random(num_conv) < prefix.share
        which = rng.integers(0, prefix.system_prompts, size=num_conv)
    chain = _BlockChain(block_tokens)
    user, out = user_tokens.tolist(), output_tokens.tolist()
    input_tokens = np.zeros(n, dtype=np.int64)
    blocks: list[list[int]] = []
    # content ids: system prompts first, then two per request (its user text, its answer)
    base = prefix.system_prompts if prefix is not None else 0
    for c in range(num_conv):
        segments = [(int(which[c]), prefix.system_prompt_len)] if shared[c] else []
        known: list[int] = []
        for i in range(c * turns, min((c + 1) * turns, n)):
            if i > c * turns:
                segments.append((base + 2 * (i - 1) + 1, out[i - 1]))
            segments.append((base + 2 * i, user[i]))
            ids = chain.ids(segments, known)
            input_tokens[i] = sum(length for _, length in segments)
            known = ids[: input_tokens[i] // block_tokens]
            blocks.append(ids)
    return input_tokens, PrefixBlocks.from_lists(block_tokens, blocks)


# ---- the hit rate of an unbounded cache ---------------------------------------------------------


def ideal_cached_blocks(prefix: PrefixBlocks) -> np.ndarray:
    """Per request, in order, how many of its leading blocks an unbounded cache holds when it
    arrives: blocks whose whole prefix (every block up to and including it) an earlier request
    had."""
    tree = PrefixTree()
    cached = np.zeros(len(prefix), dtype=np.int64)
    for i in range(len(prefix)):
        keys = prefix.ids_of(i).tolist()
        cached[i] = tree.match_length(keys)
        tree.insert(keys, [None] * len(keys), float(i))
    return cached


def ideal_hit_rate(prefix: PrefixBlocks) -> float:
    """Fraction of all prompt blocks found in an unbounded cache (`ideal_cached_blocks`)."""
    total = int(prefix.num_blocks().sum())
    return float(ideal_cached_blocks(prefix).sum() / total) if total else float("nan")


def ideal_cached_tokens(workload: Workload, page_size: int) -> np.ndarray:
    """Per request, the tokens an unbounded page-granular radix cache gives it when requests run
    one at a time in order: each caches its whole prompt pages, each takes the longest cached
    run of whole pages, short of its last token (what the schedulers do with `RadixCache`)."""
    if workload.prefix is None:
        raise ValueError("ideal_cached_tokens: the workload has no prefix blocks")
    prefix = workload.prefix
    tree = PrefixTree()
    cached = np.zeros(len(workload), dtype=np.int64)
    for i, n_in in enumerate(workload.input_tokens.tolist()):
        keys = block_page_keys(prefix.ids_of(i).tolist(), prefix.block_tokens, n_in, page_size)
        cached[i] = tree.match_length(keys[:max_match_pages(n_in, page_size)]) * page_size
        tree.insert(keys, [None] * len(keys), float(i))
    return cached
