"""Scheduler knobs, the same for a simulated and a real instance."""

from __future__ import annotations

from dataclasses import dataclass

from pdsim.core.chunking import DynamicChunking
from pdsim.core.running import Speculation


# How SGLang's overlap event loop (`event_loop_overlap_disagg_prefill`, `..._disagg_decode`,
# `event_loop_overlap`) moves an instance's batches: "off" (its normal loop, or a driver that runs
# each forward to its end before planning the next); "plans_ahead": the host launches a forward
# and plans the next while the GPU runs it, so a batch is planned as the forward before it
# begins (a request that arrives, or whose KV lands, meanwhile runs a batch later); prefill
# only, "late_results": the
# host waits for the GPU inside each forward (DeepEP's normal-mode dispatch), so it takes up a
# batch's results (first tokens, KV sends) only once it has launched the next batch, as that one
# ends, or at once when there is none.
OVERLAP_SCHEDULES = ("off", "plans_ahead", "late_results")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Sizes and limits of one scheduler (one attention-DP rank of one instance), as
    `pdsim.deployment.SchedulerKnobs.build` makes it from a config for both backends (the
    instance-wide flags already split over the DP ranks). Every field is required: the
    defaults live with the knobs, in one place.

    num_pages × page_size is the KV pool in tokens. `max_prefill_tokens` caps the new tokens of
    one extend batch; `chunked_prefill_size` cuts longer prompts into chunks, and caps the batch
    as well (0 disables chunking, so a prompt longer than the budget runs alone).
    `num_reserved_decode_tokens` is set aside per running or queued request when admitting new
    ones, so admitted requests can keep decoding.
    `speculation` (simulator only) makes decode steps verify draft tokens. `prefix_cache` gives
    colocated and prefill schedulers a radix cache of prompt pages (`pdsim.core.radix`); a
    request takes from it only if it carries `prefix_keys`. `overlap_schedule` is how SGLang's
    overlap event loop shifts an instance's batches (`OVERLAP_SCHEDULES`;
    `pdsim.core.instance.Instance` applies it). With `state_slots`, every request
    also holds one slot of the recurrent-state pool from admission to its end (SGLang's mamba
    pool), so the slots cap how many run or wait for their KV at once.
    """

    num_pages: int
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    num_reserved_decode_tokens: int
    pre_alloc_size: int  # decode: extra request slots for requests waiting for their KV
    metadata_slots: int
    state_slots: int  # recurrent-state slots (0: the model keeps no per-request state)
    bootstrap_timeout_s: float
    waiting_timeout_s: float
    speculation: Speculation | None
    prefix_cache: bool
    dynamic_chunking: DynamicChunking | None
    context_len: int | None  # the longest prompt + output a request may ask for (None: any)
    schedule_conservativeness: float  # colocated: scales new_token_ratio (SGLang's, DP-adjusted)
    overlap_schedule: str  # one of OVERLAP_SCHEDULES ("late_results": PD prefill only)

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_running_requests", "max_prefill_tokens",
                     "metadata_slots"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.overlap_schedule not in OVERLAP_SCHEDULES:
            raise ValueError(f"SchedulerConfig.overlap_schedule must be one of {OVERLAP_SCHEDULES}, "
                             f"got {self.overlap_schedule!r}")
        for name in ("chunked_prefill_size", "num_reserved_decode_tokens", "pre_alloc_size",
                     "state_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"SchedulerConfig.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size
