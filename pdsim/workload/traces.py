"""Trace files: find them, tell their format, read them into a Workload.

Mooncake JSONL: one `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}` per
line. Azure LLM inference CSV: `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS.fffffff`), `ContextTokens`,
`GeneratedTokens`. Either way times become seconds since the file's first row, and rows must
already be in arrival order (both public sets are).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pdsim.workload.arrays import PrefixBlocks, TraceNotFoundError, Workload, WorkloadError

MOONCAKE_BLOCK_TOKENS = 512  # tokens per `hash_ids` block in the Mooncake FAST'25 traces

TraceFormat = Literal["auto", "mooncake", "azure"]


def resolve_path(path: str | Path, base_dir: str | Path | None = None) -> Path:
    """An absolute path as is; a relative one under `base_dir`, then the current directory."""
    given = Path(path).expanduser()
    if given.is_absolute():
        candidates = [given]
    else:
        candidates = ([Path(base_dir) / given] if base_dir is not None else []) + [Path.cwd() / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise TraceNotFoundError(f"trace file not found: {str(path)!r} (looked at {tried})")


def detect_format(path: str | Path) -> Literal["mooncake", "azure"]:
    """By extension (.jsonl/.json: mooncake, .csv: azure), else by the first line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    if first.split(",")[:1] == ["TIMESTAMP"]:
        return "azure"
    raise WorkloadError(
        f"cannot tell the format of trace {str(path)!r} from its extension or first line; "
        "set format: mooncake or format: azure"
    )


_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


def _mooncake_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{line_no}: not a JSON object ({exc.msg})") from None
            if not isinstance(row, dict) or any(key not in row for key in _MOONCAKE_KEYS):
                keys = ", ".join(_MOONCAKE_KEYS)
                raise WorkloadError(f"{path}:{line_no}: a Mooncake row needs keys {keys}")
            rows.append(row)
    return rows


def _trace_workload(path: Path, times_s: np.ndarray, inputs: Any, outputs: Any,
                    prefix: PrefixBlocks | None = None) -> Workload:
    if len(times_s):
        times_s = times_s - times_s[0]
    try:
        return Workload(times_s, inputs, outputs, prefix=prefix)
    except WorkloadError as exc:
        raise WorkloadError(f"trace {str(path)!r}: {exc}") from None


def read_mooncake(path: str | Path) -> Workload:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length` per line; when every
    row has `hash_ids`, they become the workload's `prefix` (512 tokens a block)."""
    path = Path(path)
    rows = _mooncake_rows(path)
    try:
        times_ms, inputs, outputs = (
            np.fromiter((r[key] for r in rows), dtype=dtype, count=len(rows))
            for key, dtype in zip(_MOONCAKE_KEYS, (np.float64, np.int64, np.int64))
        )
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"trace {str(path)!r}: a Mooncake field is not a number ({exc})") from None
    prefix = None
    if rows and all("hash_ids" in r for r in rows):
        try:
            prefix = PrefixBlocks.from_lists(MOONCAKE_BLOCK_TOKENS, [r["hash_ids"] for r in rows])
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"trace {str(path)!r}: hash_ids must be lists of integers ({exc})") from None
    return _trace_workload(path, times_ms / 1000.0, inputs, outputs, prefix)


def read_mooncake_hash_ids(path: str | Path) -> tuple[np.ndarray, ...]:
    """Each row's prefix-block hashes (512 tokens per block), in file order, as int64 arrays.

    Row i here is row i of `read_mooncake(path)` (before any windowing by a TraceWorkload).
    """
    path = Path(path)
    return tuple(np.asarray(row.get("hash_ids", ()), dtype=np.int64) for row in _mooncake_rows(path))


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure(path: str | Path) -> Workload:
    """Azure LLM inference CSV: `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`."""
    import pandas as pd  # here only: a simulation alone need not load pandas

    path = Path(path)
    try:
        header = pd.read_csv(path, nrows=0).columns
    except pd.errors.EmptyDataError:
        raise WorkloadError(f"trace {str(path)!r} is empty") from None
    missing = [c for c in _AZURE_COLUMNS if c not in header]
    if missing:
        raise WorkloadError(
            f"trace {str(path)!r}: an Azure trace needs columns {', '.join(_AZURE_COLUMNS)}; "
            f"missing {', '.join(missing)} (found {', '.join(map(str, header))})"
        )
    try:
        frame = pd.read_csv(
            path, usecols=list(_AZURE_COLUMNS), dtype={"ContextTokens": np.int64, "GeneratedTokens": np.int64}
        )
        stamps = pd.to_datetime(frame["TIMESTAMP"], format="%Y-%m-%d %H:%M:%S.%f")
    except ValueError as exc:
        raise WorkloadError(f"trace {str(path)!r}: cannot parse it as an Azure trace ({exc})") from None
    ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    times_s = (ns - ns[0]) / 1e9 if len(ns) else ns.astype(np.float64)
    inputs, outputs = frame["ContextTokens"].to_numpy(), frame["GeneratedTokens"].to_numpy()
    return _trace_workload(path, times_s, inputs, outputs)


_TRACE_READERS = {"mooncake": read_mooncake, "azure": read_azure}


def read_trace(path: str | Path, format: TraceFormat = "auto") -> Workload:
    """A whole trace file as a Workload, times in seconds since its first row."""
    name = detect_format(path) if format == "auto" else format
    return _TRACE_READERS[name](path)
