"""Attention over a flat batch of variable-length segments and the paged KV cache.

A batch is the concatenation of segments, one per request. Segment `s` brings `query_lens[s]` new
tokens that follow `context_lens[s] - query_lens[s]` tokens already in the cache, so the same
metadata describes a (chunked) prefill, a decode step (one new token) or any mix of them. The
forward first writes the new tokens' K/V (or MLA latent) into `out_slots`, then attends:

- segments with one new token go, all together, through the paged decode kernel
  (`runtime.kernels`: Triton on CUDA, torch elsewhere);
- longer segments run one by one in torch: gather the segment's context through its page table,
  then scaled-dot-product attention with a bottom-right aligned causal mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from runtime.kernels.reference import context_slots

DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Where a batch's tokens sit: per-segment lengths, page tables and output slots.

    query_lens / context_lens: new tokens and cached + new tokens of each segment (host ints).
    page_size: tokens per page of the cache this batch runs against (0 when there is no cache).
    page_table: `[S, max_pages]` int64, each request's pages in order, padded with 0.
    context_lens_t: `context_lens` as an int32 tensor on the device.
    out_slots: `[T]` int64 flat cache slot (`page * page_size + offset`) of every new token.
    state_slots: each segment's slot in the recurrent-state buffer (hybrid models; else empty).
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    page_size: int
    page_table: torch.Tensor
    context_lens_t: torch.Tensor
    out_slots: torch.Tensor
    state_slots: tuple[int, ...] = ()

    @classmethod
    def build(cls, query_lens: Sequence[int], cached_lens: Sequence[int],
              page_tables: Sequence[Sequence[int]], page_size: int,
              device: str | torch.device = "cpu",
              state_slots: Sequence[int] = ()) -> AttentionMetadata:
        """Metadata for segments of `query_lens` new tokens after `cached_lens` cached ones.

        `page_tables[s]` lists the pages of request `s` in order and must cover its context.
        """
        if not len(query_lens) == len(cached_lens) == len(page_tables):
            raise ValueError("query_lens, cached_lens and page_tables differ in length")
        if state_slots and len(state_slots) != len(query_lens):
            raise ValueError(f"{len(state_slots)} state slots for {len(query_lens)} segments")
        context_lens = [c + q for q, c in zip(query_lens, cached_lens)]
        for s, (ctx, pages) in enumerate(zip(context_lens, page_tables)):
            if query_lens[s] < 1:
                raise ValueError(f"segment {s} has query_len {query_lens[s]}; must be >= 1")
            if len(pages) * page_size < ctx:
                raise ValueError(f"segment {s}: {len(pages)} pages of {page_size} tokens cannot "
                                 f"hold its {ctx} context tokens")
        width = max(1, max(len(p) for p in page_tables))
        table = torch.zeros(len(page_tables), width, dtype=torch.int64)
        for s, pages in enumerate(page_tables):
            table[s, : len(pages)] = torch.as_tensor(list(pages), dtype=torch.int64)
        positions = _positions(query_lens, cached_lens)
        segment = torch.repeat_interleave(torch.arange(len(query_lens)),
                                          torch.as_tensor(list(query_lens)))
        slots = table[segment, positions // page_size] * page_size + positions % page_size
        return cls(
            query_lens=tuple(query_lens), context_lens=tuple(context_lens), page_size=page_size,
            page_table=table.to(device), out_slots=slots.to(device),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
            state_slots=tuple(state_slots),
        )

    @classmethod
    def without_cache(cls, query_lens: Sequence[int],
                      device: str | torch.device = "cpu") -> AttentionMetadata:
        """Segments that attend only among their own tokens (a forward with `kv=None`)."""
        return cls(
            query_lens=tuple(query_lens), context_lens=tuple(query_lens), page_size=0,
            page_table=torch.zeros(len(query_lens), 0, dtype=torch.int64, device=device),
            out_slots=torch.zeros(0, dtype=torch.int64, device=device),
            context_lens_t=torch.tensor(list(query_lens), dtype=torch.int32, device=device),
        )

    @property
    def num_segments(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def cached_lens(self) -> tuple[int, ...]:
        return tuple(c - q for q, c in zip(self.query_lens, self.context_lens))

    def positions(self) -> torch.Tensor:
        """The position of every new token (its index in its request's sequence)."""
        return _positions(self.query_lens, self.cached_lens).to(self.out_slots.device)

    @cached_property
    def token_starts(self) -> tuple[int, ...]:
        """Index in the flat batch of each segment's first token, then the token count."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return tuple(starts)

    @cached_property
    def decode_segments(self) -> tuple[int, ...]:
        """Segments with exactly one new token; they run through the paged decode kernel."""
        return tuple(s for s, n in enumerate(self.query_lens) if n == 1)

    @cached_property
    def decode_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment indices, flat token indices) of the decode segments, on the device."""
        device = self.out_slots.device
        return (torch.tensor(self.decode_segments, dtype=torch.int64, device=device),
                torch.tensor([self.token_starts[s] for s in self.decode_segments],
                             dtype=torch.int64, device=device))

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat batch of each segment's last token."""
        return torch.tensor([e - 1 for e in self.token_starts[1:]], dtype=torch.int64,
                            device=self.out_slots.device)


def _positions(query_lens: Sequence[int], cached_lens: Sequence[int]) -> torch.Tensor:
    if not query_lens:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, cached_lens)])


def paged_attention(q: torch.Tensor, meta: AttentionMetadata, key_buffer: torch.Tensor,
                    value_buffer: torch.Tensor, decode: DecodeFn, scale: float,
                    window: int = 0) -> torch.Tensor:
    """Attention of the new tokens `q` `[T, H, Dk]` over their cached context -> `[T, H, Dv]`.

    Buffers are `[num_pages, page_size, heads, dim]` (the value buffer may be a view of the key
    buffer, as in MLA). `decode(q, page_table, context_lens, max_context_len)` handles the
    one-token segments. `window` > 0 (a sliding-window layer): each token attends only to the
    last `window` tokens up to itself, and every segment goes the per-segment way.
    """
    num_heads, v_dim = q.shape[1], value_buffer.shape[-1]
    out = q.new_empty(q.shape[0], num_heads, v_dim)
    starts = meta.token_starts
    if meta.decode_segments and not window:
        segs, tokens = meta.decode_index
        max_len = max(meta.context_lens[s] for s in meta.decode_segments)
        out[tokens] = decode(q[tokens], meta.page_table[segs], meta.context_lens_t[segs], max_len)
    k_flat = key_buffer.flatten(0, 1)
    v_flat = value_buffer.flatten(0, 1)
    for s, n in enumerate(meta.query_lens):
        if n == 1 and not window:
            continue
        ctx = meta.context_lens[s]
        slots, _ = context_slots(meta.page_table[s: s + 1], meta.context_lens_t[s: s + 1],
                                 meta.page_size, ctx)
        keys, values = k_flat[slots[0]], v_flat[slots[0]]  # [ctx, KVH, D]
        allowed = _causal_mask(n, ctx, window, q.device)
        out[starts[s]: starts[s + 1]] = _sdpa(q[starts[s]: starts[s + 1]], keys, values, scale,
                                              mask=allowed)
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           window: int = 0) -> torch.Tensor:
    """Causal attention inside each segment, no cache: q `[T, H, D]`, k/v `[T, KVH, D]`
    (`window` > 0: over the last `window` tokens only)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for start, end in zip(meta.token_starts, meta.token_starts[1:]):
        n = end - start
        mask = _causal_mask(n, n, window, q.device) if window else None
        out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], scale, mask=mask)
    return out


def _causal_mask(n: int, ctx: int, window: int, device: torch.device) -> torch.Tensor:
    """`[n, ctx]`: the last `n` of `ctx` tokens may see key j (bottom-right aligned causal, and
    within the last `window` tokens when `window` > 0)."""
    keys = torch.arange(ctx, device=device)[None, :]
    queries = torch.arange(ctx - n, ctx, device=device)[:, None]
    allowed = keys <= queries
    if window:
        allowed &= keys > queries - window
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention of `[n, H, D]` queries over `[m, KVH, D]` keys (causal if no
    mask is given)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)
