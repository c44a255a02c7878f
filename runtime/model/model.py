"""The decoder-only causal LM: embeddings, decoder layers (GQA or MLA, dense or MoE; hybrid
models mix full, sliding-window and linear-attention layers), LM head.

Parameter names follow HF Llama / Qwen2 / DeepSeek-V2 (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.attention import AttentionMetadata
from runtime.model.config import ModelConfig
from runtime.model.hybrid import GatedLinearRecurrence
from runtime.model.kv_cache import PagedKVCache
from runtime.model.layers import GatedMLP, MoE, RMSNorm, RotaryEmbedding
from runtime.model.llama import GQAAttention
from runtime.model.mla import MLAAttention


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if config.layer_type(layer) == "linear_attention":
            self.self_attn = GatedLinearRecurrence(config, layer)
        else:
            attention = MLAAttention if config.is_mla else GQAAttention
            self.self_attn = attention(config, layer, rotary)
        self.mlp = (MoE(config) if config.is_moe_layer(layer)
                    else GatedMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Forward over a flat batch of segments against a paged cache (see `attention`).

    Build one with `runtime.model.build_model` (random weights) or `load_model` (a checkpoint).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        if config.is_mla:
            rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position,
                                     config.rope_theta, config.rope_scaling, interleaved=True)
        else:
            rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta,
                                     config.rope_scaling)
        self.model = Transformer(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, kv: PagedKVCache | None) -> torch.Tensor:
        """Final-norm hidden states of every token, `[T, hidden]`.

        `kv=None` runs without a cache: each segment attends only to itself (it must have no
        cached tokens; build `meta` with `AttentionMetadata.without_cache`).
        """
        if input_ids.shape[0] != meta.num_tokens or positions.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input ids and {positions.shape[0]} positions "
                             f"for metadata of {meta.num_tokens} tokens")
        if kv is None and any(c != q for q, c in zip(meta.query_lens, meta.context_lens)):
            raise ValueError("kv=None needs segments without cached tokens")
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, positions, meta, kv)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKVCache | None) -> torch.Tensor:
        """Float32 logits of the last token of every segment, `[num_segments, vocab]`."""
        hidden = self.hidden_states(input_ids, positions, meta, kv)
        return self.compute_logits(hidden[meta.last_token_indices()])
