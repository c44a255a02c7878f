"""Trace replay: a trace file, or a window of it, with time stretched or compressed."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from pdsim.workload.arrays import Workload, WorkloadError
from pdsim.workload.registry import Spec
from pdsim.workload.synthetic import ClosedLoopArrival
from pdsim.workload.traces import TraceFormat, read_trace, resolve_path

log = logging.getLogger(__name__)


class TraceWorkload(Spec):
    """Replay a trace file, optionally a window of it, with time stretched or compressed.

    Steps, in order: keep arrivals at or after `start_s` (times become relative to `start_s`);
    drop requests with more than `max_input_tokens` input tokens (dropping, not clipping, keeps
    the kept requests' lengths real; the count is `Workload.num_dropped`, counting only dropped
    rows before the last kept one); keep the first `num_requests`; divide times by `rate_scale`,
    or by the factor that makes the mean rate `target_rate_rps`. Asking for more requests than
    the window holds is an error. With `closed_loop` the kept requests' lengths are sent in
    trace order by that many clients and the trace's times are ignored. Replay draws nothing
    random; `seed` is kept so every workload config names one.
    """

    trace: str = Field(min_length=1, description="path; relative to the experiment YAML's folder")
    format: TraceFormat = "auto"
    num_requests: int | None = Field(default=None, ge=1)
    start_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    rate_scale: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    target_rate_rps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_input_tokens: int | None = Field(default=None, ge=1)
    closed_loop: ClosedLoopArrival | None = None
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_rate(self) -> TraceWorkload:
        if self.rate_scale is not None and self.target_rate_rps is not None:
            raise ValueError("give at most one of rate_scale or target_rate_rps")
        if self.closed_loop is not None and (self.rate_scale or self.target_rate_rps):
            raise ValueError("a closed_loop replay ignores the trace's times: drop rate_scale "
                             "and target_rate_rps")
        return self

    def check(self, base_dir: str | Path | None = None) -> None:
        """Raise the WorkloadError `build` would (an empty window, too few requests in it):
        the replay is cut as a run cuts it, reading the file being most of the time it takes."""
        self.build(base_dir)

    def build(self, base_dir: str | Path | None = None) -> Workload:
        """Read the trace (a relative path is tried under `base_dir`, then here) and cut it."""
        try:
            trace = read_trace(resolve_path(self.trace, base_dir), self.format)
        except WorkloadError as exc:
            raise exc.in_field("trace") from None

        in_window = trace.arrival_s >= self.start_s
        keep = in_window.copy()
        if self.max_input_tokens is not None:
            keep &= trace.input_tokens <= self.max_input_tokens
        rows = np.flatnonzero(keep)
        if self.num_requests is not None:
            if len(rows) < self.num_requests:
                raise WorkloadError(
                    f"workload.num_requests: {self.num_requests} requested, but {self.trace!r} holds "
                    f"{len(rows)} {self._window()}"
                )
            rows = rows[: self.num_requests]
        if not len(rows):
            raise WorkloadError(f"workload.start_s: {self.trace!r} holds no request {self._window()}")
        end = rows[-1] + 1
        num_dropped = int(np.count_nonzero(in_window[:end] & ~keep[:end]))
        if num_dropped:
            log.info("workload %s: dropped %d requests over max_input_tokens", self.trace, num_dropped)

        prefix = None if trace.prefix is None else trace.prefix.take(rows)
        if self.closed_loop is not None:
            return Workload(np.zeros(len(rows)), trace.input_tokens[rows], trace.output_tokens[rows],
                            num_dropped, self.closed_loop.closed_loop, prefix)
        workload = Workload(
            trace.arrival_s[rows] - self.start_s,
            trace.input_tokens[rows],
            trace.output_tokens[rows],
            num_dropped,
            prefix=prefix,
        )
        if self.rate_scale is not None:
            return workload.scaled(self.rate_scale)
        if self.target_rate_rps is not None:
            native = workload.mean_rate_rps
            if not np.isfinite(native):
                raise WorkloadError(
                    f"workload.target_rate_rps: {len(workload)} requests over {workload.duration_s:g} s "
                    "have no finite mean rate to rescale"
                )
            return workload.scaled(self.target_rate_rps / native)
        return workload

    def _window(self) -> str:
        limit = f" with at most {self.max_input_tokens} input tokens" if self.max_input_tokens else ""
        return f"at or after start_s={self.start_s:g} s{limit}"
