"""Attention and KV-store kernels with one entry point per operation.

Each operation has a Triton kernel (`triton_kernels`) and a torch reference (`reference`). The
backend is chosen per call: `backend=` if given, else the `PDSIM_KERNEL_BACKEND` environment
variable (`auto`, `triton` or `torch`), else `auto`: Triton for CUDA tensors, torch otherwise.
Forcing `triton` on CPU tensors needs `TRITON_INTERPRET=1` set before the first Triton call.
The Triton module is imported only when first used, so merely importing this package never
imports triton.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Literal

import torch

from runtime.kernels import reference

Backend = Literal["auto", "triton", "torch"]
ENV_VAR = "PDSIM_KERNEL_BACKEND"


def _triton() -> ModuleType:
    return importlib.import_module("runtime.kernels.triton_kernels")


def resolve_backend(device: torch.device, backend: Backend | None = None) -> str:
    """The backend ('triton' or 'torch') that a call on `device` runs with."""
    choice = backend or os.environ.get(ENV_VAR, "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend {choice!r} (from {'argument' if backend else ENV_VAR}); "
                         "allowed: auto, triton, torch")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend on CPU tensors needs TRITON_INTERPRET=1, set before "
                           "runtime.kernels.triton_kernels is first imported")
    return choice


def _impl(device: torch.device, backend: Backend | None) -> ModuleType:
    return _triton() if resolve_backend(device, backend) == "triton" else reference


def store_kv(buffer: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, *,
             backend: Backend | None = None) -> None:
    """Write `new[t]` (`[T, heads, dim]`) into flat slot `slots[t]` of a cache buffer."""
    _impl(buffer.device, backend).store_kv(buffer, new, slots)


def decode_attention_gqa(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         page_table: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                         max_context_len: int | None = None, backend: Backend | None = None,
                         **tuning: int) -> torch.Tensor:
    """Paged decode attention, one query token per request.

    q `[S, H, D]`; k/v buffers `[num_pages, page_size, KVH, D]`; page_table `[S, max_pages]`;
    context_lens `[S]` (int32 or int64). Returns `[S, H, Dv]` in q's dtype. `tuning` (Triton
    only): `num_splits`, `block_n`.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    impl = _impl(q.device, backend)
    if impl is reference:
        return reference.decode_attention_gqa(q, k_buffer, v_buffer, page_table, context_lens,
                                              scale, max_context_len)
    return impl.decode_attention_gqa(q, k_buffer, v_buffer, page_table, context_lens, scale,
                                     max_context_len, **tuning)


def decode_attention_mla(q: torch.Tensor, latent_buffer: torch.Tensor, page_table: torch.Tensor,
                         context_lens: torch.Tensor, kv_lora_rank: int, scale: float, *,
                         max_context_len: int | None = None, backend: Backend | None = None,
                         **tuning: int) -> torch.Tensor:
    """Absorbed MLA decode: q `[S, H, kv_lora_rank + rope]` over latent rows -> `[S, H, C]`.

    `tuning` (Triton only): `num_splits`, `block_n`, `block_h`.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    impl = _impl(q.device, backend)
    if impl is reference:
        return reference.decode_attention_mla(q, latent_buffer, page_table, context_lens,
                                              kv_lora_rank, scale, max_context_len)
    return impl.decode_attention_mla(q, latent_buffer, page_table, context_lens, kv_lora_rank,
                                     scale, max_context_len, **tuning)


__all__ = ["Backend", "ENV_VAR", "decode_attention_gqa", "decode_attention_mla",
           "resolve_backend", "store_kv"]
