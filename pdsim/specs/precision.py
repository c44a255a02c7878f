"""Number formats a deployment runs in, and what each costs a cost model.

A model's weights need not share one format: published DeepSeek deployments run BF16 attention
with FP8 (Hopper) or NVFP4 (Blackwell) experts, and GPTQ/AWQ checkpoints hold int4 weights that
are widened to BF16 inside the GEMM (W4A16). `Precision` names the format of each block;
`DTYPES` says how many bytes a weight takes and which tensor-core peak the GEMM runs at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from pdsim.specs.hardware import HardwareSpec

DTypeName = Literal[
    "bf16", "fp16", "fp8", "fp8_tensor", "int8", "w4a16", "w4a16_g32", "nvfp4", "mxfp4"
]
ComputeName = Literal["bf16", "fp8"]


@dataclass(frozen=True)
class DType:
    """weight_bytes: bytes per weight element, scales included (block scales add ~1/16 B for
    FP4's 16-element blocks). compute: the tensor-core peak a GEMM with these weights runs at
    ("bf16", "fp8", "fp4"); W4A16 dequantises to BF16, so it reads 0.5 B but computes BF16."""

    name: str
    weight_bytes: float
    compute: Literal["bf16", "fp8", "fp4"]


DTYPES: dict[str, DType] = {
    "bf16": DType("bf16", 2.0, "bf16"),
    "fp16": DType("fp16", 2.0, "bf16"),
    "fp8": DType("fp8", 1.0, "fp8"),  # 128x128 block scales (DeepSeek-V3, Qwen3-FP8): DeepGEMM
    # per-tensor or per-channel scales (ModelOpt FP8, FP8-dynamic, --quantization fp8 online):
    # SGLang's CUTLASS fp8_scaled_mm, which the kernel tables time apart
    "fp8_tensor": DType("fp8_tensor", 1.0, "fp8"),
    # W8A8 runs on the INT8 peak (`HardwareSpec.int8_tflops`: FP8's on Hopper, Ada, B200/GB200;
    # its own on Ampere, which has no FP8, and on Blackwell Ultra, which cut INT8)
    "int8": DType("int8", 1.0, "fp8"),
    "w4a16": DType("w4a16", 0.5 + 1 / 64, "bf16"),  # GPTQ/AWQ int4, group 128: scale + zero
    # int4, group 32, symmetric (compressed-tensors pack-quantized, Kimi-K2-Thinking's experts):
    # one BF16 scale per 32 weights, no zero point -- SGLang's CompressedTensorsWNA16MoE
    # (Marlin) and CompressedTensorsMxInt4MoE (trtllm-gen, Blackwell) both keep BF16 scales
    "w4a16_g32": DType("w4a16_g32", 0.5 + 2 / 32, "bf16"),
    "nvfp4": DType("nvfp4", 0.5 + 1 / 16, "fp4"),  # E2M1, one FP8 scale per 16 elements
    "mxfp4": DType("mxfp4", 0.5 + 1 / 32, "fp4"),  # E2M1, one E8M0 scale per 32 elements
}


# KV-cache dtypes by the names SGLang's --kv-cache-dtype takes ("fp8" is its E4M3) -> bytes.
KV_DTYPE_BYTES: dict[str, float] = {
    "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
KVDTypeName = Literal["bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"]


def kv_format(name: str) -> str:
    """The KV dtype `name` stands for ("fp8" is SGLang's name for E4M3)."""
    return "fp8_e4m3" if name == "fp8" else name


class Precision(BaseModel):
    """The format of each block of a model's weights, and of attention's arithmetic.

    attention: QKV/O projections (MLA's down/up projections too). dense_mlp: the MLP of dense
    layers. moe_experts: routed and shared experts. lm_head: the output projection.
    attention_compute: the attention kernel's arithmetic ("fp8": FP8 attention, as with an FP8
    KV cache in FlashInfer/FA3); the KV cache's own dtype is set per role, not here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: DTypeName = "bf16"
    dense_mlp: DTypeName = "bf16"
    moe_experts: DTypeName = "bf16"
    lm_head: DTypeName = "bf16"
    attention_compute: ComputeName = "bf16"

    @classmethod
    def uniform(cls, dtype: DTypeName) -> Precision:
        """Every block in `dtype` (the LM head stays BF16 unless the dtype is 16-bit anyway)."""
        return cls(attention=dtype, dense_mlp=dtype, moe_experts=dtype)


# Formats SGLang also runs weight-only where the GPU lacks their tensor cores: MXFP4 experts
# (gpt-oss) upcast to BF16 inside its Hopper/Ampere MoE kernels, measured as `w4a16_mxfp4` in
# the H100/H200 kernel tables.
WEIGHT_ONLY_ON = {"mxfp4": "bf16"}


def compute_on(dtype: str, hardware: HardwareSpec) -> str:
    """The arithmetic ("bf16", "fp8", "fp4") a GEMM with `dtype` weights runs in on
    `hardware`: the format's own, or BF16 where SGLang runs it weight-only (WEIGHT_ONLY_ON)."""
    compute = DTYPES[dtype].compute
    if compute == "fp4" and hardware.fp4_tflops is None and dtype in WEIGHT_ONLY_ON:
        return WEIGHT_ONLY_ON[dtype]
    return compute


def gemm_peak_tflops(dtype: str, hardware: HardwareSpec) -> float:
    """The dense tensor-core peak a GEMM with `dtype` weights runs at on `hardware`.

    A format the GPU has no tensor cores for, and SGLang does not run weight-only, is an error,
    never a silent fallback: FP8 on A100, NVFP4 before Blackwell."""
    compute = compute_on(dtype, hardware)
    if compute == "bf16":
        return hardware.bf16_tflops
    if dtype == "int8" and hardware.int8_tflops is not None:
        return hardware.int8_tflops
    peak = hardware.fp8_tflops if compute == "fp8" else hardware.fp4_tflops
    if peak is None:
        raise ValueError(
            f"{dtype} weights need {compute.upper()} tensor cores, which {hardware.name} lacks; "
            f"use a format it supports (bf16, fp16, w4a16, mxfp4"
            + (", fp8" if hardware.fp8_tflops else "")
            + (", int8" if hardware.fp8_tflops or hardware.int8_tflops else "")
            + ")"
        )
    return peak
