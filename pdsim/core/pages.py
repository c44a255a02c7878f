"""Page arithmetic shared by the KV pools and the transfer backends."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def group_contiguous_runs(
    src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
) -> list[tuple[int, int, int]]:
    """Merge paired page lists into runs that are contiguous on *both* sides.

    Returns `(src_start, dst_start, length)` triples, one transfer descriptor each. A run breaks
    wherever either side stops increasing by exactly one, e.g. src [0, 1, 2, 10, 11, 20] with
    dst [5, 6, 7, 15, 16, 25] gives (0, 5, 3), (10, 15, 2), (20, 25, 1).
    """
    src_a = np.asarray(src, dtype=np.int64)
    dst_a = np.asarray(dst, dtype=np.int64)
    if src_a.shape != dst_a.shape or src_a.ndim != 1:
        raise ValueError(
            f"src and dst must be 1-D and of equal length, got shapes {src_a.shape} and {dst_a.shape}"
        )
    if src_a.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src_a) != 1) | (np.diff(dst_a) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src_a.size]))
    return [
        (int(src_a[s]), int(dst_a[s]), int(e - s)) for s, e in zip(starts.tolist(), ends.tolist())
    ]
