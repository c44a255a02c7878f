"""Per-op accuracy of the silicon and roofline cost models on measured kernel times.

    python benchmarks/fidelity_components.py [--system h100_sxm] [--samples 400] [--vidur DIR]

1. Leave-one-out on NVIDIA's tables (aiconfigurator-core, framework sglang): for a random
   sample of interior grid points of each op kind, hide the point and predict it from its
   neighbours along the size axis the simulator looks up (tokens, sequence or context length,
   message size) with the silicon model's interpolation (a monotone cubic in log-log space,
   pdsim.sim.silicon.interp.Curve; for GEMMs relative to the tile-quantised reference the
   model picks per series, picked again without the hidden point), and from the shape alone
   with the roofline cost model itself
   (pdsim.sim.cost at its default RooflineParams: floors, per-format efficiencies). The neighbours are twice as far apart
   as in the real lookup, so silicon's error is an upper bound. Printed: median and P90
   relative error per op kind and model.
2. Transfers: a measured MoE curve moved to another measured configuration by the ratio of
   the two MoE rooflines (the silicon model's rule for shapes, dtypes and EP sizes a table
   lacks, pdsim.sim.silicon.ops), against that configuration's own measurement: wide-EP
   (DeepGEMM) curves to the next EP size up or down; fused-MoE curves between expert counts and
   between dtypes at the same shape. Printed: median and P90 relative error of the moved curve,
   and the median of the source curve taken as it is. And fused-MoE curves from EP 1 to each
   EP size measured (what the model does with a shape whose EP rows it does not read), with
   and without the rows of other ranks' experts SGLang's Triton and Marlin kernels move; and
   fused-MoE EP 1 curves measured with balanced routing moved to random routing, against the
   rows measured with power-law routing; and the expert-load model (the busiest EP rank's
   tokens) applied to the wide-EP tables' uniform rows, against their power-law rows.
3. Against Vidur's measured A100 profile (CodeLlama-34B shapes; ../shared/anchors/vidur-data):
   the silicon model's a100_sxm lookups for the same ops, side by side with Vidur's medians.
4. DeepEP's low-latency kernels against DeepEP's own published timings (its README: H800s with
   one 400 Gb/s CX7 NIC each, 128 tokens per rank, hidden 7168, top-8, FP8 dispatch, BF16
   combine, EP 16-256), priced by the roofline cost model's DeepEP term
   (`RooflineCostModel.deepep_calls_s`, its default constants: fitted on other GPUs' tables).
5. The MLA decode attention block: aiconfigurator's module tables (SGLang's whole attention
   block of DeepSeek-V3 under a CUDA graph) against the sum of the silicon model's ops of it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from pdsim.core.batch import BatchShape
from pdsim.sim.cost import (
    Parallelism, RooflineCostModel, RooflineParams, experts_reached, gdn_kernel_work,
    gemm_time_s,
)
from pdsim.sim.expert_load import ExpertLoad
from pdsim.sim.overheads import attention_elementwise_kernels
from pdsim.sim.silicon import SiliconCostModel, tables
from pdsim.sim.silicon.interp import Curve, Reference, best_reference
from pdsim.sim.silicon.ops import (
    _TABLE_TO_PDSIM, DEEPEP_NUM_SMS, MLA_TABLE_DIMS, OpTables,
    deepep_link_roofline, deepep_seconds, keeps_all_rows, moved_expert_curve, underread_shapes,
    unshared_ep_shapes, without_idle_rows,
)
from pdsim.specs import ModelSpec, load_hardware_spec, model_preset
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.precision import DTYPES, Precision

RP = RooflineParams()
DSV3 = model_preset("deepseek-v3")  # the MLA tables' shape (kv_lora 512, rope 64, nope/v 128)
HARDWARE = {system: preset for preset, system in tables.SYSTEMS.items()}
# sizes, seconds, roofline cost model, the silicon model's reference candidates for the series
Series = tuple[np.ndarray, np.ndarray, Callable[[float], float], tuple[Reference | None, ...]]
PLAIN = (None,)  # the plain cubic: every op kind but GEMM


def _grouped(t: pd.DataFrame, keys: list[str], x: str, y: str, scale: float
             ) -> Iterator[tuple[tuple, np.ndarray, np.ndarray]]:
    best = t.groupby([*keys, x])[y].min().reset_index()
    for key, g in best.groupby(keys):
        g = g.sort_values(x)
        yield key, g[x].to_numpy(float), g[y].to_numpy(float) * scale


class Rooflines:
    """The roofline cost model users run (pdsim.sim.cost, default RooflineParams), per op:
    a one-layer model of the op's shape is built and the model's own pieces price it."""

    def __init__(self, hw: HardwareSpec) -> None:
        self.hw = hw

    def gemm(self, n: int, k: int, dtype: str) -> Callable[[float], float]:
        fmt = _TABLE_TO_PDSIM[dtype]
        return lambda m: gemm_time_s(m, n, k, fmt, self.hw, RP)

    def _cost(self, spec: ModelSpec, par: Parallelism = Parallelism(), kv_bytes: float = 2
              ) -> RooflineCostModel:
        return RooflineCostModel(spec, self.hw, par, kv_dtype_bytes=kv_bytes)

    def _gqa(self, h: int, kvh: int, d: int, kvb: int, fp8: bool) -> RooflineCostModel:
        prec = Precision(attention_compute="fp8" if fp8 else "bf16")
        spec = ModelSpec(name="attn", num_layers=1, hidden_size=h * d, num_attention_heads=h,
                         num_kv_heads=kvh, head_dim=d, intermediate_size=1024, vocab_size=8,
                         precision=prec)
        return self._cost(spec, kv_bytes=kvb)

    def prefill(self, b: int, h: int, kvh: int, d: int, kvb: int, fp8: bool
                ) -> Callable[[float], float]:
        """b fresh causal sequences of s tokens."""
        cost = self._gqa(h, kvh, d, kvb, fp8)
        return lambda s: cost.attention_kernels_s(
            BatchShape(prefill_tokens=int(b * s), prefill_attn_pairs=b * s * (s + 1) // 2))

    def decode(self, cost: RooflineCostModel, b: int) -> Callable[[float], float]:
        """b requests with c tokens of context each."""
        return lambda c: cost.attention_kernels_s(
            BatchShape(decode_reqs=b, decode_context_tokens=int(b * c)))

    def mla(self, heads: int, kvb: int) -> RooflineCostModel:
        return self._cost(DSV3.model_copy(update={"num_attention_heads": heads}), kv_bytes=kvb)

    def moe(self, h: int, inter: int, topk: int, experts: int, mtp: int, mep: int,
            dtype: str) -> Callable[[float], float]:
        spec = ModelSpec(name="moe", num_layers=1, hidden_size=h, num_attention_heads=8,
                         num_kv_heads=8, head_dim=128, intermediate_size=1024, vocab_size=8,
                         num_experts=experts, experts_per_token=topk, moe_intermediate_size=inter,
                         precision=Precision(moe_experts=_TABLE_TO_PDSIM[dtype]))
        cost = self._cost(spec, Parallelism(tp=mtp * mep, ep=mep))
        return lambda tokens: cost._moe_s(tokens, tokens, tokens)

    def all_reduce(self, gpus: int) -> Callable[[float], float]:
        """An all-reduce of `size` BF16 elements (the tables' unit): the model's attention-TP
        all-reduce at tp=gpus."""
        spec = ModelSpec(name="ar", num_layers=1, hidden_size=4096, num_attention_heads=32,
                         num_kv_heads=8, head_dim=128, intermediate_size=1024, vocab_size=8)
        cost = self._cost(spec, Parallelism(tp=gpus))
        return lambda size: cost._attn_ar_fixed_s + size / spec.hidden_size * cost._attn_ar_s_tok

    def gdn(self, kernel: str, heads: tuple[int, int, int, int], b: int = 1
            ) -> Callable[[float], float]:
        """One Gated DeltaNet kernel as the roofline cost model prices it (`gdn_kernel_work`
        at its attention and memory rates, FP32 states, 4 taps, plus the floor of a layer's
        prefill or decode kernels less the convolution's ~2 us), over the sequence length of
        b prompts (prefill kernels) or over the requests (decode)."""
        rate = self.hw.bf16_tflops * 1e12 * RP.attn_mfu
        mem = self.hw.stream_gb_per_s * 1e9 * RP.bw_efficiency
        prefill = kernel in ("causal_conv1d_fn", "chunk_gated_delta_rule")
        floor = (RP.gdn_prefill_floor_s if prefill else RP.gdn_decode_floor_s) - 2e-6

        def seconds(x: float) -> float:
            flops, nbytes = gdn_kernel_work(kernel, b if prefill else x, x if prefill else 1,
                                            *heads, 4, 4)
            return floor + max(flops / rate, nbytes / mem)

        return seconds

    def deepep(self, hidden: int, topk: int, experts: int, ep: int, mode: str
               ) -> Callable[[float], float]:
        model = ModelSpec(name="moe", num_layers=1, hidden_size=hidden, num_attention_heads=8,
                          num_kv_heads=8, head_dim=128, intermediate_size=1024, vocab_size=8,
                          num_experts=experts, experts_per_token=topk, moe_intermediate_size=256)
        par = Parallelism(tp=ep, ep=ep, dp_attention=ep, moe_a2a="deepep")
        fixed, per_token = RooflineCostModel(model, self.hw, par)._deepep_cost(mode)
        return lambda tokens: fixed + tokens * per_token


def series(ops: OpTables, roof: Rooflines) -> dict[str, list[Series]]:
    """Op kind → measured series along the axis the simulator looks up."""
    out: dict[str, list[Series]] = {}
    t = ops._need("gemm", "gemm_perf.parquet")
    for (dtype, n, k), xs, ys in _grouped(t, ["gemm_dtype", "n", "k"], "m", "latency", 1e-3):
        out.setdefault("GEMM", []).append(
            (xs, ys, roof.gemm(n, k, dtype), ops.tile_references(n, k, dtype)))
    t = ops._need("attention", "context_attention_perf.parquet")
    t = t[t.window_size == 0] if "window_size" in t else t  # older tables lack the column
    keys = ["num_heads", "num_key_value_heads", "head_dim", "attn_dtype", "kv_cache_dtype",
            "batch_size"]
    for (h, kvh, d, ad, kd, b), xs, ys in _grouped(t, keys, "isl", "latency", 1e-3):
        out.setdefault("attention prefill", []).append(
            (xs, ys, roof.prefill(b, h, kvh, d, 1 if kd == "fp8" else 2, ad == "fp8"), PLAIN))
    t = ops._need("attention", "generation_attention_perf.parquet")
    t = t[t.window_size == 0] if "window_size" in t else t  # older tables lack the column
    keys = ["num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype", "batch_size"]
    for (h, kvh, d, kd, b), xs, ys in _grouped(t, keys, "step", "latency", 1e-3):
        cost = roof._gqa(h, kvh, d, 1 if kd == "fp8" else 2, False)
        out.setdefault("attention decode", []).append((xs, ys, roof.decode(cost, b), PLAIN))
    t = ops._table("mla", "context_mla_perf.parquet")
    if t is not None:
        for (h, kd, b), xs, ys in _grouped(t, ["num_heads", "kv_cache_dtype", "batch_size"],
                                           "isl", "latency", 1e-3):
            cost = roof.mla(h, 1 if kd == "fp8" else 2)
            out.setdefault("MLA context", []).append((xs, ys, lambda s, c=cost, b=b: (
                c.attention_kernels_s(BatchShape(prefill_tokens=int(b * s),
                                                 prefill_attn_pairs=b * s * (s + 1) // 2))),
                PLAIN))
    t = ops._table("mla", "generation_mla_perf.parquet")
    if t is not None:
        for (h, kd, b), xs, ys in _grouped(t, ["num_heads", "kv_cache_dtype", "batch_size"],
                                           "step", "latency", 1e-3):
            cost = roof.mla(h, 1 if kd == "fp8" else 2)
            out.setdefault("MLA generation", []).append((xs, ys, roof.decode(cost, b), PLAIN))
    t = ops._need("moe", "moe_perf.parquet")
    keys = ["moe_dtype", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
            "moe_ep_size", "distribution"]
    for (dt, h, i, k, e, mtp, mep, dist), xs, ys in _grouped(t, keys, "num_tokens", "latency",
                                                            1e-3):
        out.setdefault("MoE", []).append((xs, ys, roof.moe(h, i, k, e, mtp, mep, dt), PLAIN))
    for mode, file, cols in (("low_latency", "wideep_deepep_ll_perf.parquet",
                              ["dispatch_avg_t_us", "combine_avg_t_us"]),
                             ("normal", "wideep_deepep_normal_perf.parquet",
                              ["dispatch_transmit_us", "combine_transmit_us"])):
        t = ops._table("comm", file)
        if t is None:
            continue
        if mode == "normal":
            t = t[t.dispatch_sms == DEEPEP_NUM_SMS]
        t = t.assign(seconds=t[cols[0]] + t[cols[1]])
        keys = ["hidden_size", "num_topk", "num_experts", "node_num"]
        for (h, k, e, nodes), xs, ys in _grouped(t, keys, "num_token", "seconds", 1e-6):
            r = roof.deepep(h, k, e, tables.gpus_per_node(ops.system) * nodes, mode)
            out.setdefault(f"DeepEP {mode}", []).append((xs, ys, r, PLAIN))
    t = ops._table("linear_attention", "gdn_perf.parquet")
    if t is not None:
        heads = ["num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"]
        scan = t[t.kernel_source == "chunk_gated_delta_rule"]
        for (*shape, b), xs, ys in _grouped(scan, [*heads, "batch_size"], "seq_len", "latency",
                                            1e-3):
            out.setdefault("GDN scan", []).append(
                (xs, ys, roof.gdn("chunk_gated_delta_rule", tuple(shape), b), PLAIN))
        step = t[t.kernel_source == "fused_recurrent_gated_delta_rule_packed_decode"]
        for shape, xs, ys in _grouped(step, heads, "batch_size", "latency", 1e-3):
            out.setdefault("GDN decode", []).append(
                (xs, ys, roof.gdn("fused_recurrent_gated_delta_rule_packed_decode",
                                  tuple(shape)), PLAIN))
    t = ops._table("comm", "custom_allreduce_perf.parquet")
    if t is not None:
        t = t[t.backend == "sglang_graph"] if "backend" in t else t
        for (gpus,), xs, ys in _grouped(t, ["num_gpus"], "message_size", "latency", 1e-3):
            out.setdefault("all-reduce", []).append((xs, ys, roof.all_reduce(gpus), PLAIN))
    return out


def leave_one_out(all_series: list[Series], samples: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(silicon errors, roofline errors, step-edge flags) on a random sample of hidden
    interior points. A point is a step edge when it and its size ± 1 are both measured around a
    multiple of 16 from 32 up: the GEMM grid brackets each tile boundary that way (128 and 129
    rows), and hiding one side predicts it across the step, which no real lookup does (sizes
    are integers, so a query always lies between the two measured sides)."""
    points = [(si, i) for si, (xs, *_) in enumerate(all_series) for i in range(1, len(xs) - 1)]
    if len(points) > samples:
        points = [points[j] for j in rng.choice(len(points), samples, replace=False)]
    sil, roo, edge = [], [], []
    for si, i in points:
        xs, ys, roofline, references = all_series[si]
        seen_xs, seen_ys = np.delete(xs, i), np.delete(ys, i)
        reference = best_reference(seen_xs, seen_ys, references)
        predicted = Curve(seen_xs, seen_ys, roofline, reference=reference)(xs[i])
        sil.append(abs(predicted / ys[i] - 1))
        roo.append(abs(roofline(xs[i]) / ys[i] - 1))
        pair = xs[i - 1] if xs[i] - xs[i - 1] == 1 else xs[i + 1] if xs[i + 1] - xs[i] == 1 else 0
        edge.append(min(pair, xs[i]) >= 32 and min(pair, xs[i]) % 16 == 0)
    return np.array(sil), np.array(roo), np.array(edge)


def _moved_errors(ops: OpTables, src: pd.Series, dst: pd.Series, src_cfg: tuple,
                  dst_cfg: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Relative errors at `dst`'s token counts of `src` (milliseconds by tokens) moved to
    `dst_cfg` as the silicon model moves it (`moved_expert_curve`), and at the token counts
    both measured, of `src` as it is; configs are `moe_roofline`'s arguments."""
    moved = moved_expert_curve(src, src_cfg, ops.moe_roofline(*src_cfg), dst_cfg,
                               ops.moe_roofline(*dst_cfg))
    xs = dst.index.to_numpy(float)
    inside = xs[(xs >= moved.lo) & (xs <= moved.hi)]
    errors = np.abs(moved.values(inside) * 1e3 / dst.loc[inside].to_numpy(float) - 1)
    shared = np.intersect1d(src.index.to_numpy(float), xs)
    unmoved = np.abs(src.loc[shared].to_numpy(float) / dst.loc[shared].to_numpy(float) - 1)
    return errors, unmoved


def transfers(ops: OpTables) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Transfer kind → (moved-curve errors, unmoved errors) over every measured pair."""
    out: dict[str, tuple[list, list]] = {}

    def add(kind: str, errors: tuple[np.ndarray, np.ndarray]) -> None:
        moved, unmoved = out.setdefault(kind, ([], []))
        moved.extend(errors[0])
        unmoved.extend(errors[1])

    shape = ["hidden_size", "inter_size", "topk", "num_experts"]
    for phase in ("context", "generation"):
        t = ops._table("moe", f"wideep_{phase}_moe_perf.parquet")
        if t is None:
            continue
        t = t[(t.distribution == "uniform") & (t.moe_tp_size == 1)]
        for (dt, *cfg), g in t.groupby(["moe_dtype", *shape]):
            curves = {int(e): c.groupby("num_tokens")["latency"].min()
                      for e, c in g.groupby("moe_ep_size")}
            if phase == "context":  # as the silicon model reads them
                curves = {e: without_idle_rows(c, g, e, int(cfg[2])) for e, c in curves.items()}
            eps = sorted(curves)
            for a, b in zip(eps, eps[1:]):
                for src, dst in ((a, b), (b, a)):
                    add(f"wide-EP MoE, EP {'x2' if dst > src else '/2'}",
                        _moved_errors(ops, curves[src], curves[dst],
                                      (*cfg, 1, src, _TABLE_TO_PDSIM[dt]),
                                      (*cfg, 1, dst, _TABLE_TO_PDSIM[dt])))
    t = ops._need("moe", "moe_perf.parquet")
    keys = ["moe_dtype", *shape, "moe_tp_size", "moe_ep_size", "distribution"]
    curves = {tuple(int(v) if isinstance(v, (int, np.integer)) else v for v in k):
              g.groupby("num_tokens")["latency"].min() for k, g in t.groupby(keys)}
    for (dt, h, i, k, e, mtp, mep, dist), curve in curves.items():
        for other in (e * 3 // 2, e * 2):  # 256 -> 384 and 128 -> 256 experts, ...
            dst = curves.get((dt, h, i, k, other, mtp, mep, dist))
            if dst is not None:
                add("fused MoE, experts", _moved_errors(
                    ops, curve, dst, (h, i, k, e, mtp, mep, _TABLE_TO_PDSIM[dt]),
                    (h, i, k, other, mtp, mep, _TABLE_TO_PDSIM[dt])))
        if dt == "fp8_block":
            for target in ("nvfp4", "bfloat16"):
                dst = curves.get((target, h, i, k, e, mtp, mep, dist))
                if dst is not None:
                    add(f"fused MoE, fp8 -> {target}", _moved_errors(
                        ops, curve, dst, (h, i, k, e, mtp, mep, "fp8"),
                        (h, i, k, e, mtp, mep, _TABLE_TO_PDSIM[target])))
    return {kind: (np.array(a), np.array(b)) for kind, (a, b) in out.items()}


def fused_ep_moves(ops: OpTables) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int, int]:
    """Fused-MoE curves moved from EP 1 to each EP size the same table measured, as the silicon
    model moves a shape whose EP rows it does not read: kernel → (errors with the rows of other
    ranks' experts where the kernel keeps them, errors without), 256+ tokens; and how many
    (dtype, shape, moe_tp) groups measured EP sizes above 1, and how many of them time more
    than a rank's share (`unshared_ep_shapes`, excluded here)."""
    t = ops._need("moe", "moe_perf.parquet")
    t = t[t.distribution == "balanced"]
    out: dict[str, tuple[list, list]] = {}
    groups = unshared = 0
    shape = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]
    for (source, dt), by_dtype in t.groupby(["kernel_source", "moe_dtype"]):
        if dt not in _TABLE_TO_PDSIM:
            continue
        bad = unshared_ep_shapes(by_dtype)
        fused = keeps_all_rows(source)
        for cfg, rows in by_dtype.groupby(shape):
            cfg = tuple(int(v) for v in cfg)
            base = rows[rows.moe_ep_size == 1].groupby("num_tokens")["latency"].min()
            eps = sorted(int(e) for e in rows.moe_ep_size.unique() if e > 1)
            if base.empty or not eps:
                continue
            groups += 1
            if cfg in bad:
                unshared += 1
                continue
            errors = out.setdefault(source, ([], []))
            for ep in eps:
                dst = rows[rows.moe_ep_size == ep].groupby("num_tokens")["latency"].min()
                xs = dst.index.to_numpy(float)
                xs = xs[xs >= 256]
                src, dst_cfg = (*cfg, 1), (*cfg, ep)
                for keep, got in ((fused, errors[0]), (False, errors[1])):
                    moved = moved_expert_curve(
                        base, src, ops.moe_roofline(*src, _TABLE_TO_PDSIM[dt], fused=keep),
                        dst_cfg, ops.moe_roofline(*dst_cfg, _TABLE_TO_PDSIM[dt], fused=keep))
                    got.extend(np.abs(moved.values(xs) * 1e3 / dst.loc[xs].to_numpy(float) - 1))
    return ({k: (np.array(a), np.array(b)) for k, (a, b) in out.items() if a},
            groups, unshared)


def routing_moves(ops: OpTables) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int, int]:
    """Fused-MoE EP 1 curves measured with balanced routing moved to random routing by the
    ratio of the MoE rooflines (what the silicon model prices), against the same table's rows
    measured with aiconfigurator's power-law routing (alpha 1.01, its DeepSeek-V3/R1 fit to
    real prompts): kernel -> (errors moved, errors of the balanced rows as they are), at the
    token counts where the two routings reach different numbers of experts (by 1 %+); and
    how many (dtype, shape, moe_tp) groups there are, and how many of them compute fewer
    experts than balanced routing reaches (`underread_shapes`, excluded here)."""
    t = ops._need("moe", "moe_perf.parquet")
    t = t[t.moe_ep_size == 1]
    out: dict[str, tuple[list, list]] = {}
    groups = underread = 0
    shape = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]
    bad = {dt: underread_shapes(rows, DTYPES[_TABLE_TO_PDSIM[dt]].weight_bytes,
                                ops.table_hw.hbm_gb_per_s)  # judged per dtype, as the model
           for dt, rows in t.groupby("moe_dtype") if dt in _TABLE_TO_PDSIM}
    for (source, dt), by_source in t.groupby(["kernel_source", "moe_dtype"]):
        if dt not in _TABLE_TO_PDSIM:
            continue
        pdsim_dt = _TABLE_TO_PDSIM[dt]
        for cfg, rows in by_source.groupby(shape):
            cfg = tuple(int(v) for v in cfg)
            by_dist = rows.pivot_table(index="num_tokens", columns="distribution",
                                       values="latency", aggfunc="min")
            if not {"balanced", "power_law_1.01"} <= set(by_dist.columns):
                continue
            groups += 1
            if cfg in bad[dt]:
                underread += 1
                continue
            both = by_dist[["balanced", "power_law_1.01"]].dropna()
            xs = both.index.to_numpy(float)
            k, e = cfg[2:4]
            keep = experts_reached(e, k, xs) < 0.99 * np.minimum(e, xs * k)
            to_random = ops.random_routing(*cfg, 1, pdsim_dt, keeps_all_rows(source))
            base, real = both["balanced"].to_numpy()[keep], both["power_law_1.01"].to_numpy()[keep]
            moved = base * to_random(xs[keep])
            errors = out.setdefault(source, ([], []))
            errors[0].extend(np.abs(moved / real - 1))
            errors[1].extend(np.abs(base / real - 1))
    return ({k: (np.array(a), np.array(b)) for k, (a, b) in out.items() if a},
            groups, underread)


def imbalance_checks(ops: OpTables) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """pdsim's expert-load model against aiconfigurator's skewed measurements: the wide-EP
    (DeepGEMM) tables' uniform rows looked up at the busiest rank's tokens (tokens times
    `ExpertLoad.imbalance`, no EPLB), against the same tables' rows measured with power-law
    routing (alpha 1.01; the collector moves the busiest EP rank onto the measured one): phase
    -> (errors, errors of the uniform rows as they are), every EP size and token count both
    measured."""
    out = {}
    for phase in ("generation", "context"):
        t = ops._table("moe", f"wideep_{phase}_moe_perf.parquet")
        if t is None:
            continue
        t = t[(t.moe_dtype == "fp8_block") & (t.moe_tp_size == 1)]
        got, plain = [], []
        for (h, i, k, e, ep), rows in t.groupby(["hidden_size", "inter_size", "topk",
                                                   "num_experts", "moe_ep_size"]):
            by = rows.pivot_table(index="num_tokens", columns="distribution", values="latency",
                                  aggfunc="min")
            if not {"uniform", "power_law_1.01"} <= set(by.columns):
                continue
            uniform, skewed = by["uniform"].dropna(), by["power_law_1.01"]
            curve = Curve(uniform.index.to_numpy(float), uniform.to_numpy(float),
                          ops.moe_roofline(h, i, k, e, 1, ep, "fp8"))
            to_random = ops.random_routing(h, i, k, e, 1, ep, "fp8", False)
            load = ExpertLoad(int(e), int(k), int(ep))
            for x in uniform.index.intersection(skewed.dropna().index):
                busiest = math.ceil(x * load.imbalance(x))  # as the model reads it
                got.append(abs(curve(busiest) * to_random(busiest) / skewed[x] - 1))
                plain.append(abs(uniform[x] / skewed[x] - 1))
        if got:
            out[phase] = (np.array(got), np.array(plain))
    fused = fused_imbalance_checks(ops)
    if fused is not None:
        out["fused MoE (no DeepEP)"] = fused
    return out


def fused_imbalance_checks(ops: OpTables) -> tuple[np.ndarray, np.ndarray] | None:
    """The same for the fused-MoE table (EP without DeepEP): the balanced rows at the tokens
    moved to the busiest rank by the MoE roofline's ratio (its share of the rows times the
    imbalance, over the same experts), as the silicon model prices them, against the rows
    measured with power-law routing at each model's exponent (1.01 and 1.2); points up to a
    third of each curve's largest measured tokens."""
    t = ops._table("moe", "moe_perf.parquet")
    if t is None:
        return None
    t = t[(t.moe_ep_size > 1) & t.moe_dtype.isin(list(_TABLE_TO_PDSIM))]
    got, plain = [], []
    key = ["moe_dtype", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
           "moe_ep_size"]
    for (dtype, h, i, k, e, tp, ep), rows in t.groupby(key):
        by = rows.pivot_table(index="num_tokens", columns="distribution", values="latency",
                              aggfunc="min")
        if "balanced" not in by.columns:
            continue
        balanced = by["balanced"].dropna()
        if len(balanced) < 4:
            continue
        roof = ops.moe_roofline(h, i, k, e, tp, ep, _TABLE_TO_PDSIM[dtype],
                                fused=not ops.hw.blackwell, random=True)
        rows = ops.moe_roofline(h, i, k, e, tp, ep, _TABLE_TO_PDSIM[dtype],
                                fused=not ops.hw.blackwell)
        to_random = ops.random_routing(h, i, k, e, tp, ep, _TABLE_TO_PDSIM[dtype],
                                       not ops.hw.blackwell)
        curve = Curve(balanced.index.to_numpy(float),
                      balanced.to_numpy(float) * to_random(balanced.index.to_numpy(float)),
                      roof)
        for alpha in (1.01, 1.2):
            column = f"power_law_{alpha}"
            if column not in by.columns:
                continue
            load = ExpertLoad(int(e), int(k), int(ep), alpha=alpha)
            skewed = by[column].dropna()
            for x in balanced.index.intersection(skewed.index):
                if x > balanced.index[-1] / 3:
                    continue
                f = load.imbalance(x)
                more = math.ceil(x * f)  # as the silicon model prices the busiest rank
                busiest = max(curve(more) * roof(x, f) / roof(more),
                              curve(x) * rows(x, f) / rows(x))
                got.append(abs(busiest / skewed[x] - 1))
                plain.append(abs(balanced[x] / skewed[x] - 1))
    return (np.array(got), np.array(plain)) if got else None


# The ops of SGLang's MLA attention block (`self_attn`) a decode step prices from tables; the
# fused q_a / kv_a projection is left out, as the module tables replace it (their collector
# feeds the block a random latent instead).
MLA_BLOCK_OPS = ("q_b_proj", "o_proj", "mla_bmm_pre", "mla_bmm_post", "decode attention")


def mla_block_rows(system: str) -> Iterator[tuple[int, int, float, float]]:
    """(requests, context, module ms, pdsim ms): aiconfigurator's wide-EP MLA module table (the
    whole attention block of DeepSeek-V3 timed under a CUDA graph, 128 heads, one rank) against
    the silicon model's ops of that block for one rank of DP attention (its tabled ops and its
    elementwise kernels at their floors: the latent norms, RoPE, the q/k concat, the KV-cache
    store), at the module's measured shapes; the MLA backend SGLang picks on the GPU (fa3 on
    Hopper) where measured."""
    ops = OpTables(system, "sglang", "current", load_hardware_spec(HARDWARE[system]))
    t = ops._table("mla", "wideep_generation_mla_perf.parquet")
    if t is None:
        return
    t = t[t.num_heads == 128]
    kernel = "fa3" if (t.kernel_source == "fa3").any() else t.kernel_source.iloc[0]
    t = t[t.kernel_source == kernel]
    cost = SiliconCostModel(DSV3, ops.hw, Parallelism(tp=8, dp_attention=8, ep=8,
                                                      moe_a2a="deepep"), system=system,
                            role="decode")
    for reqs in (1, 4, 16, 64, 256):
        for context in (1, 1024, 4096):
            row = t[(t.batch_size == reqs) & (t.isl == context)]
            if row.empty:
                continue
            cost.trace = []
            cost.step_breakdown_s([BatchShape(0, 0.0, reqs, reqs * context, 1, 0)])
            ops_s = {op.name: op.seconds for op in cost.trace if op.part == "attention"}
            cost.trace = None
            untabled = attention_elementwise_kernels(DSV3) * cost.params.kernel_floor_s
            yield (reqs, context, float(row.latency.min()),
                   (sum(ops_s[name] for name in MLA_BLOCK_OPS) + untabled) * 1e3)


def vidur_rows(root: Path) -> list[tuple[str, float, float]]:
    """(case, Vidur median ms, silicon a100_sxm ms) for CodeLlama-34B's ops."""
    model_dir = root / "data/profiling/compute/a100/codellama/CodeLlama-34b-Instruct-hf"
    ops = OpTables("a100_sxm", "sglang", "current", load_hardware_spec("a100"))
    mlp = pd.read_csv(model_dir / "mlp.csv")
    out = []
    h, heads, kvh, hd, inter = 8192, 64, 8, 128, 22016
    for tp in (1, 2, 4, 8):
        gemms = {
            "attn_pre_proj": ops.gemm((heads + 2 * kvh) // tp * hd, h, "bf16"),
            "attn_post_proj": ops.gemm(h, heads // tp * hd, "bf16"),
            "mlp_up_proj": ops.gemm(2 * inter // tp, h, "bf16"),
            "mlp_down_proj": ops.gemm(h, inter // tp, "bf16"),
        }
        for tokens in (1, 128, 1024, 4096):
            row = mlp[(mlp.num_tokens == tokens) & (mlp.num_tensor_parallel_workers == tp)]
            if row.empty:
                continue
            for op, curve in gemms.items():
                out.append((f"{op} tp={tp} tokens={tokens}",
                            float(row[f"time_stats.{op}.median"].iloc[0]), curve(tokens) * 1e3))
    attn = pd.read_csv(model_dir / "attention.csv")
    context = ops.context_attention(heads // 2, kvh // 2, hd, 2, False)
    generation = ops.generation_attention(heads // 2, kvh // 2, hd, 2)
    pre = attn[(attn.is_prefill) & (attn.kv_cache_size == 0)]
    for chunk in (256, 1024, 2048, 4096):
        row = pre[pre.prefill_chunk_size == chunk]
        if not row.empty:
            out.append((f"prefill attn tp=2 chunk={chunk}",
                        float(row["time_stats.attn_prefill.median"].iloc[0]),
                        context.at(1, chunk)[0] * 1e3))
    dec = attn[~attn.is_prefill]
    for batch, kv in ((1, 1024), (8, 1024), (32, 2048), (128, 1536), (128, 4032)):
        row = dec[(dec.batch_size == batch) & (dec.kv_cache_size == kv)]
        if not row.empty:
            out.append((f"decode attn tp=2 batch={batch} kv={kv}",
                        float(row["time_stats.attn_decode.median"].iloc[0]),
                        generation.at(batch, kv)[0] * 1e3))
    ar = pd.read_csv(root / "data/profiling/network/a100_pairwise_nvlink/all_reduce.csv")
    ar = ar[(ar.num_workers == 2) & (ar["rank"] == 0)]
    curve = ops.all_reduce(2, h)
    for target in (1 << 16, 1 << 20, 1 << 23, 1 << 26):
        row = ar.iloc[(ar["size"] - target).abs().argsort()[:1]]
        size = int(row["size"].iloc[0])
        out.append((f"all-reduce 2 GPUs {size / 2**20:.2f} MiB",
                    float(row["time_stats.all_reduce.median"].iloc[0]),
                    curve(size / (2 * h)) * 1e3))
    return out


# DeepEP README, "Low-latency kernels with pure RDMA": EP -> (dispatch us, combine us).
DEEPEP_LL_README_US = {16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369),
                       256: (194, 360)}


def deepep_rows() -> Iterator[tuple[int, float, float, float, float]]:
    """(EP, DeepEP dispatch us, pdsim dispatch us, DeepEP combine us, pdsim combine us) for
    DeepSeek-V3's routing (hidden 7168, top-8) on H800 at 128 tokens per rank."""
    model, hw = model_preset("deepseek-v3"), load_hardware_spec("h800")
    for ep, (dispatch, combine) in DEEPEP_LL_README_US.items():
        par = Parallelism(tp=ep, dp_attention=ep, ep=ep, moe_a2a="deepep")
        d, c = RooflineCostModel(model, hw, par).deepep_calls_s("low_latency", 128)
        yield ep, dispatch, d * 1e6, combine, c * 1e6


# Shapes of Llama-3.1-8B/70B, Qwen3-32B and DeepSeek-V3 (per GPU at tp 1-8) to move between GPUs.
GEMM_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192),
               (8192, 8192), (57344, 8192), (8192, 28672), (1280, 5120), (5120, 3200)]
ATTENTION_SHAPES = [(32, 8, 128), (64, 8, 128), (8, 1, 128), (16, 2, 128)]
BATCHES, LENGTHS = (1, 4, 16, 64), (512, 2048, 8192)
MOE_SHAPES = [(4096, 1536, 8, 128, 1, 1), (2048, 768, 8, 128, 1, 1), (7168, 2048, 8, 256, 1, 8)]


def gpu_moves(src: str, dst: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Op kind -> (errors of `src`'s tables moved to `dst` as silicon moves a `silicon_base`
    GPU's, errors of `src`'s tables read as they are), against `dst`'s own tables, over the
    model shapes above (GEMM and MoE at `dst`'s measured token counts, attention on a
    batch x length grid)."""
    src_hw, dst_hw = load_hardware_spec(HARDWARE[src]), load_hardware_spec(HARDWARE[dst])
    moved = OpTables(src, "sglang", "current", dst_hw, src_hw)
    as_is = OpTables(src, "sglang", "current", src_hw)
    truth = OpTables(dst, "sglang", "current", dst_hw)
    out: dict[str, tuple[list, list]] = {}

    def add(kind: str, want: float, got: float, unmoved: float) -> None:
        errors = out.setdefault(kind, ([], []))
        errors[0].append(abs(got / want - 1))
        errors[1].append(abs(unmoved / want - 1))

    for dtype in ("bf16", "fp8"):
        for n, k in GEMM_SHAPES:
            want = truth.gemm(n, k, dtype)
            for m in want.grid:
                add(f"GEMM {dtype}", want(m), moved.gemm(n, k, dtype)(m),
                    as_is.gemm(n, k, dtype)(m))
    for kind, extra in (("context_attention", (2, False)), ("generation_attention", (2,))):
        for shape in ATTENTION_SHAPES:
            grids = [getattr(t, kind)(*shape, *extra) for t in (truth, moved, as_is)]
            for b in BATCHES:
                for length in LENGTHS:
                    add(kind.replace("_", " "), *(g.at(b, length)[0] for g in grids))
    for shape in MOE_SHAPES:
        want = truth.moe(*shape, "bf16", "balanced")
        for x in want.grid:
            add("fused MoE bf16", want(x), moved.moe(*shape, "bf16", "balanced")(x),
                as_is.moe(*shape, "bf16", "balanced")(x))
    return {kind: (np.array(a), np.array(b)) for kind, (a, b) in out.items()}


def deepep_group_moves() -> dict[str, tuple[np.ndarray, ...]]:
    """DeepEP mode -> |errors| of (pdsim, the tables as measured, the link roofline's move)
    against B200's tables, measured on 8 GPUs, for GB200's measured on one 4-GPU tray (the
    same NVLink rate) and priced at 8 GPUs in one NVLink domain; every shape both hold, from
    256 tokens a GPU up (below, the two systems' fixed latencies differ: 35 against 44 us)."""
    gb200, b200 = load_hardware_spec("gb200"), load_hardware_spec("b200")
    source = OpTables("gb200", "sglang", "current", gb200)
    truth = OpTables("b200_sxm", "sglang", "current", b200)
    out: dict[str, tuple[list, list, list]] = {}
    for mode, file in (("low_latency", "wideep_deepep_ll_perf.parquet"),
                       ("normal", "wideep_deepep_normal_perf.parquet")):
        shapes = [set(map(tuple, ops._need("comm", file).query("node_num == 1")[
            ["hidden_size", "num_topk", "num_experts"]].to_numpy().tolist()))
            for ops in (source, truth)]
        errors = out.setdefault(mode, ([], [], []))
        for h, k, e in sorted(shapes[0] & shapes[1]):
            want = truth.deepep(mode, h, k, e, 8)
            got, as_measured = source.deepep(mode, h, k, e, 8), source.deepep(mode, h, k, e, 4)
            moved = deepep_link_roofline(mode, h, k, 8, 8, b200)
            measured = deepep_link_roofline(mode, h, k, 4, 4, gb200)
            for x in want.grid[want.grid >= 256]:
                for errs, y in zip(errors, (got(x), as_measured(x),
                                            as_measured(x) * moved(x) / measured(x))):
                    errs.append(abs(y / want(x) - 1))
    return {mode: tuple(np.array(e) for e in errs) for mode, errs in out.items()}


def deepep_node_moves() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """DeepEP mode -> |errors| of (the one-node curve, the nearest other multi-node curve)
    moved by DeepEP's link roofline to 2, 4 and 8 nodes, against that node count's own
    measurement, on h200_sxm's tables (the only ones measured over several nodes), every
    shape and token count they hold. The first is how a GPU measured on one node only would
    be priced across nodes; the second how pdsim prices it (another GPU's multi-node curve)."""
    h200 = load_hardware_spec("h200")
    out: dict[str, tuple[list, list]] = {}
    for mode, file in (("low_latency", "wideep_deepep_ll_perf.parquet"),
                       ("normal", "wideep_deepep_normal_perf.parquet")):
        path = next(p for p in tables.table_paths("h200_sxm", "comm", "sglang", "current", file)
                    if (tables.read_table(p)["node_num"] > 1).any())
        t = deepep_seconds(tables.read_table(path), mode)
        errors = out.setdefault(mode, ([], []))
        for (h, k, _), shape in t.groupby(["hidden_size", "num_topk", "num_experts"]):
            curves = {int(n): g.groupby("num_token")["seconds"].min()
                      for n, g in shape.groupby("node_num")}
            for n in (2, 4, 8):
                others = [m for m in curves if m > 1 and m != n]
                if n not in curves or 1 not in curves or not others:
                    continue
                near = min(others, key=lambda m: (abs(math.log(m / n)), m))
                want = deepep_link_roofline(mode, h, k, 8 * n, 8, h200)
                for errs, src in zip(errors, (1, near)):
                    have = deepep_link_roofline(mode, h, k, 8 * src, 8, h200)
                    both = curves[src].index.intersection(curves[n].index).to_numpy(float)
                    moved = curves[src][both].to_numpy() * want(both) / have(both)
                    errs.extend(np.abs(moved / curves[n][both].to_numpy() - 1))
    return {mode: (np.array(a), np.array(b)) for mode, (a, b) in out.items()}


# Kernels timed on an H20 and published (flash-attention issue #1310: FlashAttention-3 forward,
# causal, 2 x 2,048 tokens; FlashMLA issue #30: decode, 128 requests, one query each where
# the row says so), against the H100's tables moved as silicon moves them.
H20_KERNELS = [
    ("FA3 causal, 16 heads x 128, 2 x 2048", "context_attention", (16, 16, 128, 2, False),
     (2, 2048), 0.319),
    ("FA3 causal, 32 heads x 64, 2 x 2048", "context_attention", (32, 32, 64, 2, False),
     (2, 2048), 0.342),
    ("FlashMLA, 16 heads, 128 x 4096 keys", "mla_generation", (16, MLA_TABLE_DIMS, 2),
     (128, 4096), 0.601),
]


def h20_kernel_rows() -> Iterator[tuple[str, float, float, float]]:
    """(kernel, measured ms, pdsim ms, ms by the roofline ratio alone) for each H20 kernel."""
    h100, h20 = load_hardware_spec("h100"), load_hardware_spec("h20")
    bare = h20.model_copy(update={"hbm_share": 1.0, "roofline_share": None})
    ops = {hw: OpTables("h100_sxm", "sglang", "current", hw, h100) for hw in (h20, bare)}
    for label, op, args, at, measured_ms in H20_KERNELS:
        moved, ratio = (getattr(ops[hw], op)(*args).at(*at)[0] * 1e3 for hw in (h20, bare))
        yield label, measured_ms, moved, ratio


def _print_against(label: str, rows: dict[str, tuple[np.ndarray, np.ndarray]],
                   baseline: str) -> None:
    """A table of |relative error| per row: pdsim's median and P90, then the baseline's."""
    base = f"{baseline} p50"
    print(f"{label:32s} {'points':>6s} {'pdsim p50':>9s} {'p90':>6s} {base:>22s} {'p90':>6s}")
    for name, (got, plain) in rows.items():
        print(f"{name:32s} {len(got):6d} {np.median(got):9.1%} {np.percentile(got, 90):6.1%} "
              f"{np.median(plain):22.1%} {np.percentile(plain, 90):6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="h100_sxm", choices=sorted(HARDWARE))
    ap.add_argument("--samples", type=int, default=400, help="held-out points per op kind")
    ap.add_argument("--vidur", default="/work/shared/anchors/vidur-data")
    args = ap.parse_args()
    tables.require_systems_dir()
    hw = load_hardware_spec(HARDWARE[args.system])
    ops = OpTables(args.system, "sglang", "current", hw)
    rng = np.random.default_rng(0)
    print(f"Leave-one-out on {args.system} (sglang {ops.version}), relative error")
    print(f"{'op kind':20s} {'points':>6s} {'silicon p50':>11s} {'p90':>6s} "
          f"{'roofline p50':>12s} {'p90':>6s} {'silicon p50 off step edges':>28s}")
    for kind, group in series(ops, Rooflines(hw)).items():
        sil, roo, edge = leave_one_out(group, args.samples, rng)
        if len(sil) == 0:
            continue
        off = f"{np.median(sil[~edge]):.1%} ({(~edge).sum()} points)" if edge.any() else "-"
        print(f"{kind:20s} {len(sil):6d} {np.median(sil):11.1%} {np.percentile(sil, 90):6.1%} "
              f"{np.median(roo):12.1%} {np.percentile(roo, 90):6.1%} {off:>28s}")
    print(f"\nTransfers on {args.system}: a measured MoE curve moved to another measured "
          f"configuration as the silicon model moves it")
    print(f"{'transfer':28s} {'points':>6s} {'moved p50':>9s} {'p90':>6s} {'unmoved p50':>11s}")
    for kind, (moved, unmoved) in transfers(ops).items():
        print(f"{kind:28s} {len(moved):6d} {np.median(moved):9.1%} "
              f"{np.percentile(moved, 90):6.1%} {np.median(unmoved):11.1%}")
    moves, groups, unshared = fused_ep_moves(ops)
    print(f"\nFused MoE from EP 1 to the EP sizes measured, on {args.system}: {unshared} of "
          f"{groups} (dtype, shape, moe_tp) groups time more than a rank's share at EP > 1 "
          "and are not read; the others, moved from EP 1 by the roofline, 256+ tokens")
    _print_against("kernel", moves, "no other-rank rows")
    moves, groups, underread = routing_moves(ops)
    print(f"\nFused MoE at EP 1 from balanced to random routing, against the rows measured with "
          f"power-law routing (alpha 1.01), on {args.system}: {underread} of {groups} (dtype, "
          "shape, moe_tp) groups compute fewer experts than balanced routing reaches and are "
          "not read; the others at the token counts where the two routings reach different "
          "expert counts")
    _print_against("kernel", moves, "balanced as is")
    print(f"\nExpert load: the busiest EP rank as pdsim prices it, no EPLB (wide-EP uniform "
          f"rows at its tokens; fused-MoE balanced rows moved by the roofline ratio) against "
          f"the rows measured with power-law routing, on {args.system}")
    _print_against("phase", imbalance_checks(ops), "uniform as is")
    print(f"\nMLA decode attention block on {args.system}: aiconfigurator's module table (the "
          "block under a CUDA graph, one rank, 128 heads) against pdsim's ops of it, ms")
    print(f"{'requests':>8s} {'context':>7s} {'module':>7s} {'pdsim':>7s} {'ratio':>6s}")
    for reqs, context, module, priced in mla_block_rows(args.system):
        print(f"{reqs:8d} {context:7d} {module:7.3f} {priced:7.3f} {priced / module:6.2f}")
    for src, dst in (("h100_sxm", "h200_sxm"), ("h200_sxm", "h100_sxm"), ("h100_sxm", "b200_sxm")):
        print(f"\nGPU moves: {src}'s tables priced as a silicon_base of {dst} (each op by the "
              f"ratio of its rooflines on the two GPUs), against {dst}'s own tables")
        print(f"{'op kind':24s} {'points':>6s} {'moved p50':>9s} {'p90':>6s} {'as is p50':>9s}")
        for kind, (got, unmoved) in gpu_moves(src, dst).items():
            print(f"{kind:24s} {len(got):6d} {np.median(got):9.1%} "
                  f"{np.percentile(got, 90):6.1%} {np.median(unmoved):9.1%}")
    print("\nDeepEP from 4 GPUs to 8 in one NVLink domain: gb200's tables (one 4-GPU tray) "
          "priced at 8 GPUs, against b200_sxm's (8 GPUs, the same NVLink rate), 256+ tokens")
    print(f"{'mode':12s} {'points':>6s} {'pdsim p50':>9s} {'p90':>6s} {'as measured p50':>15s} "
          f"{'link roofline p50':>17s}")
    for mode, (got, as_measured, roofline) in deepep_group_moves().items():
        print(f"{mode:12s} {len(got):6d} {np.median(got):9.1%} {np.percentile(got, 90):6.1%} "
              f"{np.median(as_measured):15.1%} {np.median(roofline):17.1%}")
    print("\nDeepEP across nodes: h200_sxm's curves moved to 2, 4 and 8 nodes by the link "
          "roofline, against that node count's measurement")
    print(f"{'mode':12s} {'points':>6s} {'from 1 node p50':>15s} {'p90':>6s} "
          f"{'from nearest multi-node p50':>27s} {'p90':>6s}")
    for mode, (one, near) in deepep_node_moves().items():
        print(f"{mode:12s} {len(one):6d} {np.median(one):15.1%} {np.percentile(one, 90):6.1%} "
              f"{np.median(near):27.1%} {np.percentile(near, 90):6.1%}")
    print("\nH20 kernels as published against the H100's tables moved to the H20, ms "
          "(ratio only: at the datasheet's HBM rate, without the roofline share)")
    print(f"{'kernel':40s} {'measured':>8s} {'pdsim':>6s} {'ratio only':>10s}")
    for label, measured_ms, moved, ratio in h20_kernel_rows():
        print(f"{label:40s} {measured_ms:8.3f} {moved:6.3f} {ratio:10.3f}")
    print("\nDeepEP low-latency kernels (H800, 128 tokens per rank): DeepEP's README vs pdsim, us")
    print(f"{'EP':>4s} {'dispatch':>9s} {'pdsim':>6s} {'combine':>8s} {'pdsim':>6s}")
    errors = []
    for ep, dispatch, d, combine, c in deepep_rows():
        errors += [abs(d / dispatch - 1), abs(c / combine - 1)]
        print(f"{ep:4d} {dispatch:9.0f} {d:6.0f} {combine:8.0f} {c:6.0f}")
    print(f"median |error| {np.median(errors):.1%}, largest {max(errors):.1%}")
    root = Path(args.vidur)
    if not (root / "data").is_dir():
        print(f"(no Vidur data at {root}; skipping the A100 comparison)")
        return
    print("\nSilicon (a100_sxm tables) against Vidur's measured A100 medians, CodeLlama-34B")
    print(f"{'case':42s} {'vidur ms':>9s} {'silicon ms':>11s} {'ratio':>6s}")
    ratios = []
    for label, vidur_ms, silicon_ms in vidur_rows(root):
        ratios.append(silicon_ms / vidur_ms)
        print(f"{label:42s} {vidur_ms:9.3f} {silicon_ms:11.3f} {silicon_ms / vidur_ms:6.2f}")
    print(f"median |ratio - 1| = {np.median(np.abs(np.array(ratios) - 1)):.1%}")


if __name__ == "__main__":
    main()
