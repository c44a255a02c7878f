"""Seeded workloads: the requests a run serves, as arrays of arrival times and token counts.

A `Workload` is what the simulator and the load generator against the real server both consume,
so this package knows nothing about simpy or any backend. `generate(config)` builds one from the
config under an experiment YAML's `workload:` key, in one of two shapes (a mapping with a
`trace` key is a trace replay, anything else is synthetic):

```yaml
workload:                     # synthetic
  num_requests: 2000
  seed: 7
  arrival: {process: gamma, rate_rps: 4.0, cv: 2.0}   # poisson | gamma (cv) | constant
  # a rate that changes over time (Poisson at each moment's rate; `schedule`):
  # {process: steps, steps: [{at_s: 0, rate_rps: 2}, {at_s: 300, rate_rps: 8}]}
  # {process: diurnal, trough_rps: 1, peak_rps: 10, period_s: 1800}  # peak at period/2
  # or a closed loop: {process: closed, concurrency: 64, think_time_s: 0.0}
  input_len: {dist: lognormal, mean: 2048, cv: 1.0, min: 16, max: 32768}
  output_len: {dist: empirical, path: ../shared/traces/conversation_trace.jsonl, column: output}
  # also {dist: fixed, value: 128} and {dist: uniform, low: 16, high: 512} (both ends included)
  # and {dist: sglang_random, len: 1024, range_ratio: 0.0}: bench_serving's --dataset-name random
  # prefix: {system_prompts: 8, system_prompt_len: 2000, share: 0.8}  # shared system prompts
  # conversation: {turns: 4, think_time_s: 30}   # prompt = last prompt + its answer + new text
  # prefix_block_tokens: 64                      # granularity of the prefix blocks (default 64)

workload:                     # trace replay
  trace: ../shared/traces/AzureLLMInferenceTrace_conv.csv
  format: auto                # auto | mooncake | azure
  num_requests: 5000          # first N kept requests (optional)
  start_s: 600                # skip the trace's first 600 s (optional)
  target_rate_rps: 8.0        # or rate_scale: 1.5 (optional; stretch or compress time)
  max_input_tokens: 32768     # drop longer requests, counted in Workload.num_dropped (optional)
  # closed_loop: {concurrency: 64, think_time_s: 0}  # replay lengths by N clients, ignore times
```

Modules: `arrays` (the Workload value), `registry` (names to spec classes), `synthetic`
(arrival processes, length distributions), `schedule` (arrival rates that change over
time), `traces` (reading Mooncake and Azure files),
`replay` (windowing and rescaling a trace), `prefix` (system prompts, conversations and the hit
rate of an unbounded prefix cache). A Mooncake trace's `hash_ids` and the synthetic prefixes
become `Workload.prefix` (`PrefixBlocks`). A new arrival process or length distribution is a
subclass of `ArrivalProcess` / `LengthDistribution` with `process: Literal["name"] = "name"`
(or `dist: ...`) decorated with `ARRIVAL_PROCESSES.register` / `LENGTH_DISTRIBUTIONS.register`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, TypeAdapter

from pdsim.workload.arrays import ClosedLoop, PrefixBlocks, TraceNotFoundError, Workload, WorkloadError
from pdsim.workload.prefix import (
    Conversation,
    SharedPrefix,
    ideal_cached_blocks,
    ideal_cached_tokens,
    ideal_hit_rate,
)
from pdsim.workload.registry import Registry, Spec
from pdsim.workload.replay import TraceWorkload
from pdsim.workload.schedule import DiurnalArrival, ScheduledArrival, StepsArrival
from pdsim.workload.synthetic import (
    ARRIVAL_PROCESSES,
    LENGTH_DISTRIBUTIONS,
    Arrival,
    ArrivalProcess,
    ClosedLoopArrival,
    ConstantArrival,
    EmpiricalLength,
    FixedLength,
    GammaArrival,
    LengthDistribution,
    LognormalLength,
    PoissonArrival,
    SGLangRandomLength,
    SyntheticWorkload,
    UniformLength,
)
from pdsim.workload.traces import (
    TraceFormat,
    detect_format,
    read_azure,
    read_mooncake,
    read_mooncake_hash_ids,
    read_trace,
    resolve_path,
)

__all__ = [
    "ARRIVAL_PROCESSES",
    "LENGTH_DISTRIBUTIONS",
    "Arrival",
    "ArrivalProcess",
    "ClosedLoop",
    "ClosedLoopArrival",
    "ConstantArrival",
    "DiurnalArrival",
    "Conversation",
    "EmpiricalLength",
    "FixedLength",
    "GammaArrival",
    "LengthDistribution",
    "LognormalLength",
    "PoissonArrival",
    "PrefixBlocks",
    "Registry",
    "SGLangRandomLength",
    "ScheduledArrival",
    "SharedPrefix",
    "Spec",
    "StepsArrival",
    "SyntheticWorkload",
    "TraceFormat",
    "TraceNotFoundError",
    "TraceWorkload",
    "UniformLength",
    "Workload",
    "WorkloadConfig",
    "WorkloadError",
    "closed_loop_clients",
    "detect_format",
    "generate",
    "ideal_cached_blocks",
    "ideal_cached_tokens",
    "ideal_hit_rate",
    "parse_workload_config",
    "read_azure",
    "read_mooncake",
    "read_mooncake_hash_ids",
    "read_trace",
    "resolve_path",
]


def _workload_shape(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    shape = TraceWorkload if "trace" in value else SyntheticWorkload
    return shape.model_validate(dict(value))


WorkloadConfig = Annotated[SyntheticWorkload | TraceWorkload, BeforeValidator(_workload_shape)]


def closed_loop_clients(workload: SyntheticWorkload | TraceWorkload) -> int | None:
    """The clients of a closed-loop workload config; None for an open loop."""
    loop = workload.arrival if isinstance(workload, SyntheticWorkload) else workload.closed_loop
    return loop.concurrency if isinstance(loop, ClosedLoopArrival) else None
"""The type of an experiment's `workload:` field: a mapping with `trace` is a replay."""

_ADAPTER: TypeAdapter[SyntheticWorkload | TraceWorkload] = TypeAdapter(
    WorkloadConfig, config=ConfigDict(title="workload")
)


def parse_workload_config(data: Any) -> SyntheticWorkload | TraceWorkload:
    """Validate the mapping found under `workload:` (raises pydantic's ValidationError)."""
    return _ADAPTER.validate_python(data)


def generate(
    config: SyntheticWorkload | TraceWorkload | Mapping[str, Any], base_dir: str | Path | None = None
) -> Workload:
    """Build the workload a config describes; the same config gives the same arrays.

    `config` may be the raw mapping under `workload:`; `base_dir` is the experiment YAML's folder.
    """
    if isinstance(config, Mapping):
        config = parse_workload_config(config)
    if not isinstance(config, (SyntheticWorkload, TraceWorkload)):
        raise TypeError(f"generate: expected a workload config, got {type(config).__name__}")
    return config.build(base_dir)
