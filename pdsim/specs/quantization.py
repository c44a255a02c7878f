"""A Hugging Face checkpoint's weight formats, read from its `config.json`, as a `Precision`.

The quantised blocks are the transformer's linear layers (attention, dense MLPs, experts); the
LM head, and whatever the config lists as not converted (`modules_to_not_convert`,
`ignored_layers`, `ignore`, `exclude_modules`), keep the checkpoint's own dtype. A block counts
as not converted when any listed name falls in it: the precision is per block, not per layer.
A method pdsim cannot price is an error naming it, never a guess: before this, int4 GPTQ
weights were silently priced as FP8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdsim.specs.precision import DTypeName, Precision

# An unquantised checkpoint's dtype -> the format it is served in (float32 is served as BF16).
CHECKPOINT_DTYPES: dict[str, DTypeName] = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "bf16",
}
PRICEABLE_METHODS = (
    "fp8 (block or per-tensor)",
    "modelopt, modelopt_fp8, modelopt_fp4 (quant_algo FP8, NVFP4)",
    "compressed-tensors (fp8, int8 W8A8, int4 W4A16 group 128 or 32, nvfp4, mxfp4)",
    "gptq / awq (4-bit, W4A16)",
    "mxfp4",
)
_EXCLUDE_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules")
# NVIDIA ModelOpt checkpoints: `quant_method` "modelopt" names the format in `quant_algo`;
# SGLang's per-format names ("modelopt_fp8", "modelopt_fp4", its quantization configs' names,
# which some checkpoints write as their quant_method) imply it.
_MODELOPT_ALGOS: dict[str, DTypeName] = {"FP8": "fp8_tensor", "NVFP4": "nvfp4"}
_MODELOPT_METHODS: dict[str, str | None] = {
    "modelopt": None, "modelopt_fp8": "FP8", "modelopt_fp4": "NVFP4",
}


def precision_from_hf_config(config: Mapping[str, Any]) -> Precision:
    """The weight format of each block of the checkpoint `config` describes."""
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(
            f"unsupported torch_dtype {dtype!r}; known: {', '.join(CHECKPOINT_DTYPES)}"
        )
    plain = CHECKPOINT_DTYPES[dtype]
    quant = config.get("quantization_config")
    if not quant:
        return Precision(attention=plain, dense_mlp=plain, moe_experts=plain, lm_head=plain)
    if not isinstance(quant, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {quant!r}")
    if isinstance(quant.get("quantization"), Mapping):  # ModelOpt's hf_quant_config.json form
        quant = {**quant, **quant["quantization"]}
    quantised = _quantised_dtype(quant)
    excluded = [str(n).lower() for key in _EXCLUDE_KEYS for n in (quant.get(key) or [])]
    blocks = {
        block: plain if any(_in_block(name, block) for name in excluded) else quantised
        for block in ("attention", "dense_mlp", "moe_experts")
    }
    return Precision(**blocks, lm_head=plain)


def _quantised_dtype(quant: Mapping[str, Any]) -> DTypeName:
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":  # block scales where the config gives a block, else per tensor
        return "fp8" if quant.get("weight_block_size") else "fp8_tensor"
    if method == "mxfp4":
        return "mxfp4"
    if method in ("gptq", "awq"):
        bits = quant.get("bits", quant.get("w_bit"))
        if bits == 4:
            return _int4_format(quant.get("group_size", quant.get("q_group_size")))
        raise _unpriceable(f"{method} with {bits} bits")
    if method in _MODELOPT_METHODS:
        implied = _MODELOPT_METHODS[method]
        algo = str(quant.get("quant_algo") or implied or "").upper()
        if implied and algo != implied:
            raise _unpriceable(f"{method} with quant_algo {algo!r} (it stores {implied})")
        if algo in _MODELOPT_ALGOS:
            return _MODELOPT_ALGOS[algo]
        raise _unpriceable(f"modelopt quant_algo {algo or None!r}")
    if method == "compressed-tensors":
        return _compressed_tensors_dtype(quant)
    raise _unpriceable(f"quant_method {method or None!r}")


def _compressed_tensors_dtype(quant: Mapping[str, Any]) -> DTypeName:
    """One format for all `config_groups` (a checkpoint mixing schemes is not priced)."""
    groups = quant.get("config_groups") or {}
    schemes = {_scheme_dtype(g) for g in groups.values() if isinstance(g, Mapping)}
    if len(schemes) != 1:
        raise _unpriceable(
            "compressed-tensors with "
            + ("no config_groups" if not schemes else f"mixed schemes {sorted(schemes)}")
        )
    return schemes.pop()


def _scheme_dtype(group: Mapping[str, Any]) -> DTypeName:
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    act_bits = acts.get("num_bits")
    if kind == "float" and bits == 8:  # strategy "block", else per tensor or channel
        return "fp8" if weights.get("strategy") == "block" else "fp8_tensor"
    if kind == "float" and bits == 4:
        return "mxfp4" if weights.get("group_size") == 32 else "nvfp4"
    if kind == "int" and bits == 4 and act_bits in (None, 16):
        return _int4_format(weights.get("group_size"))
    if kind == "int" and bits == 8 and act_bits == 8:
        return "int8"
    act = f"A{act_bits}" if act_bits else "A16"
    raise _unpriceable(f"compressed-tensors {kind} W{bits}{act}")


def _int4_format(group_size: Any) -> DTypeName:
    """int4 weight-only weights by their scale group: group 32 or finer carries one 16-bit
    scale per 32 weights (`w4a16_g32`, 0.5625 B a weight: Kimi-K2-Thinking's experts); coarser
    groups (128, the GPTQ/AWQ default; 64; per channel) are priced as group 128 (`w4a16`)."""
    if isinstance(group_size, int) and 0 < group_size <= 32:
        return "w4a16_g32"
    return "w4a16"


def _in_block(name: str, block: str) -> bool:
    """Whether a not-converted module name (or pattern) falls in `block`."""
    if block == "attention":
        return "attn" in name or "attention" in name
    if block == "moe_experts":  # the routed experts; a shared expert alone does not count
        return "expert" in name.replace("shared_expert", "")
    # dense MLP projections, not a MoE layer's router (`mlp.gate`)
    router = name.rstrip("*$").endswith((".gate", "router"))
    return "mlp" in name and "expert" not in name and not router


def _unpriceable(what: str) -> ValueError:
    return ValueError(
        f"quantization_config: {what} is not a format pdsim can price; it prices "
        + "; ".join(PRICEABLE_METHODS)
        + " (or set the model's precision per block)"
    )
