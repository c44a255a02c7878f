"""The one cost hook: how long one forward step of one instance takes, given its batch shapes.

A cost model prices `BatchShape`s, one per attention-DP rank, and nothing else: it never sees
requests. Implementations are looked up by name (`make_cost_model`); "roofline" is the analytic
one, described with its defaults in docs/cost_model.md.

This module also answers the other sizing question the simulator asks of a (model, GPU,
parallelism) triple: how many KV tokens fit (`kv_capacity_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdsim.core.batch import BatchShape
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec

ACT_BYTES = 2  # activations are bf16


class Parallelism(BaseModel):
    """How one instance spreads over its GPUs.

    tp: GPUs per instance (the tensor-parallel group of dense and MoE layers).
    dp_attention: attention data-parallel size; each DP rank runs attention on its own batch
        over `tp // dp_attention` GPUs (its attention-TP group). Must divide tp.
    ep: expert-parallel size; routed experts are split whole over `ep` GPUs, then sliced over
        `tp // ep`. Must divide tp.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1)
    dp_attention: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check_divides(self) -> Parallelism:
        for label in ("dp_attention", "ep"):
            if self.tp % getattr(self, label):
                raise ValueError(f"{label}={getattr(self, label)} must divide tp={self.tp}")
        return self

    @property
    def attn_tp(self) -> int:
        """GPUs in one attention-DP rank."""
        return self.tp // self.dp_attention


@runtime_checkable
class CostModel(Protocol):
    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        """Seconds one forward step takes; `shapes` holds one shape per attention-DP rank."""
        ...


CostModelFactory = Callable[..., CostModel]
_REGISTRY: dict[str, CostModelFactory] = {}


def register_cost_model(name: str) -> Callable[[CostModelFactory], CostModelFactory]:
    """Register a factory `(model, hardware, parallel, **params) -> CostModel` under `name`.

    Every factory accepts `kv_dtype_bytes` among its params: the simulator passes the
    experiment's KV dtype size that way."""

    def add(factory: CostModelFactory) -> CostModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"cost model {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return add


def cost_model_names() -> list[str]:
    return sorted(_REGISTRY)


def make_cost_model(
    name: str, model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism, **params: object
) -> CostModel:
    """Build the cost model registered as `name`; `params` override its defaults."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown cost model {name!r}; registered: {', '.join(cost_model_names())}"
        ) from None
    return factory(model, hardware, parallel, **params)


class RooflineParams(BaseModel):
    """Efficiency factors and fixed costs of the roofline model (see docs/cost_model.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm_mfu: float = Field(default=0.7, gt=0, le=1)
    attn_mfu: float = Field(default=0.5, gt=0, le=1)
    bw_efficiency: float = Field(default=0.8, gt=0, le=1)
    comm_efficiency: float = Field(default=0.7, gt=0, le=1)
    allreduce_latency_s: float = Field(default=10e-6, ge=0)
    layer_overhead_s: float = Field(default=15e-6, ge=0)
    step_overhead_s: float = Field(default=0.5e-3, ge=0)
    extend_overhead_s: float = Field(default=2e-3, ge=0)
    kv_dtype_bytes: float = Field(default=2, gt=0)


@register_cost_model("roofline")
class RooflineCostModel:
    """Per part of a layer, time = max(FLOPs / compute rate, bytes / memory rate), summed.

    Parts: attention projections and attention itself (per attention-DP rank, on that rank's
    own shape; the step waits for the slowest rank), the dense MLP or MoE block (on the tokens
    of all ranks, over tp GPUs), memory-bound elementwise kernels, the LM head once, the TP
    collectives (two per layer), a kernel-launch floor per layer and a fixed per-step overhead.
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        parallel: Parallelism,
        **params: object,
    ) -> None:
        try:
            p = RooflineParams(**params)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                for e in err.errors()
            )
            allowed = ", ".join(RooflineParams.model_fields)
            raise ValueError(f"roofline params: {problems}; allowed params: {allowed}") from None
        if parallel.ep > 1 and not model.is_moe:
            raise ValueError(f"ep={parallel.ep} needs a MoE model; {model.name} is dense")
        self.model, self.hardware, self.parallel, self.params = model, hardware, parallel, p

        tp, attn_tp, ep = parallel.tp, parallel.attn_tp, parallel.ep
        h, nh, wb = model.hidden_size, model.num_attention_heads, model.weight_dtype_bytes
        heads = nh / attn_tp  # query heads on one GPU
        gemm_peak = hardware.bf16_tflops
        if wb <= 1 and hardware.fp8_tflops is not None:
            gemm_peak = hardware.fp8_tflops  # FP8 weights run FP8 GEMMs
        self._gemm_rate = gemm_peak * 1e12 * p.gemm_mfu
        attn_rate = hardware.bf16_tflops * 1e12 * p.attn_mfu
        mem_rate = hardware.hbm_gbps * 1e9 * p.bw_efficiency
        self._mem_rate = mem_rate
        self._layers = model.num_layers

        # Attention block on one GPU of a DP rank: projections, then the attention kernels.
        self._attn_flops_tok = 2 * model.attn_params_per_layer / attn_tp
        self._attn_w_bytes = model.attn_params_per_layer * wb / attn_tp
        if model.is_mla:
            q_out = heads * model.head_dim
            q_io = h + model.q_lora_rank * 2 + q_out if model.q_lora_rank else h + q_out
            kv_io = h + model.kv_elems_per_token_per_layer
            kv_io += model.kv_lora_rank + heads * (model.qk_nope_head_dim + model.v_head_dim)
            proj_io = q_io + kv_io + heads * model.v_head_dim + h
            # Prefill runs attention as MHA over the up-projected K/V; decode absorbs kv_b into
            # q and o and attends over the latent (score: kv_lora+rope, value: kv_lora).
            pf_flops_pair = 2 * heads * (model.head_dim + model.v_head_dim)
            dec_flops_ctx = 2 * heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
            rope_elems = heads * model.qk_rope_head_dim + model.qk_rope_head_dim
        else:
            kv_heads = model.kv_heads_per_rank(attn_tp)
            qkv_out = (heads + 2 * kv_heads) * model.head_dim
            proj_io = h + qkv_out + heads * model.head_dim + h
            pf_flops_pair = 4 * heads * model.head_dim
            dec_flops_ctx = 4 * heads * model.head_dim
            rope_elems = (heads + kv_heads) * model.head_dim
        self._attn_act_tok = proj_io * ACT_BYTES
        self._pf_attn_s_pair = pf_flops_pair / attn_rate
        self._dec_attn_s_ctx = dec_flops_ctx / attn_rate
        kv_bytes = model.kv_bytes_per_token_per_rank(attn_tp, p.kv_dtype_bytes)
        self._kv_mem_s_tok = kv_bytes / model.num_layers / mem_rate  # write or read, per layer
        # Two fused add+RMSNorms (read x and residual, write both) and RoPE (read+write q, k).
        self._attn_elem_s_tok = (8 * h + 2 * rope_elems) * ACT_BYTES / mem_rate

        # Dense MLP layers and MoE layers, on the tokens of all DP ranks, over tp GPUs.
        self._dense_layers = model.num_dense_layers
        inter = model.intermediate_size / tp
        self._dense_flops_tok = 2 * model.dense_mlp_params / tp
        self._dense_w_bytes = model.dense_mlp_params * wb / tp
        self._dense_act_tok = (2 * h + 3 * inter) * ACT_BYTES  # gate_up in/out, down in/out
        self._dense_elem_s_tok = 3 * inter * ACT_BYTES / mem_rate  # silu(gate) * up
        self._moe_layers = model.num_moe_layers
        if model.is_moe:
            e, k = model.num_experts, model.experts_per_token
            moe_inter = model.moe_intermediate_size / (tp // ep)
            shared = model.num_shared_experts * model.expert_params + model.router_params
            self._num_experts = float(e)
            self._miss_prob = 1.0 - k / e  # chance a token leaves a given expert out
            self._moe_fixed_flops_tok = 2 * shared / tp
            self._moe_routed_flops_tok = 2 * k * model.expert_params / tp
            self._moe_fixed_w_bytes = shared * wb / tp
            self._expert_w_bytes = model.expert_params * wb / tp  # per expert hit, per GPU
            pairs_io = k / ep * (2 * h + 3 * moe_inter)  # token-expert pairs on one GPU
            shared_inter = model.num_shared_experts * model.moe_intermediate_size / tp
            self._moe_act_tok = (pairs_io + 2 * h + 3 * shared_inter + e) * ACT_BYTES
            self._moe_elem_s_tok = (k / ep * moe_inter + shared_inter) * 3 * ACT_BYTES / mem_rate

        # LM head on the last position of each sequence, split over tp.
        lm_params = model.vocab_size * h
        self._lm_flops_tok = 2 * lm_params / tp
        self._lm_w_bytes = lm_params * wb / tp
        self._lm_act_tok = (h + model.vocab_size / tp) * ACT_BYTES

        # Per layer: an all-reduce in each attention-TP group after the output projection, and
        # across all tp GPUs around the MLP (an all-reduce; with DP attention an all-gather
        # before and a reduce-scatter after, which move the same bytes). Ring all-reduce time:
        # 2 (n - 1) / n * bytes / link bandwidth, plus a fixed latency per call.
        link = hardware.nvlink_gbps * 1e9 * p.comm_efficiency
        self._attn_ar_s_tok = 2 * (attn_tp - 1) / attn_tp * h * ACT_BYTES / link
        self._attn_ar_fixed_s = p.allreduce_latency_s if attn_tp > 1 else 0.0
        self._mlp_ar_s_tok = 2 * (tp - 1) / tp * h * ACT_BYTES / link
        self._mlp_ar_fixed_s = p.allreduce_latency_s if tp > 1 else 0.0
        self._layer_overhead_s = p.layer_overhead_s
        self._step_overhead_s = p.step_overhead_s
        self._extend_overhead_s = p.extend_overhead_s

    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        gemm_rate, mem_rate = self._gemm_rate, self._mem_rate
        attn_flops_tok, attn_w_bytes, attn_act_tok = (
            self._attn_flops_tok, self._attn_w_bytes, self._attn_act_tok
        )
        pf_s_pair, dec_s_ctx, kv_s_tok, elem_s_tok = (
            self._pf_attn_s_pair, self._dec_attn_s_ctx, self._kv_mem_s_tok, self._attn_elem_s_tok
        )
        ar_fixed_s, ar_s_tok = self._attn_ar_fixed_s, self._attn_ar_s_tok
        tokens = lm_rows = 0
        has_prefill = False
        slowest_attn = 0.0
        for shape in shapes:
            n = shape.prefill_tokens + shape.decode_reqs
            if n == 0:
                continue
            tokens += n
            lm_rows += shape.decode_reqs
            if shape.prefill_tokens:
                has_prefill = True
                lm_rows += 1  # at least one sequence ends in this rank's prefill
            proj = max(
                n * attn_flops_tok / gemm_rate, (attn_w_bytes + n * attn_act_tok) / mem_rate
            )
            prefill = max(shape.prefill_attn_pairs * pf_s_pair, shape.prefill_tokens * kv_s_tok)
            ctx = shape.decode_context_tokens
            decode = max(ctx * dec_s_ctx, (ctx + shape.decode_reqs) * kv_s_tok)
            attn = proj + prefill + decode + n * elem_s_tok + ar_fixed_s + n * ar_s_tok
            if attn > slowest_attn:
                slowest_attn = attn
        if tokens == 0:
            return 0.0

        mlp_comm = self._mlp_ar_fixed_s + tokens * self._mlp_ar_s_tok
        total = self._layers * (slowest_attn + mlp_comm + self._layer_overhead_s)
        if self._dense_layers:
            dense = max(
                tokens * self._dense_flops_tok / gemm_rate,
                (self._dense_w_bytes + tokens * self._dense_act_tok) / mem_rate,
            )
            total += self._dense_layers * (dense + tokens * self._dense_elem_s_tok)
        if self._moe_layers:
            hit = self._num_experts * (1.0 - self._miss_prob**tokens)  # expected experts used
            flops = tokens * (self._moe_fixed_flops_tok + self._moe_routed_flops_tok)
            w_bytes = self._moe_fixed_w_bytes + hit * self._expert_w_bytes
            moe = max(flops / gemm_rate, (w_bytes + tokens * self._moe_act_tok) / mem_rate)
            total += self._moe_layers * (moe + tokens * self._moe_elem_s_tok)
        total += max(
            lm_rows * self._lm_flops_tok / gemm_rate,
            (self._lm_w_bytes + lm_rows * self._lm_act_tok) / mem_rate,
        )
        total += self._step_overhead_s
        if has_prefill:
            total += self._extend_overhead_s
        return total


def kv_capacity_tokens(
    model: ModelSpec,
    hardware: HardwareSpec,
    parallel: Parallelism,
    mem_fraction_static: float = 0.88,
    kv_dtype_bytes: float = 2,
) -> int:
    """KV tokens one attention-DP rank can hold.

    SGLang's rule: `mem_fraction_static` of each GPU's memory holds the weights and the KV
    pool. Each GPU of a DP rank stores every token of that rank's pool, but only its own
    slice of it (GQA: its KV heads; MLA: the whole latent, replicated), so the tokens that fit
    are the free bytes of one GPU over the per-GPU bytes of one token. The same count holds
    for every DP rank.
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    budget = hardware.hbm_bytes * mem_fraction_static
    weights = model.weight_bytes_per_rank(parallel.tp, parallel.ep, parallel.dp_attention)
    free = budget - weights
    if free <= 0:
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} at tp={parallel.tp}: its weights "
            f"take {weights / 2**30:.1f} GiB per GPU but only {budget / 2**30:.1f} GiB "
            f"({mem_fraction_static} x {hardware.hbm_gib} GiB) is available; raise tp or "
            f"mem_fraction_static"
        )
    per_token = model.kv_bytes_per_token_per_rank(parallel.attn_tp, kv_dtype_bytes)
    return int(free // per_token)
