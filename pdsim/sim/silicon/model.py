"""The silicon cost model: a step is the sum of SGLang's per-layer ops, each a measured time.

Per layer, as SGLang runs it:

- attention block, per attention-DP rank on its own batch (the step waits for the slowest):
  the projection GEMMs (GQA: qkv and o; MLA: q_a/q_b or q, kv_a, o, plus kv_b for prefill
  tokens and the absorbed BMMs for decode tokens), prefill attention over (batch, sequence),
  decode attention over (batch, context), and the attention-TP all-reduce;
- dense MLP (gate_up and down GEMMs) or MoE block (router GEMM, shared-expert GEMMs, the fused
  routed-expert kernel) on the tokens of all ranks; with `moe_dense_tp=1` the dense MLP runs
  whole on each GPU over its own tokens, with no collective;
- the MLP's collective: an all-reduce over tp, or with DP attention an all-gather before and a
  reduce-scatter after; under DeepEP, dispatch + combine (low-latency mode for decode, normal
  for prefill) instead, optionally overlapped with compute by two-batch overlap;
- memory-bound elementwise kernels (norms, RoPE, activation), priced by bandwidth;

and once per step the LM head (over tp on all rows, or with `dp_lm_head` over a rank's GPUs on
its rows), the embedding's and LM head's collectives (`vocab_collectives`), a fixed overhead
and, for steps with prefill tokens, the extend overhead.
`step_breakdown_s` returns these parts by name. Op times come from `OpTables`; lookups are
counted by what their answer rests on: interpolation in a measured table, a measured curve
transferred to this shape, dtype or GPU by a roofline ratio, or extrapolation beyond the grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from pydantic import ConfigDict, Field, ValidationError

from pdsim.core.batch import BatchShape
from pdsim.sim.cost import (
    BREAKDOWN_PARTS,
    Parallelism,
    StepParams,
    VocabCollective,
    check_formats,
    decode_query_scale,
    deepep_normal,
    fp8_attention_kernel,
    layers_attention_s,
    max_rank_decode_reqs,
    micro_batches,
    mla_decode_rows,
    mla_extend_form,
    mla_prefix_threshold,
    overlapped_layers_s,
    pp_send_terms,
    single_batch_overlap_s,
    step_extras,
    tbo_splits,
    tbo_sm_share,
    vocab_collectives,
    with_eager_overhead,
)
from pdsim.sim.forward_shape import StepShape, step_totals
from pdsim.sim.overheads import attention_elementwise_kernels
from pdsim.sim.silicon import tables
from pdsim.sim.silicon.interp import Grid2, Stage
from pdsim.sim.silicon.ops import ACT_BYTES, MLA_TABLE_DIMS, MissingTable, op_tables
from pdsim.specs.hardware import HardwareSpec, load_hardware_spec
from pdsim.specs.models import ModelSpec
from pdsim.specs.pipeline import stage_model

# Per layer, besides the attention block's own (`attention_elementwise_kernels`): two fused
# add+RMSNorms and, in a dense layer, the MLP activation; a Gated DeltaNet block's: the fused
# q/k/v/z split, the gates and the gated RMSNorm. A MoE layer's routed-expert activation runs
# inside the kernels its table times (aiconfigurator's collect_moe.py times SGLang's
# select_experts + fused_moe, whose fused_experts runs the align/sort, both expert GEMMs, the
# SiLU-and-mul and the sum over top-k; collect_wideep_deepep_moe.py times DeepEPMoE's
# run_moe_core, grouped GEMMs and the activation between them), so it adds the shared experts'
# activation kernel if any, and under DeepEP the top-k kernel its table leaves out.
LAYER_ELEMENTWISE_KERNELS = 3
MOE_LAYER_NORM_KERNELS = 2
GDN_ELEMENTWISE_KERNELS = 3


class TracedOp(NamedTuple):
    """One op of a traced step (`SiliconCostModel.trace`): seconds of one call (one layer's,
    one rank's), the BREAKDOWN_PARTS part it counts in, the table it came from and how the
    answer was found: "interpolated" in a measured grid, "transferred" from another measured
    shape, dtype or GPU by a roofline ratio, "extrapolated" beyond the grid, or "roofline";
    `layers`: the share of its part's layers that run it (a sliding-window model's two kinds
    of attention layer)."""

    part: str
    name: str
    table: str
    seconds: float
    how: str
    layers: float = 1.0


def _how(transferred: bool, extrapolated: bool) -> str:
    return "extrapolated" if extrapolated else "transferred" if transferred else "interpolated"


class SiliconParams(StepParams):
    """Knobs of the silicon model (docs/cost_model.md, "The silicon model").

    framework/version: which measured tables (aiconfigurator's framework names; "current" is
    the package's current release for the system). system: the aiconfigurator system, by
    default the one measured for the hardware preset. moe_distribution: the expert-load
    distribution of the MoE table ("balanced", or e.g. "power_law_1.01" for skewed routing:
    such a table already times the busiest rank, so the expert-load model stays off).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    framework: str = "sglang"
    version: str = "current"
    system: str | None = None
    kv_dtype_bytes: float = Field(default=2, gt=0)
    moe_distribution: str = "balanced"
    step_overhead_s: float = Field(default=0.5e-3, ge=0)
    extend_overhead_s: float = Field(default=2e-3, ge=0)
    kernel_floor_s: float = Field(default=2e-6, ge=0)
    bw_efficiency: float = Field(default=0.8, gt=0, le=1)


@dataclass(frozen=True)
class _Plan:
    """Everything a step lookup needs, built once per (model, GPU, parallelism, params)."""

    layers: int
    dense_layers: int
    moe_layers: int
    proj: Stage  # per rank, over its tokens: attention GEMMs + attention-TP all-reduce
    prefill_proj: Stage  # per rank, over its prefill tokens (MLA's kv_b)
    decode_proj: Stage  # per rank, over its decode tokens (MLA's absorbed BMMs)
    context_attn: Grid2
    generation_attn: Grid2
    # MLA extends after a cached prefix (pdsim.sim.cost.mla_extend_form): from
    # `mla_threshold` prefix tokens on kv_b re-projects them, below it the absorbed form
    mla_threshold: int  # 0: not MLA
    prefix_reproject: Stage | None  # over the prefix tokens: kv_b
    context_attn_absorbed: Grid2 | None
    context_table: str  # the tables the two grids were read from
    generation_table: str
    # A sliding-window model's window kernels, and the share of its layers that run them
    context_attn_swa: Grid2 | None
    generation_attn_swa: Grid2 | None
    swa_share: float
    full_share: float  # of the layers: full attention
    linear_share: float  # ... and Gated DeltaNet layers, whose prefill kernels these are:
    context_gdn: tuple[tuple[str, Grid2], ...]
    gen_flops_rel: float  # generation attention at q = 1: FLOP time / max(FLOP, byte time)
    gen_bytes_rel: float  # ... and byte time / max(FLOP, byte time)
    gen_query_scale: Callable[[int], float]  # its FLOPs at q queries a request over at one
    dense_dp: bool  # moe_dense_tp=1: dense MLP whole on each GPU, over its own tokens
    dense: Stage  # over the instance's tokens (or one GPU's, dense_dp): dense MLP GEMMs
    mlp_comm: Stage  # over the instance's tokens: the MLP collective (dense, MoE without DeepEP)
    moe_global: Stage  # over the instance's tokens: routed experts (DeepEP's read at the
    # busiest EP rank's tokens; the fused kernel's moved to that rank by `moe_busiest`)
    moe_global_ll: Stage  # the same under DeepEP's low-latency mode (decode kernels)
    # fused MoE under EP: (tokens, imbalance f) -> the busiest rank's time over the curve's
    # at ceil(tokens x f) (its experts reached; the step's rows), and over the curve's at the
    # tokens with f times a rank's copies over the same experts (`_load_ratios`)
    moe_busiest: Callable[[float, float], tuple[float, float]] | None
    moe_local: Stage  # shared experts, router: over one GPU's tokens (DeepEP), else over tp
    a2a_low_latency: Stage | None  # over one GPU's tokens
    a2a_ll_calls: tuple[Stage, Stage] | None  # its dispatch and combine apart (single-batch overlap)
    a2a_normal: Stage | None
    lm_head: Stage  # over the instance's rows, or the slowest rank's with dp_lm_head
    dp_lm_head: bool
    vocab_comm: tuple[tuple[VocabCollective, Stage], ...]  # each over its own rows
    elementwise_s_tok: float  # per layer, per token of a rank
    elementwise_floor_s: float  # per layer


class SiliconCostModel:
    """Step times from measured per-op tables (see the module docstring).

    `lookups` counts table lookups since the model was built; `transferred_lookups` those
    inside the grid of a curve moved from a measured shape, dtype or GPU (count) the table has
    to one it lacks, by the ratio of the two rooflines; `extrapolated_lookups` those outside a
    table's grid. Their shares of `lookups` say how much of a run rests on roofline scaling.
    `trace`: None, or a list each priced op is appended to as a `TracedOp` (pdsim explain).
    """

    name = "silicon"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism,
                 **params: object) -> None:
        try:
            p = SiliconParams(**params)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                for e in err.errors())
            allowed = ", ".join(SiliconParams.model_fields)
            raise ValueError(f"silicon params: {problems}; allowed params: {allowed}") from None
        if parallel.ep > 1 and not model.is_moe:
            raise ValueError(f"ep={parallel.ep} needs a MoE model; {model.name} is dense")
        check_formats(model, hardware)
        tables.require_systems_dir()
        system = p.system or tables.system_for(hardware)
        if system is None:
            raise ValueError(
                f"silicon: no measured tables for hardware {hardware.name!r}; presets with "
                f"tables: {', '.join(sorted(tables.SYSTEMS))} (or set params.system, or use "
                f"the roofline cost model)")
        self.model, self.hardware, self.parallel, self.params = model, hardware, parallel, p
        self.system = system
        model = stage_model(model, parallel.pp)  # with pp, one stage's layers are priced
        self._pp_send = pp_send_terms(model, hardware, parallel)
        self._load, self._host, self._shape = step_extras(model, hardware, parallel, p)
        if p.moe_distribution != "balanced":
            self._load = None
        self._plan = _build_plan(model, hardware, parallel, p, system)
        self.lookups = 0
        self.transferred_lookups = 0
        self.extrapolated_lookups = 0
        self.trace: list[TracedOp] | None = None
        self._decode_fixed: dict[tuple[int, int], tuple] = {}  # see _decode_step_s

    @property
    def extrapolated_frac(self) -> float:
        return self.extrapolated_lookups / self.lookups if self.lookups else 0.0

    @property
    def transferred_frac(self) -> float:
        return self.transferred_lookups / self.lookups if self.lookups else 0.0

    # ----- per step ----------------------------------------------------------------------------

    def _attention_s(self, shapes: Sequence[BatchShape], part: str = "attention",
                     kernels: Sequence[BatchShape] | None = None) -> float:
        """One layer's attention block on the slowest rank; `part` is what the trace counts it
        in (tbo_overlap: a micro-batch of two-batch overlap); `kernels`, the ranks' shapes
        before graph padding, if padded: the decode attention kernel runs on those (a padded
        request's one-token context adds next to nothing to it)."""
        slowest = 0.0
        lookups = moved = extra = 0
        for i, shape in enumerate(shapes):
            if shape.num_tokens == 0:
                continue
            t, n_lookups, n_moved, n_extra = self._rank_attention_but_generation(shape, part)
            lookups += n_lookups
            moved += n_moved
            extra += n_extra
            kernel = shape if kernels is None else kernels[i]
            if kernel.decode_reqs:
                kinds = self._generation_attention(kernel, kernel.decode_reqs)
                lookups += len(kinds) - 1  # the first is counted with the rank's others
                for name, table, s, m, e, share in kinds:
                    t += s * share
                    if self.trace is not None:
                        self.trace.append(TracedOp(part, name, table, s, _how(m, e), share))
                    moved += m
                    extra += e
            if t > slowest:
                slowest = t
        self.lookups += lookups
        self.transferred_lookups += moved
        self.extrapolated_lookups += extra
        return slowest

    def _rank_attention_but_generation(self, shape: BatchShape, part: str = "attention"
                                       ) -> tuple[float, int, int, int]:
        """One rank's attention block without its generation (decode) attention kernel, the
        one part that depends on the decode context: (seconds, lookups, transferred ones,
        extrapolated ones)."""
        plan = self._plan
        q = shape.decode_query_len
        reqs, prefill = shape.decode_reqs, shape.prefill_tokens
        if self.trace is not None:
            self._trace_stage(part, plan.proj, prefill + reqs * q)
            self._trace_stage(part, plan.prefill_proj, prefill)
            self._trace_stage(part, plan.decode_proj, reqs * q)
        t, moved, extra = plan.proj.at(prefill + reqs * q)
        lookups = plan.proj.size
        if prefill:
            s, m, e = plan.prefill_proj.at(prefill)
            t += s
            lookups += plan.prefill_proj.size + 1
            moved += m
            extra += e
            kinds = _attention_kinds(plan, "prefill")
            prefix = shape.prefill_prefix_tokens
            if prefix and plan.mla_threshold:
                if mla_extend_form(prefix, plan.mla_threshold) == "absorbed":
                    kinds = [("prefill attention (absorbed)", plan.context_table,
                              plan.context_attn_absorbed, 1.0)]
                else:
                    if self.trace is not None:
                        self._trace_stage(part, plan.prefix_reproject, prefix)
                    s, m, e = plan.prefix_reproject.at(prefix)
                    t += s
                    lookups += plan.prefix_reproject.size
                    moved += m
                    extra += e
            lookups += len(kinds) - 1  # the first is counted with prefill_proj's
            for name, table, grid, share in kinds:
                s, m, e = _prefill_attention(grid, prefill, shape.prefill_attn_pairs)
                t += s * share
                moved += m
                extra += e
                if self.trace is not None:
                    self.trace.append(TracedOp(part, name, table, s, _how(m, e), share))
        if reqs:
            s, m, e = plan.decode_proj.at(reqs * q)
            t += s
            lookups += plan.decode_proj.size + 1
            moved += m
            extra += e
        return t, lookups, moved, extra

    def _trace_stage(self, part: str, stage: Stage, x: int) -> None:
        """Append each op of `stage` at size x to the trace."""
        if x <= 0:
            return
        for (name, table), curve, share in zip(stage.labels, stage.parts, stage.shares):
            outside = curve.extrapolated(x)
            self.trace.append(TracedOp(part, name, table, curve(x),
                                       _how(curve.transferred and not outside, outside), share))

    def _generation_attention(self, shape: BatchShape, reqs: int
                              ) -> list[tuple[str, str, float, bool, bool, float]]:
        """The decode attention kernels of `reqs` requests at the shape's mean context, one
        entry per kind of layer: (name, table, seconds of one layer, transferred,
        extrapolated, the kind's share of the layers)."""
        plan = self._plan
        q = shape.decode_query_len
        avg_ctx = max(shape.decode_context_tokens / shape.decode_reqs, 1.0)
        out = []
        for name, table, grid, share in _attention_kinds(plan, "decode"):
            s, e = grid.at(reqs, avg_ctx)
            moved = grid.transferred and not e
            if q > 1:  # q queries share one KV read: only the FLOP part grows
                scale = plan.gen_query_scale(q)
                s *= max(scale * plan.gen_flops_rel, plan.gen_bytes_rel)
                moved = not e
                # as many one-query requests as FLOPs read q times the KV: a bound that keeps
                # the larger batch's kernel efficiency, which a small batch's q-fold lacks
                wide, wide_e = grid.at(math.ceil(reqs * scale), avg_ctx)
                if not wide_e and wide < s:
                    s, moved, e = wide, grid.transferred, False
            out.append((name, table, s, moved, e, share))
        return out

    def _stage(self, stage: Stage, x: int, part: str) -> float:
        if x <= 0 or not stage.size:
            return 0.0
        if self.trace is not None:
            self._trace_stage(part, stage, x)
        s, m, e = stage.at(x)
        self.lookups += stage.size
        self.transferred_lookups += m
        self.extrapolated_lookups += e
        return s

    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        if len(shapes) == 1 and not self.parallel.two_batch_overlap:
            shape = shapes[0]
            if shape.decode_reqs and not shape.prefill_tokens:
                return self._decode_step_s(shape)
        return sum(self._parts(shapes))

    def _decode_step_s(self, shape: BatchShape) -> float:
        """A decode-only step of one rank: the floats and lookup counts of
        `sum(self._parts((shape,)))`. All but the generation attention depend only on the
        batch size and query length, so they are kept per (requests, query length) with the
        lookups they took, and only the context-dependent part is looked up again."""
        key = (shape.decode_reqs, shape.decode_query_len)
        fixed = self._decode_fixed.get(key)
        if fixed is None:
            before = self.lookups, self.transferred_lookups, self.extrapolated_lookups
            step = self._shape((shape,))
            t, n_lookups, n_moved, n_extra = self._rank_attention_but_generation(step.ranks[0])
            rest = self._parts_but_attention(step, math.nan)
            fixed = self._decode_fixed[key] = (
                t, self._elementwise_s(step.totals.max_rank_tokens), rest,
                n_lookups + self.lookups - before[0],
                n_moved + self.transferred_lookups - before[1],
                n_extra + self.extrapolated_lookups - before[2])
            self.lookups, self.transferred_lookups, self.extrapolated_lookups = before
        t, elementwise, rest, n_lookups, n_moved, n_extra = fixed
        kinds = self._generation_attention(shape, shape.decode_reqs)
        for _, _, s, m, e, share in kinds:
            t += s * share
            n_moved += m
            n_extra += e
        self.lookups += n_lookups + len(kinds) - 1
        self.transferred_lookups += n_moved
        self.extrapolated_lookups += n_extra
        attn = (t if t > 0.0 else 0.0) + elementwise
        return sum(with_eager_overhead((self._layers_attention_s(attn), *rest), self._host,
                                       False, shape.decode_reqs, shape.num_tokens))

    def step_breakdown_s(self, shapes: Sequence[BatchShape]) -> dict[str, float]:
        """Seconds of one step by part, summed over its layers, adding up to `step_time_s`
        (pdsim.sim.cost.BREAKDOWN_PARTS, as the roofline's; attention includes the
        elementwise kernels)."""
        return dict(zip(BREAKDOWN_PARTS, self._parts(shapes)))

    def _parts(self, shapes: Sequence[BatchShape]) -> tuple[float, ...]:
        step = self._shape(shapes)
        totals = step.totals
        if totals.tokens == 0:
            return (0.0,) * len(BREAKDOWN_PARTS)
        attn = self._attention_s(step.ranks, kernels=step.raw)
        elementwise = self._elementwise_s(totals.max_rank_tokens)
        attn += elementwise
        if self.trace is not None:
            self.trace.append(TracedOp("attention", "elementwise", "bandwidth",
                                       elementwise, "roofline"))
        rest = self._parts_but_attention(step, attn)
        return with_eager_overhead((self._layers_attention_s(attn), *rest), self._host,
                                   totals.has_prefill, max_rank_decode_reqs(shapes),
                                   totals.max_rank_tokens,
                                   tbo_splits(self.parallel, self.params.role, shapes))

    def _elementwise_s(self, max_rank_tokens: float) -> float:
        plan = self._plan
        return max(plan.elementwise_floor_s, max_rank_tokens * plan.elementwise_s_tok)

    def _layers_attention_s(self, attn: float) -> float:
        return layers_attention_s(attn, self._plan.dense_layers, self._plan.moe_layers)

    def _parts_but_attention(self, step: StepShape, attn: float) -> tuple[float, ...]:
        """The parts after `attention` (BREAKDOWN_PARTS order); `attn`, one layer's attention
        block, is read only by two-batch overlap."""
        plan = self._plan
        totals = step.totals
        tokens, max_rank_tokens, lm_rows, max_rank_rows, has_prefill = totals
        dense_mlp = dense_comm = 0.0
        if plan.dense_layers:
            layers = plan.dense_layers
            if plan.dense_dp:
                gpu_tokens = -(-max_rank_tokens // self.parallel.attn_tp)
                dense_mlp = layers * self._stage(plan.dense, gpu_tokens, "dense_mlp")
            else:
                dense_mlp = layers * self._stage(plan.dense, tokens, "dense_mlp")
                dense_comm = layers * self._stage(plan.mlp_comm, tokens, "dense_comm")
        experts = comm = tbo = 0.0
        if plan.moe_layers:
            experts, comm, tbo = self._moe_layers_s(step, attn)
        lm_head = self._stage(plan.lm_head, max_rank_rows if plan.dp_lm_head else lm_rows,
                              "lm_head")
        vocab_comm = sum(self._stage(stage, collective.count(totals), "vocab_comm")
                         for collective, stage in plan.vocab_comm)
        overhead = self._pp_send.at(max_rank_tokens)
        if self.params.scheduler_overhead:
            overhead += self.params.step_overhead_s + (
                self.params.extend_overhead_s if has_prefill else 0.0)
        return dense_mlp, dense_comm, experts, comm, tbo, lm_head, vocab_comm, overhead

    def _moe_layers_s(self, step: StepShape, attn: float) -> tuple[float, float, float]:
        """The MoE layers' (experts, communication, two-batch-overlap change), attention
        apart. Two-batch overlap follows the roofline's rule (pdsim.sim.cost,
        `overlapped_layers_s`) against attention + experts + DeepEP unsplit. The fused kernel
        runs on the padded rows; DeepEP dispatches and computes the scheduler's."""
        plan, par = self._plan, self.parallel
        layers = plan.moe_layers
        if par.moe_a2a != "deepep":
            tokens = step.totals.tokens
            # The fused kernel on every rank's tokens; the busiest EP rank holds its share of
            # the routed copies times the imbalance f (`moe_busiest`). Those reach as many of
            # its experts as f times the tokens would: at least the curve there, moved by the
            # MoE roofline's ratio back to the step's rows of other ranks' experts; and they
            # take at least f times the mean rank's rows over its experts. Shared experts and
            # router on the tokens they run on.
            routed = self._stage(plan.moe_global, tokens, "moe_experts")
            if self._load is not None and plan.moe_busiest is not None:
                load = self._load.imbalance(tokens)
                more = math.ceil(tokens * load)
                reached, rows = plan.moe_busiest(tokens, load)
                busier = max(plan.moe_global.at(more)[0] * reached, routed * rows) - routed
                if self.trace is not None:
                    self.trace.append(TracedOp("moe_experts", "routed experts: busiest EP rank",
                                               "-", busier, "derived"))
                routed += busier
            return (layers * (routed + self._stage(plan.moe_local, tokens, "moe_experts")),
                    layers * self._stage(plan.mlp_comm, tokens, "moe_comm"), 0.0)
        shapes = step.raw
        tokens, max_rank_tokens, _, _, has_prefill = step.raw_totals
        normal = deepep_normal(self.params.role, has_prefill)
        if par.single_batch_overlap and not normal:
            compute, comm = self._single_batch_overlap_layer_s(tokens, max_rank_tokens)
            return layers * compute, layers * comm, 0.0
        compute, comm = self._deepep_layer_s(tokens, max_rank_tokens, normal, "moe_experts",
                                             "moe_comm")
        tbo = 0.0
        if tbo_splits(par, self.params.role, shapes):
            halves = [self._micro_batch_s(half, normal) for half in micro_batches(shapes)]
            tbo = (overlapped_layers_s(layers, *halves,
                                       tbo_sm_share(self.hardware, self.params, normal))
                   - layers * (attn + compute + comm))
        return layers * compute, layers * comm, tbo

    def _deepep_layer_s(self, tokens: int, max_rank_tokens: int, normal: bool,
                        compute_part: str, comm_part: str) -> tuple[float, float]:
        """One MoE layer's experts (routed at the busiest EP rank's load, shared on each GPU's
        tokens) and DeepEP dispatch + combine on the busiest GPU, normal or low-latency."""
        plan = self._plan
        routed, gpu_tokens, busiest_gpu = self._deepep_loads(tokens, max_rank_tokens)
        experts = plan.moe_global if normal else plan.moe_global_ll
        compute = (self._stage(experts, routed, compute_part)
                   + self._stage(plan.moe_local, gpu_tokens, compute_part))
        a2a = plan.a2a_normal if normal else plan.a2a_low_latency
        return compute, self._stage(a2a, busiest_gpu, comm_part)

    def _deepep_loads(self, tokens: int, max_rank_tokens: int) -> tuple[int, int, int]:
        """(the busiest EP rank's routed tokens, tokens of one GPU, tokens the busiest GPU
        sends and receives) of a MoE layer under DeepEP."""
        par = self.parallel
        routed = self._busiest_rank_tokens(tokens)
        rank_gpu = -(-max_rank_tokens // par.attn_tp)
        return routed, max(rank_gpu, -(-tokens // par.tp)), max(rank_gpu, -(-routed // par.tp))

    def _single_batch_overlap_layer_s(self, tokens: int, max_rank_tokens: int
                                      ) -> tuple[float, float]:
        """`_deepep_layer_s` of a decode step under single-batch overlap: the routed experts,
        the shared ones (and router), the dispatch and the combine looked up apart and
        overlapped as `single_batch_overlap_s` says."""
        plan = self._plan
        routed, gpu_tokens, busiest_gpu = self._deepep_loads(tokens, max_rank_tokens)
        dispatch, combine = (self._stage(call, busiest_gpu, "moe_comm")
                             for call in plan.a2a_ll_calls)
        shared = self._stage(plan.moe_local, gpu_tokens, "moe_experts")
        experts = self._stage(plan.moe_global_ll, routed, "moe_experts")
        compute, comm = single_batch_overlap_s(dispatch, combine, shared, experts,
                                               self.hardware, self.model.precision.moe_experts)
        if self.trace is not None:  # what the overlap changes, so the ops add up to the parts
            self.trace += [
                TracedOp("moe_experts", "single-batch overlap: SMs the combine holds", "-",
                         compute - shared - experts, "derived"),
                TracedOp("moe_comm", "single-batch overlap: hidden", "-",
                         comm - dispatch - combine, "derived")]
        return compute, comm

    def _micro_batch_s(self, shapes: Sequence[BatchShape], normal: bool) -> tuple[float, float]:
        """One micro-batch's compute (attention block, elementwise kernels, experts) and
        DeepEP time per MoE layer; an empty one computes nothing but still joins the dispatch
        and combine (priced at one token)."""
        tokens, max_rank_tokens, *_ = step_totals(shapes)
        if not tokens:
            a2a = self._plan.a2a_normal if normal else self._plan.a2a_low_latency
            return 0.0, self._stage(a2a, 1, "tbo_overlap")
        compute, comm = self._deepep_layer_s(tokens, max_rank_tokens, normal, "tbo_overlap",
                                             "tbo_overlap")
        return (self._attention_s(shapes, "tbo_overlap") + self._elementwise_s(max_rank_tokens)
                + compute, comm)

    def _busiest_rank_tokens(self, tokens: int) -> int:
        """The instance tokens at which DeepEP's routed-expert and all-to-all tables price the
        busiest EP rank: `tokens` times the imbalance (pdsim.sim.expert_load), rounded up."""
        if self._load is None:
            return tokens
        return math.ceil(tokens * self._load.imbalance(tokens))


def _prefill_attention(grid: Grid2, tokens: int, pairs: float) -> tuple[float, bool, bool]:
    """Prefill attention of `tokens` new tokens attending over `pairs` (query, key) pairs.

    A shape carries no per-request lengths, so the batch is read as b equal causal sequences of
    length s with the same tokens and pairs: s = 2 pairs / tokens - 1, b = pairs / (s (s+1) / 2)
    (exact for fresh prompts of one length). A chunk after a cached prefix gives b < 1: one
    sequence of length s priced pro rata. Returns (seconds, transferred, extrapolated)."""
    s = max(2.0 * pairs / tokens - 1.0, 1.0)
    b = pairs / (s * (s + 1) / 2)
    seconds, extra = grid.at(max(b, 1.0), s)
    return seconds * min(b, 1.0), grid.transferred and not extra, extra


def _attention_kinds(plan: _Plan, phase: str) -> list[tuple[str, str, Grid2, float]]:
    """(trace name, table, grid, share of the layers) for each attention kernel over (batch,
    sequence) a step of `phase` ("prefill" or "decode") runs: full attention, and in a hybrid
    model the sliding-window kernel and, prefilling, the Gated DeltaNet ones, each at its
    share of the layers (a Gated DeltaNet layer decodes at a cost its context does not
    change: `decode_proj` holds it)."""
    prefill = phase == "prefill"
    table = plan.context_table if prefill else plan.generation_table
    kinds = [(f"{phase} attention", table,
              plan.context_attn if prefill else plan.generation_attn, plan.full_share)]
    window = plan.context_attn_swa if prefill else plan.generation_attn_swa
    if window is not None:
        kinds.append((f"{phase} swa attention", table, window, plan.swa_share))
    if prefill:
        kinds += [(name, "gdn", grid, plan.linear_share) for name, grid in plan.context_gdn]
    return kinds


@lru_cache(maxsize=16)  # ~6 MB a plan; a run needs one per role, a plan one per (role, shape)
def _build_plan(model: ModelSpec, hw: HardwareSpec, par: Parallelism, p: SiliconParams,
                system: str) -> _Plan:
    # The GPU the tables were measured on, as published (whatever a spec based on it
    # overrides; for an H800, the H100 it names as `silicon_base`).
    measured = tables.preset_for(system)
    table_hw = load_hardware_spec(measured) if measured else hw
    ops = op_tables(system, p.framework, p.version, hw, table_hw)
    prec = model.precision
    tp, attn_tp, ep = par.tp, par.attn_tp, par.ep
    h = model.hidden_size
    heads = model.num_attention_heads // attn_tp
    kv_bytes = p.kv_dtype_bytes
    fp8_attn = fp8_attention_kernel(model, hw, kv_bytes)
    ad = prec.attention

    # Each stage's ops as (name, table, curve).
    gemm, bmm = "gemm", "mla_bmm"
    proj, prefill_proj, decode_proj = [], [], []
    context_swa = generation_swa = None
    if model.is_mla:
        dims = (model.kv_lora_rank, model.qk_rope_head_dim, model.qk_nope_head_dim,
                model.v_head_dim)
        lora, rope, nope, v = dims
        lora0, _, nope0, v0 = MLA_TABLE_DIMS
        qk = nope + rope
        if model.q_lora_rank:
            q_lora = model.q_lora_rank
            proj += [("q_a_proj", gemm, ops.gemm(q_lora, h, ad)),
                     ("q_b_proj", gemm, ops.gemm(heads * qk, q_lora, ad))]
        else:
            proj.append(("q_proj", gemm, ops.gemm(heads * qk, h, ad)))
        proj += [("kv_a_proj", gemm, ops.gemm(lora + rope, h, ad)),
                 ("o_proj", gemm, ops.gemm(h, heads * v, ad))]
        prefill_proj.append(("kv_b_proj", gemm, ops.gemm(heads * (nope + v), lora, ad)))
        decode_proj += [("mla_bmm_pre", bmm,
                         ops.mla_bmm("pre", heads, nope, lora, (nope0, lora0))),
                        ("mla_bmm_post", bmm, ops.mla_bmm("post", heads, lora, v, (lora0, v0)))]
        context = ops.mla_context(heads, dims, kv_bytes)
        context_absorbed = ops.mla_context(heads, dims, kv_bytes, absorbed=True)
        reproject = [("kv_b_proj (prefix)", gemm, prefill_proj[-1][2])]
        generation = ops.mla_generation(heads, dims, kv_bytes)
        context_table, generation_table = "context_mla", "generation_mla"
        gen_flops = 2.0 * mla_decode_rows(heads) * (2 * lora + rope) / ops.peak_flops("bf16")
        gen_bytes = (lora + rope) * kv_bytes / ops.mem_rate
        rope_elems = heads * rope + rope
    else:
        hd = model.head_dim
        kvh = model.kv_heads_per_rank(attn_tp)
        proj += [("qkv_proj", gemm, ops.gemm((heads + 2 * kvh) * hd, h, ad)),
                 ("o_proj", gemm, ops.gemm(h, heads * hd, ad))]
        context = ops.context_attention(heads, kvh, hd, kv_bytes, fp8_attn)
        generation = ops.generation_attention(heads, kvh, hd, kv_bytes)
        context_table, generation_table = ("context_attention",
                                           "generation_attention")
        context_absorbed, reproject = None, []
        if model.num_sliding_layers:
            window = model.sliding_window
            context_swa = ops.context_attention(heads, kvh, hd, kv_bytes, fp8_attn, window)
            generation_swa = ops.generation_attention(heads, kvh, hd, kv_bytes, window)
        gen_flops = 4.0 * heads * hd / ops.peak_flops("bf16")
        gen_bytes = 2 * kvh * hd * kv_bytes / ops.mem_rate
        # RoPE on q and k, and a second pass over them for the per-head q/k RMSNorm
        rope_elems = (1 + model.qk_norm) * (heads + kvh) * hd
    # A hybrid model's Gated DeltaNet layers (`linear_share` of them) project in and out
    # with their own GEMMs and run their own kernels; the attention projections above are
    # the other layers'.
    linear_share = model.linear_share
    proj = [(*op, 1.0 - linear_share) for op in proj]
    context_gdn = []
    if linear_share:
        hk, hv, dk, dv = model.linear_heads_per_rank(attn_tp)
        heads_dims = (hk, hv, dk, dv, model.recurrent_state_dtype_bytes)
        value = hv * dv
        conv = model.linear_conv_dim // attn_tp
        proj += [("in_proj_qkvz", gemm, ops.gemm(conv + value, h, ad), linear_share),
                 ("in_proj_ba", gemm, ops.gemm(2 * hv, h, ad), linear_share),
                 ("out_proj", gemm, ops.gemm(h, value, ad), linear_share)]
        context_gdn = [(f"prefill gdn {name}", ops.gdn_context(kernel, *heads_dims))
                       for name, kernel in (("conv1d", "causal_conv1d_fn"),
                                            ("scan", "chunk_gated_delta_rule"))]
        decode_proj += [(f"gdn {name}", "gdn", ops.gdn_generation(kernel, *heads_dims),
                         linear_share)
                        for name, kernel in (("conv1d update", "causal_conv1d_update"),
                                             ("recurrent step",
                                              "fused_recurrent_gated_delta_rule_packed_decode"))]
    if attn_tp > 1:
        proj.append(("attn all_reduce", "allreduce", ops.all_reduce(attn_tp, h)))

    # The MLP's collective on the instance's tokens: an all-reduce over tp, or around a
    # DP-attention MLP an all-gather before and a reduce-scatter after.
    if tp == 1:
        mlp_comm = []
    elif par.dp_attention == 1:
        mlp_comm = [("mlp all_reduce", "allreduce", ops.all_reduce(tp, h))]
    else:
        mlp_comm = [("mlp all_gather", "nccl", ops.nccl("all_gather", tp, h)),
                    ("mlp reduce_scatter", "nccl", ops.nccl("reduce_scatter", tp, h))]

    # Dense MLP over tp, or with moe_dense_tp=1 whole on each GPU (no collective).
    inter = model.intermediate_size // (par.moe_dense_tp or tp)
    dense = [("gate_up_proj", gemm, ops.gemm(2 * inter, h, prec.dense_mlp)),
             ("down_proj", gemm, ops.gemm(h, inter, prec.dense_mlp))
             ] if model.num_dense_layers else []

    moe_global, moe_global_ll, moe_local, a2a_ll, a2a_normal = [], [], [], None, None
    moe_busiest = None
    a2a_ll_calls = None
    # Elements a layer's MLP activation reads and writes per token of a rank, and its
    # elementwise kernels besides the attention block's: a dense layer's SiLU-and-mul on its
    # gate_up output; a MoE layer's routed activation is inside the expert tables (above).
    dense_act = 3 * (model.intermediate_size // (par.moe_dense_tp or tp))
    moe_act, moe_kernels = 0, LAYER_ELEMENTWISE_KERNELS
    if model.is_moe:
        md = prec.moe_experts
        deepep = par.moe_a2a == "deepep"
        # a layer's physical experts: EPLB's redundant copies are experts a step reads too
        # (tables measure the model's own count; another is moved by the roofline, transferred)
        experts = model.num_experts + (p.eplb_redundant_experts or 0)
        shape = (h, model.moe_intermediate_size, model.experts_per_token, experts)
        fused = ("routed experts", "moe",
                 ops.moe(*shape, tp // ep, ep, md, p.moe_distribution))
        moe_global.append(fused)
        moe_global_ll.append(fused)
        if deepep:  # DeepGEMM's grouped GEMMs where measured, else the fused kernel
            for phase, ops_list in (("context", moe_global), ("generation", moe_global_ll)):
                grouped = ops.wideep_moe(phase, *shape, ep, md, p.moe_distribution)
                if grouped is not None:
                    ops_list[0] = ("routed experts", f"wideep_{phase}_moe", grouped)
        # Router (BF16 in every quantised checkpoint) and shared experts: replicated under
        # DeepEP (each GPU runs them on its own tokens), else over tp on the gathered tokens.
        split = 1 if deepep else tp
        shared = model.num_shared_experts * model.moe_intermediate_size // split
        local = [("router", gemm, ops.gemm(model.num_experts, h, "bf16"))]
        if shared:
            local += [("shared gate_up", gemm, ops.gemm(2 * shared, h, md)),
                      ("shared down", gemm, ops.gemm(h, shared, md))]
        if deepep:
            moe_local = local
            a2a_ll = ops.deepep("low_latency", h, model.experts_per_token, model.num_experts, ep)
            a2a_normal = ops.deepep("normal", h, model.experts_per_token, model.num_experts, ep)
            if a2a_ll is None or a2a_normal is None:
                raise MissingTable(f"silicon: {system} has no DeepEP tables; use moe_a2a 'none' "
                                 f"or the roofline cost model")
            if par.single_batch_overlap:
                a2a_ll_calls = tuple(
                    _labelled([(call, "wideep_deepep_ll", ops.deepep(
                        "low_latency", h, model.experts_per_token, model.num_experts, ep,
                        (call,)))]) for call in ("dispatch", "combine"))
        else:
            moe_local = local  # over tp, on the instance's tokens
            moe_global_ll = moe_global
            if ep > 1:
                moe_busiest = partial(_load_ratios, ops.moe_roofline(
                    *shape, tp // ep, ep, md, fused=not hw.blackwell, random=True),
                    ops.moe_roofline(*shape, tp // ep, ep, md, fused=not hw.blackwell))
        moe_act = 3 * shared
        moe_kernels = MOE_LAYER_NORM_KERNELS + (shared > 0) + deepep
    dense_share = model.num_dense_layers / model.num_layers
    mlp_act = dense_share * dense_act + (1 - dense_share) * moe_act
    mlp_kernels = dense_share * LAYER_ELEMENTWISE_KERNELS + (1 - dense_share) * moe_kernels

    lm = [("lm_head", gemm,
           ops.gemm(model.vocab_size // (attn_tp if par.dp_lm_head else tp), h, prec.lm_head))]
    vocab_comm = tuple(
        (c, _labelled([(c.name, "allreduce" if c.op == "all_reduce" else "nccl",
                        ops.all_reduce(c.gpus, c.width) if c.op == "all_reduce"
                        else ops.nccl(c.op, c.gpus, c.width))]))
        for c in vocab_collectives(model, par))
    mem = hw.stream_gb_per_s * 1e9 * p.bw_efficiency
    return _Plan(
        layers=model.num_layers,
        dense_layers=model.num_dense_layers,
        moe_layers=model.num_moe_layers,
        proj=_labelled(proj),
        prefill_proj=_labelled(prefill_proj),
        decode_proj=_labelled(decode_proj),
        context_attn=context,
        generation_attn=generation,
        mla_threshold=mla_prefix_threshold(hw, p) if model.is_mla else 0,
        prefix_reproject=_labelled(reproject) if reproject else None,
        context_attn_absorbed=context_absorbed,
        context_table=context_table,
        generation_table=generation_table,
        context_attn_swa=context_swa,
        generation_attn_swa=generation_swa,
        swa_share=model.num_sliding_layers / model.num_layers,
        full_share=model.num_full_attention_layers / model.num_layers,
        linear_share=linear_share,
        context_gdn=tuple(context_gdn),
        gen_flops_rel=gen_flops / max(gen_flops, gen_bytes),
        gen_bytes_rel=gen_bytes / max(gen_flops, gen_bytes),
        gen_query_scale=decode_query_scale(model, heads),
        dense_dp=par.moe_dense_tp == 1,
        dense=_labelled(dense),
        mlp_comm=_labelled(mlp_comm),
        moe_global=_labelled(moe_global),
        moe_global_ll=_labelled(moe_global_ll),
        moe_busiest=moe_busiest,
        moe_local=_labelled(moe_local),
        a2a_low_latency=_labelled([("dispatch+combine", "wideep_deepep_ll",
                                    a2a_ll)]) if a2a_ll else None,
        a2a_ll_calls=a2a_ll_calls,
        a2a_normal=_labelled([("dispatch+combine", "wideep_deepep_normal",
                               a2a_normal)]) if a2a_normal else None,
        lm_head=_labelled(lm),
        dp_lm_head=par.dp_lm_head,
        vocab_comm=vocab_comm,
        elementwise_s_tok=(8 * h + 2 * rope_elems + mlp_act) * ACT_BYTES / mem,
        elementwise_floor_s=(mlp_kernels
                             + (1 - linear_share) * attention_elementwise_kernels(model)
                             + linear_share * GDN_ELEMENTWISE_KERNELS) * p.kernel_floor_s,
    )


def _load_ratios(random: Callable, balanced: Callable, tokens: float, load: float
                 ) -> tuple[float, float]:
    """The busiest EP rank's fused-MoE roofline, `load` times a rank's routed copies among
    `tokens`: over the randomly routed roofline at `load` times the tokens (the same copies and
    experts reached, more rows of other ranks' experts), and over the balanced roofline at the
    tokens (the same experts: the rows alone)."""
    return (float(random(tokens, load) / random(math.ceil(tokens * load))),
            float(balanced(tokens, load) / balanced(tokens)))


def _labelled(entries: list[tuple]) -> Stage:
    """A stage of (name, table, curve) ops, or (name, table, curve, share of the layers)."""
    return Stage([e[2] for e in entries], [e[:2] for e in entries],
                 [e[3] if len(e) > 3 else 1.0 for e in entries])
