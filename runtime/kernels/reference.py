"""Torch reference kernels: the CPU backend and the oracle the Triton kernels are tested against.

Shapes (S requests, H query heads, T new tokens):
- cache buffers are `[num_pages, page_size, heads, dim]`; a flat slot is `page * page_size + off`;
- `page_table` is `[S, max_pages]` (padding entries are never read past `context_lens`);
- `context_lens` is `[S]`, the tokens each request attends to, its new token included.
"""

from __future__ import annotations

import torch


def store_kv(buffer: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """Write `new[t]` (one token's heads) into flat slot `slots[t]` of `buffer`."""
    flat = buffer.view(-1, buffer.shape[-2] * buffer.shape[-1])
    flat[slots] = new.reshape(new.shape[0], -1).to(buffer.dtype)


def context_slots(page_table: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                  max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots `[S, max_len]` of every context token and a mask of the valid ones."""
    pos = torch.arange(max_len, device=page_table.device)
    pages = page_table[:, pos // page_size]
    slots = pages * page_size + pos % page_size
    valid = pos[None, :] < context_lens[:, None]
    return torch.where(valid, slots, 0), valid


def decode_attention_gqa(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         max_context_len: int | None = None) -> torch.Tensor:
    """One query token per request: q `[S, H, D]` -> out `[S, H, Dv]`."""
    num_reqs, num_heads, _ = q.shape
    page_size, kv_heads = k_buffer.shape[1], k_buffer.shape[2]
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    slots, valid = context_slots(page_table, context_lens, page_size, max_len)
    k = k_buffer.view(-1, kv_heads, k_buffer.shape[-1])[slots].float()  # [S, L, KVH, D]
    v = v_buffer.view(-1, kv_heads, v_buffer.shape[-1])[slots].float()
    group = num_heads // kv_heads
    qg = q.float().view(num_reqs, kv_heads, group, -1)
    scores = torch.einsum("skgd,slkd->skgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", scores.softmax(-1), v)
    return out.reshape(num_reqs, num_heads, -1).to(q.dtype)


def decode_attention_mla(q: torch.Tensor, latent_buffer: torch.Tensor, page_table: torch.Tensor,
                         context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                         max_context_len: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode: q `[S, H, C + R]` against the latent cache -> `[S, H, C]`.

    Keys are whole latent rows (`C` compressed + `R` rotary dims); values are their first `C` dims.
    """
    page_size, dim = latent_buffer.shape[1], latent_buffer.shape[-1]
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    slots, valid = context_slots(page_table, context_lens, page_size, max_len)
    kv = latent_buffer.view(-1, dim)[slots].float()  # [S, L, C + R]
    scores = torch.einsum("shd,sld->shl", q.float(), kv) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("shl,slc->shc", scores.softmax(-1), kv[..., :kv_lora_rank])
    return out.to(q.dtype)
