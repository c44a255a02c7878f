"""What one GPU offers a cost model: peak compute, memory, and its links.

All numbers are per GPU and as the vendor publishes them (peaks, not measured); the cost
models apply efficiency factors. Bandwidths are in GB/s (10^9 bytes/s); NVLink and the NIC are
unidirectional, the direction one transfer uses. Each preset names its sources in `source`, and
its rental price's in `price_source`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdsim.specs.sources import (
    find_spec_file, merge_fields, not_found, read_spec_yaml, validate_fields,
)


class HardwareSpec(BaseModel):
    """One GPU model as a cost model sees it.

    bf16_tflops: dense BF16 tensor-core peak (no 2:4 sparsity).
    fp8_tflops: dense FP8 peak, None where the GPU has no FP8 tensor cores.
    fp4_tflops: dense FP4 (NVFP4/MXFP4) peak, None before Blackwell.
    int8_tflops: dense INT8 tensor-core peak (TOPS) for W8A8 int8 GEMMs; None: FP8's (equal
        on Hopper, Ada and Blackwell B200/GB200). Set where they differ: Ampere has INT8 but no
        FP8; Blackwell Ultra (B300, GB300) cut INT8 to a few percent of FP8.
    hbm_gib: memory capacity as the driver reports it (the datasheet's where within 0.5 %).
    hbm_gb_per_s: peak memory bandwidth (GB/s: gigabytes, as every *_gb_per_s).
    nvlink_gb_per_s: NVLink bandwidth per GPU, one direction (PCIe cards: their PCIe link).
    rdma_gb_per_s: per-GPU NIC bandwidth typical of the platform (400 Gb/s = 50 GB/s).
    gpus_per_node: GPUs in one NVLink domain (8 in an HGX board, 72 in a GB200 NVL72 rack);
        traffic between GPUs of one domain takes NVLink, beyond it RDMA.
    gpus_per_host: GPUs in one host, the machine one server process group runs on (8 on an
        HGX board; 4 on a GB200/GB300 compute tray, 18 of which make the NVL72 domain): an
        instance over more spans hosts (SGLang's --nnodes). None: the NVLink domain's.
    host_link_gb_per_s: the GPU's link to its host's memory, one direction: PCIe Gen4 x16 32,
        Gen5 x16 64 (the default), NVLink-C2C to a Grace CPU 450 (900 both ways). A PD
        decode instance's retraction copies KV pages over it (pdsim.core.decode).
    sms: streaming multiprocessors (the CUDA device's multiProcessorCount); two-batch overlap's
        compute shares them with DeepEP's normal-mode kernels. None: the sharing is not priced.
    usd_per_gpu_hour: a rental price for one GPU-hour, None where no public list price was
        found; `price_source` says whose price and when. Prices move: override it.
    silicon_base: the preset of the same die whose measured kernel tables price this GPU in
        the silicon cost model: each compute op moved by the ratio of its roofline on the two
        GPUs' peaks (H800 <- H100, the same peaks; H20 <- H100, 15 % of its FLOPs), the
        communication at this GPU's own link rates. None: its own tables, if any.
    hbm_share: the share of `hbm_gb_per_s` this GPU's kernels stream at, beside what other
        GPUs' kernels reach of theirs (the tables and efficiency constants come from full
        dies): 1, but for a die whose SMs cannot fill its HBM (the H20: 78 of the GH100's 132);
        `stream_gb_per_s` is the rate every time estimate reads.
    roofline_share: with a silicon_base, the share of its roofline this GPU's kernels are
        measured to reach; a moved op runs at least that well here (never faster than on the
        base): the base's inefficiency at a compute-bound shape is not carried to a GPU of a
        fraction of its FLOPs. None: moved by the roofline ratio alone.
    host_time_scale: how long the system's host CPU takes over SGLang's eager forward (the
        launches and the Python around them) against the x86 hosts the eager host constants
        were measured on: 1, but 1.6 for the Grace CPU of GB200/GB300 (GRACE_HOST_TIME_SCALE).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = Field(default=None, gt=0)
    fp4_tflops: float | None = Field(default=None, gt=0)
    int8_tflops: float | None = Field(default=None, gt=0)
    hbm_gib: float = Field(gt=0)
    hbm_gb_per_s: float = Field(gt=0)
    nvlink_gb_per_s: float = Field(gt=0)
    rdma_gb_per_s: float = Field(gt=0)
    gpus_per_node: int = Field(default=8, ge=1)
    gpus_per_host: int | None = Field(default=None, ge=1)
    host_link_gb_per_s: float = Field(default=64, gt=0)
    sms: int | None = Field(default=None, ge=1)
    usd_per_gpu_hour: float | None = Field(default=None, gt=0)
    silicon_base: str | None = None
    hbm_share: float = Field(default=1.0, gt=0, le=1)
    roofline_share: float | None = Field(default=None, gt=0, le=1)
    host_time_scale: float = Field(default=1.0, gt=0)
    source: str = ""
    price_source: str = ""

    @model_validator(mode="before")
    @classmethod
    def _units(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for part in ("hbm", "nvlink", "rdma"):
                if f"{part}_gbps" in data:
                    raise ValueError(f"{part}_gbps is now {part}_gb_per_s (GB/s, gigabytes)")
        return data

    @model_validator(mode="after")
    def _known_base(self) -> HardwareSpec:
        if self.silicon_base is not None and self.silicon_base not in _PRESETS:
            raise ValueError(f"silicon_base {self.silicon_base!r} is not a hardware preset; "
                             f"presets: {', '.join(hardware_preset_names())}")
        if self.roofline_share is not None and self.silicon_base is None:
            raise ValueError("roofline_share applies to ops moved from a silicon_base; give "
                             "one, or leave roofline_share out")
        if self.gpus_per_host is not None and self.gpus_per_node % self.gpus_per_host:
            raise ValueError(f"gpus_per_host {self.gpus_per_host} does not divide the NVLink "
                             f"domain's gpus_per_node {self.gpus_per_node}")
        if self.silicon_base is not None and _PRESETS[self.silicon_base].get("silicon_base"):
            raise ValueError(f"silicon_base {self.silicon_base!r} has a silicon_base itself; "
                             f"name a GPU with its own tables")
        return self

    @property
    def host_gpus(self) -> int:
        """GPUs in one host (`gpus_per_host`, else the NVLink domain)."""
        return self.gpus_per_host or self.gpus_per_node

    @property
    def stream_gb_per_s(self) -> float:
        """The memory rate kernels read and write at, as a datasheet rate (GB/s)."""
        return self.hbm_gb_per_s * self.hbm_share

    @property
    def blackwell(self) -> bool:
        """Blackwell or later: the GPUs with FP4 tensor cores (SGLang picks some kernels by it)."""
        return self.fp4_tflops is not None

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)


_NO_PRICE = "no public on-demand list price in USD found; set usd_per_gpu_hour"
# Compute-bound kernels measured on an H20, share of its 148 TFLOPS BF16 peak:
# FlashAttention-3 forward at 2,048 tokens (flash-attention issue #1310) 0.68-0.73 causal,
# 0.81-0.85 not; FlashMLA decode, 64 heads, 8,192 keys, 3-8 queries a request (FlashMLA
# issue #30) 0.81-0.88. Between the causal kernel prefill runs and the rest; the H100's own
# tables reach 0.35 (the same causal shape) to 0.75 (large GEMMs) of its peak.
H20_ROOFLINE_SHARE = 0.75
# Memory-bound kernels on an H20 stream at about an H100's rate, not 4.0 / 3.35 faster: its 78
# SMs cannot issue loads fast enough to fill its HBM. DeepGEMM's FP8 grouped GEMM (masked, 16-32
# rows a group, n 4,096, k 7,168; DeepGEMM PR #116) 1.67 TB/s at 2 groups, 1.88 at 9, where
# the H100 streams 1.63 TB/s (SGLang's DeepGEMM MoE at 2 experts a GPU, the H100 tables) to
# 2.3 TB/s (DeepGEMM issue #136, a 117 MB weight): 0.8-1.0 of the H100's rate, 2.8 TB/s here.
H20_STREAM_GB_PER_S = 2800
# aiconfigurator's SGLang tables time two blocks of an eager forward where the GPU waits for the
# host, so a row is host time: the MLA attention block (wide-EP context module, 1 token, 128
# heads, up to 256 tokens; medians 517-619 us on the x86 hosts of H100, H200, B200 and B300,
# 858 and 930 us on GB200 and GB300) and the DeepEP MoE core (wide-EP context MoE, uniform
# routing, 32-256 tokens; 321-397 us on x86, 569 and 591 us on Grace). Grace's medians over
# x86's: 1.58 (MLA), 1.61 (MoE); over the same die's x86 systems (B200, B300): 1.66-1.77.
GRACE_HOST_TIME_SCALE = 1.6

# Memory (`hbm_gib`): what SGLang multiplies by --mem-fraction-static is the driver's total
# (torch's total_memory, nvidia-smi's), so a preset keeps that, in GiB. Where the datasheet's
# "GB" is within 0.5 % of it the datasheet figure stays (A100 80 = 81,920 MiB; H100/H800
# 80 against 81,559 MiB; H200 and H20-141G 141 against 143,771; B200 180 against 183,359;
# GB200 186 against 189,471 MiB, aiconfigurator-core 0.12's gb200 file; the H20's 96 is six
# 16 GiB HBM3 stacks, as the H100's 80 is five).
# Where it is not: the A10's and L40S's GDDR6 with ECC on (the default) keep 1/16 for ECC
# (23,028 and 46,068 MiB), and Blackwell Ultra's "288GB" is 275,040 MiB on the B300 and 284,208
# MiB on the GB300 (aiconfigurator-core 0.12's b300_sxm and gb300 files, from nvidia-smi).
# SM counts: NVIDIA's architecture whitepapers (A100 108; GA102 in the A10 72; AD102 in the
# L40S 142; H100 SXM5 132, as in the H800 and H200); the H20 78 (as republished); B200 and
# GB200 148 (their CUDA device properties, as DeepGEMM and FlashMLA report them); B300 and
# GB300 160 (NVIDIA's "Inside NVIDIA Blackwell Ultra" technical blog).
# Host links: PCIe Gen4 x16 (32 GB/s a direction) on the A100, A10 and L40S, Gen5 x16 (64) on
# the Hopper and HGX Blackwell GPUs (their datasheets' "PCIe Gen5: 128GB/s", both directions);
# GB200 and GB300 reach their Grace's memory over NVLink-C2C (900 GB/s both ways).
_PRESETS: dict[str, dict[str, Any]] = {
    "a100": dict(
        host_link_gb_per_s=32,
        sms=108,
        bf16_tflops=312, fp8_tflops=None, int8_tflops=624, hbm_gib=80, hbm_gb_per_s=2039, nvlink_gb_per_s=300,
        rdma_gb_per_s=25, usd_per_gpu_hour=1.30,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16 312 TFLOPS dense "
            "(624 with sparsity), INT8 624 TOPS dense (1,248 with sparsity), 80GB HBM2e, 2,039 GB/s, NVLink 600 GB/s (both directions); "
            "DGX A100 datasheet: one 200 Gb/s ConnectX-6 HDR InfiniBand port per GPU"
        ),
        price_source=(
            "Mercatus-AI cloud GPU pricing guide, May 2026: A100 80GB on specialty clouds "
            "$1.10-1.50 per GPU-hour on demand (midpoint)"
        ),
    ),
    "a10": dict(
        host_link_gb_per_s=32,
        sms=72,
        bf16_tflops=125, fp8_tflops=None, int8_tflops=250, hbm_gib=22.49, hbm_gb_per_s=600, nvlink_gb_per_s=32,
        rdma_gb_per_s=3.125, usd_per_gpu_hour=0.86,
        source=(
            "NVIDIA A10 Tensor Core GPU datasheet: BF16 125 TFLOPS dense (250 with sparsity), "
            "INT8 250 TOPS dense (500 with sparsity), no FP8, 24GB GDDR6, 600 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s (both directions) "
            "-> 32 one way; memory as the driver reports it with ECC on (the default): "
            "23,028 MiB (GDDR6's inline ECC keeps 1/16 of the 24 GiB); the NIC is not in the "
            "datasheet: 25 Gb/s Ethernet per GPU assumed"
        ),
        price_source="Lambda on-demand 1x A10 instance, $0.86/h (list price seen 2026-05-07)",
    ),
    "l40s": dict(
        host_link_gb_per_s=32,
        sms=142,
        bf16_tflops=362, fp8_tflops=733, hbm_gib=44.99, hbm_gb_per_s=864, nvlink_gb_per_s=32,
        rdma_gb_per_s=50, usd_per_gpu_hour=1.95,
        source=(
            "NVIDIA L40S datasheet: BF16 362 TFLOPS and FP8 733 TFLOPS dense (733 / 1,466 "
            "with sparsity), 48GB GDDR6, 864 GB/s, no NVLink: PCIe Gen4 x16 64 GB/s (both "
            "directions) -> 32 one way; memory as the driver reports it with ECC on (the "
            "default): 46,068 MiB (aiconfigurator-core 0.12's l40s system file; GDDR6's inline "
            "ECC keeps 1/16 of the 48 GiB); NIC 400 Gb/s per GPU as in that system file"
        ),
        price_source="Modal on-demand L40S, $1.9512/h (list price seen 2026-05-07)",
    ),
    "h100": dict(
        sms=132,
        bf16_tflops=989, fp8_tflops=1979, hbm_gib=80, hbm_gb_per_s=3350, nvlink_gb_per_s=450,
        rdma_gb_per_s=50, usd_per_gpu_hour=2.95,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 1,979 and FP8 3,958 "
            "TFLOPS with sparsity (dense is half), 80GB HBM3, 3.35 TB/s, NVLink 900 GB/s (both "
            "directions); DGX H100 datasheet: one 400 Gb/s ConnectX-7 port per GPU"
        ),
        price_source=(
            "AIMultiple cloud GPU rental price index, 2026-05-20: H100 on-demand median over "
            "37 providers, $2.95 per GPU-hour"
        ),
    ),
    "h800": dict(
        sms=132,
        bf16_tflops=989, fp8_tflops=1979, hbm_gib=80, hbm_gb_per_s=3350, nvlink_gb_per_s=200,
        rdma_gb_per_s=50, silicon_base="h100",
        source=(
            "NVIDIA H800 SXM (China-market H100): the H100 SXM datasheet's BF16 / FP8 peaks, "
            "80GB HBM3 and 3.35 TB/s, NVLink cut to 400 GB/s (both directions) -> 200 one way; "
            "DeepSeek-V3 technical report (sec. 3.2): H800 nodes with 8 GPUs, InfiniBand 50 "
            "GB/s per GPU (NVLink measured at 160 GB/s)"
        ),
        price_source=_NO_PRICE + " (China-market part)",
    ),
    "h200": dict(
        sms=132,
        bf16_tflops=989, fp8_tflops=1979, hbm_gib=141, hbm_gb_per_s=4800, nvlink_gb_per_s=450,
        rdma_gb_per_s=50, usd_per_gpu_hour=3.50,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979 and FP8 3,958 "
            "TFLOPS with sparsity (dense is half), 141GB HBM3e, 4.8 TB/s, NVLink 900 GB/s "
            "(both directions); HGX H200 platforms: one 400 Gb/s ConnectX-7 port per GPU"
        ),
        price_source=(
            "Nebius AI Cloud on-demand, 1x H200 preset $3.50/h (docs.nebius.com billing "
            "note, October 2025)"
        ),
    ),
    "h20": dict(
        sms=78,
        bf16_tflops=148, fp8_tflops=296, hbm_gib=96, hbm_gb_per_s=4000, nvlink_gb_per_s=450,
        rdma_gb_per_s=50, silicon_base="h100",  # the GH100 die with fewer SMs at lower clocks
        hbm_share=H20_STREAM_GB_PER_S / 4000, roofline_share=H20_ROOFLINE_SHARE,
        source=(
            "NVIDIA HGX H20 product brief (China market, as widely republished): BF16 148 "
            "TFLOPS and FP8 296 TFLOPS dense, 96GB HBM3, 4.0 TB/s, NVLink 900 GB/s (both "
            "directions); H20 servers ship with 400 Gb/s ConnectX-7 NICs, one per GPU"
        ),
        price_source=_NO_PRICE + " (China-market part)",
    ),
    "h20-141g": dict(
        sms=78,
        bf16_tflops=148, fp8_tflops=296, hbm_gib=141, hbm_gb_per_s=4800, nvlink_gb_per_s=450,
        rdma_gb_per_s=50, silicon_base="h200",  # the H200's die and memory, the H20's SMs
        hbm_share=H20_STREAM_GB_PER_S / 4800, roofline_share=H20_ROOFLINE_SHARE,
        source=(
            "NVIDIA H20 141GB (the 2024 HBM3e refresh of the HGX H20 product brief, as widely "
            "republished): the H20's BF16 148 / FP8 296 TFLOPS dense, 141GB HBM3e at 4.8 "
            "TB/s, NVLink 900 GB/s (both directions); one 400 Gb/s ConnectX-7 port per GPU"
        ),
        price_source=_NO_PRICE + " (China-market part)",
    ),
    "b200": dict(
        sms=148,
        bf16_tflops=2250, fp8_tflops=4500, fp4_tflops=9000, hbm_gib=180, hbm_gb_per_s=8000,
        nvlink_gb_per_s=900, rdma_gb_per_s=50, usd_per_gpu_hour=6.03,
        source=(
            "NVIDIA HGX B200 / DGX B200 datasheets, per GPU (8-GPU totals / 8): BF16 36, FP8 "
            "72 and FP4 144 PFLOPS with sparsity -> 2.25 / 4.5 / 9 PFLOPS dense, 1,440GB "
            "HBM3e -> 180GB, 64 TB/s -> 8 TB/s, NVLink 5 1.8 TB/s (both directions); DGX "
            "B200: one 400 Gb/s ConnectX-7 port per GPU"
        ),
        price_source="Spheron on-demand B200 SXM, $6.03/h (published 2026-03-17)",
    ),
    "b300": dict(
        sms=160,
        bf16_tflops=2250, fp8_tflops=4500, fp4_tflops=13500, int8_tflops=153.5,
        hbm_gib=268.6, hbm_gb_per_s=8000,
        nvlink_gb_per_s=900, rdma_gb_per_s=100,
        source=(
            "NVIDIA HGX B300 datasheet, per GPU (8-GPU totals / 8): FP4 144 PFLOPS with "
            "sparsity / 108 dense -> 13.5 PFLOPS dense, FP8 72 and BF16 36 PFLOPS with "
            "sparsity -> 4.5 / 2.25 dense, \"288GB\" HBM3e at up to 8 TB/s, NVLink 5 1.8 TB/s "
            "(both directions); one 800 Gb/s ConnectX-8 port per GPU. INT8 153.5 TOPS dense "
            "(307 with sparsity; Blackwell Ultra cut INT8; aiconfigurator-core 0.12's b300_sxm "
            "int8_tc_flops). Memory as the driver "
            "reports it: 275,040 MiB = 268.6 GiB (aiconfigurator-core 0.12's b300_sxm system "
            "file, from nvidia-smi; the HGX B300 page's 2.1 TB for 8 GPUs agrees), not 288 GiB"
        ),
        price_source=_NO_PRICE,
    ),
    "gb200": dict(
        host_link_gb_per_s=450,
        host_time_scale=GRACE_HOST_TIME_SCALE,
        sms=148,
        bf16_tflops=2500, fp8_tflops=5000, fp4_tflops=10000, hbm_gib=186, hbm_gb_per_s=8000,
        nvlink_gb_per_s=900, rdma_gb_per_s=50, gpus_per_node=72, gpus_per_host=4,
        usd_per_gpu_hour=4.54,
        source=(
            "NVIDIA GB200 NVL72 datasheet, per GPU (72-GPU rack totals / 72): FP4 1,440, FP8 "
            "720 and BF16 360 PFLOPS with sparsity -> 10 / 5 / 2.5 PFLOPS dense, 13.4TB "
            "HBM3e -> 186GB, 576 TB/s -> 8 TB/s, NVLink 5 130 TB/s -> 1.8 TB/s (both "
            "directions) across all 72 GPUs; one 400 Gb/s ConnectX-7 port per GPU"
        ),
        price_source=(
            "Spheron on-demand GB200, $9.08/h per superchip of 2 GPUs (published 2026-03-17)"
        ),
    ),
    "gb300": dict(
        host_link_gb_per_s=450,
        host_time_scale=GRACE_HOST_TIME_SCALE,
        sms=160,
        bf16_tflops=2500, fp8_tflops=5000, fp4_tflops=15000, int8_tflops=165,
        hbm_gib=277.5, hbm_gb_per_s=8000,
        nvlink_gb_per_s=900, rdma_gb_per_s=100, gpus_per_node=72, gpus_per_host=4,
        source=(
            "NVIDIA GB300 NVL72 datasheet, per GPU (72-GPU rack totals / 72): FP4 1,080 PFLOPS "
            "dense -> 15, FP8 720 and BF16 360 PFLOPS with sparsity -> 5 / 2.5 dense, \"288GB\" "
            "HBM3e per GPU, 576 TB/s -> 8 TB/s, NVLink 5 130 TB/s -> 1.8 TB/s (both "
            "directions) across all 72 GPUs; one 800 Gb/s ConnectX-8 SuperNIC per GPU. INT8 "
            "165 TOPS dense (the datasheet's 23 POPS with sparsity / 72 / 2 ~ 0.16; "
            "aiconfigurator-core 0.12's gb300 int8_tc_flops). Memory "
            "as the driver reports it: 284,208 MiB = 277.5 GiB (aiconfigurator-core 0.12's "
            "gb300 system file, from nvidia-smi), not 288 GiB"
        ),
        price_source=_NO_PRICE,
    ),
}


def hardware_preset_names() -> list[str]:
    return sorted(_PRESETS)


def load_hardware_spec(
    spec: str | Path | Mapping[str, Any], base_dir: str | Path | None = None
) -> HardwareSpec:
    """A preset by name, a YAML file holding the fields of `HardwareSpec`, or a dict of them.

    A dict (or file) may start from `base: <preset or file>` and override some fields; it
    keeps the base's name unless it gives one. A relative file path is looked for under
    `base_dir` (the experiment's folder), then the current directory. Unknown names, missing
    files and bad fields raise ValueError naming the input, the field, where it looked and
    the presets.
    """
    if isinstance(spec, Mapping):
        return _from_fields(spec, "hardware", base_dir)
    if isinstance(spec, str) and spec in _PRESETS:
        return HardwareSpec(name=spec, **_PRESETS[spec])
    path, tried = find_spec_file(spec, base_dir)
    if path is None:
        raise ValueError(not_found("hardware", spec, hardware_preset_names(), tried, "a YAML file"))
    return _from_fields(read_spec_yaml(path, "HardwareSpec"), str(path), path.parent)


def _from_fields(data: Mapping[str, Any], where: str, base_dir: str | Path | None) -> HardwareSpec:
    fields = dict(data)
    base = fields.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ValueError(f"{where}: base must be a preset name or a file, got {base!r}")
        base_spec = load_hardware_spec(base, base_dir)
        if fields and "source" not in fields:
            fields["source"] = f"{base_spec.source} [overridden: {', '.join(sorted(fields))}]"
        fields = merge_fields(base_spec.model_dump(), fields)
    return validate_fields(HardwareSpec, fields, where)
