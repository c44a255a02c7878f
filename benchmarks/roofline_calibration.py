"""Where the roofline's efficiency and floor constants come from: fits on measured kernel tables.

    pip install aiconfigurator-core==0.12.0
    python benchmarks/roofline_calibration.py

Reads NVIDIA's measured SGLang kernel tables shipped in aiconfigurator-core (component-level
data only: single kernels and single collectives, never end-to-end serving results) and prints,
per GPU, the figure each `RooflineParams` default is taken from (docs/cost_model.md lists them):

- GEMM: the per-kernel floor (median latency of m <= 16, n, k <= 512) and the share of the
  dtype's dense peak large GEMMs reach (m, n, k >= 4096), per weight format;
- prefill attention: `attn_mfu` and `prefill_attn_extra_keys` of the rule
  efficiency = attn_mfu * keys / (keys + extra_keys), fitted to FlashAttention context tables
  (keys = mean keys a query attends to); the FP8 kernel's share of the FP8 peak;
- decode attention: the kernel floor and the per-request cost beyond reading the KV;
- fused MoE: the floor beyond reading the hit experts' weights (DeepEP MoE tables);
- Gated DeltaNet: the floor of a layer's prefill kernels (causal convolution + chunked scan)
  at a one-token prompt and of its decode kernels at one request;
- DeepEP: per-call latency and achieved share of NVLink / NIC bandwidth, low-latency and
  normal mode, with the byte counts of pdsim.sim.moe_comm.
"""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

from pdsim.sim.cost import RooflineParams
from pdsim.sim.moe_comm import deepep_traffic
from pdsim.specs import load_hardware_spec

SYSTEMS = {"a100_sxm": "a100", "h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200"}
PEAK_OF = {"bfloat16": "bf16_tflops", "fp8": "fp8_tflops", "fp8_block": "fp8_tflops",
           "nvfp4": "fp4_tflops"}
WEIGHT_BYTES = {"bfloat16": 2.0, "fp8": 1.0, "fp8_block": 1.0, "nvfp4": 0.5625}


def data_root() -> Path:
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or spec.origin is None:
        raise SystemExit("needs aiconfigurator-core==0.12.0 (pip install aiconfigurator-core)")
    return Path(spec.origin).parent / "systems" / "data"


def table(root: Path, system: str, pattern: str) -> pd.DataFrame | None:
    """The newest SGLang version's table matching `pattern` (op/sglang/<version>/file)."""
    paths = sorted(glob.glob(str(root / system / pattern)))
    return pd.read_parquet(paths[-1]) if paths else None


def gemm(root: Path) -> None:
    print("GEMM: per-kernel floor, large-GEMM share of peak, small-m weight-read bandwidth")
    for system, hw_name in SYSTEMS.items():
        d, hw = table(root, system, "gemm/sglang/*/gemm_perf.parquet"), load_hardware_spec(hw_name)
        if d is None:
            continue
        for dtype in sorted(set(d.gemm_dtype) & set(PEAK_OF)):
            peak = getattr(hw, PEAK_OF[dtype])
            if peak is None:
                continue
            x = d[d.gemm_dtype == dtype]
            t = x.latency * 1e-3
            floor = t[(x.m <= 16) & (x.n <= 512) & (x.k <= 512)].median()
            big = (x.m >= 4096) & (x.n >= 4096) & (x.k >= 4096)
            mfu = (2 * x.m * x.n * x.k / t / 1e12 / peak)[big].median()
            small = (x.m <= 8) & (x.n * x.k >= 32e6)
            bw = (x.n * x.k * WEIGHT_BYTES[dtype] / (t - floor) / 1e9 / hw.hbm_gb_per_s)[small]
            print(f"  {system:9s} {dtype:9s} floor {floor * 1e6:4.1f} us  mfu {mfu:.2f}  "
                  f"weight-read bw {bw.median():.2f}")


def prefill_attention(root: Path) -> None:
    print("prefill attention: efficiency = attn_mfu * keys / (keys + extra_keys)")
    for system, hw_name in SYSTEMS.items():
        d, hw = (table(root, system, "attention/sglang/*/context_attention_perf.parquet"),
                 load_hardware_spec(hw_name))
        if d is None:
            continue
        d = d[(d.head_dim == 128) & (d.isl >= 256) & (d.kv_cache_dtype == d.attn_dtype)]
        if "window_size" in d:
            d = d[d.window_size == 0]
        for dtype in sorted(set(d.attn_dtype)):
            x = d[d.attn_dtype == dtype]
            peak = hw.bf16_tflops if dtype == "bfloat16" else hw.fp8_tflops
            pairs = x.batch_size * x.isl * (x.isl + 1) / 2
            t = x.latency * 1e-3
            # t = pairs * F / (peak * mfu) + tokens * extra * F / (peak * mfu): linear in
            # (pairs, tokens) with F = 4 * heads * head_dim flops per pair.
            flops_pair = 4 * x.num_heads * x.head_dim
            a = np.vstack([pairs * flops_pair, x.batch_size * x.isl * flops_pair]).T
            (inv_rate, extra_over_rate), *_ = np.linalg.lstsq(a / t.values[:, None],
                                                               np.ones(len(x)), rcond=None)
            mfu = 1 / inv_rate / (peak * 1e12)
            print(f"  {system:9s} {dtype:9s} attn_mfu {mfu:.2f}  "
                  f"extra_keys {extra_over_rate / inv_rate:5.0f}  ({len(x)} points)")


def decode_attention(root: Path) -> None:
    print("decode attention: floor and per-request cost beyond the KV read at bw_efficiency")
    bw_eff = RooflineParams().bw_efficiency
    for system, hw_name in SYSTEMS.items():
        d, hw = (table(root, system, "attention/sglang/*/generation_attention_perf.parquet"),
                 load_hardware_spec(hw_name))
        if d is None:
            continue
        x = d[(d.head_dim == 128) & (d.kv_cache_dtype == "bfloat16")]
        if "window_size" in x:
            x = x[x.window_size == 0]
        t = x.latency * 1e-3
        floor = t[(x.batch_size == 1) & (x.step <= 16)].median()
        kv_bytes = x.batch_size * (x.step + 1) * x.num_key_value_heads * x.head_dim * 4
        rest = (t - floor - kv_bytes / (hw.hbm_gb_per_s * 1e9 * bw_eff)) / x.batch_size
        many = (x.batch_size >= 256) & (x.step <= 255)
        print(f"  {system:9s} floor {floor * 1e6:4.1f} us  per request "
              f"{rest[many].median() * 1e6:.3f} us")


def moe(root: Path) -> None:
    print("fused MoE (DeepEP, FP8, DeepSeek-V3 shapes): time beyond reading the experts")
    bw_eff = RooflineParams().bw_efficiency
    for system, hw_name in SYSTEMS.items():
        d = table(root, system, "moe/sglang/*/wideep_generation_moe_perf.parquet")
        if d is None:
            continue
        hw = load_hardware_spec(hw_name)
        x = d[d.distribution == "uniform"]
        # Saturated points: every expert of a GPU is hit (tokens * topk >> experts per GPU).
        x = x[x.num_tokens * x.topk >= 8 * x.num_experts]
        expert_bytes = 3 * x.hidden_size * x.inter_size * 1.0  # FP8
        read_s = x.num_experts / x.moe_ep_size * expert_bytes / (hw.hbm_gb_per_s * 1e9 * bw_eff)
        floor = x.latency * 1e-3 - read_s
        print(f"  {system:9s} floor {floor.median() * 1e6:5.1f} us "
              f"(p25 {floor.quantile(0.25) * 1e6:.1f}, p75 {floor.quantile(0.75) * 1e6:.1f})")


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    a = np.vstack([np.ones_like(x), x]).T
    (intercept, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    return intercept, slope


def deepep(root: Path) -> None:
    print("DeepEP, DeepSeek-V3 shapes: latency at one token, achieved share of link bandwidth")
    for system, hw_name in SYSTEMS.items():
        hw = load_hardware_spec(hw_name)
        for path in sorted(glob.glob(str(root / system / "comm/sglang/*/wideep_deepep_*.parquet"))):
            d = pd.read_parquet(path)
            d = d[(d.hidden_size == 7168) & (d.num_topk == 8) & (d.num_experts == 256)]
            normal = "normal" in Path(path).name
            if normal:
                d = d[d.dispatch_sms == 24]  # SGLang's DeepEP normal-mode default
            for nodes, x in d.groupby("node_num"):
                ep = 8 * int(nodes)
                mode = "normal" if normal else "low_latency"
                link = "rdma" if ep > hw.gpus_per_node else "nvlink"
                link_gb_per_s = hw.rdma_gb_per_s if link == "rdma" else hw.nvlink_gb_per_s
                for op in ("dispatch", "combine"):
                    col = f"{op}_transmit_us" if normal else f"{op}_avg_t_us"
                    y = x[col].to_numpy() * 1e-6
                    moved = np.array([getattr(getattr(deepep_traffic(
                        t, 7168, 8, ep, hw.gpus_per_node, mode), op), f"{link}_bytes")
                        for t in x.num_token])
                    big = x.num_token.to_numpy() >= (1024 if normal else 64)
                    if big.sum() < 2:
                        continue
                    _, slope = _fit(moved[big], y[big])
                    print(f"  {system:9s} {Path(path).parent.name:11s} {mode:11s} EP{ep:<3d} "
                          f"{op:8s} one token {y[0] * 1e6:5.1f} us  {link} share "
                          f"{1 / slope / 1e9 / link_gb_per_s:.2f}")


def gdn(root: Path) -> None:
    print("Gated DeltaNet: one layer's kernels at one token (prefill) and one request (decode)")
    for system in SYSTEMS:
        d = table(root, system, "linear_attention/sglang/*/gdn_perf.parquet")
        if d is None:
            continue
        one = d[(d.batch_size == 1) & (d.seq_len == 1)]
        us = one.groupby("kernel_source")["latency"].median() * 1e3
        if not {"chunk_gated_delta_rule", "causal_conv1d_update"} <= set(us.index):
            continue  # a table without the prefill scan's rows
        prefill = us["causal_conv1d_fn"] + us["chunk_gated_delta_rule"]
        decode = us["causal_conv1d_update"] + us[
            "fused_recurrent_gated_delta_rule_packed_decode"]
        print(f"  {system:9s} prefill floor {prefill:4.1f} us  decode floor {decode:4.1f} us")


def main() -> None:
    root = data_root()
    gemm(root)
    prefill_attention(root)
    decode_attention(root)
    moe(root)
    deepep(root)
    gdn(root)


if __name__ == "__main__":
    main()
