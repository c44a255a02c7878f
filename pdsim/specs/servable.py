"""The tiny random-weight models the real backend can serve, as Hugging Face `config.json`
mappings: the one registry of servable presets for both backends. The simulator reads them with
`pdsim.specs.models.model_spec_from_hf_config`, the real backend with
`runtime.model.config.ModelConfig.from_hf_config`. Plain data, so the simulator needs no part of
the real backend to know them."""

from __future__ import annotations

from typing import Any

SERVABLE_HF_CONFIGS: dict[str, dict[str, Any]] = {
    # vocab 512 holds the byte tokenizer's 256 bytes and its special tokens.
    "tiny-llama": {
        "_name_or_path": "tiny-llama", "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "max_position_embeddings": 2048,
    },
    # Multi-head latent attention and a mixture of experts (DeepSeek-V2's layout, scaled down):
    # layer 0 dense, layer 1 MoE with 4 routed experts (2 per token) and 1 shared.
    "tiny-mla": {
        "_name_or_path": "tiny-mla", "model_type": "deepseek_v2", "torch_dtype": "float32",
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    },
    # Expert parallelism's test model (DeepSeek-V2's MoE layout, scaled down): layer 0 dense,
    # layers 1-2 MoE with 16 routed experts (2 per token) and 1 shared, so `ep` of 2 or 4
    # holds 8 or 4 whole experts per rank.
    "tiny-moe": {
        "_name_or_path": "tiny-moe", "model_type": "deepseek_v2", "torch_dtype": "float32",
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    },
    # A hybrid (runtime/model/hybrid.py): a sliding-window layer (window 16, so short prompts
    # cross it), two gated linear-recurrence layers with a per-request recurrent state, and one
    # full-attention layer.
    "tiny-hybrid": {
        "_name_or_path": "tiny-hybrid", "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "max_position_embeddings": 2048,
        "layer_types": ["sliding_attention", "linear_attention", "full_attention",
                        "linear_attention"],
        "sliding_window": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        # the real backend keeps both parts of the recurrent state in float32
        "mamba_ssm_dtype": "float32", "mamba_conv_dtype": "float32",
    },
}
