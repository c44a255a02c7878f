"""One measured op at the shape a model needs: table rows selected, interpolated, or stood in for.

`OpTables` reads one system's tables (one framework and version) and answers, per op, a `Curve`
over tokens or a `Grid2` over (batch, sequence), in seconds. When the table lacks the exact
shape (a GEMM width off its grid, a head count it never measured, a dtype it lacks, another
expert shape), the nearest measured shape of the same kernel stands in, scaled point by point by
the ratio of the two shapes' rooflines, and the curve is marked as transferred.

Rooflines here are max(FLOPs / peak, bytes / HBM bandwidth) at the GPU's published peaks; they
only ever enter as ratios, so no efficiency constant is involved. A GPU priced from another's
tables (`HardwareSpec.silicon_base`: the same die) moves each measured compute op by the ratio
of its roofline to the table GPU's (the identity where the peaks agree: an H800 is an H100 in
compute; an H20 is the same die at 15 % of its FLOPs), and communication to its own links by
the ratio of the two link rooflines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property, lru_cache, wraps
from typing import TYPE_CHECKING

import numpy as np

from pdsim.sim.cost import (
    experts_reached,
    gdn_kernel_work,
    mla_decode_rows,
    remote_row_bytes,
    ring_link_gb_per_s,
)
from pdsim.sim.moe_comm import deepep_traffic
from pdsim.sim.silicon import tables
from pdsim.sim.silicon.interp import Curve, Grid2, Reference, best_reference
from pdsim.specs.hardware import HardwareSpec, load_hardware_spec
from pdsim.specs.precision import DTYPES, compute_on, gemm_peak_tflops

if TYPE_CHECKING:
    from pathlib import Path

    import pandas as pd

ACT_BYTES = 2
DEEPEP_NUM_SMS = 20  # DeepEP's default SM count for normal-mode kernels (Buffer.num_sms)
# DeepSeek-V3's MLA dimensions, the ones the MLA tables were measured at.
MLA_TABLE_DIMS = (512, 64, 128, 128)  # kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
# MLA context tables whose rows time the absorbed form (one latent KV head: q·k over
# kv_lora + rope dims, values of kv_lora dims) rather than SGLang's prefill form (MHA over
# up-projected K/V, qk_nope + rope and v dims): the Hopper FlashAttention rows. Their time per
# FLOP of the absorbed form matches the MHA-form tables' per FLOP of theirs (~590 TFLOP/s on
# H100/H200 at 8-16k tokens, docs/cost_model.md), 3.4x slower per MHA-form FLOP.
ABSORBED_CONTEXT_KERNELS = frozenset({"flash_attention"})
# Row (M) tile sizes of CUTLASS/cuBLAS/DeepGEMM GEMM kernels on Ampere to Blackwell: one to
# four 64-row warp-group MMAs (Hopper's wgmma is 64 rows; 128 and 256 are the usual CTA tiles).
GEMM_TILE_ROWS = (64, 128, 256)
# The Gated DeltaNet tables' recurrent-state element (FP32) and convolution width (d_conv).
GDN_TABLE_STATE_BYTES = 4
GDN_TABLE_TAPS = 4

# pdsim weight format → the table's dtype names, best first. FP8 checkpoints served by SGLang
# (DeepSeek-V3/R1, Qwen3-FP8, Kimi-K2) are block-quantised (128x128 scales): "fp8_block";
# per-tensor or per-channel ones (ModelOpt, FP8-dynamic) run CUTLASS's "fp8" GEMMs. The MoE
# tables time block-scaled experts only.
GEMM_DTYPES = {
    "bf16": ("bfloat16",), "fp16": ("bfloat16",), "fp8": ("fp8_block", "fp8"),
    "fp8_tensor": ("fp8", "fp8_block"),
    "int8": ("int8_wo",), "w4a16": ("int4_wo",), "w4a16_g32": ("int4_wo",), "nvfp4": ("nvfp4",),
    "mxfp4": ("nvfp4",),
}
MOE_DTYPES = {
    "bf16": ("bfloat16",), "fp16": ("bfloat16",), "fp8": ("fp8_block",),
    "fp8_tensor": ("fp8_block",), "int8": ("fp8_block",),
    "w4a16": ("int4_wo",), "w4a16_g32": ("int4_wo",), "nvfp4": ("nvfp4",),
    "mxfp4": ("w4a16_mxfp4", "w4a8_mxfp4_mxfp8"),
}
# MXFP4 experts on FP4 tensor cores (Blackwell): SGLang's trtllm-gen MoE quantises the
# activations to MXFP8 unless --flashinfer-mxfp4-moe-precision bf16 (its default is
# "default"); elsewhere it runs them weight-only in BF16 (`WEIGHT_ONLY_ON`).
MXFP4_ON_FP4_CORES = ("w4a8_mxfp4_mxfp8", "w4a16_mxfp4")


def moe_dtypes(dtype: str, hw: HardwareSpec) -> tuple[str, ...]:
    """The MoE tables' dtype names for experts in `dtype` on `hw`, best first."""
    if dtype == "mxfp4" and compute_on(dtype, hw) == "fp4":
        return MXFP4_ON_FP4_CORES
    return MOE_DTYPES[dtype]


_TABLE_TO_PDSIM = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "int8_wo": "int8",
                   "int4_wo": "w4a16", "nvfp4": "nvfp4", "w4a16_mxfp4": "w4a16",
                   "w4a8_mxfp4_mxfp8": "mxfp4"}


def _moe_table_format(used: str, hw: HardwareSpec) -> str:
    """The pdsim format the MoE table's `used` rows were measured in. `int4_wo` experts on
    Blackwell are SGLang's flashinfer_trtllm rows, CompressedTensorsMxInt4MoE, which takes
    group-32 symmetric int4 only (its __init__ asserts it): `w4a16_g32`; on Hopper they are
    Marlin rows (aiconfigurator's collector: group 128 unless the model's config says else)."""
    if used == "int4_wo" and hw.blackwell:
        return "w4a16_g32"
    return _TABLE_TO_PDSIM[used]


def _fallbacks(dtype: str, hw: HardwareSpec) -> tuple[str, ...]:
    """Measured dtypes that stand in for a missing one, best first: the same tensor-core path
    if possible (W4A16, and MXFP4 without FP4 tensor cores, compute in BF16); the roofline
    ratio covers the weight-size gap."""
    if compute_on(dtype, hw) == "bf16":
        return ("bfloat16",)
    return ("fp8_block", "fp8", "bfloat16")


def _compute_peaks(hw: HardwareSpec) -> tuple:
    return hw.bf16_tflops, hw.fp8_tflops, hw.fp4_tflops, hw.stream_gb_per_s


def _on_this_gpu(op: Callable) -> Callable:
    """An `OpTables` compute op (a Curve or Grid2 of measured seconds) moved from the tables'
    GPU to this one by the ratio of the op's roofline on each, where their peaks differ. A GPU
    that states the share of its roofline its kernels reach (`HardwareSpec.roofline_share`)
    runs a moved op at least that well, though no faster than the tables' GPU at this GPU's
    memory rate: the tables' GPU's own inefficiency at a compute-bound shape is not carried
    to a GPU of a fraction of its FLOPs."""

    @wraps(op)
    def moved(self: OpTables, *args, **kwargs):
        here = op(self, *args, **kwargs)
        if self._table_gpu is None or here is None:
            return here
        measured = op(self._table_gpu, *args, **kwargs)
        there, roof = measured.roofline, here.roofline
        share = self.hw.roofline_share
        if share is None:
            return measured.scaled(lambda *x: roof(*x) / there(*x))
        memory = self._table_gpu.mem_rate / self.mem_rate
        return measured.moved(lambda t, *x: np.minimum(
            t * roof(*x) / there(*x), np.maximum(t * memory, roof(*x) / share)), roof)

    return moved


class MissingTable(ValueError):
    """The system has no measured table for an op the model needs."""


def _log_distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum(abs(math.log(x / y)) for x, y in zip(a, b))


class OpTables:
    """One system's measured ops for one framework version, with rooflines for scaling."""

    def __init__(self, system: str, framework: str, version: str, hardware: HardwareSpec,
                 table_hardware: HardwareSpec | None = None) -> None:
        if framework not in tables.FRAMEWORKS:
            raise ValueError(
                f"silicon framework {framework!r} is not one of {', '.join(tables.FRAMEWORKS)}"
            )
        self.system, self.framework, self.hw = system, framework, hardware
        self.table_hw = table_hardware or hardware  # the GPU the tables were measured on
        self.version = (tables.current_version(system, framework)
                        if version == "current" else version)
        self.mem_rate = hardware.stream_gb_per_s * 1e9
        self._gemm_refs: dict[tuple[str, int, int], Reference | None] = {}
        # by the fused-MoE table's dtype: its (unshared_ep_shapes, underread_shapes)
        self._unread: dict[str, tuple[set[tuple[int, ...]], set[tuple[int, ...]]]] = {}
        # the same tables with the table GPU's rooflines, where its compute peaks differ
        self._table_gpu = (OpTables(system, framework, version, self.table_hw)
                           if _compute_peaks(self.table_hw) != _compute_peaks(hardware)
                           else None)

    # ----- files -------------------------------------------------------------------------------

    def _table(self, op: str, file: str) -> pd.DataFrame | None:
        path = tables.table_path(self.system, op, self.framework, self.version, file)
        return None if path is None else tables.read_table(path)

    def _need(self, op: str, file: str) -> pd.DataFrame:
        table = self._table(op, file)
        if table is None:
            known = ", ".join(tables.versions_of(self.system, self.framework)) or "none"
            raise MissingTable(
                f"silicon: {self.system} has no {op}/{file} for {self.framework} <= "
                f"{self.version} (versions with tables: {known})"
            )
        return table

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s peak for pdsim `dtype` weights (BF16's where the GPU lacks the format)."""
        try:
            return gemm_peak_tflops(dtype, self.hw) * 1e12
        except ValueError:
            return self.hw.bf16_tflops * 1e12

    # ----- GEMM --------------------------------------------------------------------------------

    @cached_property
    def _gemm_series(self) -> dict[str, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]]:
        """dtype → (n, k) → (m grid, seconds), the fastest kernel at each point."""
        t = self._need("gemm", "gemm_perf.parquet")
        best = t.groupby(["gemm_dtype", "n", "k", "m"], sort=True)["latency"].min().reset_index()
        out: dict[str, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]] = {}
        for (dtype, n, k), g in best.groupby(["gemm_dtype", "n", "k"], sort=True):
            out.setdefault(dtype, {})[(int(n), int(k))] = (
                g["m"].to_numpy(float), g["latency"].to_numpy(float) * 1e-3)
        return out

    def _gemm_terms(self, n: int, k: int, dtype: str) -> tuple[float, Callable]:
        """(compute seconds per row at the format's peak, memory seconds over rows m)."""
        wbytes = DTYPES[dtype].weight_bytes
        mem = self.mem_rate
        return (2.0 * n * k / self.peak_flops(dtype),
                lambda m: (m * k * ACT_BYTES + n * k * wbytes + m * n * ACT_BYTES) / mem)

    def gemm_roofline(self, n: int, k: int, dtype: str) -> Callable:
        row_s, mem_s = self._gemm_terms(n, k, dtype)
        return lambda m: np.maximum(row_s * m, mem_s(m))

    def tile_references(self, n: int, k: int, table_dtype: str) -> tuple[Reference | None, ...]:
        """Candidate tile-quantised references for one measured (n, k) GEMM series, the plain
        cubic (None) first. Each prices a GEMM on whole row tiles: `ceil(m / tile) * tile`
        rows for tile in GEMM_TILE_ROWS, plus, in the `idle` variants, the idle rows of the
        last tile once more (the tables' FP8 kernels run slower just past a tile boundary than
        at its end), with compute and memory time overlapped (max) or in sequence (sum)."""
        row_s, mem_s = self._gemm_terms(n, k, _TABLE_TO_PDSIM[table_dtype])
        refs: list[Reference | None] = [None]
        for tile in GEMM_TILE_ROWS:
            for idle in (0, 1):
                def rows(m: np.ndarray, tile: int = tile, idle: int = idle) -> np.ndarray:
                    padded = np.ceil(m / tile) * tile
                    return padded + idle * (padded - m)
                refs.append(lambda m, rows=rows: np.maximum(row_s * rows(m), mem_s(m)))
                refs.append(lambda m, rows=rows: row_s * rows(m) + mem_s(m))
        return tuple(refs)

    def _gemm_reference(self, table_dtype: str, n: int, k: int) -> Reference | None:
        """The tile reference that predicts this measured series' own points best when each
        is hidden in turn (`best_reference`), cached per series."""
        key = (table_dtype, n, k)
        if key not in self._gemm_refs:
            ms, ys = self._gemm_series[table_dtype][(n, k)]
            self._gemm_refs[key] = best_reference(ms, ys, self.tile_references(n, k, table_dtype))
        return self._gemm_refs[key]

    @_on_this_gpu
    def gemm(self, n: int, k: int, dtype: str) -> Curve:
        """Seconds of an (m x k) @ (k x n) GEMM with `dtype` weights, over m (tokens)."""
        series = self._gemm_series
        wanted = GEMM_DTYPES[dtype]
        used = next((d for d in wanted if d in series), None)
        if used is None:
            used = next(d for d in _fallbacks(dtype, self.hw) if d in series)
        grid = series[used]
        ns = sorted({nk[0] for nk in grid})
        ks = sorted({nk[1] for nk in grid})
        if n > ns[-1]:  # wider than any measured GEMM (an LM head): column blocks in turn
            pieces = math.ceil(n / ns[-1])
            return self.gemm(math.ceil(n / pieces), k, dtype).times(pieces)
        n_c, k_c = min(max(n, ns[0]), ns[-1]), min(max(k, ks[0]), ks[-1])
        n0, n1 = _bracket(ns, n_c)
        k0, k1 = _bracket(ks, k_c)
        corners = [(a, b) for a in (n0, n1) for b in (k0, k1)]
        if any(c not in grid for c in corners):  # a hole in the grid: take the nearest point
            n0, k0 = n1, k1 = min(grid, key=lambda nk: _log_distance(nk, (n_c, k_c)))
            corners = [(n0, k0)]
        ms = grid[corners[0]][0]
        for c in corners[1:]:
            ms = np.intersect1d(ms, grid[c][0])
        wn = 0.0 if n1 == n0 else math.log(n_c / n0) / math.log(n1 / n0)
        wk = 0.0 if k1 == k0 else math.log(k_c / k0) / math.log(k1 / k0)

        def log_at(nk: tuple[int, int]) -> np.ndarray:
            xs, ys = grid[nk]
            return np.log(ys[np.searchsorted(xs, ms)])

        weights: dict[tuple[int, int], float] = {}  # corner → weight (one corner on the grid)
        for a, wa in ((n0, 1 - wn), (n1, wn)):
            for b, wb in ((k0, 1 - wk), (k1, wk)):
                if wa * wb > 0:
                    weights[(a, b)] = weights.get((a, b), 0.0) + wa * wb
        lz = sum(w * log_at(nk) for nk, w in weights.items())
        refs = [(w, self._gemm_reference(used, *nk)) for nk, w in weights.items()]
        refs = [(w, r) for w, r in refs if r is not None]

        def reference(m: np.ndarray) -> np.ndarray:  # the corners' references, blended as lz
            return np.exp(sum(w * np.log(r(m)) for w, r in refs))

        snapped = (n0 if wn == 0 else n_c, k0 if wk == 0 else k_c)
        have_roof = self.gemm_roofline(*snapped, _TABLE_TO_PDSIM[used])
        curve = Curve(ms, np.exp(lz), have_roof, reference=reference if refs else None)
        if snapped != (n, k) or used not in wanted:
            want_roof = self.gemm_roofline(n, k, dtype)
            curve = curve.scaled(lambda m: want_roof(m) / have_roof(m))
        return curve

    # ----- attention (GQA/MHA) -----------------------------------------------------------------

    def _attention_grid(self, file: str, seq_col: str, heads: int, kv_heads: int, head_dim: int,
                        kv_dtype: str, attn_dtype: str | None,
                        roofline: Callable[[int, int, int], Callable], window: int = 0,
                        floor: Callable[[float, float], float] | None = None) -> Grid2:
        """The table's grid at the nearest measured head shape, moved to the wanted one by
        their roofline ratio; no cell below `floor(batch, seq)` where given."""
        t = self._need("attention", file)
        # sliding-window rows (absent from older tables) time a window of `window_size` tokens
        windowed = "window_size" in t
        if windowed:
            t = t[t["window_size"] == window]
        if window and (not windowed or t.empty):
            raise MissingTable(f"silicon: {self.system} {file} has no rows for a {window}-token "
                               "sliding window")
        t = t[t["kv_cache_dtype"] == kv_dtype]
        if attn_dtype is not None and (t["attn_dtype"] == attn_dtype).any():
            t = t[t["attn_dtype"] == attn_dtype]
        if t.empty:
            raise MissingTable(f"silicon: {self.system} {file} has no kv_cache_dtype {kv_dtype}")
        shapes = t[["num_heads", "num_key_value_heads", "head_dim"]].drop_duplicates()
        want = (heads, kv_heads, head_dim)
        have = min((tuple(int(v) for v in row) for row in shapes.itertuples(index=False)),
                   key=lambda s: (_log_distance(s, want), s))
        sel = t[(t["num_heads"] == have[0]) & (t["num_key_value_heads"] == have[1])
                & (t["head_dim"] == have[2])]
        pivot = sel.pivot_table(index="batch_size", columns=seq_col, values="latency",
                                aggfunc="min").sort_index().sort_index(axis=1)
        bs, ss = pivot.index.to_numpy(float), pivot.columns.to_numpy(float)
        zs = pivot.to_numpy(float) * 1e-3
        roof = roofline(*want)
        if have != want:
            have_roof = roofline(*have)
            zs = zs * np.array([[roof(b, s) / have_roof(b, s) for s in ss] for b in bs])
        if floor is not None:
            zs = np.maximum(zs, np.array([[floor(b, s) for s in ss] for b in bs]))
        return Grid2(bs, ss, zs, roof, transferred=have != want)

    @_on_this_gpu
    def context_attention(self, heads: int, kv_heads: int, head_dim: int, kv_bytes: float,
                          fp8_compute: bool, window: int = 0) -> Grid2:
        """Causal prefill attention over (batch, sequence length), no cached prefix; with a
        `window`, each query attends to at most that many keys."""
        peak = self.peak_flops("fp8" if fp8_compute else "bf16")
        mem = self.mem_rate

        def pairs(s: float) -> float:  # query-key pairs of one causal sequence
            w = min(s, window) if window else s
            return w * (w + 1) / 2 + (s - w) * w

        def roofline(h: int, kvh: int, d: int) -> Callable:
            return lambda b, s: max(
                4.0 * h * d * b * pairs(s) / peak,
                b * s * (2 * h * d * ACT_BYTES + 2 * kvh * d * kv_bytes) / mem)

        return self._attention_grid(
            "context_attention_perf.parquet", "isl", heads, kv_heads, head_dim,
            _kv_name(kv_bytes), "fp8" if fp8_compute else "bfloat16", roofline, window)

    @_on_this_gpu
    def generation_attention(self, heads: int, kv_heads: int, head_dim: int,
                             kv_bytes: float, window: int = 0) -> Grid2:
        """One decode query per request over (batch, context length); with a `window`, over
        at most that many keys. No cell reads the KV faster than the GPU's HBM peak: some
        tables time a cache small enough to stay in L2 between their repeats (L40S: 4,822 of
        its 30,902 full-attention rows, up to 4.7x its 864 GB/s), which a serving step, its
        other layers' weights read in between, cannot."""
        peak = self.peak_flops("bf16")
        mem = self.mem_rate
        hbm = self.hw.hbm_gb_per_s * 1e9

        def keys(c: float) -> float:
            return min(c, window) if window else c

        def roofline(h: int, kvh: int, d: int) -> Callable:
            def seconds(b: float, c: float) -> float:
                return max(4.0 * h * d * b * keys(c) / peak,
                           b * (keys(c) * 2 * kvh * d * kv_bytes + 2 * h * d * ACT_BYTES) / mem)
            return seconds

        def kv_read(b: float, c: float) -> float:
            return b * keys(c) * 2 * kv_heads * head_dim * kv_bytes / hbm

        return self._attention_grid("generation_attention_perf.parquet", "step", heads, kv_heads,
                                    head_dim, _kv_name(kv_bytes), None, roofline, window,
                                    floor=kv_read)

    # ----- MLA ---------------------------------------------------------------------------------

    def _mla_grid(self, t: pd.DataFrame, seq_col: str, heads: int, kv_bytes: float,
                  roofline: Callable[[int], Callable], measured: Callable[[int], Callable],
                  same_op: bool) -> Grid2:
        """An MLA table's grid at the nearest measured head count, moved to `heads` of the
        model's op (`roofline`) from the measured op (`measured`) by their roofline ratio
        unless the two are the same op (`same_op`) at the same head count."""
        kv = _kv_name(kv_bytes)
        if (t["kv_cache_dtype"] == kv).any():
            t = t[t["kv_cache_dtype"] == kv]
        have = min(sorted(t["num_heads"].unique()), key=lambda h: abs(math.log(h / heads)))
        sel = t[t["num_heads"] == have]
        pivot = sel.pivot_table(index="batch_size", columns=seq_col, values="latency",
                                aggfunc="min").sort_index().sort_index(axis=1)
        bs, ss = pivot.index.to_numpy(float), pivot.columns.to_numpy(float)
        zs = pivot.to_numpy(float) * 1e-3
        roof = roofline(heads)
        exact = have == heads and same_op
        if not exact:
            have_roof = measured(int(have))
            zs = zs * np.array([[roof(b, s) / have_roof(b, s) for s in ss] for b in bs])
        return Grid2(bs, ss, zs, roof, transferred=not exact)

    @_on_this_gpu
    def mla_context(self, heads: int, dims: tuple[int, int, int, int], kv_bytes: float,
                    absorbed: bool = False) -> Grid2:
        """MLA prefill attention per GPU heads, in the form SGLang runs it for the model's MLA
        `dims` (kv_lora_rank, qk_rope, qk_nope, v_head_dim): MHA over K/V up-projected from
        the latent (q·k over qk_nope + rope dims, v_head_dim values), or with `absorbed`
        decode's form (q·k over kv_lora + rope dims, kv_lora values, the latent cache read;
        pdsim.sim.cost.mla_extend_form). A table that timed the other form
        (ABSORBED_CONTEXT_KERNELS time the absorbed one) is moved by the ratio of the two
        forms' rooflines."""
        peak, mem = self.peak_flops("bf16"), self.mem_rate
        t = self._need("mla", "context_mla_perf.parquet")
        lora0, rope0, nope0, v0 = MLA_TABLE_DIMS
        lora, rope, nope, v = dims
        table_absorbed = bool(t["kernel_source"].isin(ABSORBED_CONTEXT_KERNELS).all())
        if table_absorbed and not absorbed:  # the MHA form attends over freshly up-projected
            kv_bytes = ACT_BYTES  # BF16 K/V, whatever the cache holds: the closer rows

        def mha(qk: int, vd: int) -> Callable[[int], Callable]:
            return lambda h: lambda b, s: max(
                2.0 * h * (qk + vd) * b * s * (s + 1) / 2 / peak,
                b * s * h * (2 * qk + 2 * vd) * ACT_BYTES / mem)

        def latent(lat: int, rd: int) -> Callable[[int], Callable]:
            return lambda h: lambda b, s: max(
                2.0 * h * (2 * lat + rd) * b * s * (s + 1) / 2 / peak,
                b * s * (h * (2 * lat + rd) * ACT_BYTES + (lat + rd) * kv_bytes) / mem)

        want = latent(lora, rope) if absorbed else mha(nope + rope, v)
        measured = latent(lora0, rope0) if table_absorbed else mha(nope0 + rope0, v0)
        return self._mla_grid(t, "isl", heads, kv_bytes, want, measured,
                              absorbed == table_absorbed and dims == MLA_TABLE_DIMS)

    @_on_this_gpu
    def mla_generation(self, heads: int, dims: tuple[int, int, int, int],
                       kv_bytes: float) -> Grid2:
        """MLA decode attention over the compressed latent, per GPU heads."""
        peak, mem = self.peak_flops("bf16"), self.mem_rate

        def roofline(latent_dim: int, rope_dim: int) -> Callable[[int], Callable]:
            return lambda h: lambda b, c: max(
                2.0 * mla_decode_rows(h) * (2 * latent_dim + rope_dim) * b * c / peak,
                b * c * (latent_dim + rope_dim) * kv_bytes / mem)

        t = self._need("mla", "generation_mla_perf.parquet")
        return self._mla_grid(t, "step", heads, kv_bytes, roofline(dims[0], dims[1]),
                              roofline(*MLA_TABLE_DIMS[:2]), dims == MLA_TABLE_DIMS)

    @_on_this_gpu
    def mla_bmm(self, kind: str, heads: int, dim_in: int, dim_out: int,
                table_dims: tuple[int, int]) -> Curve:
        """The absorbed per-head BMMs of MLA decode (kind "pre": q_nope x W_UK, "post":
        out x W_UV), BF16, over tokens; `table_dims`: the (in, out) the table measured."""
        t = self._need("mla_bmm", "mla_bmm_perf.parquet")
        t = t[(t["op_name"] == f"mla_gen_{kind}") & (t["bmm_dtype"] == "bfloat16")]
        have = min(sorted(t["num_heads"].unique()), key=lambda h: abs(math.log(h / heads)))
        g = t[t["num_heads"] == have].groupby("num_tokens")["latency"].min()
        peak, mem = self.peak_flops("bf16"), self.mem_rate

        def roofline(h: int, d_in: int, d_out: int) -> Callable:
            return lambda m: np.maximum(
                2.0 * m * h * d_in * d_out / peak,
                (h * d_in * d_out + m * h * (d_in + d_out)) * ACT_BYTES / mem)

        got = roofline(int(have), *table_dims)
        curve = Curve(g.index.to_numpy(float), g.to_numpy(float) * 1e-3, got)
        if (have, *table_dims) != (heads, dim_in, dim_out):
            want = roofline(heads, dim_in, dim_out)
            curve = curve.scaled(lambda m: want(m) / got(m))
        return curve

    # ----- linear attention (Gated DeltaNet) ---------------------------------------------------

    def _gdn_roofline(self, kernel: str, k_heads: int, v_heads: int, dk: int, dv: int,
                      state_bytes: float) -> Callable[[float, float], float]:
        """Seconds of one Gated DeltaNet kernel of one layer over (batch, sequence) at this
        GPU's peaks (`gdn_kernel_work`, with the tables' 4-tap convolution), for moving a
        measured shape or state dtype to another and past the grid."""
        peak, mem = self.peak_flops("bf16"), self.mem_rate

        def seconds(b, s):
            flops, nbytes = gdn_kernel_work(kernel, b, s, k_heads, v_heads, dk, dv,
                                            state_bytes, GDN_TABLE_TAPS)
            return np.maximum(flops / peak, nbytes / mem)

        return seconds

    def _gdn_rows(self, phase: str, kernel: str, want: tuple) -> tuple[pd.DataFrame, tuple]:
        """The GDN table's rows of `kernel` at the measured (k heads, v heads, dk, dv, state
        bytes) nearest `want`, and that shape."""
        t = self._need("linear_attention", "gdn_perf.parquet")
        t = t[(t["phase"] == phase) & (t["kernel_source"] == kernel)]
        if t.empty:
            raise MissingTable(f"silicon: {self.system} gdn_perf has no {kernel} rows")
        cols = ["num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"]
        shapes = [tuple(int(v) for v in r) for r in t[cols].drop_duplicates().itertuples(False)]
        have = min(shapes, key=lambda s: (_log_distance(s, want[:4]), s))
        return t[(t[cols] == list(have)).all(axis=1)], (*have, GDN_TABLE_STATE_BYTES)

    @_on_this_gpu
    def gdn_context(self, kernel: str, k_heads: int, v_heads: int, dk: int, dv: int,
                    state_bytes: float) -> Grid2:
        """A prefill kernel of one Gated DeltaNet layer ("causal_conv1d_fn" or
        "chunk_gated_delta_rule") over (batch, sequence length), per attention-TP rank's
        heads, with `state_bytes` an element of the recurrent state, as SGLang's hybrid
        linear-attention backend runs it."""
        want = (k_heads, v_heads, dk, dv, state_bytes)
        sel, have = self._gdn_rows("context", kernel, want)
        pivot = sel.pivot_table(index="batch_size", columns="seq_len", values="latency",
                                aggfunc="min").sort_index().sort_index(axis=1)
        bs, ss = pivot.index.to_numpy(float), pivot.columns.to_numpy(float)
        zs = pivot.to_numpy(float) * 1e-3
        roof = self._gdn_roofline(kernel, *want)
        if have != want:
            have_roof = self._gdn_roofline(kernel, *have)
            zs = zs * np.array([[roof(b, s) / have_roof(b, s) for s in ss] for b in bs])
        return Grid2(bs, ss, zs, roof, transferred=have != want)

    @_on_this_gpu
    def gdn_generation(self, kernel: str, k_heads: int, v_heads: int, dk: int, dv: int,
                       state_bytes: float) -> Curve:
        """A decode kernel of one Gated DeltaNet layer ("causal_conv1d_update" or
        "fused_recurrent_gated_delta_rule_packed_decode") over the batch: one token per
        request, whatever its context (the state is of fixed size)."""
        want = (k_heads, v_heads, dk, dv, state_bytes)
        sel, have = self._gdn_rows("generation", kernel, want)
        g = sel.groupby("batch_size")["latency"].min()
        roof, have_roof = self._gdn_roofline(kernel, *want), self._gdn_roofline(kernel, *have)
        curve = Curve(g.index.to_numpy(float), g.to_numpy(float) * 1e-3,
                      lambda b: have_roof(b, 1))
        if have != want:
            curve = curve.scaled(lambda b: roof(b, 1) / have_roof(b, 1))
        return curve

    # ----- MoE ---------------------------------------------------------------------------------

    def moe_roofline(self, hidden: int, inter: int, topk: int, experts: int, moe_tp: int,
                     moe_ep: int, dtype: str, fused: bool = False, random: bool = False
                     ) -> Callable:
        """One MoE layer's routed experts on one rank over the layer's tokens, routed as the
        tables' collectors route them: balanced, each token's top-k on distinct experts spread
        over all of them, so min(experts, tokens * topk) experts hold tokens (a transfer must
        price both shapes the way the measured one was routed); `random`: each token's top-k
        drawn at random, `experts_reached` of them, as the roofline cost model counts them.
        `fused`: a kernel that also moves the rows of other ranks' experts (`remote_row_bytes`:
        SGLang's Triton and Marlin MoE, `ALL_ROW_KERNELS`); DeepEP, and FlashInfer's kernels,
        which route inside, give a rank its own rows only. The callable's `load` prices a rank
        holding that many times its share of the routed rows (FLOPs, activations) over the
        same experts (weights), as the busiest EP rank does; with `random`, its routed copies
        land at random on its experts too, so it reaches as many as `load` times the tokens
        would (`experts_reached(experts, topk, load * tokens) / moe_ep`: a rank's share of the
        copies spread over its `experts / moe_ep` experts)."""
        wbytes = DTYPES[dtype].weight_bytes
        peak, mem = self.peak_flops(dtype), self.mem_rate
        slice_ = inter / moe_tp
        remote = remote_row_bytes(hidden, slice_, topk, moe_ep) if fused else 0.0

        def roofline(tokens, load=1.0):
            pairs = load * tokens * topk / moe_ep
            hit = (experts_reached(experts, topk, load * np.asarray(tokens, float)) if random
                   else np.minimum(experts, tokens * topk)) / moe_ep
            return np.maximum(6.0 * hidden * slice_ * pairs / peak,
                              (hit * 3 * hidden * slice_ * wbytes
                               + pairs * (2 * hidden + 3 * slice_) * ACT_BYTES) / mem
                              ) + tokens * remote / mem

        return roofline

    @_on_this_gpu
    def moe(self, hidden: int, inter: int, topk: int, experts: int, moe_tp: int, moe_ep: int,
            dtype: str, distribution: str) -> Curve:
        """Routed experts of one MoE layer (fused MoE kernel) over the layer's total tokens;
        the balanced rows moved to random routing (docs/cost_model.md, "Random routing"): at
        EP > 1 the mean rank's, which `moe_roofline(..., random=True)`'s `load` moves to the
        busiest rank."""
        import pandas as pd  # here, not at import: the roofline-only simulator never reads a table
        t = self._need("moe", "moe_perf.parquet")
        wanted = moe_dtypes(dtype, self.hw)
        present = set(t["moe_dtype"].unique())
        used = next((d for d in wanted if d in present), None)
        if used is None:
            used = next(d for d in _fallbacks(dtype, self.hw) if d in present)
        t = t[t["moe_dtype"] == used]
        if used not in self._unread:
            self._unread[used] = (
                unshared_ep_shapes(t),
                underread_shapes(t, DTYPES[_moe_table_format(used, self.table_hw)].weight_bytes,
                                 self.table_hw.hbm_gb_per_s))
        unshared, underread = self._unread[used]
        if (t["distribution"] == distribution).any():
            t = t[t["distribution"] == distribution]
        else:
            raise ValueError(
                f"silicon moe_distribution {distribution!r} is not in the table; allowed: "
                f"{', '.join(sorted(t['distribution'].unique()))}")
        key = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size"]
        configs = [c for c in (tuple(int(v) for v in r)
                               for r in t[key].drop_duplicates().itertuples(False))
                   if c[:5] not in underread and (c[5] == 1 or c[:5] not in unshared)]
        want = (hidden, inter, topk, experts, moe_tp, moe_ep)
        have = min(configs, key=lambda c: (_log_distance(c, want), c))
        sel = t[(t[key] == pd.Series(have, index=key)).all(axis=1)]
        g = sel.groupby("num_tokens")["latency"].min()
        fused = all(map(keeps_all_rows, sel["kernel_source"].unique()))
        have_roof = self.moe_roofline(*have, _moe_table_format(used, self.table_hw),
                                      fused=fused)
        if have == want and used in wanted:
            curve = Curve(g.index.to_numpy(float), g.to_numpy(float) * 1e-3, have_roof)
        else:
            curve = moved_expert_curve(g, have, have_roof, want,
                                       self.moe_roofline(*want, dtype, fused=fused))
        if distribution != "balanced":  # power-law rows are routed as measured
            return curve
        return curve.scaled(self.random_routing(*want, dtype, fused),
                            transferred=curve.transferred)

    def random_routing(self, hidden: int, inter: int, topk: int, experts: int, moe_tp: int,
                       moe_ep: int, dtype: str, fused: bool) -> Callable:
        """The factor (over tokens) that moves a fused-MoE curve measured with the tables'
        balanced routing to random routing, which reaches fewer experts: the ratio of the two
        MoE rooflines."""
        shape = (hidden, inter, topk, experts, moe_tp, moe_ep, dtype)
        random = self.moe_roofline(*shape, fused=fused, random=True)
        balanced = self.moe_roofline(*shape, fused=fused)
        return lambda tokens: random(tokens) / balanced(tokens)

    @_on_this_gpu
    def wideep_moe(self, phase: str, hidden: int, inter: int, topk: int, experts: int, ep: int,
                   dtype: str, distribution: str) -> Curve | None:
        """Routed experts under DeepEP (DeepGEMM grouped GEMMs; phase "context" for normal
        mode, "generation" for low-latency mode) over the layer's total tokens; None when the
        system has no such table. The tables measure DeepSeek-V3's expert shape in FP8 blocks:
        another expert shape, dtype or EP size is moved from the nearest measured one by the
        ratio of the two MoE rooflines (`moe_roofline`), and counted as transferred. The context
        table's rows carry the time of rows a real dispatch never delivers (`idle_rows`); it
        is taken out first. Their "uniform" rows route balanced (every local expert the same
        tokens, `min(experts, tokens * topk) / ep` of them busy); the curve is moved to random
        routing by the MoE rooflines' ratio, as the fused-MoE one is (`random_routing`): read at
        the busiest rank's tokens it then reaches that rank's experts, not more."""
        import pandas as pd
        t = self._table("moe", f"wideep_{phase}_moe_perf.parquet")
        if t is None:
            return None
        wanted = "uniform" if distribution == "balanced" else distribution
        t = t[t["moe_tp_size"] == 1]
        if not (t["distribution"] == wanted).any():
            raise ValueError(
                f"silicon moe_distribution {distribution!r} is not in the wide-EP table; "
                f"allowed: balanced, {', '.join(sorted(set(t['distribution']) - {'uniform'}))}")
        t = t[t["distribution"] == wanted]
        present = set(t["moe_dtype"].unique())
        used = next((d for d in (*moe_dtypes(dtype, self.hw), *_fallbacks(dtype, self.hw))
                     if d in present),
                    sorted(present)[0])
        t = t[t["moe_dtype"] == used]
        key = ["hidden_size", "inter_size", "topk", "num_experts", "moe_ep_size"]
        configs = [tuple(int(v) for v in r) for r in t[key].drop_duplicates().itertuples(False)]
        want = (hidden, inter, topk, experts, ep)
        # the nearest expert shape, then the nearest EP size measured at it
        shape = min({c[:4] for c in configs}, key=lambda c: (_log_distance(c, want[:4]), c))
        have_ep = min((c[4] for c in configs if c[:4] == shape),
                      key=lambda e: (abs(math.log(e / ep)), e))
        have = (*shape, have_ep)
        sel = t[(t[key] == pd.Series(have, index=key)).all(axis=1)]
        g = sel.groupby("num_tokens")["latency"].min()
        if phase == "context":
            g = without_idle_rows(g, t[(t[key[:4]] == pd.Series(shape, index=key[:4])).all(
                axis=1)], have_ep, shape[2])
        have_roof = self.moe_roofline(*shape, 1, have_ep, _moe_table_format(used, self.table_hw))
        if have == want and used in moe_dtypes(dtype, self.hw):
            curve = Curve(g.index.to_numpy(float), g.to_numpy(float) * 1e-3, have_roof)
        else:
            curve = moved_expert_curve(g, have, have_roof, want,
                                       self.moe_roofline(hidden, inter, topk, experts, 1, ep,
                                                         dtype))
        if wanted != "uniform":  # power-law rows: the busiest rank as measured
            return curve
        return curve.scaled(self.random_routing(hidden, inter, topk, experts, 1, ep, dtype,
                                                False), transferred=curve.transferred)

    # ----- communication -----------------------------------------------------------------------

    def _collective(self, t: pd.DataFrame, gpus: int, hidden: int) -> Curve:
        """A collective's curve over tokens of `hidden` BF16 elements on `gpus`, moved from the
        nearest measured GPU count, and from the tables' GPU's links to this GPU's, by the
        ratio of the two ring rooflines. The tables' `message_size` counts elements, not
        bytes: aiconfigurator's collectors log nccl-tests' byte size over the dtype's width
        (`collect_nccl.py`) and the element count of the all-reduced tensor
        (`collect_all_reduce.py`)."""
        have = min(sorted(int(g) for g in t["num_gpus"].unique()),
                   key=lambda g: (abs(math.log(g / gpus)), -g))
        g = t[t["num_gpus"] == have].groupby("message_size")["latency"].min()
        tok_bytes = hidden * ACT_BYTES
        link = ring_link_gb_per_s(self.table_hw, have) * 1e9
        want_link = ring_link_gb_per_s(self.hw, gpus) * 1e9

        def ring(n: int, gbps: float) -> Callable:
            return lambda tokens: 10e-6 + 2 * (n - 1) / n * tokens * tok_bytes / gbps

        curve = Curve(g.index.to_numpy(float) / hidden, g.to_numpy(float) * 1e-3,
                      ring(have, link))
        if have != gpus or want_link != link:
            want, got = ring(gpus, want_link), ring(have, link)
            curve = curve.scaled(lambda x: want(x) / got(x))
        return curve

    def all_reduce(self, gpus: int, hidden: int) -> Curve:
        """The faster of SGLang's custom all-reduce (CUDA-graph mode) and NCCL's at each
        message size, as SGLang uses custom all-reduce only where it wins (small messages,
        NVLink)."""
        t = self._table("comm", "custom_allreduce_perf.parquet")
        if t is not None and "backend" in t and (t["backend"] == "sglang_graph").any():
            t = t[t["backend"] == "sglang_graph"]
        nccl = self.nccl("all_reduce", gpus, hidden) if tables.nccl_path(self.system) else None
        if t is None or gpus > int(t["num_gpus"].max()):
            if nccl is None:
                raise MissingTable(f"silicon: {self.system} has no all-reduce table")
            return nccl
        custom = self._collective(t, gpus, hidden)
        if nccl is None:
            return custom
        xs = np.union1d(custom.grid, nccl.grid)
        xs = xs[(xs >= max(custom.lo, nccl.lo)) & (xs <= min(custom.hi, nccl.hi))]
        return Curve(xs, np.minimum(custom.values(xs), nccl.values(xs)), custom.roofline,
                     custom.transferred and nccl.transferred)

    def nccl(self, op: str, gpus: int, hidden: int) -> Curve:
        path = tables.nccl_path(self.system)
        if path is None:
            raise MissingTable(f"silicon: {self.system} has no NCCL table (comm/nccl)")
        t = tables.read_table(path)
        t = t[(t["op_name"] == op) & (t["nccl_dtype"] == "half")]
        return self._collective(t, gpus, hidden)

    def deepep(self, mode: str, hidden: int, topk: int, experts: int, ep: int,
               calls: tuple[str, ...] = ("dispatch", "combine")) -> Curve | None:
        """DeepEP's `calls` (dispatch and combine, or one of them; mode "low_latency" or
        "normal") over tokens per GPU; None when the system has no DeepEP table.

        The tables count the measured machines' nodes (`node_num`; `tables.gpus_per_node`: 8
        GPUs on HGX boards, 4 on a GB200 tray) and have no EP-size column: an EP group inside
        one NVLink domain reads node_num 1, a larger one `ceil(ep / node size)` nodes, taken
        from the newest version that measured that many (older releases measured multi-node
        runs). A shape, group size or node count the tables lack is scaled from the nearest
        measured one by the ratio of DeepEP's link-time roofline (pdsim.sim.moe_comm) and
        counted; but normal mode keeps its measured group size inside one NVLink domain."""
        file = f"wideep_deepep_{'ll' if mode == 'low_latency' else 'normal'}_perf.parquet"
        paths = tables.table_paths(self.system, "comm", self.framework, self.version, file)
        if not paths:
            return None
        args = (mode, hidden, topk, experts, calls)
        if ep > self.hw.gpus_per_node and not _multi_node(paths):
            # Beyond one NVLink domain the NICs carry the traffic: a curve measured over
            # several nodes (another GPU's, on the same kind of NIC) moves there far better
            # than a one-node curve, whose pace is NVLink's (docs/cost_model.md, "Known
            # limits (silicon)").
            donor = multi_node_donor(self.framework, file)
            if donor is not None:
                system, donor_paths = donor
                donor_hw = load_hardware_spec(tables.preset_for(system))
                node = self.hw.gpus_per_node
                moved = self._deepep_curve(system, donor_paths, donor_hw, *args, ep)
                # The donor GPU's per-call floor is its own: keep the destination's. The
                # donor's curve over several nodes moves by the difference between the two
                # GPUs' one-node curves at one token (kernel launch, barrier, the GPU's own
                # pace; the link roofline already moved the bytes), and never undercuts the
                # destination's own one node: more peers over RDMA cannot be faster than
                # fewer over NVLink (docs/cost_model.md, "DeepEP across GPU families").
                own = self._deepep_curve(self.system, paths, self.table_hw, *args, node)
                donor_one = self._deepep_curve(system, donor_paths, donor_hw, *args, node)
                shift = own(1.0) - donor_one(1.0)
                return moved.moved(lambda t, x: np.maximum(t + shift, own.values(x)),
                                   lambda x: np.maximum(moved.roofline(x) + shift,
                                                        own.roofline(x)))
        return self._deepep_curve(self.system, paths, self.table_hw, *args, ep)

    def _deepep_curve(self, system: str, paths: tuple[Path, ...], table_hw: HardwareSpec,
                      mode: str, hidden: int, topk: int, experts: int, calls: tuple[str, ...],
                      ep: int) -> Curve:
        """`deepep` from one system's tables (`paths`, measured on `table_hw`)."""
        import pandas as pd
        node_gpus = tables.gpus_per_node(system)
        nodes = 1 if ep <= self.hw.gpus_per_node else math.ceil(ep / node_gpus)
        frames, seen = [], set()
        for path in paths:  # newest first: each node count from the newest table holding it
            t = tables.read_table(path)
            t = t[~t["node_num"].isin(seen)]
            seen.update(int(n) for n in t["node_num"].unique())
            frames.append(t)
        t = deepep_seconds(pd.concat(frames), mode, calls)
        key = ["hidden_size", "num_topk", "num_experts", "node_num"]
        configs = [tuple(int(v) for v in r) for r in t[key].drop_duplicates().itertuples(False)]
        want = (hidden, topk, experts, nodes)
        have = min(configs, key=lambda c: (_log_distance(c, want), c))
        sel = t[(t[key] == pd.Series(have, index=key)).all(axis=1)]
        g = sel.groupby("num_token")["seconds"].min()

        # The tables' runs: node_num nodes of node_gpus GPUs, one NVLink domain each.
        have_group = node_gpus * have[3]
        have_roof = deepep_link_roofline(mode, have[0], have[1], have_group, node_gpus,
                                         table_hw)
        curve = Curve(g.index.to_numpy(float), g.to_numpy(float), have_roof)
        # Normal-mode kernels inside one NVLink domain are held by their SMs, not the links:
        # B200's 8-GPU tables sit 10 % (median) from GB200's 4-GPU ones where the link
        # roofline moves the latter 28 % off (benchmarks/fidelity_components.py). There the
        # group keeps its measured size; low-latency kernels follow the link roofline (3 %).
        group = have_group if mode == "normal" and nodes == have[3] == 1 else ep
        if have != want or group != have_group or _links(table_hw) != _links(self.hw):
            want_roof = deepep_link_roofline(mode, hidden, topk, group,
                                             min(group, self.hw.gpus_per_node), self.hw)
            curve = curve.scaled(lambda x: want_roof(x) / have_roof(x))
        return curve


def deepep_seconds(t: pd.DataFrame, mode: str,
                   calls: tuple[str, ...] = ("dispatch", "combine")) -> pd.DataFrame:
    """A DeepEP table's rows with `seconds`, the time of `calls`: low latency's average per
    call; normal mode's transmit and notify at SGLang's default SM count."""
    if mode == "normal":
        t = t[t["dispatch_sms"] == DEEPEP_NUM_SMS]
        columns = [f"{call}_{kind}_us" for call in calls for kind in ("transmit", "notify")]
    else:
        columns = [f"{call}_avg_t_us" for call in calls]
    return t.assign(seconds=t[columns].sum(axis=1) * 1e-6)


def _multi_node(paths: tuple[Path, ...]) -> bool:
    """Whether any of these DeepEP tables measured a run over more than one node."""
    return any((tables.read_table(path)["node_num"] > 1).any() for path in paths)


@lru_cache(maxsize=None)
def multi_node_donor(framework: str, file: str) -> tuple[str, tuple[Path, ...]] | None:
    """(system, its tables newest first) of the first system whose DeepEP `file` measured runs
    over several nodes (the HGX H100/H200 tables: 1-8 nodes), or None."""
    for system in tables.SYSTEMS.values():
        paths = tables.table_paths(system, "comm", framework,
                                   tables.current_version(system, framework), file)
        if paths and _multi_node(paths):
            return system, paths
    return None


def deepep_link_roofline(mode: str, hidden: int, topk: int, group: int, domain: int,
                         hw: HardwareSpec) -> Callable:
    """DeepEP dispatch + combine over `group` GPUs in NVLink domains of `domain`, at `hw`'s
    link rates (seconds over tokens per GPU): the ratio that moves a measured curve."""
    one = deepep_traffic(1.0, hidden, topk, group, domain, mode)
    nvlink, rdma = hw.nvlink_gb_per_s * 1e9, hw.rdma_gb_per_s * 1e9
    per_token = sum(max(c.nvlink_bytes / nvlink, c.rdma_bytes / rdma)
                    for c in (one.dispatch, one.combine))
    return lambda tokens: 20e-6 + np.asarray(tokens, float) * per_token


@lru_cache(maxsize=16)
def op_tables(system: str, framework: str, version: str, hardware: HardwareSpec,
              table_hardware: HardwareSpec | None = None) -> OpTables:
    """A shared `OpTables` (its indexed tables serve every plan on that system)."""
    return OpTables(system, framework, version, hardware, table_hardware)


def idle_rows(tokens: np.ndarray, ep: int, topk: int) -> np.ndarray:
    """Rows of a wide-EP context-table point that no local expert takes. aiconfigurator's
    collector (`collect_wideep_deepep_moe.py`) hands each rank all `tokens` of the EP group
    (`num_token * num_rank` rows, each with its share of the rank's routed pairs), where
    DeepEP's normal dispatch delivers a rank only the tokens routed to one of its experts:
    `tokens * (1 - (1 - 1/ep)^topk)` of them (uniform routing). The rest are scattered and
    gathered all the same (`ep_scatter`, `ep_gather`): a cost that grows with EP at equal work
    per rank (H200, 2,048 tokens a rank: 3.5x the EP 8 time at EP 256), which SGLang does not
    pay."""
    return tokens * (1.0 - 1.0 / ep) ** topk


def excess_row_ms(t: pd.DataFrame) -> float:
    """Milliseconds per idle row (`idle_rows`) in a wide-EP context table of one expert shape:
    at each per-rank pair count (`tokens * topk / ep`) measured at three or more EP sizes the
    latency grows linearly with the idle rows; the slope, fitted over all such pair counts
    with one intercept each (5-8.5 ns a row on Hopper and Blackwell, uniform routing)."""
    u = t[t["distribution"] == "uniform"]
    dx, dy = [], []
    for _, level in u.groupby(u["num_tokens"] * u["topk"] / u["moe_ep_size"]):
        best = level.groupby(["moe_ep_size", "num_tokens"], as_index=False)["latency"].min()
        if len(best) < 3:
            continue
        x = idle_rows(best["num_tokens"].to_numpy(float), best["moe_ep_size"].to_numpy(float),
                      int(u["topk"].iloc[0]))
        dx.append(x - x.mean())
        dy.append(best["latency"].to_numpy(float) - best["latency"].mean())
    if not dx:
        return 0.0
    dx, dy = np.concatenate(dx), np.concatenate(dy)
    return max(0.0, float(dx @ dy / (dx @ dx)))


def without_idle_rows(measured: pd.Series, same_shape: pd.DataFrame, ep: int,
                      topk: int) -> pd.Series:
    """A wide-EP context curve (ms by tokens, at `ep`) less the time of its idle rows, at
    the slope its table (`same_shape`: one expert shape, every EP size) gives them."""
    return measured - excess_row_ms(same_shape) * idle_rows(measured.index.to_numpy(float), ep,
                                                            topk)


# The fused-MoE tables' kernels (their `kernel_source` prefixes) that keep every token's top-k
# rows under expert parallelism (`remote_row_bytes`). Moved from EP 1 to the measured EP sizes
# by the roofline with those rows, the 0.5.14 tables' Triton rows come out a median -1 to -21 %
# off (H100 to B200), -56 to -61 % without them; FlashInfer's come out +31 to +48 % with them.
ALL_ROW_KERNELS = ("sglang_fused_moe_triton", "sglang_marlin_moe")


def keeps_all_rows(kernel_source: str) -> bool:
    """Whether a fused-MoE table's kernel keeps every token's top-k rows under EP."""
    return kernel_source.startswith(ALL_ROW_KERNELS)

# A fused-MoE row at moe_ep_size k > 1 should time one rank that holds 1/k of the experts and,
# routed balanced, 1/k of the pairs: at the largest tokens measured, EP 2 then takes 0.49-0.60
# of EP 1's time (aiconfigurator-core 0.12's 0.5.14 tables, every shape but one). Where the
# next EP size above 1 takes more than this share of it, the rows time a rank that computes
# most of every token's pairs (docs/cost_model.md, "Fused MoE under EP without DeepEP"):
# they are not read.
EP_ROWS_MAX_SHARE = 0.8


def unshared_ep_shapes(t: pd.DataFrame) -> set[tuple[int, ...]]:
    """The (hidden, inter, topk, experts, moe_tp) of the fused-MoE table `t` (one dtype) whose
    rows at moe_ep_size > 1 do not time one rank's share of the layer, judged on their balanced
    rows: the smallest EP size above 1 takes over `EP_ROWS_MAX_SHARE` of EP 1's time at the
    largest token count both measured."""
    key = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]
    bad = set()
    for shape, rows in t[t["distribution"] == "balanced"].groupby(key):
        by_ep = rows.pivot_table(index="num_tokens", columns="moe_ep_size", values="latency",
                                 aggfunc="min")
        above = [e for e in by_ep.columns if e > 1]
        if 1 not in by_ep.columns or not above:
            continue
        both = by_ep[[1, min(above)]].dropna()
        if not both.empty and both.iloc[-1, 1] > EP_ROWS_MAX_SHARE * both.iloc[-1, 0]:
            bad.add(tuple(int(v) for v in shape))
    return bad


# A rank's expert weights below this size may stay in the L2 cache between a benchmark's
# repeats (the tabled GPUs' L2 caches hold 40-128 MB), so rows that read them faster than the
# HBM can are not judged by `underread_shapes`.
UNDERREAD_MIN_BYTES = 256e6


def underread_shapes(t: pd.DataFrame, weight_bytes: float, hbm_gb_per_s: float
                     ) -> set[tuple[int, ...]]:
    """The (hidden, inter, topk, experts, moe_tp) of the fused-MoE table `t` (one dtype, whose
    weights take `weight_bytes` a parameter) whose balanced EP 1 rows did not route as
    balanced: at some token count where balanced routing sends a token to every expert
    (tokens * topk >= experts; the collector's `balanced_logits`), the row takes less time than
    reading every expert's weights once at the GPU's datasheet HBM rate (`hbm_gb_per_s`), so
    it computed fewer experts than it says. DeepSeek-V3's shape (0.56-0.90 of that floor on
    Hopper and Blackwell): SGLang's grouped top-k (8 groups, best 4) sees every group tie on
    balanced logits and keeps four groups, half the experts."""
    key = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]
    rows = t[(t["distribution"] == "balanced") & (t["moe_ep_size"] == 1)
             & (t["num_tokens"] * t["topk"] >= t["num_experts"])]
    bad = set()
    for shape, ms in rows.groupby(key)["latency"].min().items():
        h, inter, topk, experts, moe_tp = (int(v) for v in shape)
        nbytes = experts * 3 * h * inter / moe_tp * weight_bytes
        if nbytes >= UNDERREAD_MIN_BYTES and ms * 1e-3 < nbytes / (hbm_gb_per_s * 1e9):
            bad.add((h, inter, topk, experts, moe_tp))
    return bad


def moved_expert_curve(measured: pd.Series, have: tuple, have_roof: Callable, want: tuple,
                   want_roof: Callable) -> Curve:
    """A routed-expert curve for an expert shape, dtype or EP size the tables lack, from the
    measured one (`measured`: milliseconds by the layer's tokens; `have` and `want`: (hidden,
    inter, topk, experts, ...)). Each measured point stands for the want-shape's tokens that
    give each expert as many tokens (x * topk / experts), so as many experts are busy (the
    tables route balanced), scaled by the two shapes' rooflines there; counted as transferred.
    Moved at equal tokens instead, a point where half the measured experts idle would price a
    shape whose experts are all busy."""
    xs = measured.index.to_numpy(float)
    want_xs = xs * (want[3] * have[2]) / (have[3] * want[2])
    ys = measured.to_numpy(float) * 1e-3 * want_roof(want_xs) / have_roof(xs)
    return Curve(want_xs, ys, want_roof, transferred=True)


def _bracket(grid: list[int], x: float) -> tuple[int, int]:
    """The grid values just below and above x (equal when x is on the grid)."""
    for a, b in zip(grid, grid[1:]):
        if a <= x <= b:
            return (a, a) if x == a else (b, b) if x == b else (a, b)
    return grid[0], grid[0]


def _links(hw: HardwareSpec) -> tuple[float, float, int]:
    return hw.nvlink_gb_per_s, hw.rdma_gb_per_s, hw.gpus_per_node


def _kv_name(kv_bytes: float) -> str:
    return "fp8" if kv_bytes <= 1 else "bfloat16"
