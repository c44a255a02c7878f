"""Roofline predictions against Vidur's measured A100 per-operator times (CodeLlama-34B shapes).

    python benchmarks/cost_vs_vidur_profile.py [VIDUR_DATA_DIR]

VIDUR_DATA_DIR defaults to /work/shared/anchors/vidur-data (or $VIDUR_DATA) and must hold
Vidur's `data/profiling/...` tree. The data stays there; nothing is copied into this repo.

What is compared, per transformer layer on one GPU:
- "layer ops": Vidur's norms + QKV/O projections + RoPE + MLP up/act/down + residual add (medians,
  mlp.csv) against the roofline step of a one-layer model with only decode tokens and no
  context, so only projections, MLP and elementwise kernels are priced;
- "prefill attn" / "decode attn": Vidur's attention kernel (attention.csv, TP 2 only) against the
  roofline's attention-kernel time for that shape (`attention_kernels_s`, floor included);
- "all-reduce": Vidur's 2-GPU NVLink all-reduce against the roofline's ring formula.
Per-step overheads and collectives are switched off in the model for the compute rows.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.cost import Parallelism, RooflineCostModel, RooflineParams
from pdsim.specs import ModelSpec, load_hardware_spec

MODEL_DIR = "data/profiling/compute/a100/codellama/CodeLlama-34b-Instruct-hf"
NET_DIR = "data/profiling/network/a100_pairwise_nvlink"
LAYER_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
# Per-step costs are off; the kernel floors (GEMM floors, layer_overhead_s) stay on for the
# "layer ops" rows, where Vidur's sum of nine kernels includes theirs.
NO_STEP_COSTS = dict(step_overhead_s=0.0, extend_overhead_s=0.0, allreduce_latency_s=0.0)

# CodeLlama-34B shapes (codellama/CodeLlama-34b-Instruct-hf config.json), cut to one layer and
# a one-entry vocabulary so a step prices one layer's projections, MLP and kernels only.
ONE_LAYER = ModelSpec(
    name="codellama-34b-one-layer", num_layers=1, hidden_size=8192, num_attention_heads=64,
    num_kv_heads=8, head_dim=128, intermediate_size=22016, vocab_size=1,
)


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def ms(row: dict[str, str], op: str) -> float:
    return float(row[f"time_stats.{op}.median"])


def model_for(tp: int, **params: float) -> RooflineCostModel:
    """The roofline on an A100 whose NVLink is free: Vidur prices collectives separately."""
    no_comm = load_hardware_spec("a100").model_copy(update={"nvlink_gb_per_s": 1e12})
    return RooflineCostModel(ONE_LAYER, no_comm, Parallelism(tp=tp), **NO_STEP_COSTS, **params)


def layer_ops(root: Path) -> list[tuple[str, float, float]]:
    rows = read_rows(root / MODEL_DIR / "mlp.csv")
    out = []
    for tp in (1, 2, 4, 8):
        cost = model_for(tp)
        for tokens in (1, 16, 128, 512, 2048, 4096):
            match = [
                r for r in rows
                if int(r["num_tokens"]) == tokens and int(r["num_tensor_parallel_workers"]) == tp
            ]
            if not match:
                continue
            measured = sum(ms(match[0], op) for op in LAYER_OPS)
            shape = BatchShape(decode_reqs=tokens)
            # The step less its attention kernels and the one-entry LM head's GEMM floor.
            predicted = (cost.step_time_s([shape]) - cost.attention_kernels_s(shape)
                         - cost.params.gemm_floor_s) * 1e3
            out.append((f"layer ops tp={tp} tokens={tokens}", measured, predicted))
    return out


def attention(root: Path) -> list[tuple[str, float, float]]:
    rows = read_rows(root / MODEL_DIR / "attention.csv")
    cost = model_for(2)
    out = []
    prefill = {(int(r["prefill_chunk_size"]), int(r["kv_cache_size"])): r
               for r in rows if r["is_prefill"] == "True"}
    for chunk, kv in ((256, 0), (1024, 0), (2048, 0), (1024, 2048), (3776, 320)):
        row = prefill.get((chunk, kv))
        if row is None:
            continue
        shape = BatchShape(prefill_tokens=chunk, prefill_attn_pairs=extend_attn_pairs(chunk, kv))
        predicted = cost.attention_kernels_s(shape) * 1e3
        out.append((f"prefill attn chunk={chunk} kv={kv}", ms(row, "attn_prefill"), predicted))
    decode = {(int(r["batch_size"]), int(r["kv_cache_size"])): r
              for r in rows if r["is_prefill"] == "False"}
    for batch, kv in ((1, 1024), (8, 1024), (32, 2048), (64, 2048), (128, 1536), (128, 4032)):
        row = decode.get((batch, kv))
        if row is None:
            continue
        shape = BatchShape(decode_reqs=batch, decode_context_tokens=batch * kv)
        predicted = cost.attention_kernels_s(shape) * 1e3
        out.append((f"decode attn batch={batch} kv={kv}", ms(row, "attn_decode"), predicted))
    return out


def all_reduce(root: Path) -> list[tuple[str, float, float]]:
    rows = [r for r in read_rows(root / NET_DIR / "all_reduce.csv")
            if r["num_workers"] == "2" and r["rank"] == "0"]
    a100 = load_hardware_spec("a100")
    latency_s = RooflineParams().allreduce_latency_s
    with_comm = RooflineCostModel(ONE_LAYER, a100, Parallelism(tp=2), **NO_STEP_COSTS)
    without = model_for(2)
    out = []
    for target in (1 << 16, 1 << 20, 1 << 23, 1 << 26, 1 << 28):
        row = min(rows, key=lambda r: abs(int(r["size"]) - target))
        tokens = max(1, round(int(row["size"]) / (2 * ONE_LAYER.hidden_size)))  # bf16 hidden
        shape = [BatchShape(decode_reqs=tokens)]
        # A tp=2 layer runs two all-reduces of this size; the model's default latency is added
        # back because both models above run with it switched off.
        one = (with_comm.step_time_s(shape) - without.step_time_s(shape)) / 2 + latency_s
        label = f"all-reduce 2 GPUs {int(row['size']) / 2**20:.2f} MiB"
        out.append((label, ms(row, "all_reduce"), one * 1e3))
    return out


def main() -> None:
    default = os.environ.get("VIDUR_DATA", "/work/shared/anchors/vidur-data")
    root = Path(sys.argv[1] if len(sys.argv) > 1 else default)
    print(f"{'case':44s} {'vidur ms':>10s} {'roofline ms':>12s} {'roofline/vidur':>15s}")
    for label, measured, predicted in layer_ops(root) + attention(root) + all_reduce(root):
        print(f"{label:44s} {measured:10.3f} {predicted:12.3f} {predicted / measured:15.2f}")


if __name__ == "__main__":
    main()
