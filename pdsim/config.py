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
from pdsim.core.router import POLICIES
from pdsim.faults import FaultsConfig
from pdsim.specs.precision import KV_DTYPE_BYTES, KVDTypeName, kv_format

from pdsim.metrics import SLO, MeasurementWindow
from pdsim.workload import WorkloadConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerKnobs(_Spec):
    """Per-scheduler limits (see pdsim.core.config.SchedulerConfig); the KV pool is sized from
    the GPU memory left after the weights unless `num_pages` is given."""

    page_size: int = Field(16, ge=1)
    max_running_requests: int = Field(256, ge=1)
    max_prefill_tokens: int = Field(16384, ge=1)
    chunked_prefill_size: int = Field(8192, ge=0)
    num_reserved_decode_tokens: int = Field(512, ge=0)
    pre_alloc_size: int = Field(64, ge=0)
    metadata_slots: int = Field(512, ge=1)
    bootstrap_timeout_s: float = Field(300.0, gt=0)
    waiting_timeout_s: float = Field(300.0, gt=0)
    mem_fraction_static: float = Field(0.88, gt=0, le=1)
    num_pages: int | None = Field(None, ge=1)
    wakeup_s: float = Field(0.0, ge=0, description="sim only: an idle scheduler notices new "
                            "work (a request, a finished transfer) this late")


class RoleConfig(_Spec):
    instances: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    dp_attention: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    kv_dtype: KVDTypeName | None = Field(
        None, description="KV-cache dtype (SGLang's --kv-cache-dtype); default: the "
        "experiment's kv_dtype_bytes")
    moe_a2a: Literal["none", "deepep"] = Field(
        "none", description="deepep: SGLang's --moe-a2a-backend deepep (needs ep = tp > 1 "
        "and a MoE model)")
    two_batch_overlap: bool = Field(
        False, description="SGLang's --enable-two-batch-overlap (needs moe_a2a: deepep)")
    moe_dense_tp: Literal[1] | None = Field(
        None, description="SGLang's --moe-dense-tp-size: None = tp; 1 = dense MLP layers "
        "data-parallel, per GPU on its own tokens (needs dp_attention > 1)")
    dp_lm_head: bool = Field(
        False, description="SGLang's --enable-dp-lm-head: LM head and embedding per "
        "attention-DP rank (needs dp_attention > 1)")
    scheduler: SchedulerKnobs = SchedulerKnobs()

    @model_validator(mode="after")
    def _divides(self) -> RoleConfig:
        from pdsim.sim.cost import check_dp_options, check_moe_a2a

        for name in ("dp_attention", "ep"):
            if self.tp % getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} must divide tp={self.tp}")
        check_moe_a2a(self.moe_a2a, self.two_batch_overlap, self.tp, self.ep)
        check_dp_options(self.moe_dense_tp, self.dp_lm_head, self.dp_attention)
        return self

    @property
    def gpus(self) -> int:
        return self.instances * self.tp

    def kv_bytes(self, default_bytes: float) -> float:
        """Bytes per KV-cache element: this role's kv_dtype, else the experiment's."""
        return KV_DTYPE_BYTES[self.kv_dtype] if self.kv_dtype else default_bytes


class ClusterConfig(_Spec):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: RoleConfig = RoleConfig()
    decode: RoleConfig = RoleConfig()
    colocated: RoleConfig = RoleConfig(instances=2)

    @model_validator(mode="after")
    def _same_page_size(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            p, d = self.prefill.scheduler.page_size, self.decode.scheduler.page_size
            if p != d:
                raise ValueError(
                    f"prefill page_size {p} != decode page_size {d}: a decode instance "
                    "cannot pair with a prefill instance of another page size"
                )
        return self

    @property
    def num_gpus(self) -> int:
        if self.mode == "colocated":
            return self.colocated.gpus
        return self.prefill.gpus + self.decode.gpus


class NetworkConfig(_Spec):
    """The KV path between instances. Bandwidths are GB/s (gigabytes) per GPU. Defaults and
    their sources: docs/cost_model.md, "Fixed costs and KV transfer"."""

    enabled: bool = True
    protocol: Literal["rdma", "tcp"] = "rdma"
    bandwidth_gbps: float | None = Field(None, gt=0, description="line rate; default: the hardware's NIC")
    line_rate_efficiency: float | None = Field(
        None, gt=0, le=1, description="share of the line rate a transfer reaches; default by protocol")
    transfer_floor_s: float | None = Field(
        None, ge=0, description="fixed time of every KV transfer (one per chunk); default by protocol")
    message_latency_s: float = Field(50e-6, ge=0)
    first_contact_s: float = Field(2e-3, ge=0)
    handshake_s: float = Field(0.58e-3, ge=0, description="per request: the decode side's "
                               "bootstrap lookup and receiver set-up before it asks for the KV")
    head_slice_efficiency: float = Field(
        0.5, gt=0, le=1,
        description="share of the bandwidth reached when GQA KV moves as head slices because "
        "prefill and decode attention-TP sizes differ (many small writes)",
    )


class CostModelConfig(_Spec):
    # "auto": silicon where the hardware has measured tables (pdsim[silicon]), else roofline.
    name: str = "auto"
    params: dict[str, float | str] = {}  # numbers, or paths (relative to the experiment file)

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from pdsim.sim.cost import cost_model_names

        if name not in cost_model_names():
            raise ValueError(f"unknown cost model {name!r}; allowed: {', '.join(cost_model_names())}")
        return name


class RouterConfig(_Spec):
    policy: str = "round_robin"
    dp_assignment: Literal["room", "shortest_queue"] = "room"
    frontend_latency_s: float = Field(6.5e-3, ge=0, description="sim only: tokenizer, HTTP and "
                                      "router time of a request, both ways, counted in its TTFT")

    @field_validator("policy")
    @classmethod
    def _known(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; allowed: {', '.join(sorted(POLICIES))}")
        return policy


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
    """Speculative decoding, simulator only: the real backend does not speculate."""

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


class ExperimentConfig(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = 0
    model: str | dict[str, Any] = Field(
        "llama-3.1-8b", description="a preset, a file (relative to this YAML's folder first) "
        "or a mapping of ModelSpec fields, optionally over `base: <preset or file>`")
    hardware: str | dict[str, Any] = Field(
        "h100", description="a preset, a YAML file or a mapping of HardwareSpec fields, "
        "optionally over `base:`")
    kv_dtype_bytes: float = Field(2, gt=0, description="KV-cache bytes per element of the "
                                  "roles without their own kv_dtype")
    cluster: ClusterConfig = ClusterConfig()
    router: RouterConfig = RouterConfig()
    network: NetworkConfig = NetworkConfig()
    cost_model: CostModelConfig = CostModelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    workload: WorkloadConfig
    slo: SLO = SLO()
    metrics: MeasurementWindow = MeasurementWindow()
    max_duration_s: float = Field(
        3600.0, gt=0, description="simulated seconds after the last arrival before giving up"
    )
    faults: FaultsConfig = FaultsConfig()
    sweep: dict[str, list[Any]] = {}

    @model_validator(mode="after")
    def _faults_fit(self) -> ExperimentConfig:
        c = self.cluster
        self.faults.check_instances({} if c.mode == "colocated" else
                                    {"prefill": c.prefill.instances, "decode": c.decode.instances})
        return self

    @model_validator(mode="after")
    def _one_kv_dtype_across_pd(self) -> ExperimentConfig:
        c = self.cluster
        if c.mode == "colocated":
            return self
        p, d = c.prefill, c.decode
        p_bytes, d_bytes = p.kv_bytes(self.kv_dtype_bytes), d.kv_bytes(self.kv_dtype_bytes)
        if p_bytes != d_bytes or (p.kv_dtype and d.kv_dtype
                                    and kv_format(p.kv_dtype) != kv_format(d.kv_dtype)):
            raise ValueError(
                f"cluster.prefill.kv_dtype {p.kv_dtype or 'default'} ({p_bytes:g} B) and "
                f"cluster.decode.kv_dtype {d.kv_dtype or 'default'} ({d_bytes:g} B) differ: the KV "
                "is copied byte for byte from prefill to decode, so both need one KV dtype"
            )
        return self


def parse_experiment(data: Any, source: str = "<config>") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment is a mapping of keys, got {type(data).__name__}")
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, source, "experiment config", ExperimentConfig)
        ) from None


def load_experiment(path: str | Path) -> tuple[ExperimentConfig, dict]:
    """The validated config and the raw mapping (sweeps re-validate edited copies of it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such experiment file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
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
