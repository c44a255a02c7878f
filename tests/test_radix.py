"""Radix prefix cache: page-boundary matching, pins, LRU eviction and page conservation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdsim.core.pool import PagePool
from pdsim.core.radix import (
    RadixCache,
    block_page_keys,
    max_match_pages,
    token_page_keys,
)


def in_use(pool: PagePool) -> set[int]:
    return set(pool._in_use)


def cache_of(num_pages=16, page_size=4) -> RadixCache:
    return RadixCache(PagePool(num_pages, page_size))


def run_request(cache: RadixCache, tokens: list[int], now: float) -> tuple[int, list[int]]:
    """Admit, 'compute' and finish one request as a scheduler would; (cached tokens, its pages)."""
    ps = cache.page_size
    keys = token_page_keys(tokens, ps)
    m = cache.match_prefix(keys[:max_match_pages(len(tokens), ps)], now)
    cache.lock(m.node)
    new = cache.alloc(-(-len(tokens) // ps) - len(m.pages))
    assert new is not None
    pages = m.pages + new
    cache.cache_finished(keys, pages, m.node, now)
    return m.cached_tokens, pages


def test_token_page_keys_cover_whole_pages_only():
    assert token_page_keys(list(range(10)), 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert token_page_keys([1, 2, 3], 4) == []
    assert max_match_pages(8, 4) == 1  # the last token is always computed
    assert max_match_pages(9, 4) == 2


def test_block_page_keys_equal_exactly_where_blocks_are_equal():
    # pages of 4 tile blocks of 8: page j of block b is b * 2 + j
    assert block_page_keys([7, 9], 8, 14, 4) == [14, 15, 18]
    assert block_page_keys([7, 9], 8, 14, 4) != block_page_keys([7, 8], 8, 14, 4)
    # pages of 8 over blocks of 4: both blocks under the page
    assert block_page_keys([7, 9, 11], 4, 12, 8) == [(0, 7, 9)]
    # pages of 6 over blocks of 4 straddle blocks
    assert block_page_keys([1, 2, 3], 4, 12, 6) == [(0, 1, 2), (2, 2, 3)]
    a = block_page_keys([1, 2, 3], 4, 12, 6)
    b = block_page_keys([1, 2, 5], 4, 12, 6)
    assert a[0] == b[0] and a[1] != b[1]
    with pytest.raises(ValueError, match="cannot cover 13 tokens"):
        block_page_keys([1, 2, 3], 4, 13, 4)


def test_second_request_matches_the_first_on_page_boundaries():
    cache = cache_of()
    first, pages1 = run_request(cache, list(range(10)), now=1.0)  # pages 0,1 cached; 2 freed
    assert first == 0
    assert cache.total_cached_pages == 2 and cache.pool.num_used == 2
    # shares 9 tokens: two whole pages match, the ninth token is in a partial page
    cached, pages2 = run_request(cache, list(range(9)) + [99, 98, 97], now=2.0)
    assert cached == 8
    assert pages2[:2] == pages1[:2]
    # differs inside the second page: only the first page matches
    cached, _ = run_request(cache, [0, 1, 2, 3, 4, 5, 99, 7, 8], now=3.0)
    assert cached == 4
    cache.check_full()


def test_the_last_prompt_token_is_never_taken_from_the_cache():
    cache = cache_of()
    run_request(cache, list(range(8)), now=1.0)
    cached, _ = run_request(cache, list(range(8)), now=2.0)  # identical prompt
    assert cached == 4  # one page short: the second page holds the last token
    cache.check_full()


def test_pinned_pages_survive_memory_pressure():
    cache = cache_of(num_pages=4, page_size=2)
    run_request(cache, [1, 2, 3, 4], now=1.0)  # caches 2 pages
    m = cache.match_prefix(token_page_keys([1, 2, 3, 4], 2), now=2.0)
    cache.lock(m.node)
    assert cache.evictable_pages == 0
    assert cache.alloc(3) is None  # 2 free, nothing evictable
    assert cache.evict(2) == 0
    assert cache.total_cached_pages == 2
    cache.unlock(m.node)
    assert cache.evictable_pages == 2
    got = cache.alloc(3)
    assert got is not None and len(got) == 3
    assert cache.total_cached_pages == 0  # its two pages are one leaf: evicted whole
    cache.pool.free_many(got)
    cache.check_full()


def test_a_pinned_descendant_pins_its_ancestors():
    cache = cache_of(num_pages=8, page_size=1)
    run_request(cache, [1, 2, 3, 9], now=1.0)  # caches 1,2,3,9 as a chain
    m = cache.match_prefix([(1,), (2,)], now=2.0)
    cache.lock(m.node)
    assert cache.evict(10) == 2  # only 9 and 3 go; 1 and 2 are pinned
    assert cache.match_prefix([(1,), (2,), (3,)], now=3.0).cached_tokens == 2
    cache.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)


def test_eviction_is_least_recently_used_leaf_first():
    cache = cache_of(num_pages=8, page_size=1)
    run_request(cache, [1, 10], now=1.0)  # caches the run (1)(10)
    run_request(cache, [2, 20], now=2.0)
    run_request(cache, [3, 30], now=3.0)
    cache.match_prefix([(1,), (10,)], now=4.0)  # branch 1 used again: now the newest
    held = cache.tree.match_length  # looks without touching
    assert cache.evict(1) == 2  # a whole leaf goes: branch 2, the least recently used
    assert [held([(b,), (10 * b,)]) for b in (1, 2, 3)] == [2, 0, 2]
    assert cache.evict(1) == 2
    assert [held([(b,), (10 * b,)]) for b in (1, 2, 3)] == [2, 0, 0]
    cache.check_full()


def test_eviction_takes_the_unpinned_tail_of_a_split_run():
    cache = cache_of(num_pages=8, page_size=1)
    run_request(cache, [1, 2, 3, 4, 5], now=1.0)  # one run of 5 pages
    m = cache.match_prefix([(1,), (2,), (7,)], now=2.0)  # ends inside the run: split after 2
    cache.lock(m.node)
    assert cache.evictable_pages == 3
    assert cache.evict(1) == 3  # the tail [3, 4, 5] is one leaf
    assert cache.tree.match_length([(1,), (2,), (3,)]) == 2
    cache.unlock(m.node)
    cache.check_full()


def test_splitting_a_pinned_run_keeps_both_parts_pinned():
    cache = cache_of(num_pages=8, page_size=1)
    run_request(cache, [1, 2, 3, 4, 5, 6], now=1.0)  # one run of 6 pages
    a = cache.match_prefix([(1,), (2,), (3,), (4,), (5,)], now=2.0)  # splits off (6)
    cache.lock(a.node)
    b = cache.match_prefix([(1,), (2,), (9,)], now=3.0)  # splits a's pinned run after 2
    assert b.cached_tokens == 2
    assert cache.evictable_pages == 1 and cache.evict(8) == 1  # only (6)
    cache.unlock(a.node)
    assert cache.evictable_pages == 5
    cache.check_full()


def test_insert_keeps_the_cached_page_and_frees_a_duplicate():
    cache = cache_of(num_pages=6, page_size=2)
    a, b = cache.alloc(2), cache.alloc(2)
    res_a = cache.insert([(1, 2), (3, 4)], a, now=1.0)
    assert res_a.pages == a
    res_b = cache.insert([(1, 2), (3, 4)], b, now=2.0)  # computed the same prefix meanwhile
    assert res_b.pages == a
    assert cache.pool.num_used == 2  # b's pages went back to the pool
    cache.check_full()


def test_check_full_names_pins_and_leaks():
    cache = cache_of(num_pages=4, page_size=1)
    m = cache.insert([(1,)], cache.alloc(1), now=0.0)
    cache.lock(m.node)
    with pytest.raises(AssertionError, match="1 cached pages still pinned"):
        cache.check_full()
    cache.unlock(m.node)
    cache.alloc(1)
    with pytest.raises(AssertionError, match="leaked 1 pages"):
        cache.check_full()


# ---- property: random requests against the cache keep every page accounted for ---------------

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class CacheMachine(RuleBasedStateMachine):
    """Requests over a 3-letter alphabet so prefixes collide often; a small pool so eviction
    happens. Each active request holds its matched (pinned) pages plus its own new pages."""

    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(4, 12))
    def setup(self, page_size, num_pages):
        self.cache = RadixCache(PagePool(num_pages, page_size))
        self.now = 0.0
        self.active: list[tuple[list[int], list[int], object, list[int]]] = []

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    @rule(tokens=TOKENS)
    def admit(self, tokens):
        cache, ps = self.cache, self.cache.page_size
        keys = token_page_keys(tokens, ps)
        m = cache.match_prefix(keys[:max_match_pages(len(tokens), ps)], self.tick())
        assert m.cached_tokens % ps == 0 and m.cached_tokens < len(tokens)
        cache.lock(m.node)
        new = cache.alloc(-(-len(tokens) // ps) - len(m.pages))
        if new is None:
            cache.unlock(m.node)
            return
        assert not set(new) & set(cache.cached_pages())
        self.active.append((tokens, m.pages + new, m.node, m.pages))

    @precondition(lambda self: self.active)
    @rule(which=st.integers(0, 100))
    def finish(self, which):
        tokens, pages, node, _ = self.active.pop(which % len(self.active))
        keys = token_page_keys(tokens, self.cache.page_size)
        self.cache.cache_finished(keys, pages, node, self.tick())

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        before = self.cache.evictable_pages
        freed = self.cache.evict(n)
        assert min(n, before) <= freed <= before  # whole leaves: may free more than asked
        assert self.cache.evictable_pages == before - freed

    @invariant()
    def pages_are_conserved(self):
        cache = self.cache
        cached = cache.cached_pages()
        assert len(cached) == len(set(cached)) == cache.total_cached_pages
        held = {p for _, pages, _, _ in self.active for p in pages}
        used = in_use(cache.pool)
        assert set(cached) <= used  # no page both free and cached
        assert used == set(cached) | held
        for _, _, _, matched in self.active:  # pinned pages are still cached
            assert set(matched) <= set(cached)
        pinned = {p for _, _, _, matched in self.active for p in matched}
        assert cache.evictable_pages <= cache.total_cached_pages - len(pinned)

    def teardown(self):
        if hasattr(self, "cache"):
            while self.active:
                self.finish(0)
            self.cache.check_full()
            total = self.cache.total_cached_pages
            assert self.cache.evict(total) == total  # nothing pinned: all of it can go
            self.cache.pool.check_full()


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_cache_machine = pytest.mark.slow(CacheMachine.TestCase)


@settings(max_examples=100, deadline=None)
@given(st.lists(TOKENS, min_size=1, max_size=20), st.sampled_from([1, 2, 4]))
def test_an_unbounded_cache_matches_the_longest_earlier_whole_page_prefix(prompts, page_size):
    cache = RadixCache(PagePool(10_000, page_size))
    seen: list[list[int]] = []
    for t, tokens in enumerate(prompts):
        limit = max_match_pages(len(tokens), page_size) * page_size
        expected = 0
        for earlier in seen:
            common = 0
            while common < min(len(earlier), len(tokens)) and earlier[common] == tokens[common]:
                common += 1
            # an earlier prompt cached its whole pages only
            whole = (min(common, len(earlier)) // page_size) * page_size
            expected = max(expected, min(whole, limit))
        cached, _ = run_request(cache, tokens, now=float(t))
        assert cached == expected
        seen.append(tokens)
    cache.check_full()
