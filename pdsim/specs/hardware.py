"""What one GPU offers a cost model: peak compute, memory, and its links.

All numbers are per GPU and as the vendor publishes them (peaks, not measured); the cost
models apply efficiency factors. Bandwidths are in GB/s (10^9 bytes/s); NVLink and the NIC are
unidirectional, the direction one transfer uses. Each preset names its sources in `source`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class HardwareSpec(BaseModel):
    """One GPU model as a cost model sees it.

    bf16_tflops: dense BF16 tensor-core peak (no 2:4 sparsity).
    fp8_tflops: dense FP8 peak, None where the GPU has no FP8 tensor cores.
    fp4_tflops: dense FP4 (NVFP4/MXFP4) peak, None before Blackwell.
    hbm_gib: memory capacity (the datasheet's figure; the driver keeps ~1 % of it).
    hbm_gbps: peak memory bandwidth.
    nvlink_gbps: NVLink bandwidth per GPU, one direction.
    rdma_gbps: per-GPU NIC bandwidth typical of the platform (400 Gb/s = 50 GB/s).
    gpus_per_node: GPUs in one NVLink domain (8 in an HGX board, 72 in a GB200 NVL72 rack);
        traffic between GPUs of one domain takes NVLink, beyond it RDMA.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = Field(default=None, gt=0)
    fp4_tflops: float | None = Field(default=None, gt=0)
    hbm_gib: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    nvlink_gbps: float = Field(gt=0)
    rdma_gbps: float = Field(gt=0)
    gpus_per_node: int = Field(default=8, ge=1)
    source: str = ""

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)


_PRESETS: dict[str, dict[str, Any]] = {
    "a100": dict(
        bf16_tflops=312, fp8_tflops=None, hbm_gib=80, hbm_gbps=2039, nvlink_gbps=300,
        rdma_gbps=25,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16 312 TFLOPS dense "
            "(624 with sparsity), 80GB HBM2e, 2,039 GB/s, NVLink 600 GB/s (both directions); "
            "DGX A100 datasheet: one 200 Gb/s ConnectX-6 HDR InfiniBand port per GPU"
        ),
    ),
    "h100": dict(
        bf16_tflops=989, fp8_tflops=1979, hbm_gib=80, hbm_gbps=3350, nvlink_gbps=450,
        rdma_gbps=50,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 1,979 and FP8 3,958 "
            "TFLOPS with sparsity (dense is half), 80GB HBM3, 3.35 TB/s, NVLink 900 GB/s (both "
            "directions); DGX H100 datasheet: one 400 Gb/s ConnectX-7 port per GPU"
        ),
    ),
    "h200": dict(
        bf16_tflops=989, fp8_tflops=1979, hbm_gib=141, hbm_gbps=4800, nvlink_gbps=450,
        rdma_gbps=50,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979 and FP8 3,958 "
            "TFLOPS with sparsity (dense is half), 141GB HBM3e, 4.8 TB/s, NVLink 900 GB/s "
            "(both directions); HGX H200 platforms: one 400 Gb/s ConnectX-7 port per GPU"
        ),
    ),
    "h20": dict(
        bf16_tflops=148, fp8_tflops=296, hbm_gib=96, hbm_gbps=4000, nvlink_gbps=450,
        rdma_gbps=50,
        source=(
            "NVIDIA HGX H20 product brief (China market, as widely republished): BF16 148 "
            "TFLOPS and FP8 296 TFLOPS dense, 96GB HBM3, 4.0 TB/s, NVLink 900 GB/s (both "
            "directions); H20 servers ship with 400 Gb/s ConnectX-7 NICs, one per GPU"
        ),
    ),
    "b200": dict(
        bf16_tflops=2250, fp8_tflops=4500, hbm_gib=180, hbm_gbps=8000, nvlink_gbps=900,
        rdma_gbps=50,
        source=(
            "NVIDIA HGX B200 / DGX B200 datasheets, per GPU (8-GPU totals / 8): BF16 36 PFLOPS "
            "and FP8 72 PFLOPS with sparsity -> 2.25 / 4.5 PFLOPS dense, 1,440GB HBM3e -> "
            "180GB, 64 TB/s -> 8 TB/s, NVLink 5 1.8 TB/s (both directions); DGX B200: one "
            "400 Gb/s ConnectX-7 port per GPU"
        ),
    ),
}


def hardware_preset_names() -> list[str]:
    return sorted(_PRESETS)


def load_hardware_spec(spec: str | Path | Mapping[str, Any]) -> HardwareSpec:
    """A preset by name, a YAML file holding the fields of `HardwareSpec`, or a dict of them.

    Unknown names, missing files and bad fields raise ValueError naming the input, the field
    and (for names) the presets.
    """
    if isinstance(spec, Mapping):
        return _validate(dict(spec), where="hardware spec")
    if isinstance(spec, str) and spec in _PRESETS:
        return HardwareSpec(name=spec, **_PRESETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"unknown hardware {str(spec)!r}: not a preset "
            f"({', '.join(hardware_preset_names())}) nor a YAML file"
        )
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of HardwareSpec fields")
    data.setdefault("name", path.stem)
    return _validate(data, where=str(path))


def _validate(data: dict[str, Any], where: str) -> HardwareSpec:
    try:
        return HardwareSpec.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
            + (f" (got {e['input']!r})" if e["type"] != "missing" else "")
            for e in err.errors()
        )
        allowed = ", ".join(HardwareSpec.model_fields)
        raise ValueError(f"{where}: {problems}; fields: {allowed}") from None
