"""Radix prefix cache: KV pages of finished prompts kept for requests that start the same way.

A radix tree over *page keys*, one key per cached page, naming the page's content: a tuple of
`page_size` token ids in the real backend, a key derived from a trace's prefix-block ids in the
simulator (`block_page_keys`). The pages along a path hold the KV of every token from the root
down, so the keys a request matches from the root are the prefix it can skip. A node holds a
run of keys (and their pages); only whole pages are cached.

Ownership. A page is in exactly one state: free (in the `PagePool`), held by a request only
(its suffix, not yet cached), or cached (a node owns it; requests that matched it hold it by
reference). `lock(node)` pins a node and its ancestors for a request that uses them; a pinned
page is never evicted. Unpinned leaves are evicted whole, least recently used first, when
`alloc` finds too few free pages; their pages go back to the pool. So "nothing leaked" means
`free + cached == total` with nothing pinned (`check_full`).

The cache is clock-free: every call that uses or adds a prefix takes `now` (any non-decreasing
number; the simulator passes simulated seconds, the real backend wall-clock seconds).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from pdsim.core.pool import PagePool

PageKey = Hashable


def token_page_keys(token_ids: Sequence[int], page_size: int) -> list[tuple[int, ...]]:
    """One key per whole page of `token_ids`: the page's token ids; a partial last page has none."""
    whole = len(token_ids) - len(token_ids) % page_size
    return [tuple(token_ids[i:i + page_size]) for i in range(0, whole, page_size)]


def block_page_keys(block_ids: Sequence[int], block_tokens: int, num_tokens: int,
                    page_size: int) -> list:
    """One key per whole page of a prompt known only by its prefix-block ids.

    Block `b` covers tokens `[b * block_tokens, (b + 1) * block_tokens)`; equal ids at the same
    place after equal earlier ids mean equal tokens (a Mooncake trace's `hash_ids`). Two prompts
    get equal keys for a page exactly when the blocks under it are equal (the tree conditions
    each key on the path above it). When pages tile blocks, page `j` of block id `b` is the int
    `b * pages_per_block + j` (cheap: the simulator makes millions); otherwise a page's key is
    its start offset within its first block and the ids of every block it overlaps.
    """
    if num_tokens > len(block_ids) * block_tokens:
        raise ValueError(
            f"{len(block_ids)} blocks of {block_tokens} tokens cannot cover {num_tokens} tokens")
    n = num_tokens // page_size
    if block_tokens % page_size == 0:
        per = block_tokens // page_size
        j = np.arange(n, dtype=np.int64)
        return (np.asarray(block_ids, dtype=np.int64)[j // per] * per + j % per).tolist()
    keys = []
    for start in range(0, n * page_size, page_size):
        first, last = start // block_tokens, (start + page_size - 1) // block_tokens
        keys.append((start - first * block_tokens, *block_ids[first:last + 1]))
    return keys


def max_match_pages(input_len: int, page_size: int) -> int:
    """Pages of a prompt a request may take from the cache: the last prompt token is always
    computed, since its forward yields the first output token."""
    return (input_len - 1) // page_size


class Node:
    """An edge of the tree: a run of keys and their values, below `parent`."""

    __slots__ = ("keys", "values", "parent", "children", "lock_ref", "last_access_s")

    def __init__(self, keys: list, values: list, parent: Node | None, now: float):
        self.keys = keys
        self.values = values
        self.parent = parent
        self.children: dict[PageKey, Node] = {}  # by the first key of the child's run
        self.lock_ref = 0
        self.last_access_s = now


def _common_length(run: list, keys: Sequence, pos: int) -> int:
    """How many leading keys of `run` equal `keys[pos:]`."""
    m = min(len(run), len(keys) - pos)
    if run[:m] == list(keys[pos:pos + m]):
        return m
    n = 0
    while run[n] == keys[pos + n]:
        n += 1
    return n


class PrefixTree:
    """A radix tree of key sequences, each key holding a value (a page index in the cache,
    nothing in the router's approximate trees), with pins and LRU leaf eviction.

    A node holds a run of keys, so a prompt of thousands of pages that branches nowhere is one
    node; a lookup that ends inside a run splits it. Eviction candidates sit in a heap keyed by
    last use; an entry goes stale when its node is used again, pinned, given a child or evicted,
    and is skipped when popped, so an eviction never scans the whole tree. Sizes count values.
    """

    def __init__(self):
        self.root = Node([], [], None, float("-inf"))
        self.root.lock_ref = 1  # never evicted, never counted
        self.num_values = 0
        self.num_locked = 0  # values in pinned nodes
        self._heap: list[tuple[float, int, Node]] = []
        self._seq = 0

    def match(self, keys: Sequence[PageKey], now: float) -> tuple[Node, list]:
        """The node that ends the longest stored prefix of `keys` (a run is split so that one
        does) and the values on the way; the path counts as used at `now`."""
        node = self.root
        values = []
        pos = 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_length(child.keys, keys, pos)
            if n < len(child.keys):  # ends inside the run: split there (no child matches next)
                child = self._split(child, n)
            child.last_access_s = now
            values.extend(child.values)
            node = child
            pos += n
        self._push_if_evictable(node)
        return node, values

    def match_length(self, keys: Sequence[PageKey]) -> int:
        """How many leading `keys` are stored; changes nothing."""
        node = self.root
        pos = 0
        while pos < len(keys):
            node = node.children.get(keys[pos])
            if node is None:
                break
            n = _common_length(node.keys, keys, pos)
            pos += n
            if n < len(node.keys):
                break
        return pos

    def insert(self, keys: Sequence[PageKey], values: Sequence, now: float) -> tuple[Node, list, list]:
        """Store `values[i]` under `keys[:i + 1]` where nothing is stored yet. Returns the node
        ending `keys`, the stored values along `keys`, and the given values that were not
        stored because another value already was (duplicates)."""
        node = self.root
        stored: list = []
        duplicates: list = []
        pos = 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                child = Node(list(keys[pos:]), list(values[pos:len(keys)]), node, now)
                node.children[keys[pos]] = child
                self.num_values += len(child.values)
                stored.extend(child.values)
                node = child
                break
            n = _common_length(child.keys, keys, pos)
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_access_s = now
            given = values[pos:pos + n]
            if child.values != list(given):
                duplicates.extend(g for g, v in zip(given, child.values) if g != v)
            stored.extend(child.values)
            node = child
            pos += n
        self._push_if_evictable(node)
        return node, stored, duplicates

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked += len(node.values)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one `lock(node)`."""
        leaf = node
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("prefix tree: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked -= len(node.values)
            node = node.parent
        self._push_if_evictable(leaf)

    def evict(self, num_values: int) -> list:
        """Remove unpinned leaves, least recently used first, until at least `num_values`
        values are gone or nothing unpinned is left; the removed values."""
        evicted: list = []
        heap = self._heap
        while len(evicted) < num_values and heap:
            access_s, _, node = heapq.heappop(heap)
            if not self._is_evictable_leaf(node) or node.last_access_s != access_s:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.keys[0]]
            node.parent = None
            self.num_values -= len(node.values)
            evicted.extend(node.values)
            self._push_if_evictable(parent)
        return evicted

    def values(self) -> list:
        """Every stored value (tree order)."""
        out = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.extend(node.values)
            stack.extend(node.children.values())
        return out

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s run after `at` keys; the new upper part (returned) keeps its pins."""
        upper = Node(node.keys[:at], node.values[:at], node.parent, node.last_access_s)
        upper.lock_ref = node.lock_ref
        node.parent.children[node.keys[0]] = upper
        node.keys, node.values = node.keys[at:], node.values[at:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        return upper

    def _is_evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_evictable(self, node: Node) -> None:
        if not self._is_evictable_leaf(node):
            return
        if len(self._heap) > 2 * self.num_values + 64:
            self._rebuild_heap()
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access_s, self._seq, node))

    def _rebuild_heap(self) -> None:
        """Drop stale entries: one entry per evictable leaf."""
        self._heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self._is_evictable_leaf(node):
                self._seq += 1
                self._heap.append((node.last_access_s, self._seq, node))
        heapq.heapify(self._heap)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of some keys: its pages in order and the deepest node (the
    root when nothing matched), which the request locks while it uses the pages."""

    node: Node
    pages: list[int]
    cached_tokens: int


class RadixCache:
    """Page-granular prefix cache over a `PagePool` (see the module docstring)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.tree = PrefixTree()

    @property
    def total_cached_pages(self) -> int:
        return self.tree.num_values

    @property
    def evictable_pages(self) -> int:
        """Cached pages no request pins; eviction can free all of them."""
        return self.tree.num_values - self.tree.num_locked

    @property
    def available_pages(self) -> int:
        """Pages an `alloc` can hand out: free plus evictable."""
        return self.pool.num_free + self.evictable_pages

    def match_prefix(self, keys: Sequence[PageKey], now: float) -> PrefixMatch:
        """The longest cached prefix of `keys`; marks its pages used at `now`."""
        node, pages = self.tree.match(keys, now)
        return PrefixMatch(node, pages, len(pages) * self.page_size)

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors (a request uses their pages)."""
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int], now: float) -> PrefixMatch:
        """Cache `pages[i]` as the page of `keys[:i + 1]`, for every whole page in `keys`.

        Where a key is already cached under another page, the cache keeps its own and returns
        the given one to the pool (two requests computed the same prefix). The result holds the
        cache's pages for `keys`: a caller that goes on using them swaps them in for its own.
        The caller keeps ownership of `pages[len(keys):]`.
        """
        if len(pages) < len(keys):
            raise ValueError(f"radix insert: {len(keys)} keys but only {len(pages)} pages")
        node, stored, duplicates = self.tree.insert(keys, pages, now)
        if duplicates:
            self.pool.free_many(duplicates)
        return PrefixMatch(node, stored, len(stored) * self.page_size)

    def cache_finished(self, keys: Sequence[PageKey], pages: Sequence[int], locked: Node,
                       now: float) -> None:
        """A request is done with `pages` (its whole KV, `keys` its whole pages): cache them,
        free the rest (the partial last page, pages past the keys) and drop its pin."""
        self.insert(keys, pages, now)
        rest = pages[len(keys):]
        if rest:
            self.pool.free_many(rest)
        self.unlock(locked)

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages from the pool, evicting unpinned cached pages as needed; None (and nothing
        evicted) when even eviction cannot make room."""
        short = n - self.pool.num_free
        if short > 0:
            if short > self.evictable_pages:
                return None
            self.evict(short)
        return self.pool.alloc_many(n)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unpinned cached pages, least recently used leaves first; the
        number freed (fewer only when fewer are evictable)."""
        freed = self.tree.evict(num_pages)
        if freed:
            self.pool.free_many(freed)
        return len(freed)

    # ---- checks --------------------------------------------------------------------------------

    def cached_pages(self) -> list[int]:
        """Every cached page (tree order); for checks and tests."""
        return self.tree.values()

    def check_full(self) -> None:
        """Raise unless every page is free or cached and nothing is pinned (a run leaked
        nothing)."""
        tree = self.tree
        if tree.num_locked:
            raise AssertionError(f"radix cache: {tree.num_locked} cached pages still pinned")
        held = self.pool.num_used - tree.num_values
        if held:
            raise AssertionError(
                f"{self.pool.name} pool leaked {held} pages: {self.pool.num_used} in use, "
                f"{tree.num_values} of them cached")
