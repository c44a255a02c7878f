"""The paged KV cache: layout, and raw addresses a transfer engine would use."""

from __future__ import annotations

import ctypes

import pytest
import torch

from runtime import kernels
from runtime.model.kv_cache import PagedKVCache
from runtime.model.config import ModelConfig

pytestmark = [pytest.mark.real]


def raw_bytes(address: int, length: int) -> bytes:
    return ctypes.string_at(address, length)


def test_gqa_layout_and_sizes():
    cfg = ModelConfig.preset("tiny-llama")
    kv = PagedKVCache.for_model(cfg, num_pages=10, page_size=4)
    per_page = 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert len(kv.data_ptrs()) == 2 * cfg.num_layers
    assert kv.item_lens() == [per_page] * 2 * cfg.num_layers
    assert kv.data_lens() == [10 * per_page] * 2 * cfg.num_layers
    assert kv.key_buffer(1) is kv.buffers[1]
    assert kv.value_buffer(0) is kv.buffers[cfg.num_layers]
    assert kv.bytes_total == 10 * 4 * cfg.kv_bytes_per_token()
    with pytest.raises(TypeError):
        kv.latent_buffer(0)


def test_mla_layout_and_tp_split():
    cfg = ModelConfig.preset("tiny-mla")
    kv = PagedKVCache.for_model(cfg, num_pages=3, page_size=8)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert len(kv.buffers) == cfg.num_layers
    assert kv.latent_buffer(0).shape == (3, 8, 1, latent)
    assert kv.item_lens() == [8 * latent * 4] * cfg.num_layers
    assert kv.bytes_total == 3 * 8 * cfg.kv_bytes_per_token()
    with pytest.raises(TypeError):
        kv.key_buffer(0)
    gqa = ModelConfig.preset("tiny-llama")
    assert PagedKVCache.for_model(gqa, num_pages=2, page_size=2, tp_size=2).heads == 1
    assert PagedKVCache.for_model(gqa, num_pages=2, page_size=2, tp_size=4).heads == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_page_p_is_at_ptr_plus_p_item_len(dtype):
    kv = PagedKVCache(num_layers=2, num_pages=6, page_size=4, heads=2, head_dim=8, mla=False,
                      dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for i, buffer in enumerate(kv.buffers):
        page = (3 * i + 1) % kv.num_pages
        buffer[page] = torch.randn(buffer[page].shape, generator=gen).to(dtype)
        got = raw_bytes(kv.data_ptrs()[i] + page * kv.item_lens()[i], kv.item_lens()[i])
        assert got == buffer[page].numpy().tobytes()
        # The neighbouring pages are untouched zeros.
        assert raw_bytes(kv.data_ptrs()[i] + ((page + 1) % 6) * kv.item_lens()[i],
                         kv.item_lens()[i]) == bytes(kv.item_lens()[i])


def test_head_slice_address():
    kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, heads=4, head_dim=8, mla=False)
    page, offset, head = 2, 3, 2
    slot = page * kv.page_size + offset
    values = torch.arange(8, dtype=torch.float32) + 100
    kv.value_buffer(0)[page, offset, head] = values
    address = kv.token_address(1, slot, head)
    assert address == (kv.data_ptrs()[1] + page * kv.item_lens()[1] + offset * kv.slot_bytes()
                       + head * kv.head_bytes())
    assert raw_bytes(address, kv.head_bytes()) == values.numpy().tobytes()
    assert kv.head_offset_bytes(3) == 3 * 8 * 4
    with pytest.raises(IndexError):
        kv.head_offset_bytes(4)


def test_store_kv_lands_in_slots():
    kv = PagedKVCache(num_layers=1, num_pages=5, page_size=4, heads=1, head_dim=12, mla=True)
    new = torch.randn(3, 1, 12, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([17, 2, 9])
    kernels.store_kv(kv.latent_buffer(0), new, slots, backend="torch")
    for row, slot in zip(new, slots.tolist()):
        assert raw_bytes(kv.token_address(0, slot), kv.slot_bytes()) == row.numpy().tobytes()
