"""PLAN.yaml → one frozen, validated plan: what to serve, on what, under which SLO and budget,
and which deployments to consider.

A plan names a model, a GPU, a workload and latency targets as percentiles, and either a GPU
budget (`max_gpus`) or a traffic target (`target_rate_rps`, which sets the workload's rate).
The search space defaults to every sensible deployment: colocated and disaggregated, TP
1/2/4/8 per role with TP mismatch between roles allowed. Unknown keys are rejected and an
error names the field (pdsim.config_errors).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdsim.config import (
    ConfigError,
    read_config_file,
    CostModelConfig,
    NetworkConfig,
    RouterConfig,
    SchedulerKnobs,
    workload_mix_error,
)
from pdsim.config_errors import format_validation_error
from pdsim.metrics import SLO, MeasurementWindow
from pdsim.specs.hardware import hardware_preset_names, load_hardware_spec
from pdsim.workload import ArrivalProcess, TraceWorkload, WorkloadConfig, closed_loop_clients

Mode = Literal["disaggregated", "colocated"]
PERCENTILES = (50, 90, 99)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanSLO(_Spec):
    """Latency targets as percentiles: TTFT over requests, ITL over every inter-token gap
    pooled (as SGLang's bench_serving reports it), TPOT over requests' mean ITL. A deployment
    meets the plan's SLO when every target given holds and no request failed."""

    ttft_p50_s: float | None = Field(None, gt=0)
    ttft_p90_s: float | None = Field(None, gt=0)
    ttft_p99_s: float | None = Field(None, gt=0)
    itl_p50_s: float | None = Field(None, gt=0)
    itl_p90_s: float | None = Field(None, gt=0)
    itl_p99_s: float | None = Field(None, gt=0)
    tpot_p50_s: float | None = Field(None, gt=0)
    tpot_p90_s: float | None = Field(None, gt=0)
    tpot_p99_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _some_target(self) -> PlanSLO:
        if not self.targets():
            raise ValueError(f"give at least one target: {', '.join(type(self).model_fields)}")
        return self

    def targets(self) -> dict[str, float]:
        """Summary column → bound, for the targets given."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def percentile_targets(self, metric: Literal["ttft", "itl", "tpot"]) -> list[tuple[int, float]]:
        """The targets given on `metric` as (percentile, seconds)."""
        given = [(q, getattr(self, f"{metric}_p{q}_s")) for q in PERCENTILES]
        return [(q, v) for q, v in given if v is not None]

    def request_slo(self) -> SLO:
        """The per-request SLO that goodput counts: each request's TTFT and mean ITL within the
        plan's tightest TTFT and ITL/TPOT bounds (no bound on a metric: no limit on it)."""
        ttft = [v for k, v in self.targets().items() if k.startswith("ttft")]
        itl = [v for k, v in self.targets().items() if k.startswith(("itl", "tpot"))]
        return SLO(ttft_s=min(ttft, default=1e9), itl_s=min(itl, default=1e9))


class SearchSpace(_Spec):
    """The deployments the plan considers. Per role, every combination of `tp`, `dp_attention`,
    `ep`, `moe_a2a` (and for prefill `pp`) that SGLang accepts (dp_attention and ep divide tp;
    ep > 1 and DeepEP only for MoE models; DeepEP needs ep = tp > 1), each DeepEP shape with
    every `two_batch_overlap` setting (and, not on prefill, every `single_batch_overlap` one
    where two-batch overlap is off), each EP shape with every `eplb_redundant_experts` one,
    each DP-attention shape of a MoE model with dense layers with every `moe_dense_tp` one and
    each pipelined prefill with every `dynamic_chunking` one."""

    modes: list[Mode] = Field(["disaggregated", "colocated"], min_length=1)
    tp: list[int] = Field([1, 2, 4, 8], min_length=1)
    dp_attention: list[int] = Field([1], min_length=1)
    ep: list[int] = Field([1], min_length=1)
    moe_a2a: list[Literal["none", "deepep"]] = Field(["none"], min_length=1)
    two_batch_overlap: list[bool] = Field([False], min_length=1, description="with DeepEP: "
                                          "SGLang's --enable-two-batch-overlap; [false, true] "
                                          "tries each DeepEP shape both ways")
    single_batch_overlap: list[bool] = Field(
        [False], min_length=1, description="with DeepEP, decode and colocated roles: SGLang's "
        "--enable-single-batch-overlap; tried where two_batch_overlap is false")
    eplb_redundant_experts: list[int | None] = Field(
        [None], min_length=1, description="with ep > 1: null (no EPLB) or N (SGLang's "
        "--enable-eplb with N --ep-num-redundant-experts); an EP size the experts and N copies "
        "do not split evenly over is left out for that N")
    pp: list[int] | None = Field(None, min_length=1, description="prefill pipeline stages "
                                 "(SGLang's --pp-size); default: 1, 2 and 4 when the "
                                 "workload's p90 prompt is at least 32768 tokens, else 1")
    moe_dense_tp: list[Literal[1] | None] = Field(
        [None], min_length=1, description="with dp_attention > 1 on a MoE model with dense "
        "layers: null (dense layers over tp) or 1 (SGLang's --moe-dense-tp-size 1: each GPU "
        "runs them on its own tokens, as large-EP deployments do); [null, 1] tries each "
        "DP-attention shape both ways")
    dynamic_chunking: list[bool] = Field(
        [False], min_length=1, description="prefill shapes with pp > 1: SGLang's "
        "--enable-dynamic-chunking (its default smooth factor, the first chunk the scheduler's "
        "chunked_prefill_size); [false, true] tries each pipelined prefill both ways")
    allow_tp_mismatch: bool = Field(True, description="prefill and decode TP may differ")
    max_simulations: int = Field(200, ge=1, description="at most this many candidates are "
                                 "simulated, cheapest first")
    cost_slack: float = Field(1.0, ge=0, description="once a feasible deployment is found, "
                              "simulate only candidates costing at most (1 + cost_slack) x its "
                              "cost (they fill the frontier and give the runner-up)")
    early_stop: bool = Field(True, description="stop a candidate's simulation once enough "
                             "requests are certain to miss a percentile target (finished over "
                             "it, or with an open loop, past arrival + the TTFT target without "
                             "a first token) that it cannot be met (needs the whole-run "
                             "measurement window); its figures are then partial and it is "
                             "left off the frontier; false keeps every candidate's full figures")

    @model_validator(mode="after")
    def _positive(self) -> SearchSpace:
        for name in ("tp", "dp_attention", "ep", "pp"):
            bad = [v for v in getattr(self, name) or () if not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"{name}: sizes must be integers >= 1, got {bad}")
        bad = [v for v in self.eplb_redundant_experts if v is not None and v < 0]
        if bad:
            raise ValueError(f"eplb_redundant_experts: null or integers >= 0, got {bad}")
        return self


class PrefilterConfig(_Spec):
    """The analytic pre-filter (docs/planning.md, "What the pre-filter assumes")."""

    enabled: bool = True
    slack: float = Field(1.25, ge=1, description="capacities are multiplied by this before a "
                         "candidate is discarded, so it must miss by a clear margin")


class LaunchConfig(_Spec):
    """What the generated SGLang commands name (ports are those of the first instance on a
    node; the next instances on it take the next ones)."""

    model_path: str | None = Field(None, description="--model-path (HF id or local path); "
                                   "default: a preset's Hugging Face repository, the "
                                   "directory of a config.json, else the model's name")
    transfer_backend: Literal["mooncake", "nixl"] = "mooncake"
    ib_device: str = Field("mlx5_0", description="--disaggregation-ib-device")
    base_port: int = Field(30000, ge=1, le=65535)
    bootstrap_port: int = Field(8998, ge=1, le=65535)
    router_host: str = Field("127.0.0.1", description="--host of the router: loopback unless "
                             "set (give the address clients reach it on)")
    router_port: int = Field(8000, ge=1, le=65535)
    dist_init_port: int = Field(5000, ge=1, le=65535)


class GpuType(_Spec):
    """One more GPU type a plan may put a role on, at its price."""

    hardware: str | dict[str, Any] = Field(description="a preset, a YAML file or a mapping")
    usd_per_gpu_hour: float | None = Field(
        None, gt=0, description="price of one GPU-hour; default: the hardware preset's")


class PlanConfig(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = 0
    model: str | dict[str, Any] = Field(
        description="a preset, a file or a mapping (as in an experiment)")
    hardware: str | dict[str, Any] = Field(description="a preset, a YAML file or a mapping")
    usd_per_gpu_hour: float | None = Field(
        None, gt=0, description="price of one GPU-hour; default: the hardware preset's")
    gpu_types: list[GpuType] = Field(
        default_factory=list, description="more GPU types, each at its price: the search "
        "then puts each role on any of them or on `hardware` (prefill on one, decode on "
        "another; docs/planning.md, \"Heterogeneous hardware\"). Empty: `hardware` alone")
    workload: WorkloadConfig
    slo: PlanSLO
    max_gpus: int | None = Field(None, ge=1, description="GPU budget: no candidate uses more")
    target_rate_rps: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="traffic target: the workload's arrival rate is set to it (open-loop "
        "process or trace replay); candidates up to max_gpus, default 4 NVLink domains")
    objective: Literal["cost", "goodput_per_gpu"] = Field(
        "cost", description="cost: the cheapest deployment meeting the SLO (then the lowest "
        "$/Mtok); goodput_per_gpu: the most SLO-meeting requests/s per GPU")
    search: SearchSpace = SearchSpace()
    prefilter: PrefilterConfig = PrefilterConfig()
    kv_dtype_bytes: float = Field(2, gt=0)
    scheduler: SchedulerKnobs = Field(SchedulerKnobs(), description="every role's scheduler knobs")
    router: RouterConfig = RouterConfig()
    network: NetworkConfig = NetworkConfig()
    cost_model: CostModelConfig = CostModelConfig()
    metrics: MeasurementWindow = MeasurementWindow()
    max_duration_s: float = Field(3600.0, gt=0)
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _budget_or_target(self) -> PlanConfig:
        if self.max_gpus is None and self.target_rate_rps is None:
            raise ValueError("give a GPU budget (max_gpus) or a traffic target (target_rate_rps)")
        if self.target_rate_rps is not None and _is_closed_loop(self.workload):
            raise ValueError("target_rate_rps sets an open-loop rate; a closed-loop workload's "
                             "load is its concurrency: drop target_rate_rps or the closed loop")
        return self

    def gpu_limit(self, gpus_per_node: int) -> int:
        return self.max_gpus if self.max_gpus is not None else 4 * gpus_per_node

    def workload_data(self) -> dict[str, Any]:
        """The workload as an experiment's mapping, at the traffic target when one is set."""
        data = self.workload.model_dump(mode="json", exclude_none=True)
        if self.target_rate_rps is None:
            return data
        if isinstance(self.workload, TraceWorkload):
            data.pop("rate_scale", None)
            data["target_rate_rps"] = self.target_rate_rps
        elif isinstance(self.workload.arrival, ArrivalProcess):
            data["arrival"]["rate_rps"] = self.target_rate_rps
        return data


def _is_closed_loop(workload) -> bool:
    return closed_loop_clients(workload) is not None


def parse_plan(data: Any, source: str = "<plan>") -> PlanConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a plan is a mapping of keys, got {type(data).__name__}")
    mixed = workload_mix_error(data.get("workload"), source)
    if mixed is not None:
        raise mixed
    try:
        return PlanConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, "plan", PlanConfig)) from None


def load_plan(path: str | Path) -> PlanConfig:
    """The plan at `path`, with its `hardware` loaded and priced as `pdsim plan` will (so that
    `pdsim check`, which reads plans here, fails where the plan would). A plan's `gpu_types`
    are priced as the search loads them (pdsim.planning.hardware_mix.gpu_options)."""
    cfg = parse_plan(read_config_file(path, "plan"), str(path))
    try:
        hw = load_hardware_spec(cfg.hardware, str(Path(path).parent.resolve()))
        price_per_gpu_hour(cfg, hw.usd_per_gpu_hour, hw.name)
    except ConfigError as exc:  # a ValueError too: first
        raise ConfigError(f"{path}: {exc}") from None
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{path}: hardware: {exc}") from None
    return cfg


def price_per_gpu_hour(plan: PlanConfig, preset_price: float | None, hardware_name: str) -> float:
    """The plan's price, else the hardware's; an error saying what to set when neither has one."""
    price = plan.usd_per_gpu_hour or preset_price
    if price is None or not math.isfinite(price):
        priced = [n for n in hardware_preset_names() if load_hardware_spec(n).usd_per_gpu_hour]
        raise ConfigError(
            f"usd_per_gpu_hour: hardware {hardware_name!r} has no list price; set "
            "usd_per_gpu_hour beside it in the plan (USD per GPU-hour, e.g. "
            "`usd_per_gpu_hour: 2.5`). "
            f"Hardware presets with a list price: {', '.join(priced)} (`pdsim presets`)")
    return price
