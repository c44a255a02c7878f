"""Triton kernels: store new KV into slots, and paged decode attention for GQA and MLA.

Decode attention is split-K ("flash decoding"): stage 1 gives every (request, head block, split)
one program that walks its share of the request's pages with an online softmax and writes a
partial output plus its log-sum-exp; stage 2 merges the splits per (request, head). Splitting the
context keeps the GPU busy when a batch has few requests and long contexts.

MLA runs in the absorbed form: the query's no-rope part has already been multiplied by the key
half of `kv_b_proj`, so keys are whole latent rows and values their first `kv_lora_rank` dims;
one latent row is loaded once for all query heads of the block.

This module imports triton, and `triton.jit` reads TRITON_INTERPRET when the module is imported:
import it through `runtime.kernels` (which does so lazily) after setting the variable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_rows_kernel(src_ptr, dst_ptr, slot_ptr, src_row_stride, dst_row_stride,
                       WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    slot = tl.load(slot_ptr + token).to(tl.int64)
    row = tl.load(src_ptr + token.to(tl.int64) * src_row_stride + offs, mask=mask)
    tl.store(dst_ptr + slot * dst_row_stride + offs, row.to(dst_ptr.dtype.element_ty), mask=mask)


def store_kv(buffer: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    width = buffer.shape[-2] * buffer.shape[-1]
    src = new.reshape(new.shape[0], width)
    if src.stride(1) != 1:
        src = src.contiguous()
    dst = buffer.view(-1, width)
    block = min(1024, triton.next_power_of_2(width))
    grid = (src.shape[0], triton.cdiv(width, block))
    _store_rows_kernel[grid](src, dst, slots, src.stride(0), dst.stride(0), WIDTH=width,
                             BLOCK=block)


@triton.jit
def _gqa_decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, context_lens_ptr, out_ptr, lse_ptr,
    stride_q_req, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_pt_req, stride_out_req, stride_out_head, stride_out_split, stride_lse_req,
    stride_lse_head, scale, split_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + req)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + req * stride_q_req + heads[:, None] * stride_q_head + d[None, :],
                mask=head_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        page = tl.load(page_table_ptr + req * stride_pt_req + pos // PAGE_SIZE, mask=pos_mask,
                       other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        k = tl.load(k_ptr + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :],
                    mask=pos_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_head + dv[None, :],
                    mask=pos_mask[:, None] & (dv[None, :] < V_DIM), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    out_base = out_ptr + req * stride_out_req + split * stride_out_split
    tl.store(out_base + heads[:, None] * stride_out_head + dv[None, :], out,
             mask=head_mask[:, None] & (dv[None, :] < V_DIM))
    tl.store(lse_ptr + req * stride_lse_req + heads * stride_lse_head + split, lse, mask=head_mask)


@triton.jit
def _mla_decode_partial_kernel(
    q_ptr, kv_ptr, page_table_ptr, context_lens_ptr, out_ptr, lse_ptr,
    stride_q_req, stride_q_head, stride_kv_slot, stride_pt_req,
    stride_out_req, stride_out_head, stride_out_split, stride_lse_req, stride_lse_head,
    scale, split_len, num_heads,
    PAGE_SIZE: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + req)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    q_base = q_ptr + req * stride_q_req + heads[:, None] * stride_q_head
    q_c = tl.load(q_base + c[None, :], mask=head_mask[:, None] & (c[None, :] < LORA), other=0.0)
    q_r = tl.load(q_base + LORA + r[None, :], mask=head_mask[:, None] & (r[None, :] < ROPE),
                  other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        page = tl.load(page_table_ptr + req * stride_pt_req + pos // PAGE_SIZE, mask=pos_mask,
                       other=0)
        row = kv_ptr + (page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE)[:, None] * stride_kv_slot
        k_c = tl.load(row + c[None, :], mask=pos_mask[:, None] & (c[None, :] < LORA), other=0.0)
        k_r = tl.load(row + LORA + r[None, :], mask=pos_mask[:, None] & (r[None, :] < ROPE),
                      other=0.0)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
        scores += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        scores = tl.where(pos_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    out_base = out_ptr + req * stride_out_req + split * stride_out_split
    tl.store(out_base + heads[:, None] * stride_out_head + c[None, :], out,
             mask=head_mask[:, None] & (c[None, :] < LORA))
    tl.store(lse_ptr + req * stride_lse_req + heads * stride_lse_head + split, lse, mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, num_splits,
    stride_p_req, stride_p_head, stride_p_split, stride_lse_req, stride_lse_head,
    stride_out_req, stride_out_head,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    split_mask = s < num_splits
    lse = tl.load(lse_ptr + req * stride_lse_req + head * stride_lse_head + s, mask=split_mask,
                  other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    partial = tl.load(partial_ptr + req * stride_p_req + head * stride_p_head
                      + s[:, None] * stride_p_split + dv[None, :],
                      mask=split_mask[:, None] & (dv[None, :] < V_DIM), other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + req * stride_out_req + head * stride_out_head + dv,
             out.to(out_ptr.dtype.element_ty), mask=dv < V_DIM)


def _dot_block(n: int) -> int:
    """Block size for a tl.dot operand dimension: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def _split_len(max_context_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """Tokens per split (a multiple of block_n) and the number of splits that are not empty."""
    per_split = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    return per_split, triton.cdiv(max(max_context_len, 1), per_split)


def _default_splits(programs: int, max_context_len: int, block_n: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, 64, triton.cdiv(max_context_len, 256)))


def _merge(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    num_reqs, num_heads, num_splits, v_dim = partial.shape
    _merge_splits_kernel[(num_reqs, num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=v_dim, BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention_gqa(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         max_context_len: int | None = None, num_splits: int | None = None,
                         block_n: int = 32) -> torch.Tensor:
    num_reqs, num_heads, head_dim = q.shape
    page_size, kv_heads, v_dim = k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[-1]
    group = num_heads // kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if num_splits is None:
        num_splits = _default_splits(num_reqs * kv_heads, max_context_len, block_n, q.device)
    split_len, num_splits = _split_len(max_context_len, num_splits, block_n)
    k = k_buffer.view(-1, kv_heads, head_dim)
    v = v_buffer.view(-1, kv_heads, v_dim)
    partial = torch.empty(num_reqs, num_heads, num_splits, v_dim, dtype=torch.float32,
                          device=q.device)
    lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _gqa_decode_partial_kernel[(num_reqs, kv_heads, num_splits)](
        q, k, v, page_table, context_lens, partial, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        page_table.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), scale, split_len,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=_dot_block(group), HEAD_DIM=head_dim,
        V_DIM=v_dim, BLOCK_D=_dot_block(head_dim), BLOCK_DV=_dot_block(v_dim), BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
    )
    out = torch.empty(num_reqs, num_heads, v_dim, dtype=q.dtype, device=q.device)
    return _merge(partial, lse, out)


def decode_attention_mla(q: torch.Tensor, latent_buffer: torch.Tensor, page_table: torch.Tensor,
                         context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                         max_context_len: int | None = None, num_splits: int | None = None,
                         block_n: int = 32, block_h: int = 16) -> torch.Tensor:
    num_reqs, num_heads, dim = q.shape
    page_size = latent_buffer.shape[1]
    rope = dim - kv_lora_rank
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = _default_splits(num_reqs * head_blocks, max_context_len, block_n, q.device)
    split_len, num_splits = _split_len(max_context_len, num_splits, block_n)
    kv = latent_buffer.view(-1, dim)
    partial = torch.empty(num_reqs, num_heads, num_splits, kv_lora_rank, dtype=torch.float32,
                          device=q.device)
    lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _mla_decode_partial_kernel[(num_reqs, head_blocks, num_splits)](
        q, kv, page_table, context_lens, partial, lse,
        q.stride(0), q.stride(1), kv.stride(0), page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        scale, split_len, num_heads,
        PAGE_SIZE=page_size, LORA=kv_lora_rank, ROPE=rope, BLOCK_H=block_h,
        BLOCK_C=_dot_block(kv_lora_rank), BLOCK_R=_dot_block(rope), BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
    )
    out = torch.empty(num_reqs, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    return _merge(partial, lse, out)
