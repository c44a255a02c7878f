"""The `autoscaling:` section of a deployment: which policy (pdsim/core/autoscale.py) sizes the
prefill and decode roles while serving, within what bounds, and what a new instance costs to
start. Both backends read it; the simulator also derives the SLA planner's capacities from its
cost model when they are not given.

```yaml
autoscaling:
  policy: threshold            # static | fixed | threshold | sla
  interval_s: 30               # the policy decides once per interval
  prefill: {min_instances: 1, max_instances: 8}
  decode: {min_instances: 1, max_instances: 8}
  cold_start: {weights_gb_per_s: 2.0, process_start_s: 20}
  threshold: {cooldown_s: 60, prefill: {queue_up: 4}, decode: {kv_up: 0.85}}
  # sla: {predictor: linear, window: 4, prefill_tokens_per_s: 40000, decode_tokens_per_s: 6000}
  # fixed: {schedule: [{at_s: 0, prefill: 1, decode: 1}, {at_s: 600, prefill: 2, decode: 3}]}
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdsim.core.autoscale import (
    PREDICTORS,
    AutoscalePolicy,
    Bounds,
    FixedSchedule,
    RoleThresholds,
    SlaPlanner,
    StaticPolicy,
    ThresholdPolicy,
)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleLimits(_Spec):
    min_instances: int = Field(1, ge=1, description="never fewer instances of the role")
    max_instances: int = Field(8, ge=1, description="never more instances of the role")

    @model_validator(mode="after")
    def _ordered(self) -> RoleLimits:
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) must be <= max_instances "
                             f"({self.max_instances})")
        return self


class ColdStart(_Spec):
    """A new instance serves after process_start_s + its GPU's weight shard / weights_gb_per_s
    (every GPU of the instance loads its own shard at once)."""

    weights_gb_per_s: float = Field(2.0, gt=0, allow_inf_nan=False,
                                    description="weight loading rate per GPU, GB/s")
    process_start_s: float = Field(20.0, ge=0, allow_inf_nan=False,
                                   description="process start, CUDA init and graph capture, s")


class ScheduleStep(_Spec):
    at_s: float = Field(ge=0, allow_inf_nan=False)
    prefill: int = Field(ge=1)
    decode: int = Field(ge=1)


class FixedParams(_Spec):
    schedule: list[ScheduleStep] = Field(min_length=1, description="instances per role from "
                                         "each step's at_s on, steps in increasing at_s")

    @model_validator(mode="after")
    def _increasing(self) -> FixedParams:
        times = [s.at_s for s in self.schedule]
        if any(b <= a for a, b in zip(times, times[1:])):
            raise ValueError(f"schedule steps must have increasing at_s, got {times}")
        return self


class RoleThresholdParams(_Spec):
    queue_up: float = Field(4.0, ge=0, description="grow when requests waiting per running "
                            "instance exceed this")
    queue_down: float = Field(0.5, ge=0, description="shrink only when waiting per instance "
                              "is below this")
    kv_up: float = Field(0.85, gt=0, le=1, description="grow when the share of KV pages in use "
                         "exceeds this")
    kv_down: float = Field(0.4, ge=0, lt=1, description="shrink only when KV usage is below this")
    busy_up: float | None = Field(None, gt=0, le=1, description="grow when the share of the "
                                  "window the instances computed exceeds this (with busy_down)")
    busy_down: float | None = Field(None, ge=0, lt=1, description="shrink only when the busy "
                                    "share is below this (with busy_up)")

    @model_validator(mode="after")
    def _ordered(self) -> RoleThresholdParams:
        self.thresholds()
        return self

    def thresholds(self) -> RoleThresholds:
        return RoleThresholds(self.queue_up, self.queue_down, self.kv_up, self.kv_down,
                              self.busy_up, self.busy_down)


class ThresholdParams(_Spec):
    cooldown_s: float = Field(60.0, ge=0, allow_inf_nan=False,
                              description="a role that changed holds still this long")
    prefill: RoleThresholdParams = RoleThresholdParams()
    decode: RoleThresholdParams = RoleThresholdParams()


class SlaParams(_Spec):
    predictor: Literal[PREDICTORS] = Field(  # type: ignore[valid-type]
        "moving_average", description="how the next interval's rate and lengths are predicted")
    window: int = Field(3, ge=1, description="past intervals the predictor reads")
    headroom: float = Field(1.0, gt=0, le=1, description="plan each instance at this share "
                            "of its capacity")
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="prompt tokens/s one prefill instance "
        "sustains within the TTFT SLO (sim: derived from the cost model when omitted)")
    decode_tokens_per_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="output tokens/s one decode instance "
        "sustains within the ITL SLO (sim: derived from the cost model when omitted)")


class AutoscalingConfig(_Spec):
    """`policy` picks the policy; the sections of the others may stay (and are ignored), so
    one experiment can sweep `autoscaling.policy`."""

    policy: Literal["static", "fixed", "threshold", "sla"] = Field(
        description="static: keep the starting counts (the baseline, with the same timeline); "
        "fixed: fixed.schedule; threshold: queue and KV thresholds; sla: size each role for "
        "the predicted load")
    interval_s: float = Field(30.0, gt=0, allow_inf_nan=False,
                              description="the policy decides once per interval")
    prefill: RoleLimits = RoleLimits()
    decode: RoleLimits = RoleLimits()
    cold_start: ColdStart = ColdStart()
    fixed: FixedParams | None = None
    threshold: ThresholdParams | None = None
    sla: SlaParams | None = None

    @model_validator(mode="after")
    def _params_match_policy(self) -> AutoscalingConfig:
        if self.policy == "fixed" and self.fixed is None:
            raise ValueError("policy fixed needs fixed.schedule: a list of "
                             "{at_s, prefill, decode} steps")
        for i, step in enumerate(self.fixed.schedule if self.fixed else ()):
            for role in ("prefill", "decode"):
                lim, n = getattr(self, role), getattr(step, role)
                if not lim.min_instances <= n <= lim.max_instances:
                    raise ValueError(f"fixed.schedule[{i}].{role} {n} lies outside "
                                     f"autoscaling.{role} [{lim.min_instances}, "
                                     f"{lim.max_instances}]")
        return self

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.prefill.min_instances, self.prefill.max_instances,
                      self.decode.min_instances, self.decode.max_instances)

    def check_cluster(self, mode: str, prefill_instances: int, decode_instances: int) -> None:
        """A ValueError when the cluster cannot be autoscaled as configured."""
        if mode != "disaggregated":
            raise ValueError(f"autoscaling sizes prefill and decode roles: it needs "
                             f"cluster.mode disaggregated, got {mode!r}")
        for role, n in (("prefill", prefill_instances), ("decode", decode_instances)):
            lim = getattr(self, role)
            if not lim.min_instances <= n <= lim.max_instances:
                raise ValueError(f"cluster.{role}.instances {n} (the starting count) lies outside "
                                 f"autoscaling.{role} [{lim.min_instances}, {lim.max_instances}]")

    def make_policy(self, prefill_tokens_per_s: float | None = None,
                    decode_tokens_per_s: float | None = None) -> AutoscalePolicy:
        """The configured policy. The SLA planner's capacities come from its section, else
        from these arguments (a backend's own estimate); a ValueError when neither has one."""
        if self.policy == "static":
            return StaticPolicy(self.interval_s)
        if self.policy == "fixed":
            return FixedSchedule([(s.at_s, s.prefill, s.decode) for s in self.fixed.schedule],
                                 self.interval_s, self.bounds)
        if self.policy == "threshold":
            th = self.threshold or ThresholdParams()
            return ThresholdPolicy(th.prefill.thresholds(), th.decode.thresholds(),
                                   self.interval_s, th.cooldown_s, self.bounds)
        sla = self.sla or SlaParams()
        p = sla.prefill_tokens_per_s or prefill_tokens_per_s
        d = sla.decode_tokens_per_s or decode_tokens_per_s
        missing = [f"autoscaling.sla.{n}" for n, v in
                   (("prefill_tokens_per_s", p), ("decode_tokens_per_s", d)) if v is None]
        if missing:
            raise ValueError(f"policy sla needs {' and '.join(missing)} (per-instance capacity "
                             "at the SLO)")
        return SlaPlanner(p, d, self.interval_s, sla.predictor, sla.window, sla.headroom,
                          self.bounds)
