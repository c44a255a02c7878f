"""Metrics over per-request records: latency percentiles, throughput, goodput, SLO attainment.

Everything here reads `RequestRecord`s only, so the simulator and the real backend share one path.
Per-request and pooled inter-token gap statistics are vectorised (`_TokenTimes`); a simulated
request's token times are views of shared step times, whose gaps are counted with weights
rather than expanded per token, so 100,000 requests x 256 tokens stay light.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pdsim.core.records import RequestRecord
from pdsim.core.token_times import TokenTimes, flatten_times

if TYPE_CHECKING:  # pandas is imported by `records_frame` only: a plain run need not load it
    import pandas as pd

NAN = math.nan

# Columns of `records_frame`, in the order of `RequestRecord.to_row()`.
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord) if f.name != "token_times_s")
_DERIVED_FIELDS = ("ttft_s", "e2e_s", "itl_mean_s", "itl_max_s")
RECORD_COLUMNS = _RECORD_FIELDS + _DERIVED_FIELDS
_EMPTY_DTYPES = {  # field annotations are strings under `from __future__ import annotations`
    f.name: {"int": np.int64, int: np.int64, "str": str, str: str}.get(f.type, np.float64)
    for f in dataclasses.fields(RequestRecord)
    if f.name in _RECORD_FIELDS
}


class SLO(BaseModel):
    """Latency service-level objective of one request.

    A request *meets the SLO* when all of these hold:

    - it completed (``status == "ok"``); a failed request is always a miss;
    - its TTFT (``first_token_s - arrival_s``) is at most ``ttft_s``;
    - its mean inter-token latency (TPOT: the mean gap between consecutive delivered tokens,
      i.e. ``(token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)``) is at most
      ``itl_s``. A request that delivered a single token has no gap and meets this part.

    Both bounds are inclusive: a latency exactly equal to its bound meets it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s: float = Field(default=2.0, gt=0, description="bound on time to first token, seconds")
    itl_s: float = Field(default=0.1, gt=0, description="bound on a request's mean ITL, seconds")


class MeasurementWindow(BaseModel):
    """The part of a run the summary figures cover, so they describe the steady state.

    The window starts `warmup_s` after the first arrival, and no earlier than the arrival of
    request number `warmup_requests` (in arrival order, from 0); it ends `cooldown_s` before the
    last finish, and no later than the finish of the request that leaves `cooldown_requests`
    after it. It is half-open, [start, end): an event at `end` belongs to the next window, so
    a closed loop's request sent at the instant another ends is counted once, not at both
    edges. A request is *in the window* when it arrived inside it: latencies, counts, SLO
    attainment and goodput cover those, the load they met (a closed loop's first wave, all
    sent at the start, stays out however late it ends). Throughputs are what was served in
    it, whichever request it was for, divided by its length: the output tokens emitted inside
    it (each token's own emission time: a whole request counted by when it ended would credit
    the window with tokens emitted before it and none of those in flight at its end), the
    prompts whose first token came inside it, the completed requests that ended inside it.
    All zero (the default): the whole run, every request and token in it, from the first
    arrival to the last finish, which is what SGLang's bench_serving and aiperf summarise.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    cooldown_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    warmup_requests: int = Field(0, ge=0)
    cooldown_requests: int = Field(0, ge=0)

    @property
    def whole_run(self) -> bool:
        return not (self.warmup_s or self.cooldown_s or self.warmup_requests or self.cooldown_requests)

    def describe(self) -> str:
        """One sentence saying what the summary figures cover, for a table's reader."""
        if self.whole_run:
            return ("Measured over the whole run, first request sent to last response, as SGLang's "
                    "bench_serving and aiperf measure it: throughputs divide by that span (ramp-up "
                    "and drain included), latencies cover every completed request.")
        given = ", ".join(f"{k}={v:g}" for k, v in self.model_dump().items() if v)
        return (f"Measured over a steady-state window (metrics: {given}): latencies cover the "
                "requests sent in it, throughputs what it served per second of it. SGLang's "
                "bench_serving and aiperf report the whole run (leave `metrics:` out to match).")

    def bounds(self, arrival_s: np.ndarray, finish_s: np.ndarray) -> tuple[float, float]:
        """(start, end) of the window over a run's arrival and finish times (NaN: never)."""
        arrivals = np.sort(arrival_s[np.isfinite(arrival_s)])
        finishes = np.sort(finish_s[np.isfinite(finish_s)])
        if not len(arrivals) or not len(finishes):
            return NAN, NAN
        start = arrivals[0] + self.warmup_s
        if self.warmup_requests:
            start = max(start, arrivals[self.warmup_requests] if self.warmup_requests < len(arrivals)
                        else np.inf)
        end = finishes[-1] - self.cooldown_s
        if self.cooldown_requests:
            end = min(end, finishes[-1 - self.cooldown_requests]
                      if self.cooldown_requests < len(finishes) else -np.inf)
        return float(start), float(end)

    def mask(self, arrival_s: np.ndarray, finish_s: np.ndarray) -> np.ndarray:
        """Which requests are in the window: arrived inside it (the class docstring)."""
        return self._inside(arrival_s, arrival_s, finish_s)

    def ended_mask(self, arrival_s: np.ndarray, finish_s: np.ndarray) -> np.ndarray:
        """Which requests ended inside the window (the request throughput's)."""
        return self._inside(finish_s, arrival_s, finish_s)

    def _inside(self, times_s: np.ndarray, arrival_s: np.ndarray,
                finish_s: np.ndarray) -> np.ndarray:
        if self.whole_run:
            return np.ones(len(arrival_s), dtype=bool)
        return _in_window(times_s, *self.bounds(arrival_s, finish_s))


COLUMN_DEFINITIONS = (
    "TTFT: first token - request sent. ITL: every inter-token gap of every completed request "
    "pooled (bench_serving's ITL, aiperf's inter-chunk latency). TPOT: each request's "
    "(last token - first token) / (output tokens - 1), then over requests (bench_serving's "
    "TPOT, aiperf's inter-token latency). E2E: last token - request sent. Output tok/s: output "
    "tokens / the measured span (per GPU: / GPUs).")


def _in_window(times_s: np.ndarray, start: float, end: float) -> np.ndarray:
    """Which of `times_s` fall in [start, end) (NaN: none)."""
    with np.errstate(invalid="ignore"):
        return (times_s >= start) & (times_s < end)


def _tokens_emitted(records: Sequence[RequestRecord], start: float, end: float) -> int:
    """How many of `records`' token emission times (one per output token) fall in [start, end).
    Only the requests straddling an edge are read token by token."""
    n = len(records)
    first = np.fromiter((r.token_times_s[0] if r.token_times_s else NAN for r in records),
                        dtype=np.float64, count=n)
    last = np.fromiter((r.finish_s for r in records), dtype=np.float64, count=n)  # >= every token
    counts = np.fromiter((len(r.token_times_s) for r in records), dtype=np.int64, count=n)
    with np.errstate(invalid="ignore"):
        whole = (first >= start) & (last < end)
        straddle = ~whole & (first < end) & ~(last < start)  # a NaN finish: read its times
    total = int(counts[whole].sum())
    for i in np.flatnonzero(straddle):
        times = flatten_times([records[i].token_times_s], int(counts[i]))
        total += int(np.count_nonzero(_in_window(times, start, end)))
    return total


class _TokenTimes(NamedTuple):
    """Inter-token gap statistics of records, per record and pooled.

    The pool is a multiset of gaps given as distinct `values` with `weights` (how many times
    each occurs): a simulated request's times are views of its instance's step end times
    (`TokenTimes`), so the gaps inside them are the step-to-step gaps, shared by every request
    that ran those steps; they are counted once per step with the number of requests that saw
    them, never expanded to one float per token (100,000 requests of 256 tokens would need
    two 200 MB arrays). Other records (plain lists, speculative steps) are expanded as is.
    """

    gap_counts: np.ndarray  # gaps per record: max(count - 1, 0)
    gap_sums: np.ndarray  # sum of each record's gaps (0 without gaps)
    gap_max: np.ndarray  # largest gap of each record (NaN without gaps)
    values: np.ndarray  # pooled gaps of all records: distinct values...
    weights: np.ndarray  # ...and how often each occurs

    def mean_gap(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.gap_counts > 0, self.gap_sums / self.gap_counts, NAN)

    def pooled_percentiles(self, prefix: str, qs: Sequence[int]) -> dict[str, float]:
        """As `_percentiles` over the pooled gaps (NumPy's linear interpolation)."""
        total = int(self.weights.sum())
        if not total:
            return _percentiles(np.empty(0), prefix, qs)
        order = np.argsort(self.values, kind="stable")
        values, ends = self.values[order], np.cumsum(self.weights[order])
        out = {f"{prefix}_mean_s": float(np.dot(self.values, self.weights) / total)}
        for q in qs:
            pos = (total - 1) * (q / 100)
            below = math.floor(pos)
            a = values[np.searchsorted(ends, below, side="right")]
            b = values[np.searchsorted(ends, min(below + 1, total - 1), side="right")]
            t = pos - below  # NumPy's lerp, from whichever end is nearer
            out[f"{prefix}_p{q}_s"] = float(a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t))
        return out


def _token_times(records: Sequence[RequestRecord]) -> _TokenTimes:
    lists = [r.token_times_s for r in records]
    n = len(lists)
    counts = np.fromiter(map(len, lists), dtype=np.int64, count=n)
    gap_counts = np.maximum(counts - 1, 0)
    sums, maxes = np.zeros(n), np.full(n, NAN)
    singles: list[float] = []  # gaps between parts, weight 1 each
    single_owner: list[int] = []
    runs: dict[int, list] = {}  # id(base array) -> [base, [(record, offset, length)]]
    explicit: list[int] = []
    for i, times in enumerate(lists):
        offsets = times.step_offsets() if isinstance(times, TokenTimes) else None
        if offsets is None:
            explicit.append(i)
            continue
        last = None
        for part, offset in zip(times.parts(), offsets):
            if offset < 0:
                first = final = part
            else:
                first, final = part.item(0), part.item(-1)
                base = part.base
                entry = runs.get(id(base))
                if entry is None:
                    entry = runs[id(base)] = [base, []]
                entry[1].append((i, offset, len(part)))
            if last is not None:
                singles.append(first - last)
                single_owner.append(i)
            last = final
    values, weights = [np.asarray(singles)], [np.ones(len(singles))]
    if singles:
        owner = np.asarray(single_owner)
        np.add.at(sums, owner, values[0])
        np.fmax.at(maxes, owner, values[0])
    for base, spans in runs.values():
        idx, off, length = (np.asarray(col) for col in zip(*spans))
        steps = np.diff(base[: int((off + length).max())])
        cover = np.zeros(len(steps) + 1)
        np.add.at(cover, off, 1)
        np.add.at(cover, off + length - 1, -1)
        cover = np.cumsum(cover)[:-1]
        used = cover > 0
        values.append(steps[used])
        weights.append(cover[used])
        long = length > 1
        if long.any():
            i_long, o_long, l_long = idx[long], off[long], length[long]
            np.add.at(sums, i_long, base[o_long + l_long - 1] - base[o_long])
            padded = np.append(steps, NAN)  # reduceat needs indices below its length
            pairs = np.column_stack([o_long, o_long + l_long - 1]).ravel()
            np.fmax.at(maxes, i_long, np.maximum.reduceat(padded, pairs)[::2])
    if explicit:
        rows = [lists[i] for i in explicit]
        c = counts[explicit]
        flat = flatten_times(rows, int(c.sum()))
        gaps, g_counts = _gaps_of(flat, c)
        has = g_counts > 0
        if has.any():
            starts = (np.cumsum(g_counts) - g_counts)[has]
            rec = np.asarray(explicit)[has]
            sums[rec] += np.add.reduceat(gaps, starts)
            maxes[rec] = np.fmax(maxes[rec], np.maximum.reduceat(gaps, starts))
        values.append(gaps)
        weights.append(np.ones(len(gaps)))
    return _TokenTimes(gap_counts, sums, maxes, np.concatenate(values), np.concatenate(weights))


def _gaps_of(flat: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gaps inside each record of concatenated token times (tokens emitted together share
    their gap, `_share_shared_gaps`), and the gap count of each."""
    diffs = np.diff(flat)
    # diffs[j] = flat[j+1] - flat[j]; it crosses a record boundary when flat[j+1] starts a record.
    starts = np.cumsum(counts) - counts
    boundary = starts[(counts > 0) & (starts > 0)] - 1
    keep = np.ones(len(diffs), dtype=bool)
    keep[boundary] = False
    gap_counts = np.maximum(counts - 1, 0)
    return _share_shared_gaps(diffs[keep], gap_counts), gap_counts


def _share_shared_gaps(gaps: np.ndarray, gap_counts: np.ndarray) -> np.ndarray:
    """Tokens emitted together (one speculative decode step) share a time. As SGLang's
    bench_serving does with the tokens of one streamed chunk, each gets an equal share of the
    gap since the emission before, so ITL percentiles do not fill up with zeros; each record's
    gap sum, hence its mean ITL, is unchanged."""
    if gaps.all():
        return gaps
    first = np.zeros(len(gaps), dtype=bool)
    first[(np.cumsum(gap_counts) - gap_counts)[gap_counts > 0]] = True
    starts = np.flatnonzero(first | (gaps != 0))
    sizes = np.diff(starts, append=len(gaps))
    return np.repeat(np.add.reduceat(gaps, starts) / sizes, sizes)


def records_frame(records: Iterable[RequestRecord]) -> "pd.DataFrame":
    """One row per request, the columns and values of `RequestRecord.to_row()`, in that order.

    Built column by column from lists rather than by calling `to_row()` per record, which is
    about a hundred times slower on long token lists.
    """
    import pandas as pd

    records = list(records)
    columns: dict[str, object] = {name: list(map(attrgetter(name), records)) for name in _RECORD_FIELDS}
    arrival = np.asarray(columns["arrival_s"], dtype=np.float64)
    columns["ttft_s"] = np.asarray(columns["first_token_s"], dtype=np.float64) - arrival
    columns["e2e_s"] = np.asarray(columns["finish_s"], dtype=np.float64) - arrival
    times = _token_times(records)
    columns["itl_mean_s"] = times.mean_gap()
    columns["itl_max_s"] = times.gap_max
    frame = pd.DataFrame(columns, columns=list(RECORD_COLUMNS))
    if not records:  # give the empty frame the dtypes a populated one would have
        frame = frame.astype({name: _EMPTY_DTYPES.get(name, np.float64) for name in RECORD_COLUMNS})
    return frame


def _percentiles(values: np.ndarray, prefix: str, qs: Sequence[int]) -> dict[str, float]:
    """Mean and the given percentiles (NumPy's default linear interpolation); NaN when empty."""
    out = {f"{prefix}_mean_s": float(values.mean()) if len(values) else NAN}
    points = np.percentile(values, qs) if len(values) else [NAN] * len(qs)
    out.update({f"{prefix}_p{q}_s": float(v) for q, v in zip(qs, points)})
    return out


def meets_slo(records: Sequence[RequestRecord], slo: SLO) -> np.ndarray:
    """Boolean per record: does it meet `slo` (see `SLO` for the definition)."""
    records = list(records)
    ok = np.fromiter((r.ok for r in records), dtype=bool, count=len(records))
    ttft = np.fromiter((r.ttft_s for r in records), dtype=np.float64, count=len(records))
    return ok & _latencies_meet(ttft, _token_times(records).mean_gap(), slo)


def _latencies_meet(ttft: np.ndarray, tpot: np.ndarray, slo: SLO) -> np.ndarray:
    return (ttft <= slo.ttft_s) & (np.isnan(tpot) | (tpot <= slo.itl_s))


def summarize(records: Iterable[RequestRecord], *, num_gpus: int, slo: SLO,
              window: MeasurementWindow | None = None) -> dict:
    """Summary metrics of one run, as a flat dict of plain Python numbers.

    With a `window` (see `MeasurementWindow`) the counts, latencies, SLO attainment and goodput
    cover the requests that arrived in it, the throughputs what was served in it, and
    ``duration_s`` is its length; ``window_start_s`` / ``window_end_s`` say where it lies and
    ``run_requests`` counts the run's requests, in the window or not. Definitions (for the whole
    run):

    - ``num_requests`` counts all records, ``completed`` those with status "ok", ``failed`` the rest.
    - Latencies (``ttft_*``, ``itl_*``, ``tpot_mean_s``, ``e2e_*``) cover completed requests only.
      Percentiles use NumPy's default linear interpolation. TTFT = first token - arrival;
      E2E = finish - arrival.
    - ``itl_*`` are over every inter-token gap of every completed request pooled together (so
      long outputs weigh more): SGLang bench_serving's ITL, aiperf's inter-chunk latency.
      ``tpot_*`` are over requests, each one's mean gap ((last token - first token) /
      (tokens - 1); requests of one token have none): bench_serving's TPOT, aiperf's
      inter-token latency.
    - ``duration_s`` = last finish - first arrival over all requests, failed ones included.
    - ``input_tok_s`` / ``output_tok_s`` = input / output tokens of completed requests divided by
      ``duration_s``; ``output_tok_s_per_gpu`` divides that by ``num_gpus``. In a window: the
      output tokens emitted in it, the input tokens of the prompts whose first token came in it.
    - ``request_throughput_req_s`` = completed requests / duration (in a window: those that
      ended in it).
    - ``mean_concurrency`` = the E2E latencies of the completed requests summed / duration:
      bench_serving's "Concurrency", the mean requests in flight (Little's law). A closed loop
      of N clients reads below N by the ramp-up and the drain, which a short run makes large.
    - ``slo_attainment`` = requests meeting `slo` / all requests; failed requests are misses.
    - ``goodput_req_s`` = requests meeting `slo` / duration, the same requests as
      ``slo_attainment``'s, so it is ``slo_attainment * num_requests / duration_s``: zero when
      none met it (``_per_gpu``: / num_gpus).

    No records gives NaN rates and latencies; no completed request gives NaN latencies and zero
    throughputs. A zero or undefined duration gives NaN rates.
    """
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive, got {num_gpus}")
    records = list(records)
    run_requests = len(records)
    arrivals = np.fromiter((r.arrival_s for r in records), dtype=np.float64, count=run_requests)
    finishes = np.fromiter((r.finish_s for r in records), dtype=np.float64, count=run_requests)
    window = window or MeasurementWindow()
    start, end = window.bounds(arrivals, finishes)
    duration = end - start
    ok = np.fromiter((r.ok for r in records), dtype=bool, count=run_requests)
    served = int((ok & window.ended_mask(arrivals, finishes)).sum())
    completed = [r for r in records if r.ok]  # of the whole run: what the window served
    if window.whole_run:
        input_tokens = sum(r.input_tokens for r in completed)
        output_tokens = sum(r.output_tokens for r in completed)
    else:
        firsts = np.fromiter((r.first_token_s for r in completed), dtype=np.float64,
                             count=len(completed))
        inputs = np.fromiter((r.input_tokens for r in completed), dtype=np.int64,
                             count=len(completed))
        input_tokens = int(inputs[_in_window(firsts, start, end)].sum())
        output_tokens = _tokens_emitted(completed, start, end)
        records = [r for r, keep in zip(records, window.mask(arrivals, finishes)) if keep]
    done = [r for r in records if r.ok]
    n, n_done = len(records), len(done)

    def rate(amount: float) -> float:
        return amount / duration if duration > 0 else NAN

    times = _token_times(done)
    ttft = np.fromiter((r.ttft_s for r in done), dtype=np.float64, count=n_done)
    e2e = np.fromiter((r.e2e_s for r in done), dtype=np.float64, count=n_done)
    tpot = times.mean_gap()
    met = int(_latencies_meet(ttft, tpot, slo).sum())  # failed requests never meet it
    cached_tokens = sum(r.cached_tokens for r in done)

    summary: dict = {"num_requests": n, "completed": n_done, "failed": n - n_done, "num_gpus": num_gpus}
    summary |= _percentiles(ttft, "ttft", (50, 90, 99))
    summary |= times.pooled_percentiles("itl", (50, 90, 99))
    summary |= _percentiles(tpot[~np.isnan(tpot)], "tpot", (50, 90, 99))
    summary |= _percentiles(e2e, "e2e", (50, 90, 99))
    summary |= {
        "input_tok_s": rate(input_tokens),
        "output_tok_s": rate(output_tokens),
        "output_tok_s_per_gpu": rate(output_tokens) / num_gpus,
        "request_throughput_req_s": rate(served),
        # bench_serving's "Concurrency": Little's L from the E2Es; a closed loop's client count
        # less what its ramp-up and drain leave idle
        "mean_concurrency": rate(float(e2e.sum())) if n_done else NAN,
        "goodput_req_s": rate(met),
        "goodput_req_s_per_gpu": rate(met) / num_gpus,
        "slo_attainment": met / n if n else NAN,
        # prompt tokens taken from a prefix cache / prompt tokens, completed requests
        "prefix_hit_rate": (cached_tokens / prompt_tokens
                            if (prompt_tokens := sum(r.input_tokens for r in done)) else NAN),
        "duration_s": duration,
        "window_start_s": start,
        "window_end_s": end,
        "run_requests": run_requests,
    }
    return summary


def price_columns(summary: dict, usd_per_gpu_hour: float | None) -> dict[str, float]:
    """What a run's throughput costs at `usd_per_gpu_hour` (None: unpriced, NaN columns).

    - ``usd_per_hour`` = num_gpus x the price.
    - ``usd_per_mtok`` = USD per million output tokens of completed requests:
      usd_per_hour / 3600 / output_tok_s x 1e6.
    - ``goodput_req_per_usd`` = requests meeting the SLO per USD: goodput_req_s x 3600 / usd_per_hour.
    """
    if usd_per_gpu_hour is None:
        return {"usd_per_hour": NAN, "usd_per_mtok": NAN, "goodput_req_per_usd": NAN}
    per_hour = summary["num_gpus"] * usd_per_gpu_hour
    tok_s, good = summary["output_tok_s"], summary["goodput_req_s"]
    return {
        "usd_per_hour": per_hour,
        "usd_per_mtok": per_hour / 3600 / tok_s * 1e6 if tok_s > 0 else NAN,
        "goodput_req_per_usd": good * 3600 / per_hour if good == good else NAN,
    }


class LittlesLaw(NamedTuple):
    """Both sides of Little's law L = lambda * W over one window."""

    time_avg_in_system: float  # L: integral of the number in system over the window / its length
    lambda_w: float  # arrivals in the window / its length * their mean time in system


def littles_law(
    arrivals_s: Sequence[float] | np.ndarray,
    departures_s: Sequence[float] | np.ndarray,
    *,
    window_s: tuple[float, float] | None = None,
) -> LittlesLaw:
    """Time-average number in system and lambda*W, to check a queue against Little's law.

    L is computed exactly by sweeping the sorted arrival (+1) and departure (-1) events and
    integrating the piecewise-constant count over the window. lambda counts the arrivals inside
    the window per second and W is those customers' mean time in system.

    The default window, [first arrival, last departure], holds every customer whole, so the two
    sides agree to rounding error: a mismatch means inconsistent records. A narrower window (say,
    skipping warm-up and drain) tests the steady state; there the sides differ by edge effects.
    """
    arr = np.asarray(arrivals_s, dtype=np.float64)
    dep = np.asarray(departures_s, dtype=np.float64)
    if arr.shape != dep.shape or arr.ndim != 1:
        raise ValueError(
            f"arrivals and departures must be 1-D and equal length, got {arr.shape}, {dep.shape}")
    if len(arr) == 0:
        return LittlesLaw(NAN, NAN)
    if not (np.isfinite(arr).all() and np.isfinite(dep).all()):
        raise ValueError("arrival and departure times must be finite (drop requests that never left)")
    if (dep < arr).any():
        i = int(np.argmax(dep < arr))
        raise ValueError(f"departure before arrival at index {i}: {dep[i]} < {arr[i]}")
    start, end = window_s if window_s is not None else (float(arr.min()), float(dep.max()))
    if not end > start:
        return LittlesLaw(NAN, NAN)

    times = np.clip(np.concatenate([arr, dep]), start, end)
    steps = np.concatenate([np.ones(len(arr)), -np.ones(len(dep))])
    order = np.argsort(times, kind="stable")
    times, in_system = times[order], np.cumsum(steps[order])
    area = float(np.sum(in_system[:-1] * np.diff(times)))
    length = end - start

    inside = (arr >= start) & (arr <= end)
    lam = inside.sum() / length
    w = float((dep - arr)[inside].mean()) if inside.any() else 0.0
    return LittlesLaw(area / length, float(lam * w))


def timeline(records: Sequence[RequestRecord], window_end_s: Sequence[float],
             slo: SLO) -> list[dict]:
    """Latency and SLO figures per time window, (previous end, end] from 0: the requests that
    arrived in each (so a window's figures are what its load got). Per window: `arrivals`,
    `arrival_rate_rps`, `failed`, `slo_attainment` (as in `summarize`: failures are misses),
    TTFT p50/p90 and the p90 over requests of each one's mean ITL (completed requests; NaN
    when none)."""
    records = list(records)
    arrival = np.fromiter((r.arrival_s for r in records), dtype=np.float64, count=len(records))
    ok = np.fromiter((r.ok for r in records), dtype=bool, count=len(records))
    ttft = np.fromiter((r.ttft_s for r in records), dtype=np.float64, count=len(records))
    tpot = _token_times(records).mean_gap()
    met = ok & _latencies_meet(ttft, tpot, slo)
    rows, start = [], 0.0
    for end in window_end_s:
        inside = (arrival > start) & (arrival <= end) if start else (arrival <= end)
        n, done = int(inside.sum()), inside & ok
        row = {"start_s": start, "end_s": float(end), "arrivals": n,
               "arrival_rate_rps": n / (end - start) if end > start else NAN,
               "failed": int((inside & ~ok).sum()),
               "slo_attainment": float(met[inside].mean()) if n else NAN}
        row |= {k: v for k, v in _percentiles(ttft[done], "ttft", (50, 90)).items()
                if not k.endswith("mean_s")}
        gaps = tpot[done]
        gaps = gaps[~np.isnan(gaps)]
        row["itl_p90_s"] = float(np.percentile(gaps, 90)) if len(gaps) else NAN
        rows.append(row)
        start = float(end)
    return rows
