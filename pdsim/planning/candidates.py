"""The deployments a plan considers: P and D counts x parallelism per role, or colocated
instances, each turned into the experiment mapping the simulator runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdsim.planning.config import PlanConfig
from pdsim.specs.models import ModelSpec


@dataclass(frozen=True, order=True)
class RoleShape:
    """How one instance of a role spreads over its GPUs (SGLang's --tp/--dp/--ep flags)."""

    tp: int
    dp_attention: int = 1
    ep: int = 1
    moe_a2a: str = "none"

    @property
    def label(self) -> str:
        parts = [f"TP{self.tp}"]
        if self.dp_attention > 1:
            parts.append(f"DP{self.dp_attention}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.moe_a2a != "none":
            parts.append(self.moe_a2a)
        return " ".join(parts)

    def role_data(self, instances: int, plan: PlanConfig) -> dict[str, Any]:
        data: dict[str, Any] = {"instances": instances, "tp": self.tp}
        if self.dp_attention > 1:
            data["dp_attention"] = self.dp_attention
        if self.ep > 1:
            data["ep"] = self.ep
        if self.moe_a2a != "none":
            data["moe_a2a"] = self.moe_a2a
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
        return sum(n * shape.tp for _, n, shape in self.roles)

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


def role_shapes(plan: PlanConfig, model: ModelSpec, gpu_limit: int) -> list[RoleShape]:
    """Every parallelism of one instance the search space allows and SGLang accepts."""
    s = plan.search
    shapes = set()
    for tp in s.tp:
        if tp > gpu_limit:
            continue
        for dp in s.dp_attention:
            for ep in s.ep:
                for a2a in s.moe_a2a:
                    if tp % dp or tp % ep or (ep > 1 and not model.is_moe):
                        continue
                    if a2a == "deepep" and not (model.is_moe and ep == tp > 1):
                        continue
                    shapes.add(RoleShape(tp, dp, ep, a2a))
    return sorted(shapes)


def enumerate_deployments(plan: PlanConfig, model: ModelSpec, gpu_limit: int) -> list[Candidate]:
    """Every deployment of at most `gpu_limit` GPUs in the plan's search space."""
    shapes = role_shapes(plan, model, gpu_limit)
    out: list[Candidate] = []
    if "colocated" in plan.search.modes:
        for shape in shapes:
            for n in range(1, gpu_limit // shape.tp + 1):
                out.append(Candidate("colocated", (("colocated", n, shape),)))
    if "disaggregated" in plan.search.modes:
        for ps in shapes:
            for ds in shapes:
                if ps.tp != ds.tp and not plan.search.allow_tp_mismatch:
                    continue
                for p in range(1, (gpu_limit - ds.tp) // ps.tp + 1):
                    for d in range(1, (gpu_limit - p * ps.tp) // ds.tp + 1):
                        out.append(Candidate("disaggregated",
                                             (("prefill", p, ps), ("decode", d, ds))))
    return out
