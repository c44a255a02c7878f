"""The real backend's model: config, GQA/MLA decoder, its paged KV cache, weights (loading.py:
what a serve config names, with its tokenizer)."""

from runtime.model.attention import AttentionMetadata
from runtime.model.config import PRESETS, ModelConfig, RopeScaling
from runtime.model.kv_cache import PagedKVCache
from runtime.model.loader import build_model, load_model, load_safetensors, save_safetensors
from runtime.model.model import CausalLM

__all__ = [
    "PRESETS", "AttentionMetadata", "CausalLM", "ModelConfig", "PagedKVCache", "RopeScaling",
    "build_model", "load_model", "load_safetensors", "save_safetensors",
]
