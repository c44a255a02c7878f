"""Configs for tests, built the way the backends build theirs.

`pdsim.deployment.SchedulerKnobs` holds every scheduler default and its `build` is the one
builder of a `SchedulerConfig`; tests go through it too, so a test's scheduler differs from a
deployment's only in what the test names. A serve config is read as `pdsim run` reads it (the
deployment's layout); `colocated_config` spells the common small one.
"""

from __future__ import annotations

from typing import Any

from pdsim.core.config import SchedulerConfig
from pdsim.core.running import Speculation
from pdsim.deployment import SchedulerKnobs


def scheduler_config(num_pages: int, *, prefix_cache: bool = False,
                     speculation: Speculation | None = None, **knobs: Any) -> SchedulerConfig:
    """One rank's config with `num_pages` pages; `knobs` are `SchedulerKnobs` fields.

    `prefix_cache` is the knobs' `not disable_radix_cache`; it is off unless asked for, since
    most core tests count pages and a cache keeps finished prompts' pages."""
    return SchedulerKnobs(disable_radix_cache=not prefix_cache, **knobs).build(
        num_pages, speculation=speculation)


def colocated_config(model: str = "tiny-llama", *, num_pages: int, page_size: int, port: int = 0,
                     scheduler: dict[str, Any] | None = None, **fields: Any):
    """A colocated `ServeConfig`: one engine of `num_pages` pages of `page_size` tokens (and
    the other `scheduler` knobs), its API on 127.0.0.1:`port`; `fields` are other top-level
    deployment fields (seed, device, ...)."""
    from runtime.serve_config import ServeConfig

    knobs = {"num_pages": num_pages, "page_size": page_size, **(scheduler or {})}
    return ServeConfig(model=model, router={"port": port}, **fields,
                       cluster={"mode": "colocated",
                                "colocated": {"instances": 1, "scheduler": knobs}})


def tiny_pd_yaml(*, prefill_tp: int = 1, decode_pages: int = 128, extra: str = "") -> str:
    """The small tiny-llama PD deployment the real-backend tests serve, as YAML text: one prefill
    (tp `prefill_tp`) and one decode worker on one thread each, pages of 8 tokens, a quick
    heartbeat; `extra` adds top-level sections (YAML lines)."""
    tp = f"    tp: {prefill_tp}\n" if prefill_tp != 1 else ""
    return (
        "model: tiny-llama\nseed: 0\ndevice: cpu\ncluster:\n  mode: disaggregated\n"
        f"  prefill:\n{tp}    threads: 1\n"
        "    scheduler: &knobs {page_size: 8, num_pages: 64, max_running_requests: 8,\n"
        "                       max_prefill_tokens: 64, chunked_prefill_size: 32}\n"
        f"  decode: {{threads: 1, scheduler: {{<<: *knobs, num_pages: {decode_pages}}}}}\n"
        "router: {port: 0}\n"
        "transfer: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 5.0}\n" + extra)
