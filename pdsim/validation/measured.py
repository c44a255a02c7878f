"""Per-request results a benchmark client already wrote, read as `RequestRecord`s.

Three formats (`read_measured`, `format="auto"` tells them apart):

- **bench_serving**: SGLang's `python -m sglang.bench_serving ... --output-file F
  --output-details`. F holds one JSON object per run (the file is appended to), with per-request
  lists in send order: `input_lens`, `output_lens`, `ttfts` (s), `itls` (s, one list per
  request: the gaps between streamed chunks), `errors` ("" when it succeeded), and the run's
  `request_rate` (req/s, `Infinity` for all at once) and `max_concurrency` (null: none). It
  holds no send times: with an infinite rate every request is sent at 0, held back by
  `max_concurrency` until an earlier one finishes (reconstructed from the latencies); with a
  finite rate the gaps were drawn at random and not recorded, so a Poisson process at that
  rate (seeded) stands in for them and a note says so.
- **aiperf**: NVIDIA aiperf's `profile_export.jsonl` (`aiperf profile ... --export-level
  records`), one JSON object per request: `metadata.request_start_ns` (wall clock, ns),
  `metadata.benchmark_phase` (warmup records are skipped), `metrics.<tag>` = {value, unit} for
  `time_to_first_token`, `request_latency`, `inter_chunk_latency` (a list),
  `usage_prompt_tokens` / `input_sequence_length`, `usage_completion_tokens` /
  `output_sequence_length` (the endpoint's counts first), and `error` (null when it succeeded).
- **csv**: a header and one row per request: `arrival_s, input_tokens, output_tokens, ttft_s`,
  then `itls_s` (the gaps between tokens, separated by `;` or spaces) or `e2e_s` or both, and
  optionally `error` (non-empty: the request failed).

Gaps between chunks are gaps between tokens only when each chunk held one token; otherwise a
request's tokens are spread evenly from its first chunk to its last (pdsim.validation.timing)
and a note counts those requests. Times become seconds since the first request was sent.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdsim.config import ConfigError
from pdsim.core.records import RequestRecord
from pdsim.validation.timing import token_times

FORMATS = ("auto", "bench_serving", "aiperf", "csv")
TIME_UNITS_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "sec": 1.0, "s": 1.0}


class MeasuredFileError(ConfigError):
    """A measured file that cannot be read; the message names the line and the field."""


@dataclass
class Measured:
    """A measured run: its records (sorted by send time, times in seconds since the first
    send) and what the reader had to assume, for the report."""

    records: list[RequestRecord]
    source: str  # "aiperf profile_export.jsonl" and so on
    notes: list[str] = field(default_factory=list)


@dataclass
class _Request:
    """One request as a file states it, before its times are put on the run's clock."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: float = math.nan
    gaps_s: list[float] | None = None  # between streamed chunks
    e2e_s: float = math.nan
    error: str = ""


def read_measured(path: str | Path, fmt: str = "auto", *, seed: int = 0,
                  run: int | None = None) -> Measured:
    """Read `path` (`fmt` one of FORMATS). `seed` draws a bench_serving run's Poisson send
    times; `run` picks a bench_serving file's run by its line number (default: its only one)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise MeasuredFileError(f"--format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if not path.is_file():
        raise MeasuredFileError(f"{path}: no such file")
    if fmt == "auto":
        fmt = _detect(path)
    if run is not None and fmt != "bench_serving":
        raise MeasuredFileError(f"--run picks a run of a bench_serving file; {path} is {fmt}")
    if fmt == "bench_serving":
        requests, notes = _bench_serving(path, seed, run)
        source = "SGLang bench_serving --output-details"
    elif fmt == "aiperf":
        requests, notes = _aiperf(path), []
        source = "aiperf profile_export.jsonl"
    else:
        requests, notes = _csv(path), []
        source = "CSV"
    if not requests:
        raise MeasuredFileError(f"{path}: no requests in it")
    records, spread = _records(requests)
    if spread:
        notes.append(f"{spread} of {len(records)} requests give no time per token (fewer "
                     "chunks than tokens, or an E2E alone): their tokens are spread evenly from "
                     "the first to the last")
    if failed := sum(not r.ok for r in records):
        notes.append(f"{failed} requests failed on the endpoint: they are not simulated")
    return Measured(records, source, notes)


def _detect(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "csv"
    for number, line in _lines(path):
        data = _json(path, number, line)
        if "metadata" in data and "metrics" in data:
            return "aiperf"
        if "ttfts" in data or "input_lens" in data or "backend" in data:
            return "bench_serving"
        raise MeasuredFileError(f"{path} line {number}: neither an aiperf record (metadata, "
                                "metrics) nor a bench_serving run (input_lens, ttfts, ...); "
                                "give --format")
    raise MeasuredFileError(f"{path}: empty")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def _json(path: Path, number: int, line: str) -> dict:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MeasuredFileError(f"{path} line {number}: not JSON ({exc.msg} at column "
                                f"{exc.colno})") from None
    if not isinstance(data, dict):
        raise MeasuredFileError(f"{path} line {number}: a JSON object expected, got "
                                f"{type(data).__name__}")
    return data


def _number(where: str, value, *, integer: bool = False, minimum: float = 0.0) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value >= minimum and (not integer or value == int(value)))
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise MeasuredFileError(f"{where}: {value!r}; allowed: {kind} >= {minimum:g}")
    return int(value) if integer else float(value)


# --- bench_serving -------------------------------------------------------------------------

BENCH_LISTS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


def _bench_serving(path: Path, seed: int, run: int | None) -> tuple[list[_Request], list[str]]:
    runs = dict(_lines(path))
    if run is None and len(runs) > 1:
        lines = ", ".join(map(str, runs))
        raise MeasuredFileError(f"{path} holds {len(runs)} runs (lines {lines}); pick one with "
                                "--run LINE")
    number = next(iter(runs)) if run is None else run
    if number not in runs:
        raise MeasuredFileError(f"--run {run}: {path} has runs on lines "
                                f"{', '.join(map(str, runs))}")
    data = _json(path, number, runs[number])
    where = f"{path} line {number}"
    missing = [k for k in BENCH_LISTS if k not in data]
    if missing:
        raise MeasuredFileError(f"{where}: no {', '.join(missing)}: per-request details are "
                                "written by bench_serving --output-details")
    n = len(data["input_lens"]) if isinstance(data["input_lens"], list) else -1
    for key in BENCH_LISTS:
        if not isinstance(data[key], list) or len(data[key]) != n:
            raise MeasuredFileError(f"{where}: {key} must be a list as long as input_lens ({n})")
    rate = data.get("request_rate", math.inf)
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise MeasuredFileError(f"{where}: request_rate {rate!r}; allowed: a number > 0 or "
                                "Infinity")
    limit = data.get("max_concurrency")
    if limit is not None:
        limit = _number(f"{where}: max_concurrency", limit, integer=True, minimum=1)
    requests, latencies = [], []
    for i in range(n):
        at = f"{where}: request {i}"
        error = data["errors"][i]
        if not isinstance(error, str):
            raise MeasuredFileError(f"{at}: errors[{i}] {error!r}; allowed: a string")
        gaps = data["itls"][i]
        if not isinstance(gaps, list):
            raise MeasuredFileError(f"{at}: itls[{i}] must be a list of seconds")
        req = _Request(0.0, _number(f"{at}: input_lens[{i}]", data["input_lens"][i], integer=True),
                       _number(f"{at}: output_lens[{i}]", data["output_lens"][i], integer=True),
                       error=error)
        if not error:
            req.ttft_s = _number(f"{at}: ttfts[{i}]", data["ttfts"][i])
            req.gaps_s = [_number(f"{at}: itls[{i}][{k}]", g) for k, g in enumerate(gaps)]
            if req.output_tokens < 1:
                raise MeasuredFileError(f"{at}: output_lens[{i}] is 0 for a request without "
                                        "an error")
        requests.append(req)
        latencies.append(0.0 if error else req.ttft_s + sum(req.gaps_s))
    notes = []
    if math.isinf(rate):
        sent = np.zeros(n)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
        sent = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        notes.append(f"send times: bench_serving does not record them; a Poisson process at its "
                     f"request_rate {rate:g} req/s (seed {seed}) stands in for them")
    if limit is not None:
        sent = _held_back(sent, latencies, int(limit))
        notes.append(f"max_concurrency {limit}: a request is sent when an earlier one finishes "
                     "(reconstructed from their latencies)")
    for req, t in zip(requests, sent):
        req.arrival_s = float(t)
    return requests, notes


def _held_back(ready_s: np.ndarray, latencies_s: Sequence[float], limit: int) -> np.ndarray:
    """Send times under a client's concurrency limit: request i goes at its ready time or when
    the earliest of the `limit` requests in flight finishes, whichever is later."""
    finishes: list[float] = []
    sent = []
    for ready, latency in zip(ready_s.tolist(), latencies_s):
        t = ready if len(finishes) < limit else max(ready, heapq.heappop(finishes))
        sent.append(t)
        heapq.heappush(finishes, t + latency)
    return np.array(sent)


# --- aiperf --------------------------------------------------------------------------------

def _aiperf(path: Path) -> list[_Request]:
    requests = []
    starts = []
    for number, line in _lines(path):
        data = _json(path, number, line)
        where = f"{path} line {number}"
        meta, metrics = data.get("metadata"), data.get("metrics")
        if not isinstance(meta, dict) or not isinstance(metrics, dict):
            raise MeasuredFileError(f"{where}: an aiperf record holds `metadata` and `metrics` "
                                    "objects")
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue  # warmup
        start_ns = _number(f"{where}: metadata.request_start_ns", meta.get("request_start_ns"),
                           integer=True)
        error = data.get("error")
        value = _metric_reader(where, metrics)
        n_in = value("usage_prompt_tokens", "input_sequence_length", integer=True,
                     required=error is None)
        req = _Request(0.0, int(n_in) if n_in is not None else 0, 0)
        if error is not None:
            req.error = (error.get("message") or error.get("type") or str(error)
                         if isinstance(error, dict) else str(error)) or "error"
        else:
            req.output_tokens = int(value("usage_completion_tokens", "output_sequence_length",
                                          integer=True))
            req.ttft_s = value("time_to_first_token")
            req.e2e_s = value("request_latency")
            req.gaps_s = value("inter_chunk_latency", required=False, many=True)
        requests.append(req)
        starts.append(start_ns)
    first = min(starts, default=0)
    for req, start in zip(requests, starts):
        req.arrival_s = (start - first) * 1e-9
    return requests


def _metric_reader(where: str, metrics: dict) -> Callable:
    """value(tag, fallback tag...): a metric's value in seconds (time units) or as is (tokens);
    None when absent and not required."""

    def value(*tags: str, integer: bool = False, required: bool = True, many: bool = False):
        tag = next((t for t in tags if t in metrics), None)
        if tag is None:
            if required:
                raise MeasuredFileError(f"{where}: metrics has no {' or '.join(tags)}")
            return None
        entry = metrics[tag]
        if not isinstance(entry, dict) or "value" not in entry:
            raise MeasuredFileError(f"{where}: metrics.{tag} must be {{\"value\": ..., "
                                    "\"unit\": ...}}")
        unit = entry.get("unit", "")
        scale = TIME_UNITS_S.get(unit, 1.0)
        if not integer and unit not in TIME_UNITS_S:
            raise MeasuredFileError(f"{where}: metrics.{tag}.unit {unit!r}; allowed: "
                                    f"{', '.join(TIME_UNITS_S)}")
        raw = entry["value"]
        if many:
            if not isinstance(raw, list):
                raise MeasuredFileError(f"{where}: metrics.{tag}.value must be a list")
            return [_number(f"{where}: metrics.{tag}.value[{k}]", v) * scale
                    for k, v in enumerate(raw)]
        got = _number(f"{where}: metrics.{tag}.value", raw, integer=integer)
        return got if integer else got * scale

    return value


# --- CSV -----------------------------------------------------------------------------------

CSV_REQUIRED = ("arrival_s", "input_tokens", "output_tokens", "ttft_s")


def _csv(path: Path) -> list[_Request]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        columns = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in CSV_REQUIRED if c not in columns]
        if missing or not {"itls_s", "e2e_s"} & set(columns):
            raise MeasuredFileError(
                f"{path} line 1: columns {columns}; required: {', '.join(CSV_REQUIRED)} and "
                "itls_s or e2e_s (optional: error)")
        requests = []
        for row in reader:
            row = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
            where = f"{path} line {reader.line_num}"

            def num(column: str, integer: bool = False) -> float:
                text = row.get(column, "")
                try:
                    value = float(text)
                except ValueError:
                    raise MeasuredFileError(f"{where}: column {column}: {text!r} is not a "
                                            "number") from None
                return _number(f"{where}: column {column}", value, integer=integer)

            req = _Request(num("arrival_s"), int(num("input_tokens", True)), 0,
                           error=row.get("error", ""))
            if not req.error:
                req.output_tokens = int(num("output_tokens", True))
                req.ttft_s = num("ttft_s")
                if row.get("itls_s"):
                    req.gaps_s = _gaps(where, row["itls_s"])
                    if len(req.gaps_s) > req.output_tokens - 1:
                        raise MeasuredFileError(f"{where}: column itls_s: {len(req.gaps_s)} gaps "
                                                f"for {req.output_tokens} tokens; allowed: at "
                                                f"most {req.output_tokens - 1}")
                if row.get("e2e_s"):
                    req.e2e_s = num("e2e_s")
                if req.gaps_s is None and math.isnan(req.e2e_s):
                    raise MeasuredFileError(f"{where}: neither itls_s nor e2e_s is given")
                if req.output_tokens < 1:
                    raise MeasuredFileError(f"{where}: column output_tokens: 0 for a request "
                                            "without an error")
            requests.append(req)
    return requests


def _gaps(where: str, text: str) -> list[float]:
    parts = text.strip("[]").replace(";", " ").replace(",", " ").split()
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise MeasuredFileError(f"{where}: column itls_s: {text!r}; allowed: seconds separated "
                                "by ';' or spaces") from None
    return [_number(f"{where}: column itls_s", v) for v in values]


# --- records -------------------------------------------------------------------------------

def _records(requests: list[_Request]) -> tuple[list[RequestRecord], int]:
    """Records sorted by send time, times since the first send; and how many requests' token
    times had to be spread (fewer chunks than tokens)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    t0 = requests[order[0]].arrival_s
    records, spread = [], 0
    for i in order:
        req = requests[i]
        arrival = req.arrival_s - t0
        if req.error:
            records.append(RequestRecord(
                rid=str(i), input_tokens=req.input_tokens, output_tokens=0, status="failed",
                error=req.error, arrival_s=arrival, finish_s=arrival))
            continue
        first = arrival + req.ttft_s
        if req.gaps_s is not None:
            chunks = first + np.concatenate([[0.0], np.cumsum(req.gaps_s)])
        else:
            chunks = np.array([first, arrival + req.e2e_s])
        times, exact = token_times(chunks, req.output_tokens)
        spread += not exact and req.output_tokens > 1
        finish = arrival + req.e2e_s if not math.isnan(req.e2e_s) else times[-1]
        records.append(RequestRecord(
            rid=str(i), input_tokens=req.input_tokens, output_tokens=req.output_tokens,
            status="ok", arrival_s=arrival, first_token_s=first, finish_s=max(finish, times[-1]),
            token_times_s=times))
    return records, spread
