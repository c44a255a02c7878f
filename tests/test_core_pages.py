"""Page arithmetic: page counts and transfer descriptors."""

from __future__ import annotations

import numpy as np
import pytest

from pdsim.core.pages import group_contiguous_runs, num_pages


@pytest.mark.parametrize(
    "tokens,page_size,pages",
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (40, 6, 7), (7, 1, 7)],
)
def test_num_pages_rounds_up(tokens, page_size, pages):
    assert num_pages(tokens, page_size) == pages


def test_seed_example():
    runs = group_contiguous_runs([0, 1, 2, 10, 11, 20], [5, 6, 7, 15, 16, 25])
    assert runs == [(0, 5, 3), (10, 15, 2), (20, 25, 1)]
    assert all(type(x) is int for run in runs for x in run)


def test_empty_and_single():
    assert group_contiguous_runs([], []) == []
    assert group_contiguous_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    assert group_contiguous_runs([9], [4]) == [(9, 4, 1)]


def test_one_run_when_both_sides_are_contiguous():
    assert group_contiguous_runs(range(100, 164), range(0, 64)) == [(100, 0, 64)]


def test_src_contiguous_but_dst_not():
    assert group_contiguous_runs([0, 1, 2, 3], [8, 9, 3, 4]) == [(0, 8, 2), (2, 3, 2)]


def test_dst_contiguous_but_src_not():
    assert group_contiguous_runs([4, 6, 7, 9], [0, 1, 2, 3]) == [(4, 0, 1), (6, 1, 2), (9, 3, 1)]


def test_descending_pages_never_merge():
    assert group_contiguous_runs([5, 4, 3], [2, 1, 0]) == [(5, 2, 1), (4, 1, 1), (3, 0, 1)]
    assert group_contiguous_runs([1, 1], [2, 3]) == [(1, 2, 1), (1, 3, 1)]


def test_runs_cover_every_pair_exactly_once():
    rng = np.random.default_rng(0)
    src = rng.permutation(200)[:80]
    dst = rng.permutation(200)[:80]
    src[10:30] = np.arange(500, 520)
    dst[10:30] = np.arange(700, 720)
    runs = group_contiguous_runs(src, dst)
    pairs = [(s + k, d + k) for s, d, n in runs for k in range(n)]
    assert pairs == list(zip(src.tolist(), dst.tolist()))
    assert (500, 700, 20) in runs or any(n >= 20 for _, _, n in runs)


@pytest.mark.parametrize("src,dst", [([0, 1, 2], [0, 1]), ([], [1]), ([[0, 1]], [[0, 1]])])
def test_mismatched_shapes_raise(src, dst):
    with pytest.raises(ValueError, match="1-D and of equal length"):
        group_contiguous_runs(src, dst)
