"""The workload value: requests in arrival order, as three read-only numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where used: a simulation alone need not load pandas
    import pandas as pd


class WorkloadError(ValueError):
    """A workload cannot be built from a valid-looking config (bad trace, too few rows...)."""

    def in_field(self, field: str) -> WorkloadError:
        """The same error, its message prefixed with the config field it comes from."""
        return type(self)(f"workload.{field}: {self}")


class TraceNotFoundError(WorkloadError, FileNotFoundError):
    """A trace file named by the config does not exist where it was looked for."""


def _int_column(values: Any, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind == "f" and not np.all(arr == np.floor(arr)):
        raise WorkloadError(f"{name}: token counts must be whole numbers")
    if arr.dtype.kind not in "iuf" and arr.size:
        raise WorkloadError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


@dataclass(frozen=True)
class ClosedLoop:
    """`concurrency` clients, all starting at 0 s; each sends its next request `think_time_s`
    after its previous one ended (completed or failed), as benchmark clients with a maximum
    concurrency do. Arrival times then come from the serving, not from the workload."""

    concurrency: int
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")
        if not (self.think_time_s >= 0 and np.isfinite(self.think_time_s)):
            raise WorkloadError(f"think_time_s must be a finite number >= 0, got {self.think_time_s!r}")


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests in arrival order: arrival time (s), input and output tokens, one index per request.

    The arrays are copies made read-only. `num_dropped` counts requests the config removed (a
    trace's `max_input_tokens`), so a report can say what was left out. With `closed_loop` the
    requests are sent in index order by that many clients and `arrival_s` is all zero: the real
    times exist only once a backend has served them (they are in its per-request records).
    """

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    num_dropped: int = 0
    closed_loop: ClosedLoop | None = None

    def __post_init__(self) -> None:
        arrival = np.array(self.arrival_s, dtype=np.float64)
        inputs = _int_column(self.input_tokens, "input_tokens")
        outputs = _int_column(self.output_tokens, "output_tokens")
        if not (arrival.ndim == inputs.ndim == outputs.ndim == 1):
            raise WorkloadError("arrival_s, input_tokens and output_tokens must be 1-D arrays")
        if not (len(arrival) == len(inputs) == len(outputs)):
            raise WorkloadError(
                f"arrays differ in length: arrival_s {len(arrival)}, "
                f"input_tokens {len(inputs)}, output_tokens {len(outputs)}"
            )
        if len(arrival):
            if not np.all(np.isfinite(arrival)) or arrival[0] < 0:
                raise WorkloadError("arrival_s must be finite and >= 0")
            unsorted = np.flatnonzero(np.diff(arrival) < 0)
            if len(unsorted):
                i = int(unsorted[0])
                raise WorkloadError(
                    f"arrival_s must be non-decreasing; request {i + 1} arrives at "
                    f"{arrival[i + 1]!r} s, before request {i} at {arrival[i]!r} s"
                )
            for name, arr in (("input_tokens", inputs), ("output_tokens", outputs)):
                if arr.min() < 1:
                    i = int(np.argmin(arr))
                    raise WorkloadError(f"{name} must be >= 1; request {i} has {arr[i]}")
        if self.num_dropped < 0:
            raise WorkloadError(f"num_dropped must be >= 0, got {self.num_dropped}")
        if self.closed_loop is not None and np.any(arrival != 0):
            raise WorkloadError(
                "a closed-loop workload has no arrival times of its own: arrival_s must be all zero"
            )
        for name, arr in (("arrival_s", arrival), ("input_tokens", inputs), ("output_tokens", outputs)):
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Workload):
            return NotImplemented
        return (
            self.num_dropped == other.num_dropped
            and self.closed_loop == other.closed_loop
            and np.array_equal(self.arrival_s, other.arrival_s)
            and np.array_equal(self.input_tokens, other.input_tokens)
            and np.array_equal(self.output_tokens, other.output_tokens)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking contents; compare, don't hash

    @property
    def duration_s(self) -> float:
        """Time from the first arrival to the last (0 for fewer than two requests; NaN for a
        closed loop, whose times are not known before serving)."""
        if self.closed_loop is not None:
            return float("nan")
        if len(self) < 2:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def mean_rate_rps(self) -> float:
        """Arrivals per second over the span: (n - 1) / duration_s; nan below two requests or
        for a closed loop."""
        if len(self) < 2 or self.closed_loop is not None:
            return float("nan")
        if self.duration_s == 0:
            return float("inf")
        return (len(self) - 1) / self.duration_s

    def head(self, n: int) -> Workload:
        """The first `n` requests."""
        if n < 0:
            raise ValueError(f"head: n must be >= 0, got {n}")
        return Workload(self.arrival_s[:n], self.input_tokens[:n], self.output_tokens[:n],
                        self.num_dropped, self.closed_loop)

    def scaled(self, rate_factor: float) -> Workload:
        """The same requests with every arrival time divided by `rate_factor` (2.0: twice the rate)."""
        if not (rate_factor > 0 and np.isfinite(rate_factor)):
            raise ValueError(f"scaled: rate_factor must be a finite number > 0, got {rate_factor!r}")
        if self.closed_loop is not None:
            raise ValueError("scaled: a closed-loop workload has no arrival times to rescale")
        return Workload(self.arrival_s / rate_factor, self.input_tokens, self.output_tokens, self.num_dropped)

    def to_frame(self) -> "pd.DataFrame":
        import pandas as pd

        columns = ("arrival_s", "input_tokens", "output_tokens")
        return pd.DataFrame({name: getattr(self, name) for name in columns})

    def summary(self) -> dict[str, float]:
        """Counts, span, rate and mean lengths, for logs and reports."""
        empty = len(self) == 0
        return {
            "num_requests": len(self),
            "num_dropped": self.num_dropped,
            "duration_s": self.duration_s,
            "mean_rate_rps": self.mean_rate_rps,
            "mean_input_tokens": float("nan") if empty else float(self.input_tokens.mean()),
            "mean_output_tokens": float("nan") if empty else float(self.output_tokens.mean()),
        }
