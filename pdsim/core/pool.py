"""Index pools: KV pages, request slots and metadata slots.

Every pool hands out integers and takes them back; `check_full()` is how tests and drivers prove
that a run leaked nothing.
"""

from __future__ import annotations

from collections.abc import Iterable


class IndexPool:
    """The integers `0 .. size-1`, handed out lowest first from a sorted free list, as SGLang's
    page allocator does: freed indices wait aside and join the list, sorted, only when it runs
    short. Allocations then come in ascending runs, so the pages of a request (and of the
    requests after it) stay mostly contiguous; a KV transfer writes one descriptor per
    contiguous run."""

    def __init__(self, size: int, name: str):
        if size <= 0:
            raise ValueError(f"{name} pool size must be positive, got {size}")
        self.name = name
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # sorted, descending: pop() is the lowest
        self._released: list[int] = []  # freed since the last merge
        self._in_use = set()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._released)

    @property
    def num_used(self) -> int:
        return self.size - self.num_free

    def _merge(self) -> None:
        self._free += self._released
        self._released = []
        self._free.sort(reverse=True)

    def alloc(self) -> int | None:
        """One index, or None when the pool is empty."""
        if not self._free:
            if not self._released:
                return None
            self._merge()
        idx = self._free.pop()
        self._in_use.add(idx)
        return idx

    def alloc_many(self, n: int) -> list[int] | None:
        """`n` indices, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            if n > self.num_free:
                return None
            self._merge()
        if n == 0:
            return []
        taken = self._free[:-n - 1:-1]  # the last n, lowest first
        del self._free[-n:]
        self._in_use.update(taken)
        return taken

    def free(self, idx: int) -> None:
        try:
            self._in_use.remove(idx)
        except KeyError:
            raise ValueError(f"{self.name} index {idx} freed but not in use") from None
        self._released.append(idx)

    def free_many(self, indices: Iterable[int]) -> None:
        if not isinstance(indices, list):
            indices = list(indices)
        in_use = self._in_use
        before = len(in_use)
        in_use.difference_update(indices)  # one pass; a bad call is undone below
        if before - len(in_use) != len(indices):
            self._undo_bad_free(indices)
        self._released += indices

    def _undo_bad_free(self, indices: list[int]) -> None:
        """`free_many` took out of use those of `indices` that were in use, but some were not
        (or came twice): put them back and raise. Every index not in use is in the free list
        or waits aside to join it."""
        self._in_use = set(range(self.size)).difference(self._free, self._released)
        bad = sorted(set(indices) - self._in_use)[:10]
        if bad:
            raise ValueError(f"{self.name} indices {bad} freed but not in use")
        raise ValueError(f"{self.name} indices freed twice in one call: {indices}")

    def check_full(self) -> None:
        """Raise if anything is still handed out."""
        if self._in_use:
            shown = sorted(self._in_use)[:10]
            raise AssertionError(f"{self.name} pool leaked {len(self._in_use)} indices, e.g. {shown}")


class PagePool(IndexPool):
    """KV-cache pages of `page_size` tokens each."""

    def __init__(self, num_pages: int, page_size: int, name: str = "kv page"):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        super().__init__(num_pages, name)
        self.page_size = page_size

    @property
    def free_tokens(self) -> int:
        return self.num_free * self.page_size
