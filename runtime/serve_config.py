"""`pdsim serve` configuration: YAML -> one frozen pydantic model.

Unknown keys are rejected; every error names the file, the field path, the bad value and what is
allowed. `mode` is "colocated" for now (one engine runs prefill and decode); "disaggregated"
comes with the PD workers.

    mode: colocated
    model: tiny-llama          # a preset (tiny-llama, tiny-mla) or a local HF checkpoint directory
    seed: 0
    page_size: 16
    num_pages: 2048
    scheduler: {max_running_requests: 64, chunked_prefill_size: 512}
    host: 127.0.0.1
    port: 30000                # 0 picks a free port
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pdsim.config import ConfigError
from pdsim.core.config import SchedulerConfig

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


class ServeConfig(_Spec):
    mode: Literal["colocated"] = "colocated"
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
    num_pages: int = Field(2048, ge=1)
    scheduler: ServeSchedulerKnobs = ServeSchedulerKnobs()
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535, description="0 picks a free port")
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens of a chat request that gives none (completions: 16)")
    max_records: int = Field(100_000, ge=1, description="finished requests' records kept")
    records_path: str | None = Field(None, description="write the records here (.csv/.parquet) "
                                     "at shutdown")
    timings_path: str | None = Field(None, description="write the forward timings here "
                                     "(.csv/.parquet) at shutdown")

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

    def scheduler_config(self) -> SchedulerConfig:
        s = self.scheduler
        return SchedulerConfig(
            num_pages=self.num_pages, page_size=self.page_size,
            max_running_requests=s.max_running_requests, max_prefill_tokens=s.max_prefill_tokens,
            chunked_prefill_size=s.chunked_prefill_size,
            num_reserved_decode_tokens=s.num_reserved_decode_tokens)


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = ServeConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return sorted(getattr(model, "model_fields", {}))


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid serve config"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key (allowed: {', '.join(_allowed_keys(err['loc']))})"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)


def parse_serve_config(data: Any, source: str = "<config>") -> ServeConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a serve config is a mapping of keys, got "
                          f"{type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_serve_config(path: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """The config in `path` (defaults when None) with the non-None `overrides` applied on top
    (top-level keys, as the CLI options give them)."""
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
        data = {**data, **given}
        source += f" with command-line options {sorted(given)}"
    return parse_serve_config(data, source)
