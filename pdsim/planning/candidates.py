"""The deployments a plan considers: P and D counts x parallelism per role, or colocated
instances, each turned into the experiment mapping the simulator runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdsim.planning.config import PlanConfig, SearchSpace
from pdsim.specs.models import ModelSpec

# Prompts this long at p90 make pipeline-parallel prefill worth searching: SGLang's PP serves
# long-context prefill, where a prompt's chunks overlap across the stages.
LONG_PROMPT_TOKENS = 32768
LONG_PROMPT_PP = (1, 2, 4)


@dataclass(frozen=True, order=True)
class RoleShape:
    """How one instance of a role spreads over its GPUs (SGLang's --tp/--dp/--ep/--pp flags;
    pp > 1 for prefill only; DP attention comes with --enable-dp-lm-head), whether it
    overlaps two micro-batches (--enable-two-batch-overlap, DeepEP only) or a decode batch's
    DeepEP calls with its own experts (--enable-single-batch-overlap, DeepEP only, not on
    prefill, where it changes nothing), balances experts (--enable-eplb with
    `redundant_experts` copies, EP only), sizes a pipelined prefill's chunks dynamically
    (--enable-dynamic-chunking, pp > 1 only) and runs a MoE model's dense layers per GPU
    (--moe-dense-tp-size 1, DP attention only)."""

    tp: int
    dp_attention: int = 1
    ep: int = 1
    moe_a2a: str = "none"
    pp: int = 1
    two_batch_overlap: bool = False
    eplb: bool = False
    redundant_experts: int = 0
    single_batch_overlap: bool = False
    dynamic_chunking: bool = False
    dense_dp: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        parts = [f"TP{self.tp}"]
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dynamic_chunking:
            parts.append("DCK")
        if self.dp_attention > 1:
            parts.append(f"DP{self.dp_attention}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.moe_a2a != "none":
            parts.append(self.moe_a2a)
        if self.two_batch_overlap:
            parts.append("TBO")
        if self.single_batch_overlap:
            parts.append("SBO")
        if self.eplb:
            parts.append(f"EPLB+{self.redundant_experts}")
        if self.dense_dp:
            parts.append("dense-TP1")
        return " ".join(parts)

    def role_data(self, instances: int, plan: PlanConfig) -> dict[str, Any]:
        data: dict[str, Any] = {"instances": instances, "tp": self.tp}
        if self.pp > 1:
            data["pp"] = self.pp
        if self.dynamic_chunking:
            data["dynamic_chunking"] = True
        if self.dp_attention > 1:
            # each DP rank's LM head on its own rows, as DP-attention deployments run it
            # (without it every step all-gathers all ranks' logits over tp)
            data["dp_attention"] = self.dp_attention
            data["dp_lm_head"] = True
        if self.ep > 1:
            data["ep"] = self.ep
        if self.moe_a2a != "none":
            data["moe_a2a"] = self.moe_a2a
        if self.two_batch_overlap:
            data["two_batch_overlap"] = True
        if self.single_batch_overlap:
            data["single_batch_overlap"] = True
        if self.eplb:
            data["eplb"] = {"redundant_experts": self.redundant_experts}
        if self.dense_dp:
            data["moe_dense_tp"] = 1
        knobs = plan.scheduler.model_dump(exclude_defaults=True)
        if knobs:
            data["scheduler"] = knobs
        return data


@dataclass(frozen=True, order=True)
class Candidate:
    """One candidate: `roles` holds (role, instances, shape): prefill then decode, or the one
    colocated role."""

    mode: str
    roles: tuple[tuple[str, int, RoleShape], ...]

    @property
    def num_gpus(self) -> int:
        return sum(n * shape.gpus for _, n, shape in self.roles)

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            (_, n, shape), = self.roles
            return f"{n}x colocated {shape.label}"
        (_, p, ps), (_, d, ds) = self.roles
        return f"{p}P {ps.label} + {d}D {ds.label}"

    def experiment_data(self, plan: PlanConfig, name: str | None = None) -> dict[str, Any]:
        """The experiment mapping that simulates this deployment under the plan's workload."""
        cluster: dict[str, Any] = {"mode": self.mode}
        for role, n, shape in self.roles:
            cluster[role] = shape.role_data(n, plan)
        data: dict[str, Any] = {
            "name": name or plan.name,
            "description": f"{self.label} ({plan.name})",
            "seed": plan.seed,
            "model": plan.model,
            "hardware": plan.hardware,
            "kv_dtype_bytes": plan.kv_dtype_bytes,
            "cluster": cluster,
            "workload": plan.workload_data(),
            "slo": plan.slo.request_slo().model_dump(),
            "max_duration_s": plan.max_duration_s,
        }
        for section in ("router", "network", "cost_model", "metrics"):
            values = getattr(plan, section).model_dump(mode="json", exclude_defaults=True)
            if values:
                data[section] = values
        return data


def prefill_pp_sizes(plan: PlanConfig, input_tokens: np.ndarray) -> tuple[int, ...]:
    """The prefill pipeline sizes to search: the plan's `search.pp`, else `LONG_PROMPT_PP` when
    the workload's p90 prompt is at least `LONG_PROMPT_TOKENS`, else none but 1."""
    if plan.search.pp is not None:
        return tuple(plan.search.pp)
    long = len(input_tokens) > 0 and np.percentile(input_tokens, 90) >= LONG_PROMPT_TOKENS
    return LONG_PROMPT_PP if long else (1,)


def _eplb_options(redundant: Sequence[int | None], model: ModelSpec, ep: int
                  ) -> list[tuple[bool, int]]:
    """(eplb, redundant experts) settings for an instance of `ep` expert-parallel ranks: without
    EP none; with it each of the search's settings whose experts and copies split evenly over
    the ranks (SGLang's rule, EPLB or not; None: no EPLB)."""
    if ep == 1:
        return [(False, 0)]
    return [(False, 0) if n is None else (True, n) for n in redundant
            if (model.num_experts + (n or 0)) % ep == 0]


def _overlaps(s: SearchSpace, prefill: bool) -> list[tuple[bool, bool]]:
    """(two-batch, single-batch overlap) settings of a DeepEP shape: the search's, one overlap
    at a time."""
    singles = (False,) if prefill else s.single_batch_overlap
    return sorted({(tbo, sbo) for tbo in s.two_batch_overlap for sbo in singles
                   if not (tbo and sbo)})


def role_shapes(plan: PlanConfig, model: ModelSpec, gpu_limit: int,
                pp_sizes: Sequence[int] = (1,), prefill: bool = False) -> list[RoleShape]:
    """Every parallelism of one instance the search space allows and SGLang accepts (heads
    split evenly, block-FP8 weights split into whole scale blocks), with
    each of `pp_sizes` pipeline stages (a stage needs a layer; more than one: with each
    dynamic-chunking setting) and, with DP attention on a MoE model with dense layers, each
    `moe_dense_tp` setting; a `prefill` role's without single-batch overlap (a decode-step
    overlap)."""
    s = plan.search
    shapes = set()
    for tp in s.tp:
        for dp in s.dp_attention:
            for ep in s.ep:
                for a2a in s.moe_a2a:
                    if tp % dp or tp % ep or model.split_error(tp // dp, ep) is not None:
                        continue
                    if a2a == "deepep" and not (model.is_moe and ep == tp > 1):
                        continue
                    overlaps = _overlaps(s, prefill) if a2a == "deepep" else [(False, False)]
                    balancing = _eplb_options(s.eplb_redundant_experts, model, ep)
                    dense_dp = ({m == 1 for m in s.moe_dense_tp}
                                if dp > 1 and model.is_moe and model.num_dense_layers
                                else {False})
                    dense_dp = {dense for dense in dense_dp
                                if model.block_fp8_error(tp, ep, 1 if dense else None) is None}
                    for pp in pp_sizes:
                        if tp * pp <= gpu_limit and pp <= model.num_layers:
                            chunking = s.dynamic_chunking if pp > 1 else (False,)
                            shapes.update(
                                RoleShape(tp, dp, ep, a2a, pp, two_batch_overlap=tbo,
                                          eplb=balanced, redundant_experts=copies,
                                          single_batch_overlap=sbo, dynamic_chunking=dck,
                                          dense_dp=dense)
                                for tbo, sbo in overlaps for balanced, copies in balancing
                                for dck in chunking for dense in dense_dp)
    return sorted(shapes)


def enumerate_deployments(plan: PlanConfig, model: ModelSpec, gpu_limit: int,
                          prefill_pp: Sequence[int] = (1,)) -> list[Candidate]:
    """Every deployment of at most `gpu_limit` GPUs in the plan's search space; prefill
    instances of each of `prefill_pp` pipeline stages (decode and colocated ones have none)."""
    shapes = role_shapes(plan, model, gpu_limit)
    out: list[Candidate] = []
    if "colocated" in plan.search.modes:
        for shape in shapes:
            for n in range(1, gpu_limit // shape.gpus + 1):
                out.append(Candidate("colocated", (("colocated", n, shape),)))
    if "disaggregated" in plan.search.modes:
        for ps in role_shapes(plan, model, gpu_limit, prefill_pp, prefill=True):
            for ds in shapes:
                if ps.tp != ds.tp and not plan.search.allow_tp_mismatch:
                    continue
                if model.pd_tp_error(ps.tp // ps.dp_attention, ds.tp // ds.dp_attention):
                    continue  # SGLang cannot move this model's state between them
                for p in range(1, (gpu_limit - ds.gpus) // ps.gpus + 1):
                    for d in range(1, (gpu_limit - p * ps.gpus) // ds.gpus + 1):
                        out.append(Candidate("disaggregated",
                                             (("prefill", p, ps), ("decode", d, ds))))
    return out
