"""Paged KV cache: contiguous per-layer buffers addressed by page index.

Layout (one torch buffer per entry of `buffers`, each `[num_pages, page_size, heads, head_dim]`):

- GQA: `2 * num_layers` buffers, all K buffers first (layer order), then all V buffers;
  `heads` = the KV heads this rank holds.
- MLA: `num_layers` buffers of one latent "head" (`kv_lora_rank + qk_rope_head_dim`): the
  normalised compressed KV followed by the rotated key part.

Page `p` of buffer `i` is the byte range `[data_ptrs()[i] + p * item_lens()[i], + item_lens()[i])`,
which is what a transfer engine needs (`kv_data_ptrs`, `kv_data_lens`, `kv_item_lens`). Inside a
page, token slot `t` starts at `t * slot_bytes()`, and KV head `h` of that slot at
`head_offset_bytes(h)` (for the head-sliced writes of a TP mismatch).

A hybrid model's cache has buffers for its KV layers only (`ModelConfig.kv_layers`; a
sliding-window layer keeps every token's KV, attention masks it to the window) and its
per-request recurrent state in `state` (runtime/model/hybrid.py).

A token's flat slot index is `page * page_size + offset`. The cache does not hand pages out: the
scheduler core owns the free lists and passes page indices in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.model.config import ModelConfig


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        mla: bool,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if min(num_layers, num_pages, page_size, heads, head_dim) < 1:
            raise ValueError("num_layers, num_pages, page_size, heads and head_dim must be >= 1")
        if mla and heads != 1:
            raise ValueError(f"an MLA cache stores one latent head per token, got heads={heads}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.heads = heads
        self.head_dim = head_dim
        self.mla = mla
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, heads, head_dim)
        count = num_layers if mla else 2 * num_layers
        self.buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(count)
        ]
        # Hybrid models: the per-request RecurrentState the linear-attention layers read and
        # write (runtime/model/hybrid.py `recurrent_state_for`); None otherwise.
        self.state = None

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> PagedKVCache:
        """A cache for `config` on one attention-TP rank (GQA heads split `tp_size` ways).

        Only the layers that keep KV get buffers (`config.kv_layers`).
        """
        heads = 1 if config.is_mla else max(1, config.num_kv_heads // tp_size)
        return cls(
            num_layers=len(config.kv_layers), num_pages=num_pages, page_size=page_size, heads=heads,
            head_dim=config.kv_cache_head_dim, mla=config.is_mla,
            dtype=dtype if dtype is not None else getattr(torch, config.dtype), device=device,
        )

    # ---- tensors the model reads and writes ----------------------------------------------

    def key_buffer(self, layer: int) -> torch.Tensor:
        self._require(mla=False)
        return self.buffers[layer]

    def value_buffer(self, layer: int) -> torch.Tensor:
        self._require(mla=False)
        return self.buffers[self.num_layers + layer]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        self._require(mla=True)
        return self.buffers[layer]

    def _require(self, *, mla: bool) -> None:
        if self.mla != mla:
            kind = "MLA" if self.mla else "GQA"
            wanted = "latent" if mla else "K/V"
            raise TypeError(f"this is a {kind} cache; it has no {wanted} buffers")

    # ---- host copies (a PD decode instance's retraction) ---------------------------------

    def copy_out(self, pages: Sequence[int]) -> list[torch.Tensor]:
        """A host copy of `pages` of every buffer, in that order (SGLang's `get_cpu_copy`)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        return [b.index_select(0, index).to("cpu") for b in self.buffers]

    def copy_in(self, pages: Sequence[int], saved: Sequence[torch.Tensor]) -> None:
        """Write a `copy_out` into `pages`, in order (SGLang's `load_cpu_copy`)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        for buffer, data in zip(self.buffers, saved, strict=True):
            buffer.index_copy_(0, index, data.to(buffer.device))

    # ---- addressing for transfer engines -------------------------------------------------

    def data_ptrs(self) -> list[int]:
        """Base address of every buffer."""
        return [b.data_ptr() for b in self.buffers]

    def data_lens(self) -> list[int]:
        """Total bytes of every buffer."""
        return [b.numel() * b.element_size() for b in self.buffers]

    def item_lens(self) -> list[int]:
        """Bytes of one page of every buffer."""
        return [b[0].numel() * b.element_size() for b in self.buffers]

    def slot_bytes(self) -> int:
        """Bytes of one token slot in one buffer (all the heads this rank holds)."""
        return self.heads * self.head_bytes()

    def head_bytes(self) -> int:
        """Bytes of one head of one token in one buffer."""
        return self.head_dim * self.buffers[0].element_size()

    def head_offset_bytes(self, head: int) -> int:
        """Offset of local KV head `head` inside a token slot."""
        if not 0 <= head < self.heads:
            raise IndexError(f"head {head} out of range 0..{self.heads - 1}")
        return head * self.head_bytes()

    def token_address(self, buffer: int, slot: int, head: int = 0) -> int:
        """Address of head `head` of flat token slot `slot` (`page * page_size + offset`)."""
        return self.data_ptrs()[buffer] + slot * self.slot_bytes() + self.head_offset_bytes(head)

    @property
    def bytes_total(self) -> int:
        return sum(self.data_lens())
