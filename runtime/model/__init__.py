"""The real backend's model: config, GQA/MLA decoder, its paged KV cache, weights (loading.py:
what a serve config names, with its tokenizer).

The names are imported on first use (PEP 562): the simulator reads the presets through
`runtime.model.config`, which is torch-free, and must not pay for importing torch."""

from importlib import import_module

_WHERE = {
    "AttentionMetadata": "attention", "PRESETS": "config", "ModelConfig": "config",
    "RopeScaling": "config", "PagedKVCache": "kv_cache", "build_model": "loader",
    "load_model": "loader", "load_safetensors": "loader", "save_safetensors": "loader",
    "CausalLM": "model",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
