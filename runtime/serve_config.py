"""`pdsim serve` configuration: YAML -> one frozen pydantic model.

Unknown keys are rejected; every error names the file, the field path, the bad value and what is
allowed. `mode` picks the model: "colocated" (`ServeConfig`: one engine runs prefill and decode)
or "disaggregated" (`PDServeConfig`: prefill and decode workers behind a router).

    mode: colocated
    model: tiny-llama          # a preset (tiny-llama, tiny-mla) or a local HF checkpoint directory
    seed: 0
    page_size: 16
    num_pages: 2048
    scheduler: {max_running_requests: 64, chunked_prefill_size: 512}
    host: 127.0.0.1
    port: 30000                # 0 picks a free port

    mode: disaggregated
    model: tiny-llama
    page_size: 16
    prefill: {instances: 1, tp: 1, num_pages: 2048}
    decode: {instances: 1, tp: 1, num_pages: 2048}
    router: {policy: round_robin, port: 30000}
    transfer: {protocol: tcp, heartbeat_interval_s: 2, heartbeat_timeout_s: 20}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdsim.config import ConfigError
from pdsim.config_errors import format_validation_error
from pdsim.core.config import SchedulerConfig
from pdsim.faults import FaultsConfig

MODEL_PRESETS = ("tiny-llama", "tiny-mla")  # runtime.model.config.PRESETS, without importing torch


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServeSchedulerKnobs(_Spec):
    """The scheduler's limits (see `pdsim.core.config.SchedulerConfig`)."""

    max_running_requests: int = Field(64, ge=1, description="requests in the decode batch at most")
    max_prefill_tokens: int = Field(4096, ge=1, description="new tokens of one extend batch")
    chunked_prefill_size: int = Field(512, ge=0, description="prefill chunk; 0 disables chunking")
    num_reserved_decode_tokens: int = Field(
        64, ge=0, description="KV tokens set aside per running request when admitting new ones")


class SecuritySpec(_Spec):
    """The cluster secret and the public API key (runtime/security.py; docs/serving.md,
    "Security"). Neither is ever written out: `model_dump` leaves them out, and the launcher
    hands the secret to the processes it starts in their environment."""

    cluster_secret: str | None = Field(
        None, min_length=16, exclude=True, repr=False,
        description="authenticates internal calls and messages (PDSIM_CLUSTER_SECRET wins); "
        "`pdsim serve` of a whole deployment generates one when none is given")
    api_key: str | None = Field(
        None, min_length=1, exclude=True, repr=False,
        description="clients of the public API must send `Authorization: Bearer KEY` "
        "(also PDSIM_API_KEY); none: the API is open")
    insecure: bool = Field(
        False, description="a role started alone (--role) may run without a cluster secret")


class _ServeBase(_Spec):
    """What every serving mode shares: the model, its tokenizer and the KV page size."""

    model: str = Field("tiny-llama", description="preset name or local checkpoint directory")
    served_model_name: str | None = Field(
        None, description="the name clients send as `model` (default: the preset or the "
        "directory's name)")
    tokenizer: str | None = Field(
        None, description="tokenizer.json (or its directory); default: the checkpoint's own "
        "tokenizer.json, else the byte-level tokenizer")
    seed: int = Field(0, description="random weights of a preset, and unseeded sampling")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and KV dtype (default: the model config's)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    page_size: int = Field(16, ge=1)
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens of a chat request that gives none (completions: 16)")
    max_records: int = Field(100_000, ge=1, description="finished requests' records kept")
    max_inflight_requests: int = Field(
        4096, ge=1, description="requests one server (colocated server, PD worker or router) "
        "answers at once; more get 503 with Retry-After")
    security: SecuritySpec = SecuritySpec()

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value in MODEL_PRESETS:
            return value
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"not a preset and not a directory holding config.json; allowed: "
                             f"{', '.join(MODEL_PRESETS)} or a local checkpoint directory")
        return value

    @property
    def is_preset(self) -> bool:
        return self.model in MODEL_PRESETS

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.is_preset else Path(self.model).expanduser().resolve().name


class ServeConfig(_ServeBase):
    """Colocated serving: one engine, one OpenAI-compatible server."""

    mode: Literal["colocated"] = "colocated"
    num_pages: int = Field(2048, ge=1)
    scheduler: ServeSchedulerKnobs = ServeSchedulerKnobs()
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535, description="0 picks a free port")
    records_path: str | None = Field(None, description="write the records here (.csv/.parquet) "
                                     "at shutdown")
    timings_path: str | None = Field(None, description="write the forward timings here "
                                     "(.csv/.parquet) at shutdown")

    def scheduler_config(self) -> SchedulerConfig:
        s = self.scheduler
        return SchedulerConfig(
            num_pages=self.num_pages, page_size=self.page_size,
            max_running_requests=s.max_running_requests, max_prefill_tokens=s.max_prefill_tokens,
            chunked_prefill_size=s.chunked_prefill_size,
            num_reserved_decode_tokens=s.num_reserved_decode_tokens)


# ---- disaggregated -------------------------------------------------------------------------


class _RoleSpec(_Spec):
    """The instances of one role (prefill or decode): each is `tp` rank processes."""

    instances: int = Field(1, ge=1, description="instances of this role")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks (processes) per instance")
    num_pages: int = Field(2048, ge=1, description="KV pool pages of each instance")
    metadata_slots: int = Field(256, ge=1, description="first-token metadata slots")
    host: str = Field("127.0.0.1", description="the workers' HTTP bind address")
    port: int = Field(0, ge=0, le=65535, description="HTTP port of instance 0 (instance i: "
                      "port + i); 0 picks free ports")
    threads: int | None = Field(None, ge=1, description="torch threads per rank (default: "
                                "the CPUs divided by tp)")
    scheduler: ServeSchedulerKnobs | None = Field(
        None, description="this role's scheduler knobs (default: the top-level ones)")


class PrefillSpec(_RoleSpec):
    bootstrap_port: int = Field(0, ge=0, le=65535, description="bootstrap server port of "
                                "instance 0 (instance i: + i); 0 picks free ports")


class DecodeSpec(_RoleSpec):
    pre_alloc_size: int = Field(
        64, ge=0, description="request slots beyond max_running_requests for requests whose KV "
        "is on its way")


class RouterSpec(_Spec):
    policy: str = Field("round_robin", description="how the router picks a (prefill, decode) pair")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535, description="0 picks a free port")
    prefill_urls: list[str] = Field(
        default_factory=list, description="`--role router` alone: the prefill workers' URLs "
        "(default: prefill.host and ports from prefill.port)")
    decode_urls: list[str] = Field(default_factory=list, description="likewise for decode")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from pdsim.core.router import POLICIES

        if value not in POLICIES:
            raise ValueError(f"unknown policy; allowed: {', '.join(sorted(POLICIES))}")
        return value


class TransferSpec(_Spec):
    """The Mooncake transfer engine, ZMQ and the failure timeouts (DESIGN.md "Failure edges")."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device, e.g. mlx5_0 (rdma only)")
    host: str = Field("127.0.0.1", description="ZMQ bind address and transfer-engine hostname: "
                      "this machine's routable IP when the roles span machines")
    num_workers: int = Field(2, ge=1, description="KV-sending threads per prefill rank")
    heartbeat_interval_s: float = Field(
        2.0, ge=0, description="decode -> prefill heartbeats; 0 disables them")
    heartbeat_timeout_s: float = Field(
        20.0, gt=0, description="a peer silent this long fails its unfinished requests")
    bootstrap_timeout_s: float = Field(
        30.0, gt=0, description="prefill: a request whose decode side never says where to "
        "write fails after this; decode: the bootstrap-server lookup gives up after this")
    waiting_timeout_s: float = Field(
        60.0, gt=0, description="decode: a request whose KV does not arrive fails after this")
    poll_interval_s: float = Field(
        0.005, gt=0, description="tp > 1: how often rank 0 re-polls transfers in flight")

    @model_validator(mode="after")
    def _consistent(self) -> TransferSpec:
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("protocol rdma needs a device_name (e.g. mlx5_0)")
        if self.heartbeat_interval_s and self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        return self


ROLES = ("prefill", "decode")


class PDServeConfig(_ServeBase):
    """Disaggregated serving: prefill and decode workers (each `tp` rank processes) and a router
    with the OpenAI-compatible API in front."""

    mode: Literal["disaggregated"] = "disaggregated"
    scheduler: ServeSchedulerKnobs = ServeSchedulerKnobs()
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    router: RouterSpec = RouterSpec()
    transfer: TransferSpec = TransferSpec()
    faults: FaultsConfig = Field(FaultsConfig(), description="fault injection (pdsim/faults.py)")

    @model_validator(mode="after")
    def _faults_fit(self) -> PDServeConfig:
        from runtime.faults import check_serving

        self.faults.check_instances({r: self.role(r).instances for r in ROLES})
        check_serving(self.faults)
        return self

    def role(self, name: str) -> PrefillSpec | DecodeSpec:
        if name not in ROLES:
            raise ValueError(f"role {name!r}; allowed: {', '.join(ROLES)}")
        return self.prefill if name == "prefill" else self.decode

    def scheduler_config(self, role: str) -> SchedulerConfig:
        spec = self.role(role)
        s = spec.scheduler or self.scheduler
        t = self.transfer
        return SchedulerConfig(
            num_pages=spec.num_pages, page_size=self.page_size,
            max_running_requests=s.max_running_requests, max_prefill_tokens=s.max_prefill_tokens,
            chunked_prefill_size=s.chunked_prefill_size,
            num_reserved_decode_tokens=s.num_reserved_decode_tokens,
            pre_alloc_size=self.decode.pre_alloc_size, metadata_slots=spec.metadata_slots,
            bootstrap_timeout_s=t.bootstrap_timeout_s, waiting_timeout_s=t.waiting_timeout_s)

    def worker_port(self, role: str, instance: int) -> int:
        """The configured HTTP port of instance `instance` of `role` (0: pick a free one)."""
        port = self.role(role).port
        return port + instance if port else 0

    def bootstrap_port(self, instance: int) -> int:
        port = self.prefill.bootstrap_port
        return port + instance if port else 0


MODES = {"colocated": ServeConfig, "disaggregated": PDServeConfig}


def parse_serve_config(data: Any, source: str = "<config>") -> ServeConfig | PDServeConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a serve config is a mapping of keys, got "
                          f"{type(data).__name__}")
    mode = data.get("mode", "colocated")
    model = MODES.get(mode) if isinstance(mode, str) else None
    if model is None:
        raise ConfigError(f"{source}: invalid serve config\n  mode: unknown mode (got {mode!r}); "
                          f"allowed: {', '.join(MODES)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, "serve config", model)) from None


def load_serve_config(path: str | Path | None = None,
                      **overrides: Any) -> ServeConfig | PDServeConfig:
    """The config in `path` (defaults when None) with the non-None `overrides` applied on top
    (keys, as the CLI options give them; a dict value is merged into that section)."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such serve config file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a serve config is a mapping of keys, got "
                              f"{type(data).__name__}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        data = dict(data)
        for key, value in given.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        source += f" with command-line options {sorted(given)}"
    return parse_serve_config(data, source)
