"""The workload value: requests in arrival order, as three read-only numpy arrays (and, where
known, each prompt's prefix-block ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pdsim.core.radix import block_page_keys

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
class PrefixBlocks:
    """Each request's prompt as prefix-block ids: request i's tokens
    `[b * block_tokens, (b + 1) * block_tokens)` are block `ids_of(i)[b]`, and two prompts with
    equal ids up to block b (a Mooncake trace's `hash_ids`) hold equal tokens up to its end.

    Stored flat (one int64 array of ids, one of offsets: request i's ids are
    `ids[offsets[i]:offsets[i + 1]]`), so a trace of 10^4 requests costs a few MB.
    """

    block_tokens: int
    ids: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise WorkloadError(f"prefix block_tokens must be >= 1, got {self.block_tokens}")
        ids = np.array(self.ids, dtype=np.int64)
        offsets = np.array(self.offsets, dtype=np.int64)
        if offsets.ndim != 1 or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(ids) \
                or np.any(np.diff(offsets) < 0):
            raise WorkloadError("prefix offsets must start at 0, never decrease and end at len(ids)")
        for name, arr in (("ids", ids), ("offsets", offsets)):
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @classmethod
    def from_lists(cls, block_tokens: int, per_request) -> PrefixBlocks:
        """From one sequence of block ids per request."""
        lengths = np.fromiter((len(b) for b in per_request), dtype=np.int64, count=len(per_request))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in per_request]) \
            if len(per_request) else np.zeros(0, dtype=np.int64)
        return cls(block_tokens, flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def ids_of(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def num_blocks(self) -> np.ndarray:
        return np.diff(self.offsets)

    def page_keys(self, i: int, num_tokens: int, page_size: int) -> list:
        """Request i's prefix-cache keys: one per whole page of its first `num_tokens` tokens."""
        return block_page_keys(self.ids_of(i).tolist(), self.block_tokens, num_tokens, page_size)

    def take(self, rows: np.ndarray | slice) -> PrefixBlocks:
        """The blocks of the requests `rows` (indices or a slice), in that order."""
        rows = np.arange(len(self))[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
        lengths = self.num_blocks()[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = self.offsets[rows]
        # for every output id, its source index: start of its request + position within it
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        return PrefixBlocks(self.block_tokens, self.ids[np.repeat(starts, lengths) + within], offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefixBlocks):
            return NotImplemented
        return (self.block_tokens == other.block_tokens and np.array_equal(self.ids, other.ids)
                and np.array_equal(self.offsets, other.offsets))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests in arrival order: arrival time (s), input and output tokens, one index per request.

    The arrays are copies made read-only. `num_dropped` counts requests the config removed (a
    trace's `max_input_tokens`), so a report can say what was left out. With `closed_loop` the
    requests are sent in index order by that many clients and `arrival_s` is all zero: the real
    times exist only once a backend has served them (they are in its per-request records).
    `prefix`, when the source knows it, says which prompts share which prefixes (block ids
    covering every prompt token); without it every prompt counts as unique.
    """

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    num_dropped: int = 0
    closed_loop: ClosedLoop | None = None
    prefix: PrefixBlocks | None = None

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
        if self.prefix is not None:
            if len(self.prefix) != len(inputs):
                raise WorkloadError(
                    f"prefix holds blocks of {len(self.prefix)} requests, the workload has {len(inputs)}")
            short = np.flatnonzero(self.prefix.num_blocks() * self.prefix.block_tokens < inputs)
            if len(short):
                i = int(short[0])
                raise WorkloadError(
                    f"request {i}: {self.prefix.num_blocks()[i]} prefix blocks of "
                    f"{self.prefix.block_tokens} tokens cannot cover its {inputs[i]} input tokens")
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
            and self.prefix == other.prefix
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
        prefix = None if self.prefix is None else self.prefix.take(slice(0, n))
        return Workload(self.arrival_s[:n], self.input_tokens[:n], self.output_tokens[:n],
                        self.num_dropped, self.closed_loop, prefix)

    def scaled(self, rate_factor: float) -> Workload:
        """The same requests with every arrival time divided by `rate_factor` (2.0: twice the rate)."""
        if not (rate_factor > 0 and np.isfinite(rate_factor)):
            raise ValueError(f"scaled: rate_factor must be a finite number > 0, got {rate_factor!r}")
        if self.closed_loop is not None:
            raise ValueError("scaled: a closed-loop workload has no arrival times to rescale")
        return Workload(self.arrival_s / rate_factor, self.input_tokens, self.output_tokens,
                        self.num_dropped, prefix=self.prefix)

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
