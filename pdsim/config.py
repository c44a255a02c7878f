"""Experiment YAML → one frozen, validated config tree.

Unknown keys are rejected; every error names the file, the field path, the bad value and what
is allowed. A `sweep:` maps dotted field paths to lists of values and runs their grid; a key of
several comma-separated paths takes tuples, so fields can move together:

    sweep:
      cluster.prefill.instances,cluster.decode.instances: [[1, 3], [2, 2], [3, 1]]
      workload.arrival.rate_rps: [4, 8]
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdsim.config_errors import format_validation_error
from pdsim.deployment import (  # noqa: F401  (public here too: pdsim.planning imports them)
    ClusterConfig,
    Deployment,
    NetworkConfig,
    RoleConfig,
    RouterConfig,
    SchedulerKnobs,
    TransferConfig,
)
from pdsim.metrics import SLO, MeasurementWindow
from pdsim.workload import (
    EmpiricalLength,
    SyntheticWorkload,
    TraceWorkload,
    WorkloadConfig,
    WorkloadError,
    resolve_path,
)


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostModelConfig(_Spec):
    # "auto": silicon where the hardware has measured tables (pdsim[silicon]), else roofline.
    name: str = "auto"
    # numbers, or paths (relative to the experiment file); lists of whole numbers
    # (cuda_graph_bs); or mappings of numbers and paths (the profiled model's per-role `roles`)
    params: dict[str, float | str | tuple[int, ...]
                 | dict[str, float | str | dict[str, float | str]]] = {}

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from pdsim.sim.cost import cost_model_names

        if name not in cost_model_names():
            raise ValueError(f"unknown cost model {name!r}; allowed: {', '.join(cost_model_names())}")
        return name


class AcceptanceConfig(_Spec):
    """How many drafts a verify step accepts: give `rates` or `mean_accept_len`."""

    rates: list[float] | None = Field(
        None, min_length=1,
        description="per draft position, the chance it is accepted given the drafts before it "
        "were; the first num_draft_tokens entries are used, a single entry holds for all",
    )
    mean_accept_len: float | None = Field(
        None, ge=1,
        description="mean tokens a request emits per verify step (accepted drafts + 1, SGLang's "
        "'accept length'); the same rate at every position is solved from it",
    )

    @field_validator("rates")
    @classmethod
    def _probabilities(cls, rates: list[float] | None) -> list[float] | None:
        if rates is not None and not all(0 <= r <= 1 for r in rates):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {rates}")
        return rates


class SpeculativeConfig(_Spec):
    """Speculative decoding: simulated with the given acceptance; the real backend serves
    method mtp colocated and in PD at tp 1 (runtime/speculative.py) and measures its own
    acceptance, which `pdsim calibrate` writes back here."""

    method: Literal["none", "mtp", "eagle"] = Field(
        "none", description="simulator only: mtp (the target's own MTP layers, DeepSeek-V3) or "
        "eagle (a small draft model); none turns speculation off",
    )
    num_draft_tokens: int = Field(
        3, ge=1, description="drafts per request per step, k (SGLang's --speculative-num-steps "
        "with top-k 1; its --speculative-num-draft-tokens is k + 1)",
    )
    acceptance: AcceptanceConfig = AcceptanceConfig()
    draft_layers: int = Field(1, ge=1, description="decoder layers of the MTP module or EAGLE draft")
    draft_model: str | None = Field(
        None, description="eagle only: a model preset or config.json for the draft "
        "(default: draft_layers layers of the target's attention with a dense MLP)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.method == "none":
            return self
        acc, k = self.acceptance, self.num_draft_tokens
        if (acc.rates is None) == (acc.mean_accept_len is None):
            raise ValueError(f"speculative.method {self.method!r} needs exactly one of "
                             "acceptance.rates and acceptance.mean_accept_len")
        if acc.rates is not None and 1 < len(acc.rates) < k:
            raise ValueError(f"acceptance.rates has {len(acc.rates)} entries; num_draft_tokens={k} "
                             f"needs 1 or at least {k}")
        if acc.mean_accept_len is not None and acc.mean_accept_len > k + 1:
            raise ValueError(f"acceptance.mean_accept_len {acc.mean_accept_len} exceeds "
                             f"num_draft_tokens + 1 = {k + 1}")
        if self.draft_model is not None and self.method != "eagle":
            raise ValueError("draft_model applies to method 'eagle' only")
        return self

    def accept_len_probs(self) -> tuple[float, ...]:
        """P(a = 1..k + 1) of the tokens a request emits per step."""
        from pdsim.sim.speculative import accept_len_probs, rate_for_mean_accept_len

        k, acc = self.num_draft_tokens, self.acceptance
        if acc.rates is not None:
            rates = acc.rates * k if len(acc.rates) == 1 else acc.rates[:k]
        else:
            rates = [rate_for_mean_accept_len(acc.mean_accept_len, k)] * k
        return accept_len_probs(rates)


class ExperimentConfig(Deployment):
    """A deployment (pdsim.deployment) and what only the simulator reads: the workload, the
    cost model, speculative decoding, SLOs, the measurement window and sweeps. Real-only
    fields of the deployment are accepted and ignored, so a serve config is an experiment too."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    cost_model: CostModelConfig = CostModelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    workload: WorkloadConfig
    slo: SLO = SLO()
    metrics: MeasurementWindow = MeasurementWindow()
    max_duration_s: float = Field(
        3600.0, gt=0, description="simulated seconds after the last arrival before giving up"
    )
    sweep: dict[str, list[Any]] = {}


def workload_mix_error(workload: Any, source: str) -> ConfigError | None:
    """The error for a `workload:` mapping that names a trace and keys only a synthetic
    workload takes (`arrival`, `input_len`...): the two are exclusive, and pydantic's own
    message ("workload.arrival: unknown key") hides that."""
    if not isinstance(workload, dict) or "trace" not in workload:
        return None
    synthetic = [k for k in workload
                 if k in set(SyntheticWorkload.model_fields) - set(TraceWorkload.model_fields)]
    if not synthetic:
        return None
    return ConfigError(
        f"{source}: invalid workload\n  workload: `trace` and {', '.join(synthetic)} are "
        "exclusive: a trace replay takes its arrival times and lengths from the file (rescale "
        "time with target_rate_rps or rate_scale, or replay the lengths with closed_loop); "
        "drop `trace` for a synthetic workload")


def parse_experiment(data: Any, source: str = "<config>") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment is a mapping of keys, got {type(data).__name__}")
    mixed = workload_mix_error(data.get("workload"), source)
    if mixed is not None:
        raise mixed
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, source, "experiment config", ExperimentConfig)
        ) from None


def read_config_file(path: str | Path, what: str, hint: str = "") -> Any:
    """The YAML a config file holds; a ConfigError naming the file when it is missing (`hint`
    says how to make one) or not valid YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such {what} file{hint}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load_experiment(path: str | Path) -> tuple[ExperimentConfig, dict]:
    """The validated config and the raw mapping (sweeps re-validate edited copies of it)."""
    data = read_config_file(path, "experiment")
    return parse_experiment(data, str(path)), data


def _set_dotted(data: dict, dotted: str, value: Any, source: str) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: sweep field {dotted!r}: {part!r} is not a mapping")
        node = child
    node[parts[-1]] = value


def expand_sweep(config: ExperimentConfig, raw: dict, source: str = "<config>") -> list[tuple[dict, ExperimentConfig]]:
    """Every point of the sweep grid: (the swept values by field path, the point's config)."""
    if not config.sweep:
        return [({}, config)]
    axes = []
    for key, values in config.sweep.items():
        fields = [k.strip() for k in key.split(",")]
        if not values:
            raise ConfigError(f"{source}: sweep.{key}: needs at least one value")
        if len(fields) > 1:
            for v in values:
                if not isinstance(v, (list, tuple)) or len(v) != len(fields):
                    raise ConfigError(
                        f"{source}: sweep.{key}: each value must be a list of {len(fields)} "
                        f"(one per field), got {v!r}"
                    )
            axes.append([dict(zip(fields, v)) for v in values])
        else:
            axes.append([{fields[0]: v} for v in values])
    points = []
    base = {k: v for k, v in raw.items() if k != "sweep"}
    for combo in itertools.product(*axes):
        values = {k: v for part in combo for k, v in part.items()}
        data = copy.deepcopy(base)
        for field, value in values.items():
            _set_dotted(data, field, value, source)
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        points.append((values, parse_experiment(data, f"{source} [sweep point {label}]")))
    return points


def workload_files(workload: BaseModel, where: str = "workload") -> list[tuple[str, str]]:
    """(field path, path as given) of every file a workload config reads: a replay's trace, an
    empirical length distribution's trace."""
    if isinstance(workload, TraceWorkload):
        return [(f"{where}.trace", workload.trace)]
    if isinstance(workload, EmpiricalLength):
        return [(f"{where}.path", workload.path)]
    return [pair for name in type(workload).model_fields
            if isinstance(value := getattr(workload, name), BaseModel)
            for pair in workload_files(value, f"{where}.{name}")]


def check_files(workload: BaseModel, base_dir: str | Path | None, source: str) -> None:
    """A ConfigError naming every file the workload names that does not exist (looked for as
    the simulation will: under `base_dir`, the config's folder, then here)."""
    missing = []
    for field, path in workload_files(workload):
        try:
            resolve_path(path, base_dir)
        except WorkloadError as exc:
            missing.append(f"  {field}: {exc}")
    if missing:
        raise ConfigError("\n".join([f"{source}: missing file"] + missing))


# Keys only a plan has (PlanConfig's fields an experiment lacks), to tell the two apart.
_PLAN_KEYS = ("max_gpus", "target_rate_rps", "usd_per_gpu_hour", "gpu_types", "objective",
              "search", "prefilter", "launch", "scheduler")


def config_kind(data: Any) -> str:
    """What a config mapping is, by its keys: "plan" (a plan-only key such as max_gpus or
    search), "experiment" (a workload), else "serve" (a serve config)."""
    if isinstance(data, dict) and any(k in data for k in _PLAN_KEYS):
        return "plan"
    if isinstance(data, dict) and "workload" in data:
        return "experiment"
    return "serve"
