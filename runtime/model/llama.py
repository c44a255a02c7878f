"""Grouped-query attention (Llama, Qwen2) over the paged cache, full or sliding-window."""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.model.attention import AttentionMetadata, dense_causal_attention, paged_attention
from runtime.model.config import ModelConfig
from runtime.model.kv_cache import PagedKVCache
from runtime.model.layers import RotaryEmbedding


class GQAAttention(nn.Module):
    """q/k/v/o projections with HF names; Qwen2 adds biases to q, k and v."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = config.kv_layers.index(layer)  # its buffers in the paged cache
        self.window = (config.sliding_window
                       if config.layer_type(layer) == "sliding_attention" else 0)
        self.rotary = rotary
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache | None) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.rotary(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), positions)
        k = self.rotary(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if kv is None:
            out = dense_causal_attention(q, k, v, meta, self.scale, self.window)
        else:
            k_buffer, v_buffer = kv.key_buffer(self.layer), kv.value_buffer(self.layer)
            kernels.store_kv(k_buffer, k, meta.out_slots)
            kernels.store_kv(v_buffer, v, meta.out_slots)

            def decode(q1, page_table, context_lens, max_len):
                return kernels.decode_attention_gqa(q1, k_buffer, v_buffer, page_table,
                                                    context_lens, self.scale,
                                                    max_context_len=max_len)

            out = paged_attention(q, meta, k_buffer, v_buffer, decode, self.scale, self.window)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
