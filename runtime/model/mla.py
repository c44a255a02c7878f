"""Multi-head latent attention (DeepSeek-V2/V3) over a latent paged cache.

Per token and layer the cache holds one row: the normalised compressed KV `c` (`kv_lora_rank`)
followed by the rotated shared key `k_pe` (`qk_rope_head_dim`).

With the cache, attention runs in the *absorbed* form: each head's no-rope query is multiplied by
that head's key block of `kv_b_proj` (W_UK), giving a query in latent space, so keys are the
cached rows themselves and values their first `kv_lora_rank` dims (an MQA with one shared head);
the latent output is then mapped to the head's value space by the value block (W_UV). Without a
cache (`kv=None`) the module reconstructs per-head K and V from `c` the plain way, which the tests
use as an independent check of the absorption.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.model.attention import AttentionMetadata, dense_causal_attention, paged_attention
from runtime.model.config import ModelConfig
from runtime.model.kv_cache import PagedKVCache
from runtime.model.layers import RMSNorm, RotaryEmbedding


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.num_heads = config.num_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.lora_rank = config.kv_lora_rank
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        hidden, heads = config.hidden_size, config.num_heads
        q_dim = heads * (self.nope_dim + self.rope_dim)
        self.has_q_lora = bool(config.q_lora_rank)
        if self.has_q_lora:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_q_lora:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache | None) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        q = self._query(x).view(tokens, heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self.rotary(q_pe, positions)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = self.rotary(k_pe[:, None, :], positions)  # [T, 1, R]
        w_kv_b = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, self.lora_rank)
        w_uk, w_uv = w_kv_b.split([self.nope_dim, self.v_dim], dim=1)
        if kv is None:
            k_nope, v = self.kv_b_proj(c).view(tokens, heads, -1).split(
                [self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat((k_nope, k_pe.expand(tokens, heads, self.rope_dim)), dim=-1)
            q = torch.cat((q_nope, q_pe), dim=-1)
            out = dense_causal_attention(q, k, v, meta, self.scale)
        else:
            latent = kv.latent_buffer(self.layer)  # [pages, page_size, 1, C + R]
            kernels.store_kv(latent, torch.cat((c[:, None, :], k_pe), dim=-1), meta.out_slots)
            q_latent = torch.cat((torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe), dim=-1)

            def decode(q1, page_table, context_lens, max_len):
                return kernels.decode_attention_mla(q1, latent, page_table, context_lens,
                                                    self.lora_rank, self.scale,
                                                    max_context_len=max_len)

            out_latent = paged_attention(q_latent, meta, latent, latent[..., : self.lora_rank],
                                         decode, self.scale)
            out = torch.einsum("thc,hvc->thv", out_latent, w_uv)
        return self.o_proj(out.reshape(tokens, heads * self.v_dim))
