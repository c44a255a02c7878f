"""`pdsim serve` configuration: YAML -> one frozen pydantic model.

A serve config is an experiment (pdsim.config.ExperimentConfig, built on pdsim.deployment): the
same file is simulated by `pdsim run` and served by `pdsim serve`. `cluster.mode` picks the
model: "colocated" (`ServeConfig`: one engine runs prefill and decode and serves the API at
router.host:router.port) or "disaggregated" (`PDServeConfig`: prefill and decode workers behind
a router). Serving ignores the simulator-only sections (workload, cost_model, network, slo, ...).

    cluster:
      mode: disaggregated
      prefill: {instances: 1, tp: 1, scheduler: {num_pages: 1024}}
      decode: {instances: 1, tp: 1, scheduler: {num_pages: 2048}}
    model: tiny-llama          # a servable preset (pdsim presets) or a checkpoint directory
    router: {policy: round_robin, port: 30000}
    transfer: {protocol: tcp, heartbeat_interval_s: 2, heartbeat_timeout_s: 20}

An `autoscaling:` section (pdsim/autoscaling_config.py) makes `pdsim serve` resize the roles
while it serves (runtime/scaling.py); it needs pdsim's router (`router.impl: pdsim`).

Serving reads a file with the validators `pdsim run` reads it with (the deployment's): a key
either backend would reject, such as the earlier flat layout's (`mode:` at the top, a role's
`num_pages`, `transfer.bootstrap_timeout_s`), is an error naming its place now.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from pdsim.config import ConfigError, ExperimentConfig, read_config_file
from pdsim.config_errors import format_validation_error
from pdsim.core.config import SchedulerConfig
from pdsim.deployment import RoleConfig, overlap_schedule, servable_presets
from pdsim.specs.models import load_model_spec
from pdsim.workload import WorkloadConfig

ROLES = ("prefill", "decode")
CLUSTER_ROLES = ("colocated", *ROLES)  # the cluster's sections a command-line override names


class _ServeBase(ExperimentConfig):
    """What every serving mode shares; the simulator's sections are optional here."""

    name: str = Field("serve", pattern=r"^[A-Za-z0-9_.-]+$")
    workload: WorkloadConfig | None = Field(None, description="sim only")

    @model_validator(mode="after")
    def _servable(self) -> _ServeBase:
        """The deployment's model (its default too: one default for both backends) must be
        one the real backend can build."""
        presets = servable_presets()
        if isinstance(self.model, str) and (
                self.model in presets or (Path(self.model).expanduser() / "config.json").is_file()):
            return self
        raise ValueError(f"model: {self.model!r} is not a servable preset and not a directory "
                         f"holding config.json; allowed: {', '.join(presets)} or a local "
                         "checkpoint directory (the simulator's presets have no weights)")

    @model_validator(mode="after")
    def _real_parallelism(self) -> _ServeBase:
        for name, role in self.cluster.roles.items():
            # attention DP and EP run in PD workers' rank processes; the colocated engine
            # is one process (its ep has its own message below)
            knobs = ("pp",) if name != "colocated" else ("dp_attention", "pp")
            for knob in knobs:
                if getattr(role, knob) != 1:
                    raise ValueError(f"cluster.{name}.{knob}: {getattr(role, knob)}; the real "
                                     "backend serves 1 only (the simulator models more)")
            if role.dp_attention > 1 and role.ep > 1:
                raise ValueError(f"cluster.{name}: dp_attention {role.dp_attention} with ep "
                                 f"{role.ep}; the real backend serves one of them above 1 per "
                                 "role (the simulator models both)")
        return self

    @model_validator(mode="after")
    def _pool_given(self) -> _ServeBase:
        """num_pages means the same in both backends; only the simulator can size it from
        memory (its `hardware`), so serving needs it given."""
        for name, role in self.cluster.roles.items():
            if role.scheduler.pool_pages() is None:
                raise ValueError(
                    f"cluster.{name}.scheduler.num_pages: not given; the simulator sizes the KV "
                    "pool from the hardware's memory, the real backend does not measure its "
                    "device: give the pages per rank (the pool holds num_pages * page_size "
                    "tokens) or max_total_tokens (SGLang's --max-total-tokens)")
        return self

    @property
    def is_preset(self) -> bool:
        return self.model in servable_presets()

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.is_preset else Path(self.model).expanduser().resolve().name

    def notes(self) -> list[str]:
        """What to know before serving this config (`pdsim check` and `pdsim serve` print it)."""
        return []

    def role(self, name: str) -> RoleConfig:
        roles = self.cluster.roles
        if name not in roles:
            raise ValueError(f"role {name!r}; allowed: {', '.join(roles)}")
        return roles[name]

    def forward_threads(self, role: str) -> int:
        """Torch threads of one rank of `role` for its forwards (`ModelExecutor.threads`): the
        role's `threads`, else the CPUs divided among its tp ranks."""
        spec = self.role(role)
        return spec.threads or max(1, (os.cpu_count() or 1) // spec.tp)

    def scheduler_config(self, role: str) -> SchedulerConfig:
        """The core config of one rank of `role` (the one builder: SchedulerKnobs.build)."""
        spec = self.role(role)
        overlap = overlap_schedule(role, spec, self.speculative.method)
        return spec.scheduler.build(spec.scheduler.pool_pages(), spec.dp_attention,
                                    f"cluster.{role}.scheduler",
                                    model_context_len=load_model_spec(self.model).context_len,
                                    overlap_schedule=overlap,
                                    speculating=self.speculative.method != "none")


def check_served_method(spec) -> None:
    """The speculative methods the real backend serves (a `SpeculativeConfig`)."""
    if spec.method == "eagle" or (spec.method == "mtp" and spec.draft_layers != 1):
        raise ValueError(f"speculative: method {spec.method!r} with draft_layers "
                         f"{spec.draft_layers}; the real backend serves method 'mtp' (one "
                         "random-weight MTP layer, draft_layers 1) or 'none'")


class ServeConfig(_ServeBase):
    """Colocated serving: one engine, one OpenAI-compatible server at router.host:router.port."""

    @model_validator(mode="after")
    def _one_engine(self) -> ServeConfig:
        if self.cluster.mode != "colocated":
            raise ValueError("cluster.mode: a ServeConfig is colocated; use PDServeConfig")
        if self.cluster.colocated.instances != 1:
            raise ValueError(f"cluster.colocated.instances: {self.cluster.colocated.instances}; "
                             "the real backend serves one colocated engine (more: simulator only)")
        if self.cluster.colocated.ep != 1:
            raise ValueError(f"cluster.colocated.ep: {self.cluster.colocated.ep}; the colocated "
                             "server is one process: the real backend serves expert "
                             "parallelism disaggregated (prefill or decode ep)")
        check_served_method(self.speculative)
        return self

    @property
    def host(self) -> str:
        return self.router.host

    @property
    def port(self) -> int:
        return self.router.port

    @property
    def num_pages(self) -> int:
        return self.cluster.colocated.scheduler.pool_pages()

    def scheduler_config(self, role: str = "colocated") -> SchedulerConfig:
        return super().scheduler_config(role)


class PDServeConfig(_ServeBase):
    """Disaggregated serving: prefill and decode workers (each `tp` rank processes) and a router
    with the OpenAI-compatible API in front."""

    @model_validator(mode="after")
    def _disaggregated(self) -> PDServeConfig:
        from runtime.faults import check_serving

        if self.cluster.mode != "disaggregated":
            raise ValueError("cluster.mode: a PDServeConfig is disaggregated; use ServeConfig")
        check_serving(self.faults)
        spec = self.speculative
        check_served_method(spec)
        if spec.method == "mtp":
            shapes = {name: (role.tp, role.dp_attention) for name, role in
                      (("prefill", self.cluster.prefill), ("decode", self.cluster.decode))}
            if any(shape != (1, 1) for shape in shapes.values()):
                raise ValueError(
                    "speculative.method 'mtp': the real backend speculates in PD at tp 1 -> tp 1 "
                    "without attention DP; got " + ", ".join(
                        f"{name} tp {tp}, dp_attention {dp}"
                        for name, (tp, dp) in shapes.items()))
        return self

    @model_validator(mode="after")
    def _autoscaled_by_pdsim(self) -> PDServeConfig:
        """The launcher scales the workers behind pdsim's router (runtime/scaling.py), which
        admits and drains workers while it serves; SGLang's router is a process of its own."""
        if self.autoscaling is None:
            return self
        if self.router.impl != "pdsim":
            raise ValueError(f"autoscaling: needs router.impl pdsim (the router that admits "
                             f"and drains workers while serving), got {self.router.impl!r}")
        try:
            self.autoscaling.make_policy()
        except ValueError as exc:  # sla without capacities: only the simulator derives them
            raise ValueError(f"autoscaling: {exc}; serving has no cost model to derive them "
                             "from") from None
        return self

    @property
    def prefill(self) -> RoleConfig:
        return self.cluster.prefill

    @property
    def decode(self) -> RoleConfig:
        return self.cluster.decode

    def worker_port(self, role: str, instance: int) -> int:
        """The configured HTTP port of instance `instance` of `role` (0: pick a free one)."""
        port = self.role(role).port
        return port + instance if port else 0

    def bootstrap_port(self, instance: int) -> int:
        port = self.prefill.bootstrap_port
        return port + instance if port else 0

    def notes(self) -> list[str]:
        """GQA KV over a TP mismatch moves as one head slice per token slot per buffer (the
        simulator counts the same, pdsim.sim.network.descriptor_counts), and over TCP each
        costs tens of microseconds, so the transfer, not the forward, sets TTFT."""
        from pdsim.sim.network import PROTOCOLS, descriptor_counts

        p, d = self.prefill, self.decode
        src, dst = p.tp // p.dp_attention, d.tp // d.dp_attention
        if self.transfer.protocol != "tcp" or src == dst:
            return []
        spec = load_model_spec(self.model)
        _, per_page = descriptor_counts(spec.num_layers, 1 if spec.is_mla else 2, 1,
                                        spec.num_kv_heads, src, dst, spec.is_mla)
        if not per_page:
            return []
        per_s = PROTOCOLS["tcp"].per_descriptor_s
        return [f"attention TP {src} (prefill) -> {dst} (decode) splits {spec.name}'s "
                f"{spec.num_kv_heads} KV heads differently: every prompt token's KV moves as "
                f"{per_page:g} head slices, one transfer descriptor each; over transfer.protocol "
                f"tcp at ~{per_s * 1e6:.1f} us a descriptor (`pdsim calibrate` measures this "
                f"machine's) a 1,000-token prompt's KV takes ~{1000 * per_page * per_s:.2f} s "
                "to send. Equal attention TP on both roles, or rdma, sends whole pages."]

    def request_limits(self, model_vocab: int, max_position: int):
        """What one request may ask for (`runtime.openai.protocol.Limits`): its prompt must fit
        the smaller KV pool, prompt + output the decode pool and the model's positions. The
        router's API and the workers' OpenAI routes check the same."""
        from runtime.openai.protocol import Limits

        decode_pool = self.scheduler_config("decode").pool_tokens
        prefill_pool = self.scheduler_config("prefill").pool_tokens
        return Limits(max_model_len=min(decode_pool, max_position),
                      pool_tokens=min(decode_pool, prefill_pool), max_position=max_position,
                      model_vocab=model_vocab)


MODES = {"colocated": ServeConfig, "disaggregated": PDServeConfig}


def parse_serve_config(data: Any, source: str = "<config>") -> ServeConfig | PDServeConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a serve config is a mapping of keys, got "
                          f"{type(data).__name__}")
    cluster = data.get("cluster")
    mode = cluster.get("mode", "disaggregated") if isinstance(cluster, dict) else "disaggregated"
    model = MODES.get(mode) if isinstance(mode, str) else None
    if model is None:
        raise ConfigError(f"{source}: invalid serve config\n  cluster.mode: unknown mode (got "
                          f"{mode!r}); allowed: {', '.join(MODES)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, "serve config", model)) from None


def load_serve_config(path: str | Path | None = None,
                      **overrides: Any) -> ServeConfig | PDServeConfig:
    """The config in `path` (defaults when None) with the non-None `overrides` applied on top
    (keys, as the CLI options give them: `model`, `security`; `host` and `port` (the API's:
    router); `colocated`, `prefill`, `decode`, `router` (a dict merged into that section))."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {"model": "tiny-llama", "cluster": {
        "mode": "colocated", "colocated": {"instances": 1, "scheduler": {"num_pages": 2048}}}}
    if path is not None:
        data = read_config_file(path, "serve config") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a serve config is a mapping of keys, got "
                              f"{type(data).__name__}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        data = dict(data)
        data["cluster"] = dict(data.get("cluster") or {})
        for key, value in given.items():
            if key in ("host", "port"):
                data["router"] = {**(data.get("router") or {}), key: value}
                continue
            section, parent = (data["cluster"], key) if key in CLUSTER_ROLES else (data, key)
            if isinstance(value, dict) and isinstance(section.get(parent), dict):
                section[parent] = {**section[parent], **value}
            else:
                section[parent] = value
        source += f" with command-line options {sorted(given)}"
    return parse_serve_config(data, source)
