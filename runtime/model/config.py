"""Model shape: one frozen dataclass for dense GQA (Llama, Qwen2) and MLA/MoE (DeepSeek-V2/V3).

This module imports no torch, so the PD router can size its limits without loading the model.
`ModelConfig.from_hf_config` reads a HuggingFace `config.json`;
`ModelConfig.preset` returns the tiny random models the tests and the CPU backend use (their
config.json mappings are in pdsim/specs/servable.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pdsim.specs.servable import SERVABLE_HF_CONFIGS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`); the only kind the model applies.

    `yarn` (DeepSeek) is recorded so that such configs can still be sized, but building a model
    from them raises NotImplementedError.
    """

    kind: Literal["llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    name: str = "custom"
    # Attention kind. "mla" caches one latent "head" of kv_lora_rank + qk_rope_head_dim per token.
    attention: Literal["gqa", "mla"] = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    # Mixture of experts; num_experts == 0 means every layer has a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_scoring: Literal["softmax", "sigmoid"] = "softmax"
    # Hybrid layers (runtime/model/hybrid.py): layer i is `layer_types[i]` (empty: all
    # "full_attention"). A "sliding_attention" layer attends to the last `sliding_window` tokens;
    # a "linear_attention" layer keeps no KV but a recurrent state per request, of
    # `linear_num_heads` heads (key dim `linear_key_head_dim`, value dim
    # `linear_value_head_dim`) after a causal convolution of `linear_conv_kernel_dim` taps.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    linear_num_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"ModelConfig {self.name!r}: {field}={value!r}; {allowed}")

        if self.dtype not in DTYPE_BYTES:
            raise bad("dtype", self.dtype, f"allowed: {sorted(DTYPE_BYTES)}")
        if self.attention not in ("gqa", "mla"):
            raise bad("attention", self.attention, "allowed: 'gqa', 'mla'")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.attention == "mla":
            for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, field) <= 0:
                    raise bad(field, getattr(self, field), "must be > 0 when attention='mla'")
            if self.qk_rope_head_dim % 2:
                raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        elif self.head_dim % 2:
            raise bad("head_dim", self.head_dim, "must be even (rotary embedding)")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise bad("experts_per_token", self.experts_per_token,
                          f"must be in 1..num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", self.moe_intermediate_size, "must be > 0")
        self._check_hybrid(bad)

    def _check_hybrid(self, bad) -> None:
        if not self.layer_types:
            return
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise bad("layer_types", list(self.layer_types),
                      f"needs one entry per layer ({self.num_layers})")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise bad("layer_types", unknown, f"allowed: {list(LAYER_TYPES)}")
        if self.is_mla:
            raise bad("attention", "mla", "hybrid layer_types need attention='gqa'")
        if "full_attention" not in self.layer_types:
            raise bad("layer_types", list(self.layer_types), "need a full_attention layer")
        if ("sliding_attention" in self.layer_types) != (self.sliding_window > 0):
            raise bad("sliding_window", self.sliding_window,
                      "must be > 0 exactly when a layer is sliding_attention")
        if "linear_attention" in self.layer_types:
            for field in ("linear_num_heads", "linear_key_head_dim", "linear_value_head_dim"):
                if getattr(self, field) <= 0:
                    raise bad(field, getattr(self, field),
                              "must be > 0 with a linear_attention layer")
            if self.linear_conv_kernel_dim < 2:
                raise bad("linear_conv_kernel_dim", self.linear_conv_kernel_dim,
                          "must be >= 2 with a linear_attention layer")

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def kv_cache_heads(self) -> int:
        """Heads stored per token per cache buffer (MLA: the single latent head)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_buffers_per_layer(self) -> int:
        """GQA keeps K and V in two buffers per layer, MLA one latent buffer."""
        return 1 if self.is_mla else 2

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep KV in the paged cache (all but linear-attention ones), in order;
        a layer's index in this tuple is its index in the cache."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_type(i) != "linear_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers, in order (a layer's index here is its index in the
        recurrent-state buffer)."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_type(i) == "linear_attention")

    @property
    def state_floats_per_head(self) -> int:
        """Recurrent-state elements of one linear-attention head of one layer: its key x value
        matrix, then its convolution's last `linear_conv_kernel_dim - 1` q/k/v inputs."""
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        return dk * dv + (2 * dk + dv) * (self.linear_conv_kernel_dim - 1)

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """KV cache bytes one token occupies on one attention-TP rank, all layers."""
        heads = 1 if self.is_mla else max(1, self.num_kv_heads // tp_size)
        return (len(self.kv_layers) * self.kv_buffers_per_layer * heads * self.kv_cache_head_dim
                * self.dtype_bytes)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers

    def with_(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- construction --------------------------------------------------------------------

    @staticmethod
    def preset(name: str) -> ModelConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}") from None

    @staticmethod
    def from_hf_config(source: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a HuggingFace config (a dict, a config.json, or a directory holding one).

        Supported `model_type`s: llama, qwen2 (q/k/v bias), deepseek_v2 and deepseek_v3.
        """
        if isinstance(source, dict):
            hf, origin = source, "<dict>"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            hf, origin = json.loads(path.read_text()), str(path)
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen2", "deepseek_v2", "deepseek_v3"):
            raise ValueError(
                f"{origin}: model_type={model_type!r}; allowed: llama, qwen2, deepseek_v2, "
                "deepseek_v3")
        heads = hf["num_attention_heads"]
        common = dict(
            name=hf.get("_name_or_path") or model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=_HF_DTYPES.get(str(hf.get("torch_dtype", "bfloat16")), "bfloat16"),
            rope_scaling=_parse_rope_scaling(hf.get("rope_scaling"), origin),
        )
        if model_type in ("llama", "qwen2"):
            if hf.get("mlp_bias"):
                raise ValueError(f"{origin}: mlp_bias=True is not supported")
            if model_type == "qwen2" and hf.get("use_sliding_window"):
                raise ValueError(f"{origin}: use_sliding_window=True is not supported")
            return ModelConfig(
                **common,
                **_hybrid_fields(hf),
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            )
        experts = hf.get("n_routed_experts") or 0
        return ModelConfig(
            **common,
            num_kv_heads=heads,
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            attention="mla",
            kv_lora_rank=hf["kv_lora_rank"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank"),
            num_experts=experts,
            experts_per_token=hf.get("num_experts_per_tok") or 0 if experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0 if experts else 0,
            num_shared_experts=hf.get("n_shared_experts") or 0 if experts else 0,
            first_dense_layers=hf.get("first_k_dense_replace", 0) if experts else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_scoring=hf.get("scoring_func", "softmax"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of `from_hf_config` (model_type llama, qwen2 or deepseek_v2)."""
        hf: dict[str, Any] = dict(
            _name_or_path=self.name,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position,
            tie_word_embeddings=self.tie_word_embeddings,
            torch_dtype=self.dtype,
        )
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            hf["rope_scaling"] = dict(
                rope_type=rs.kind, factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position)
        if not self.is_mla:
            hf.update(model_type="qwen2" if self.qkv_bias else "llama",
                      num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim)
            if self.layer_types:
                hf["layer_types"] = list(self.layer_types)
            if self.sliding_window:
                hf["sliding_window"] = self.sliding_window
            if self.linear_layers:
                hf.update(linear_num_key_heads=self.linear_num_heads,
                          linear_num_value_heads=self.linear_num_heads,
                          linear_key_head_dim=self.linear_key_head_dim,
                          linear_value_head_dim=self.linear_value_head_dim,
                          linear_conv_kernel_dim=self.linear_conv_kernel_dim,
                          mamba_ssm_dtype="float32", mamba_conv_dtype="float32")
            return hf
        hf.update(
            model_type="deepseek_v2", num_key_value_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim, n_routed_experts=self.num_experts or None,
            num_experts_per_tok=self.experts_per_token or None,
            moe_intermediate_size=self.moe_intermediate_size,
            n_shared_experts=self.num_shared_experts or None,
            first_k_dense_replace=self.first_dense_layers, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, scoring_func=self.moe_scoring,
        )
        return hf


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def _hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The hybrid-layer fields of a llama-type config with `layer_types` (the recurrent state is
    kept in float32; the key and value head counts must match)."""
    types = hf.get("layer_types")
    if not types:
        return {}
    fields: dict[str, Any] = {"layer_types": tuple(types),
                              "sliding_window": hf.get("sliding_window") or 0}
    if "linear_attention" in types:
        key_heads, value_heads = hf.get("linear_num_key_heads"), hf.get("linear_num_value_heads")
        if key_heads != value_heads:
            raise ValueError(f"linear_num_key_heads={key_heads} and linear_num_value_heads="
                             f"{value_heads}; the real backend needs them equal")
        for key in ("mamba_ssm_dtype", "mamba_conv_dtype"):
            if hf.get(key, "float32") != "float32":
                raise ValueError(f"{key}={hf[key]!r}; allowed: 'float32' (the real backend's "
                                 "recurrent state)")
        fields.update(linear_num_heads=key_heads,
                      linear_key_head_dim=hf.get("linear_key_head_dim") or 0,
                      linear_value_head_dim=hf.get("linear_value_head_dim") or 0,
                      linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim") or 0)
    return fields


def _parse_rope_scaling(raw: dict[str, Any] | None, origin: str) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position=int(raw.get("original_max_position_embeddings", 8192)))
    if kind == "yarn":
        return RopeScaling(kind="yarn", factor=float(raw.get("factor", 1.0)),
                           original_max_position=int(raw.get("original_max_position_embeddings",
                                                             4096)))
    raise ValueError(f"{origin}: rope_scaling type {kind!r}; allowed: default, llama3, yarn")


PRESETS: dict[str, ModelConfig] = {
    name: ModelConfig.from_hf_config(hf) for name, hf in SERVABLE_HF_CONFIGS.items()}
