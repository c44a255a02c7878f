"""Index pools: pages, request slots and metadata slots come back, or `check_full` says which leaked."""

from __future__ import annotations

import pytest

from pdsim.core.pool import IndexPool, PagePool


def test_alloc_hands_out_lowest_first_and_runs_dry():
    pool = IndexPool(3, "thing")
    assert [pool.alloc(), pool.alloc(), pool.alloc()] == [0, 1, 2]
    assert pool.alloc() is None
    assert (pool.num_free, pool.num_used) == (0, 3)


def test_freed_indices_come_back_sorted_once_the_free_list_runs_short():
    pool = IndexPool(6, "thing")
    held = pool.alloc_many(4)  # 0 1 2 3
    pool.free(held[2])
    pool.free_many([held[1], held[0]])
    assert (pool.num_free, pool.num_used) == (5, 1)
    assert pool.alloc() == 4  # never-used indices first...
    assert pool.alloc_many(3) == [0, 1, 2]  # ...then the freed ones join them, sorted
    assert pool.alloc_many(1) == [5] and pool.alloc() is None
    pool.free_many([0, 1, 2, 3, 4, 5])
    pool.check_full()


def test_alloc_many_is_all_or_nothing():
    pool = IndexPool(5, "thing")
    assert pool.alloc_many(3) == [0, 1, 2]
    assert pool.alloc_many(3) is None
    assert pool.num_free == 2  # the failed call took nothing
    assert pool.alloc_many(0) == []
    assert pool.alloc_many(2) == [3, 4]
    assert pool.alloc_many(1) is None
    pool.free_many([0, 1, 2, 3, 4])
    pool.check_full()
    assert sorted(pool.alloc_many(5)) == [0, 1, 2, 3, 4]


def test_indices_are_unique_under_churn():
    pool = IndexPool(8, "thing")
    held = pool.alloc_many(6)
    for idx in held[::2]:
        pool.free(idx)
    held = held[1::2] + pool.alloc_many(5)
    assert len(set(held)) == len(held) == 8
    assert set(held) == set(range(8))


def test_double_free_raises_with_a_clear_message():
    pool = IndexPool(2, "metadata slot")
    idx = pool.alloc()
    pool.free(idx)
    with pytest.raises(ValueError, match=r"metadata slot index 0 freed but not in use"):
        pool.free(idx)
    with pytest.raises(ValueError, match=r"index 1 freed but not in use"):
        pool.free(1)  # never handed out
    assert pool.num_free == 2  # the bad frees did not corrupt the free list


def test_bad_free_many_raises_and_leaves_the_pool_as_it_was():
    pool = IndexPool(6, "kv page")
    held = pool.alloc_many(4)  # 0 1 2 3
    pool.free(held[3])
    with pytest.raises(ValueError, match=r"kv page indices \[3, 9\] freed but not in use"):
        pool.free_many([0, 3, 9])
    with pytest.raises(ValueError, match=r"kv page indices freed twice in one call: \[1, 1\]"):
        pool.free_many([1, 1])
    assert (pool.num_free, pool.num_used) == (3, 3)  # 0, 1 and 2 still in use
    pool.free_many(held[:3])
    pool.check_full()
    assert pool.alloc_many(6) == [0, 1, 2, 3, 4, 5]


def test_check_full_lists_the_leaks():
    pool = PagePool(20, page_size=4)
    pages = pool.alloc_many(12)
    pool.free_many(pages[:10])
    with pytest.raises(AssertionError, match=r"kv page pool leaked 2 indices, e\.g\. \[10, 11\]"):
        pool.check_full()
    pool.free_many(pages[10:])
    pool.check_full()


def test_check_full_shows_at_most_ten_leaks():
    pool = IndexPool(30, "request slot")
    pool.alloc_many(25)
    with pytest.raises(AssertionError) as err:
        pool.check_full()
    assert "leaked 25 indices" in str(err.value)
    assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in str(err.value)


def test_page_pool_counts_free_tokens():
    pool = PagePool(10, page_size=16)
    assert pool.free_tokens == 160
    pool.alloc_many(3)
    assert pool.free_tokens == 112
    assert pool.page_size == 16


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: IndexPool(0, "thing"), "thing pool size must be positive, got 0"),
        (lambda: PagePool(0, 16), "pool size must be positive"),
        (lambda: PagePool(4, 0), "page_size must be positive, got 0"),
    ],
)
def test_bad_sizes_are_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        make()
