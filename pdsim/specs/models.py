"""What a decoder LLM looks like to a cost model: its shapes, and the sizes derived from them.

`ModelSpec` is a frozen description built from a preset or a Hugging Face `config.json`. Every
size the simulator needs (parameters, weight bytes per GPU, KV bytes per token per rank) is a
method of it, computed from the shapes, so one spec serves the cost model, the KV-capacity
planner and the transfer model alike.

Counting conventions (they decide the "published size" tests):

- A linear layer of `in` -> `out` features has `in * out` parameters; biases are not modelled
  (Qwen2's QKV bias is < 0.01 % of its parameters).
- RMSNorm weights are counted (two per layer, one final; MLA adds its q/kv latent norms).
- The input embedding and the LM head are separate tables unless `tie_word_embeddings`.
- DeepSeek's multi-token-prediction module is not part of the model (the published 671B
  excludes it too).

Weight bytes follow `precision` block by block (pdsim.specs.precision): attention, dense MLPs,
experts and the LM head each in their own format; the input embedding is stored like the LM
head (quantisers leave both vocabulary tables alone, and a tied head is the embedding); norms
and the MoE router stay BF16.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdsim.specs.precision import DTYPES, DTypeName, Precision
from pdsim.specs.quantization import precision_from_hf_config
from pdsim.specs.servable import SERVABLE_HF_CONFIGS
from pdsim.specs.sources import (
    find_spec_file, merge_fields, not_found, read_mapping, read_spec_yaml, validate_fields,
)

MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size")
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
# `weight_dtype_bytes` (one width for every block, the field before `precision`) -> format.
_UNIFORM_BY_BYTES: dict[float, DTypeName] = {2: "bf16", 1: "fp8", 0.5: "w4a16"}


class ModelSpec(BaseModel):
    """Shapes of a decoder-only transformer (GQA/MHA or MLA attention, dense or MoE MLP).

    For MLA models `head_dim` is the query/key head size `qk_nope_head_dim + qk_rope_head_dim`
    and `num_kv_heads` is what the HF config says (unused: the KV cache holds one latent).
    For MoE models `first_k_dense_layers` layers have a dense MLP of `intermediate_size` (the
    first ones in DeepSeek; only their number matters to pdsim, so Qwen-MoE's interleaved dense
    layers count here too); the others have `num_experts` routed experts (top
    `experts_per_token`) plus `num_shared_experts` always-on experts, all of
    `moe_intermediate_size`.

    `precision` gives each block's weight format. The older `weight_dtype_bytes` is still
    accepted as input: 2, 1 or 0.5 put every block, LM head included, in bf16, fp8 or w4a16.

    Hybrid models: layer i is of type `layer_pattern[i % len(layer_pattern)]` (HF's
    `layer_types` names). A `full_attention` layer keeps every token's KV; a
    `sliding_attention` layer only the last `sliding_window` tokens' (gpt-oss); a
    `linear_attention` layer (Qwen3-Next's Gated DeltaNet) no KV at all but a fixed-size
    recurrent state per request: `linear_num_value_heads` matrices of `linear_key_head_dim` x
    `linear_value_head_dim` in `recurrent_state_dtype_bytes` (SGLang's `--mamba-ssm-dtype`,
    float32 by default), plus a causal-convolution state of the last
    `linear_conv_kernel_dim - 1` inputs of its q/k/v channels in `conv_state_dtype_bytes`
    (SGLang's SGLANG_MAMBA_CONV_DTYPE, bf16 by default; the served tiny models keep float32,
    as the real backend does). Its projections replace the attention block's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    attention: Literal["gqa", "mla"] = "gqa"
    # MLA (DeepSeek-V2/V3) only
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)
    # MoE only
    num_experts: int | None = Field(default=None, gt=0)
    experts_per_token: int | None = Field(default=None, gt=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    num_shared_experts: int = Field(default=0, ge=0)
    first_k_dense_layers: int = Field(default=0, ge=0)
    # GQA models that RMS-normalise each head of q and k before RoPE (Qwen3's q_norm/k_norm;
    # GLM-4.5's use_qk_norm): SGLang runs one more kernel a layer (models/utils.py
    # apply_qk_norm: fused_inplace_qknorm on q and k, then RoPE apart unless
    # --enable-fused-qk-norm-rope, off by default)
    qk_norm: bool = False
    precision: Precision = Precision()
    tie_word_embeddings: bool = False
    # the longest sequence, prompt and output, it serves: config.json's max_position_embeddings
    # (SGLang's default --context-length); None: unbounded
    context_len: int | None = Field(default=None, gt=0)
    # Hybrid models only
    layer_pattern: tuple[LayerType, ...] = Field(default=("full_attention",), min_length=1)
    sliding_window: int | None = Field(default=None, gt=0)
    linear_num_key_heads: int | None = Field(default=None, gt=0)
    linear_num_value_heads: int | None = Field(default=None, gt=0)
    linear_key_head_dim: int | None = Field(default=None, gt=0)
    linear_value_head_dim: int | None = Field(default=None, gt=0)
    linear_conv_kernel_dim: int | None = Field(default=None, gt=1)
    recurrent_state_dtype_bytes: float = Field(default=4, gt=0)
    conv_state_dtype_bytes: float = Field(default=2, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _weight_dtype_bytes_to_precision(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "weight_dtype_bytes" not in data:
            return data
        data = dict(data)
        width = data.pop("weight_dtype_bytes")
        if "precision" in data:
            raise ValueError("give precision or weight_dtype_bytes, not both")
        dtype = _UNIFORM_BY_BYTES.get(width) if isinstance(width, (int, float)) else None
        if dtype is None:
            allowed = ", ".join(f"{b:g} ({d})" for b, d in _UNIFORM_BY_BYTES.items())
            raise ValueError(
                f"weight_dtype_bytes {width!r} is not a width pdsim can price; allowed: "
                f"{allowed}, or set precision per block"
            )
        data["precision"] = Precision(
            attention=dtype, dense_mlp=dtype, moe_experts=dtype, lm_head=dtype
        )
        return data

    @model_validator(mode="after")
    def _check_consistent(self) -> ModelSpec:
        mla_set = [f for f in MLA_FIELDS if getattr(self, f) is not None]
        if self.attention == "mla":
            missing = [f for f in MLA_FIELDS if getattr(self, f) is None]
            if missing:
                raise ValueError(f"attention 'mla' needs {', '.join(missing)}")
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim != qk:
                raise ValueError(
                    f"MLA head_dim must be qk_nope_head_dim + qk_rope_head_dim = {qk}, "
                    f"got {self.head_dim}"
                )
        else:
            if mla_set or self.q_lora_rank is not None:
                raise ValueError(
                    f"{', '.join(mla_set or ['q_lora_rank'])} only apply to attention 'mla'"
                )
            if self.num_attention_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads})"
                )
        moe_set = [f for f in MOE_FIELDS if getattr(self, f) is not None]
        if moe_set and len(moe_set) != len(MOE_FIELDS):
            missing = [f for f in MOE_FIELDS if getattr(self, f) is None]
            raise ValueError(f"a MoE model needs {', '.join(missing)} as well")
        if not moe_set and (self.num_shared_experts or self.first_k_dense_layers):
            raise ValueError("num_shared_experts and first_k_dense_layers need num_experts")
        if moe_set and self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) exceeds num_experts "
                f"({self.num_experts})"
            )
        self._check_hybrid()
        if self.first_k_dense_layers > self.num_layers:
            raise ValueError(
                f"first_k_dense_layers ({self.first_k_dense_layers}) exceeds num_layers "
                f"({self.num_layers})"
            )
        return self

    def _check_hybrid(self) -> None:
        kinds = set(self.layer_pattern)
        if "full_attention" not in kinds:
            raise ValueError(
                f"layer_pattern {list(self.layer_pattern)} has no full_attention layer; pdsim "
                "sizes the KV pool by the layers that keep every token, so it needs one"
            )
        has_sliding = "sliding_attention" in kinds
        if has_sliding != (self.sliding_window is not None):
            raise ValueError("sliding_window (tokens) goes with a sliding_attention layer in "
                             "layer_pattern, and only with one")
        linear_set = [f for f in LINEAR_FIELDS if getattr(self, f) is not None]
        if "linear_attention" in kinds:
            missing = [f for f in LINEAR_FIELDS if getattr(self, f) is None]
            if missing:
                raise ValueError(f"a linear_attention layer needs {', '.join(missing)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                    f"multiple of linear_num_key_heads ({self.linear_num_key_heads})"
                )
        elif linear_set:
            raise ValueError(f"{', '.join(linear_set)} only apply with a linear_attention "
                             "layer in layer_pattern")
        if self.is_mla and kinds != {"full_attention"}:
            raise ValueError("sliding or linear attention layers are not modelled with MLA")

    # ----- structure -------------------------------------------------------------------------

    def _count_layers(self, kind: str) -> int:
        pattern = self.layer_pattern
        whole, rest = divmod(self.num_layers, len(pattern))
        return whole * pattern.count(kind) + pattern[:rest].count(kind)

    @property
    def num_full_attention_layers(self) -> int:
        return self._count_layers("full_attention")

    @property
    def num_sliding_layers(self) -> int:
        return self._count_layers("sliding_attention")

    @property
    def num_linear_layers(self) -> int:
        return self._count_layers("linear_attention")

    @property
    def is_hybrid(self) -> bool:
        return self.layer_pattern != ("full_attention",)

    @property
    def attention_summary(self) -> str:
        """The attention kind, and a hybrid model's layer mix: `gqa: 18 swa-128 + 18 full`."""
        if not self.is_hybrid:
            return self.attention
        parts = [f"{self.num_sliding_layers} swa-{self.sliding_window}" if self.num_sliding_layers
                 else "", f"{self.num_linear_layers} linear" if self.num_linear_layers else "",
                 f"{self.num_full_attention_layers} full"]
        return f"{self.attention}: {' + '.join(p for p in parts if p)}"

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_v_head_dim(self) -> int:
        """Size of one head of the attention output (MLA: `v_head_dim`)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    # ----- parameters ------------------------------------------------------------------------

    @property
    def attn_params_per_layer(self) -> int:
        """Projection weights of one attention block (QKV + output; MLA: all its low-rank parts)."""
        h, nh = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            return h * (nh + 2 * self.num_kv_heads) * self.head_dim + nh * self.head_dim * h
        q_out = nh * self.head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)
        o = nh * self.v_head_dim * h
        return q + kv_a + kv_b + o

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's causal convolution (its q, k and v)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def linear_attn_params_per_layer(self) -> int:
        """Projections of one Gated DeltaNet block: q/k/v/z in, the b/a gates, the depthwise
        convolution and the output projection (its per-head decay and norm are < 0.01 %)."""
        if not self.num_linear_layers:
            return 0
        h, value = self.hidden_size, self.linear_num_value_heads * self.linear_value_head_dim
        qkvz = h * (self.linear_conv_dim + value)
        gates = h * 2 * self.linear_num_value_heads
        conv = self.linear_conv_dim * self.linear_conv_kernel_dim
        return qkvz + gates + conv + value * h

    @property
    def attn_params(self) -> int:
        """Attention (or linear-attention) projection weights of all layers."""
        return ((self.num_layers - self.num_linear_layers) * self.attn_params_per_layer
                + self.num_linear_layers * self.linear_attn_params_per_layer)

    @property
    def norm_params_per_layer(self) -> int:
        extra = (self.q_lora_rank or 0) + self.kv_lora_rank if self.is_mla else 0
        return 2 * self.hidden_size + extra

    @property
    def dense_mlp_params(self) -> int:
        """Gated MLP (gate, up, down) of one dense layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed or shared expert (a gated MLP of `moe_intermediate_size`)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.is_moe else 0

    @property
    def moe_layer_params(self) -> int:
        if not self.is_moe:
            return 0
        experts = (self.num_experts + self.num_shared_experts) * self.expert_params
        return experts + self.router_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection that are not shared with the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameter count."""
        return (
            self.attn_params + self.num_layers * self.norm_params_per_layer
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * self.moe_layer_params
            + self.embedding_params
            + self.lm_head_params
            + self.hidden_size
        )

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies by: all but the embedding table (a lookup) and, in
        MoE layers, the routed experts it is not sent to. The LM head counts even when tied."""
        moe_active = 0
        if self.is_moe:
            moe_active = (
                self.experts_per_token + self.num_shared_experts
            ) * self.expert_params + self.router_params
        return (
            self.attn_params + self.num_layers * self.norm_params_per_layer
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * moe_active
            + self.vocab_size * self.hidden_size
            + self.hidden_size
        )

    # ----- bytes -----------------------------------------------------------------------------

    @property
    def weight_dtype_bytes(self) -> float:
        """Bytes per weight of the attention block's format: a one-format view kept for cost
        code that predates per-block precision (new code reads `precision` per block)."""
        return DTYPES[self.precision.attention].weight_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights, each block in its own format."""
        return self.weight_bytes_per_rank()

    def weight_bytes_per_rank(self, tp: int = 1, ep: int = 1, dp_attention: int = 1, *,
                              deepep: bool = False, dense_tp: int | None = None,
                              dp_lm_head: bool = False, redundant_experts: int = 0) -> int:
        """Weight bytes one GPU of a `tp`-GPU instance holds (SGLang's sharding).

        Attention weights split over the attention-TP group `tp // dp_attention` (each
        DP-attention rank holds a copy); routed experts, with EPLB's `redundant_experts` copies
        (SGLang builds each MoE layer with n_routed_experts + --ep-num-redundant-experts
        physical experts), over `ep` (whole experts) and then over `tp // ep` (slices); shared
        experts over `tp`, or replicated under DeepEP (`deepep`:
        SGLang runs them with tp_size 1); dense MLPs over `dense_tp` GPUs (SGLang's
        `--moe-dense-tp-size`; None: tp); embedding and LM head over tp, or over the
        attention-TP group with `dp_lm_head`; norms and the router are replicated. Each
        block's params count at its format's bytes.
        """
        _check_divides("dp_attention", dp_attention, tp)
        if ep != 1 and not self.is_moe:
            raise ValueError(f"ep={ep} needs a MoE model; {self.name} is dense")
        _check_divides("ep", ep, tp)
        attn_tp = tp // dp_attention
        p = self.precision
        routed = shared = 0.0
        if self.is_moe:
            routed = (self.num_experts + redundant_experts) * self.expert_params / ep / (tp // ep)
            shared = self.num_shared_experts * self.expert_params / (1 if deepep else tp)
        blocks = [
            (p.attention, self.attn_params / attn_tp),
            (p.dense_mlp, self.num_dense_layers * self.dense_mlp_params / (dense_tp or tp)),
            (p.moe_experts, self.num_moe_layers * (routed + shared)),
            (p.lm_head, (self.embedding_params + self.lm_head_params)
             / (attn_tp if dp_lm_head else tp)),
            ("bf16", self.num_layers * self.norm_params_per_layer + self.hidden_size),
            ("bf16", self.num_moe_layers * self.router_params),
        ]
        total = sum(params * DTYPES[dtype].weight_bytes for dtype, params in blocks)
        return round(total)

    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """KV-cache elements one token stores in one layer (whole model, no sharding)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype_bytes: float = 2) -> int:
        """KV-cache bytes of one token over the layers that keep every token (all layers
        unless the model is hybrid: its full-attention layers), unsharded."""
        return round(self.num_full_attention_layers * self.kv_elems_per_token_per_layer
                     * kv_dtype_bytes)

    def split_error(self, attn_tp: int, ep: int = 1) -> str | None:
        """Why SGLang cannot run this model's attention over `attn_tp` GPUs and its experts over
        `ep`, or None: its attention layers assert that the query heads divide evenly, and
        that the KV heads divide by the GPUs or the GPUs by them (a KV head then replicates);
        expert parallelism needs experts."""
        if ep > 1 and not self.is_moe:
            return f"ep={ep} needs a MoE model; {self.name} is dense: drop ep (1)"
        heads, kv = self.num_attention_heads, self.num_kv_heads
        fits = [n for n in range(1, heads + 1) if not heads % n
                and (self.is_mla or not (kv % n if n <= kv else n % kv))]
        if attn_tp in fits:
            return None
        return (f"attention tp={attn_tp} (tp / dp_attention) does not split {self.name}'s "
                f"{heads} query heads" + ("" if self.is_mla else f" and {kv} KV heads")
                + f" evenly, as SGLang requires; allowed: {', '.join(map(str, fits))}")

    def block_fp8_error(self, tp: int, ep: int, dense_tp: int | None = None) -> str | None:
        """Why SGLang cannot load this model's block-FP8 MLP weights split this way, or None:
        each GPU's slice of an expert's (or a dense MLP's) intermediate dimension must hold
        whole 128-wide scale blocks (`Fp8MoEMethod.create_weights`, `Fp8LinearMethod`'s
        partition check in layers/quantization/fp8.py). Experts split over tp / ep GPUs, the
        dense MLP over `dense_tp` (None: tp)."""
        parts = []
        if self.is_moe and self.precision.moe_experts == "fp8":
            parts.append(("expert", self.moe_intermediate_size, tp // ep))
        if self.num_dense_layers and self.precision.dense_mlp == "fp8":
            parts.append(("dense MLP", self.intermediate_size, dense_tp or tp))
        for what, size, split in parts:
            if split > 1 and size % (split * FP8_BLOCK):
                fits = [2**i for i in range(split.bit_length())
                        if 2**i < split and not size % (2**i * FP8_BLOCK)]
                fits_words = f"{', '.join(map(str, fits[:-1]))} or {fits[-1]}" \
                    if len(fits) > 1 else str(fits[0])
                if what == "expert":  # experts split over tp / ep GPUs: more ep, fewer GPUs
                    fix = (f"raise ep (SGLang's --ep-size) so that tp / ep is {fits_words} "
                           f"(now {tp} / {ep})")
                else:  # the dense MLP splits over tp unless moe_dense_tp is 1
                    fix = (f"set moe_dense_tp: 1 (SGLang's --moe-dense-tp-size 1: each GPU "
                           "runs the dense MLP whole on its own tokens; needs dp_attention > 1)"
                           f", or use a tp of {fits_words}")
                return (f"{self.name}'s block-FP8 {what} weights ({size} wide) split over "
                        f"{split} GPUs leave {size // split} a GPU, not a multiple of the "
                        f"{FP8_BLOCK}-wide scale block, so SGLang refuses to load them; {fix}")
        return None

    def pd_tp_error(self, prefill_attn_tp: int, decode_attn_tp: int) -> str | None:
        """Why SGLang cannot move this model's KV from prefill ranks of `prefill_attn_tp` to
        decode ranks of `decode_attn_tp`, or None: its transfer sends a non-MLA model's
        sliding-window state page by page, rank to rank, and refuses another TP size
        (`maybe_send_extra`: "PD Disaggregation does NOT support PD different TP sizes for
        non-MLA SWA hybrid models yet")."""
        if self.is_mla or not self.num_sliding_layers or prefill_attn_tp == decode_attn_tp:
            return None
        return (f"{self.name} has sliding-window layers, whose state SGLang's PD transfer sends "
                f"only between equal attention TP sizes (prefill {prefill_attn_tp}, decode "
                f"{decode_attn_tp}); give both roles one attention TP size")

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one attention-TP rank holds: `max(1, num_kv_heads // tp)` (heads replicate
        when tp exceeds them). MLA's latent is one "head", replicated on every rank."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // tp)

    def _kv_bytes_per_token_per_layer_per_rank(self, tp: int, kv_dtype_bytes: float) -> float:
        if self.is_mla:
            return self.kv_elems_per_token_per_layer * kv_dtype_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes

    def kv_bytes_per_token_per_rank(self, tp: int, kv_dtype_bytes: float = 2) -> int:
        """KV bytes one attention-TP rank stores per token over the layers that keep every
        token (MLA: full latent)."""
        per_layer = self._kv_bytes_per_token_per_layer_per_rank(tp, kv_dtype_bytes)
        return round(self.num_full_attention_layers * per_layer)

    def swa_bytes_per_token_per_rank(self, tp: int, kv_dtype_bytes: float = 2) -> int:
        """KV bytes one attention-TP rank stores per token over the sliding-window layers; a
        request keeps at most `sliding_window` such tokens."""
        per_layer = self._kv_bytes_per_token_per_layer_per_rank(tp, kv_dtype_bytes)
        return round(self.num_sliding_layers * per_layer)

    @property
    def linear_share(self) -> float:
        """The share of the layers that are linear-attention (Gated DeltaNet) layers."""
        return self.num_linear_layers / self.num_layers

    def linear_heads_per_rank(self, tp: int) -> tuple[int, int, int, int]:
        """A linear-attention layer's (key heads, value heads, key head dim, value head dim)
        on one attention-TP rank: its heads split over tp, and its state with them."""
        for label, heads in (("linear_num_key_heads", self.linear_num_key_heads),
                             ("linear_num_value_heads", self.linear_num_value_heads)):
            if tp < 1 or heads % tp:
                raise ValueError(f"attention tp={tp} must divide {label} ({heads}): the "
                                 "recurrent state splits by heads")
        return (self.linear_num_key_heads // tp, self.linear_num_value_heads // tp,
                self.linear_key_head_dim, self.linear_value_head_dim)

    def recurrent_state_bytes_per_layer_per_rank(self, tp: int) -> int:
        """One request's recurrent state in one linear-attention layer on one attention-TP
        rank: its value heads (with their key heads' convolution channels) split over tp."""
        if not self.num_linear_layers:
            return 0
        self.linear_heads_per_rank(tp)  # heads that do not split are an error
        ssm = (self.linear_num_value_heads * self.linear_key_head_dim
               * self.linear_value_head_dim * self.recurrent_state_dtype_bytes)
        conv_elems = self.linear_conv_dim * (self.linear_conv_kernel_dim - 1)
        conv = conv_elems * self.conv_state_dtype_bytes
        return round((ssm + conv) / tp)

    def recurrent_state_bytes_per_request_per_rank(self, tp: int) -> int:
        """One request's recurrent state over all linear-attention layers, one rank's share."""
        return self.num_linear_layers * self.recurrent_state_bytes_per_layer_per_rank(tp)

    def swa_window_bytes_per_request_per_rank(self, tp: int, kv_dtype_bytes: float = 2) -> int:
        """Sliding-window KV of one request with a full window, one rank's share."""
        if not self.num_sliding_layers:
            return 0
        return self.sliding_window * self.swa_bytes_per_token_per_rank(tp, kv_dtype_bytes)


def _check_divides(label: str, part: int, tp: int) -> None:
    if part < 1 or tp < 1 or tp % part:
        raise ValueError(f"{label}={part} must be >= 1 and divide tp={tp}")


# ----- presets ---------------------------------------------------------------------------------
# Numbers from each model's public Hugging Face config.json (the repo named in the comment).

# Block-FP8 checkpoints' scale blocks (weight_block_size [128, 128]: DeepSeek-V3, Qwen3-FP8)
FP8_BLOCK = 128

# Kimi-K2's shapes (moonshotai/Kimi-K2-Instruct config.json), shared by its checkpoints
_KIMI_K2_SHAPE = dict(
    num_layers=61, hidden_size=7168, num_attention_heads=64, num_kv_heads=64,
    head_dim=192, intermediate_size=18432, vocab_size=163840, attention="mla",
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    q_lora_rank=1536, num_experts=384, experts_per_token=8, moe_intermediate_size=2048,
    num_shared_experts=1, first_k_dense_layers=1,
)

_PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256,
        context_len=131072,
    ),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": dict(
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256,
        context_len=131072,
    ),
    # Qwen/Qwen3-32B config.json (head_dim 128 is explicit there; 64 * 128 != hidden 5120)
    "qwen3-32b": dict(
        num_layers=64, hidden_size=5120, num_attention_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=25600, vocab_size=151936,
        qk_norm=True, context_len=40960,
    ),
    # deepseek-ai/DeepSeek-V3 config.json; its weights are published in FP8 (block-wise
    # quantization_config, 128x128 blocks), which is how SGLang serves them; the embedding and
    # LM head stay BF16 in that checkpoint.
    "deepseek-v3": dict(
        num_layers=61, hidden_size=7168, num_attention_heads=128, num_kv_heads=128,
        head_dim=192, intermediate_size=18432, vocab_size=129280, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        q_lora_rank=1536, num_experts=256, experts_per_token=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_k_dense_layers=3,
        precision=Precision(attention="fp8", dense_mlp="fp8", moe_experts="fp8"),
        context_len=163840,
    ),
    # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's architecture with 384 experts,
    # 64 heads, one dense layer and a 163,840-token vocabulary; published in block FP8 like
    # DeepSeek-V3 (BF16 embedding and LM head).
    "kimi-k2": dict(
        **_KIMI_K2_SHAPE,
        precision=Precision(attention="fp8", dense_mlp="fp8", moe_experts="fp8"),
        context_len=131072,
    ),
    # moonshotai/Kimi-K2-Thinking config.json: Kimi-K2's shapes, a 262,144-token context, and
    # compressed-tensors int4 routed experts (W4A16, group 32, symmetric: BF16 scales); its
    # `ignore` keeps attention, the dense MLP, the shared expert and the LM head BF16 (the
    # shared expert is priced with the routed ones: one `moe_experts` block, < 0.3 % of them).
    "kimi-k2-thinking": dict(
        **_KIMI_K2_SHAPE,
        precision=Precision(moe_experts="w4a16_g32"),
        context_len=262144,
    ),
    # Qwen/Qwen3-235B-A22B config.json (Qwen3MoeForCausalLM: 128 experts, top 8, no shared
    # expert, every layer MoE: decoder_sparse_step 1, mlp_only_layers []); BF16 weights.
    "qwen3-235b-a22b": dict(
        num_layers=94, hidden_size=4096, num_attention_heads=64, num_kv_heads=4, head_dim=128,
        intermediate_size=12288, vocab_size=151936, num_experts=128, experts_per_token=8,
        moe_intermediate_size=1536,
        qk_norm=True, context_len=40960,
    ),
    # Qwen/Qwen3-30B-A3B config.json (the same family, smaller).
    "qwen3-30b-a3b": dict(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_kv_heads=4, head_dim=128,
        intermediate_size=6144, vocab_size=151936, num_experts=128, experts_per_token=8,
        moe_intermediate_size=768,
        qk_norm=True, context_len=40960,
    ),
    # Qwen/Qwen2.5-7B-Instruct config.json (28 heads of 128 over hidden 3584).
    "qwen2.5-7b": dict(
        num_layers=28, hidden_size=3584, num_attention_heads=28, num_kv_heads=4, head_dim=128,
        intermediate_size=18944, vocab_size=152064,
        context_len=32768,
    ),
    # openai/gpt-oss-120b config.json: layer_types alternate sliding_attention (window 128)
    # and full_attention, starting with sliding; 128 experts of 2880, top 4, every layer MoE;
    # experts published in MXFP4 (its quantization_config converts every MLP; none is dense),
    # attention, router, embedding and LM head in BF16. Its
    # attention sinks and biases are not modelled (< 0.01 % of its parameters).
    "gpt-oss-120b": dict(
        num_layers=36, hidden_size=2880, num_attention_heads=64, num_kv_heads=8, head_dim=64,
        intermediate_size=2880, vocab_size=201088, num_experts=128, experts_per_token=4,
        moe_intermediate_size=2880, layer_pattern=("sliding_attention", "full_attention"),
        sliding_window=128, precision=Precision(dense_mlp="mxfp4", moe_experts="mxfp4"),
        context_len=131072,
    ),
    # openai/gpt-oss-20b config.json: the same with 24 layers and 32 experts.
    "gpt-oss-20b": dict(
        num_layers=24, hidden_size=2880, num_attention_heads=64, num_kv_heads=8, head_dim=64,
        intermediate_size=2880, vocab_size=201088, num_experts=32, experts_per_token=4,
        moe_intermediate_size=2880, layer_pattern=("sliding_attention", "full_attention"),
        sliding_window=128, precision=Precision(dense_mlp="mxfp4", moe_experts="mxfp4"),
        context_len=131072,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: full_attention_interval 4 (three Gated
    # DeltaNet layers, then one full-attention layer); 512 experts of 512, top 10, one shared
    # expert of 512 (shared_expert_intermediate_size), every layer MoE; BF16. The SSM state
    # stays fp32 (SGLang's --mamba-ssm-dtype default). Not modelled: the gate doubling the
    # full-attention layers' q_proj (0.13 % of the parameters).
    "qwen3-next-80b-a3b": dict(
        num_layers=48, hidden_size=2048, num_attention_heads=16, num_kv_heads=2, head_dim=256,
        intermediate_size=5120, vocab_size=151936, num_experts=512, experts_per_token=10,
        moe_intermediate_size=512, num_shared_experts=1,
        layer_pattern=("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        qk_norm=True, context_len=262144,
    ),
    # Qwen/Qwen2.5-72B-Instruct config.json.
    "qwen2.5-72b": dict(
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=29568, vocab_size=152064,
        context_len=32768,
    ),
}


# Checkpoints whose config.json gives another preset's architecture, shapes and weight format
# (they differ in training, not in what a forward costs): the alias is that preset, renamed.
_ALIASES: dict[str, str] = {
    "deepseek-r1": "deepseek-v3",  # deepseek-ai/DeepSeek-R1 (and -0528): DeepSeek-V3's config
    "deepseek-v3.1": "deepseek-v3",  # deepseek-ai/DeepSeek-V3.1: the same
    "llama-3.3-70b": "llama-3.1-70b",  # meta-llama/Llama-3.3-70B-Instruct: Llama-3.1-70B's
}


# The Hugging Face repository of each preset's checkpoint: what SGLang's --model-path takes.
PRESET_REPOS: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "deepseek-v3.1": "deepseek-ai/DeepSeek-V3.1",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "kimi-k2-thinking": "moonshotai/Kimi-K2-Thinking",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct",
}


def model_preset_names() -> list[str]:
    return sorted({*_PRESETS, *_ALIASES, *SERVABLE_HF_CONFIGS})


def model_preset(name: str) -> ModelSpec:
    """The preset called `name`; ValueError listing the presets otherwise."""
    if name in SERVABLE_HF_CONFIGS:
        return model_spec_from_hf_config(SERVABLE_HF_CONFIGS[name], name)
    try:
        fields = _PRESETS[_ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; presets: {', '.join(model_preset_names())}"
        ) from None
    return ModelSpec(name=name, **fields)


# ----- Hugging Face config.json ----------------------------------------------------------------

_GQA_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# Whose SGLang attention normalises q and k per head (q_norm/k_norm) with no config key for it;
# GLM-4.5 and after say so in `use_qk_norm`.
_QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"})
# Kimi-K2 checkpoints name DeepseekV3ForCausalLM (model_type "kimi_k2"): the same shapes.
_MLA_ARCHS = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Vision-language checkpoints priced by their text model (`text_config`; the vision encoder,
# which only images and video reach, is not priced): the wrapper's architecture -> the text one.
_MULTIMODAL_ARCHS = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",  # Kimi-K2.5 and after
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Glm4vMoeForConditionalGeneration": "Glm4MoeForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(sorted({**_GQA_ARCHS, **_MLA_ARCHS, **_MULTIMODAL_ARCHS}))


def model_spec_from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """A spec from the dict of an HF `config.json` (Llama, Mistral, Qwen2/3, Qwen2/3-MoE,
    Mixtral, gpt-oss, MiniMax-M2, GLM-4.5/4.6/4.7, Qwen3-Next, DeepSeek-V2/V3 and Kimi-K2);
    weight formats from its `quantization_config`. A vision-language checkpoint's text model
    (Kimi-K2.5, Qwen3-VL, GLM-4.5V) reads as that model."""
    config = _text_model_config(config)
    arch = _architecture_of(config)
    h = _req(config, "hidden_size")
    heads = _req(config, "num_attention_heads")
    fields: dict[str, Any] = dict(
        name=name,
        num_layers=_req(config, "num_hidden_layers"),
        hidden_size=h,
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=_req(config, "intermediate_size"),
        vocab_size=_req(config, "vocab_size"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        precision=precision_from_hf_config(config),
        context_len=config.get("max_position_embeddings"),
    )
    if arch in _MLA_ARCHS:
        nope, rope = _req(config, "qk_nope_head_dim"), _req(config, "qk_rope_head_dim")
        fields.update(
            attention="mla",
            head_dim=nope + rope,
            kv_lora_rank=_req(config, "kv_lora_rank"),
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=_req(config, "v_head_dim"),
            q_lora_rank=config.get("q_lora_rank"),
        )
        if config.get("n_routed_experts"):
            fields.update(_deepseek_moe_fields(config, name))
    else:
        fields["head_dim"] = config.get("head_dim") or h // heads
        if config.get("num_experts"):
            fields.update(_qwen_moe_fields(config, fields["num_layers"]))
        elif config.get("n_routed_experts"):  # GLM-4.5 and after: DeepSeek's MoE keys
            fields.update(_deepseek_moe_fields(config, name))
        elif config.get("num_local_experts"):
            # Mixtral, gpt-oss, MiniMax-M2: every layer MoE, experts of `intermediate_size`
            fields.update(num_experts=config["num_local_experts"],
                          experts_per_token=_req(config, "num_experts_per_tok"),
                          moe_intermediate_size=fields["intermediate_size"])
        fields.update(_hybrid_fields(config, fields["num_layers"]))
        fields["qk_norm"] = bool(config.get("use_qk_norm", arch in _QK_NORM_ARCHS))
    return ModelSpec(**fields)


def _text_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A vision-language checkpoint's `text_config` as a text model's config (the wrapper's
    keys, such as its `quantization_config`, where the text config has none); any other
    config as it is."""
    text_arch = next((_MULTIMODAL_ARCHS[a] for a in config.get("architectures") or []
                      if a in _MULTIMODAL_ARCHS), None)
    if text_arch is None:
        return config
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{config['architectures']} without a text_config mapping")
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **text, "architectures": [text_arch]}


_STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# config.json keys of a linear-attention layer's state dtypes, with SGLang's defaults: the SSM
# state's `mamba_ssm_dtype` (float32), and the convolution state's (SGLang takes it from
# SGLANG_MAMBA_CONV_DTYPE, default bfloat16; pdsim reads it from the config under this key).
STATE_DTYPE_KEYS = (("mamba_ssm_dtype", "float32", "recurrent_state_dtype_bytes"),
                    ("mamba_conv_dtype", "bfloat16", "conv_state_dtype_bytes"))


def _hybrid_fields(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """A hybrid model's layer kinds: HF's `layer_types` (or Qwen3-Next's
    `full_attention_interval`) as its shortest repeating pattern, and the fields its kinds need."""
    types = config.get("layer_types")
    if types is None and config.get("full_attention_interval"):
        interval = config["full_attention_interval"]
        types = (["linear_attention"] * (interval - 1) + ["full_attention"]) * num_layers
        types = types[:num_layers]
    if not types:
        return {}
    known = get_args(LayerType)
    unknown = sorted({t for t in types} - set(known))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not modelled; known: {', '.join(known)}")
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    period = next(p for p in range(1, num_layers + 1)
                  if all(t == types[i % p] for i, t in enumerate(types)))
    fields: dict[str, Any] = {"layer_pattern": tuple(types[:period])}
    if "sliding_attention" in types:
        fields["sliding_window"] = _req(config, "sliding_window")
    if "linear_attention" in types:
        fields.update({name: _req(config, name) for name in LINEAR_FIELDS})
        for key, default, field in STATE_DTYPE_KEYS:
            dtype = config.get(key, default)
            if dtype not in _STATE_DTYPE_BYTES:
                raise ValueError(f"{key} {dtype!r}; known: {', '.join(_STATE_DTYPE_BYTES)}")
            fields[field] = _STATE_DTYPE_BYTES[dtype]
    return fields


def _deepseek_moe_fields(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """DeepSeek's MoE keys (DeepSeek-V2/V3, Kimi-K2, GLM-4.5 and after): the first
    `first_k_dense_replace` layers dense, every other layer MoE."""
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{name}: moe_layer_freq != 1 is not supported")
    return dict(
        num_experts=config["n_routed_experts"],
        experts_per_token=_req(config, "num_experts_per_tok"),
        moe_intermediate_size=_req(config, "moe_intermediate_size"),
        num_shared_experts=config.get("n_shared_experts") or 0,
        first_k_dense_layers=config.get("first_k_dense_replace", 0),
    )


def _qwen_moe_fields(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen-MoE experts: layer i is MoE when (i + 1) is a multiple of `decoder_sparse_step`
    and i is not in `mlp_only_layers`; the others are dense (counted, not placed)."""
    step = config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(num_layers) if (i + 1) % step == 0 and i not in dense_only)
    moe_size = _req(config, "moe_intermediate_size")
    shared_size = config.get("shared_expert_intermediate_size") or 0
    if shared_size % moe_size:
        raise ValueError(
            f"shared_expert_intermediate_size ({shared_size}) must be a multiple of "
            f"moe_intermediate_size ({moe_size}): shared experts are priced as routed-size ones"
        )
    return dict(
        num_experts=config["num_experts"],
        experts_per_token=_req(config, "num_experts_per_tok"),
        moe_intermediate_size=moe_size,
        num_shared_experts=shared_size // moe_size,
        first_k_dense_layers=num_layers - moe_layers,
    )


def load_model_spec(
    spec: str | Path | Mapping[str, Any], base_dir: str | Path | None = None
) -> ModelSpec:
    """A preset by name; an HF `config.json` (or a directory holding one); a YAML file of
    `ModelSpec` fields; or a dict of those fields.

    A dict (or YAML file) may start from `base: <preset or file>` and override some fields
    (`precision` merges key by key); it keeps the base's name unless it gives one. A relative
    path is looked for under `base_dir` (the experiment's folder), then the current directory.
    A spec read from a file is named after it (a config.json after its directory).
    """
    if isinstance(spec, Mapping):
        return _from_fields(spec, "model", base_dir)
    if isinstance(spec, str) and spec in model_preset_names():
        return model_preset(spec)
    path, tried = find_spec_file(spec, base_dir, dirs=True)
    if path is not None and path.is_dir():
        path = path / "config.json" if (path / "config.json").is_file() else None
    if path is None:
        raise ValueError(
            not_found("model", spec, model_preset_names(), tried,
                      "a config.json (or its directory) or a YAML file of ModelSpec fields")
        )
    if path.suffix in (".yaml", ".yml"):
        return _from_fields(read_spec_yaml(path, "ModelSpec"), str(path), path.parent)
    config = read_mapping(path, "a JSON object", as_json=True)
    modelopt = path.parent / "hf_quant_config.json"  # where ModelOpt checkpoints keep it
    if "quantization_config" not in config and modelopt.is_file():
        config["quantization_config"] = {"quant_method": "modelopt",
                                         **read_mapping(modelopt, "a JSON object", as_json=True)}
    name = path.parent.name if path.name == "config.json" else path.stem
    try:
        return model_spec_from_hf_config(config, name=name or path.stem)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _from_fields(data: Mapping[str, Any], where: str, base_dir: str | Path | None) -> ModelSpec:
    fields = dict(data)
    base = fields.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"{where}: base must be a preset name or a file, got {base!r}")
        base_fields = load_model_spec(base, base_dir).model_dump()
        if "weight_dtype_bytes" in fields:  # one width for every block replaces the base's
            base_fields.pop("precision")
        fields = merge_fields(base_fields, fields)
    return validate_fields(ModelSpec, fields, where)


def _architecture_of(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    known = {**_GQA_ARCHS, **_MLA_ARCHS}
    for arch in archs:
        if arch in known:
            return arch
    if not archs:  # no architectures list: fall back on model_type
        by_type = {mtype: arch for arch, mtype in known.items()}
        if config.get("model_type") in by_type:
            return by_type[config["model_type"]]
    model_type = config.get("model_type")
    raise ValueError(
        f"unsupported architecture {archs or model_type!r}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _req(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return config[key]
