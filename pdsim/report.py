"""The markdown report of an experiment: best configurations, a results table and the plots.

Plain string building, no extra dependencies; the same summary gives byte-identical output.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from pdsim.metrics import COLUMN_DEFINITIONS, SLO, MeasurementWindow
from pdsim.plots import PD_RATIO, is_pd_sweep, short_field, sweep_labels, varying_fields, with_pd_ratio
from pdsim.tables import shows_prefix_hits

_DASH = "–"


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _ms(seconds) -> str:
    if _is_missing(seconds):
        return _DASH
    ms = float(seconds) * 1e3
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:.1f}" if abs(ms) >= 10 else f"{ms:.2f}"


def _num(value) -> str:
    if _is_missing(value):
        return _DASH
    value = float(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}" if abs(value) >= 1 else f"{value:#.3g}"


def _pct(fraction) -> str:
    return _DASH if _is_missing(fraction) else f"{float(fraction) * 100:.1f}%"


def _int(value) -> str:
    return _DASH if _is_missing(value) else str(int(value))


def _gpus(value) -> str:
    """Whole GPUs, or the mean held to a tenth when autoscaling changed them over the run."""
    if _is_missing(value):
        return _DASH
    value = float(value)
    return str(round(value)) if abs(value - round(value)) < 1e-6 else f"{value:.1f}"


def _rate(value) -> str:
    return _DASH if _is_missing(value) else f"{float(value):g}"


# (column, header, formatter) of the results table; columns absent from the summary are left out.
_TABLE: tuple[tuple[str, str, Callable], ...] = (
    (PD_RATIO, "P:D", str),
    ("request_rate", "rate (req/s)", _rate),
    ("concurrency", "clients", _int),
    ("num_gpus", "GPUs", _gpus),
    ("completed", "done", _int),
    ("failed", "failed", _int),
    ("ttft_p50_s", "TTFT p50 (ms)", _ms),
    ("ttft_p99_s", "TTFT p99 (ms)", _ms),
    ("itl_p50_s", "ITL p50 (ms)", _ms),
    ("itl_p99_s", "ITL p99 (ms)", _ms),
    ("tpot_p50_s", "TPOT p50 (ms)", _ms),
    ("e2e_p99_s", "E2E p99 (ms)", _ms),
    ("output_tok_s_per_gpu", "out tok/s/GPU", _num),
    ("goodput_req_s_per_gpu", "goodput/GPU (req/s)", _num),
    ("usd_per_mtok", "$/Mtok", _num),  # both NaN, so left out, when the hardware has no price
    ("goodput_req_per_usd", "goodput req/$", _num),
    ("slo_attainment", "SLO met", _pct),
    ("gpu_hours", "GPU-hours", _num),  # autoscaling: what the run held...
    ("gpu_hours_vs_static_peak", "vs static at peak", _pct),  # ...against its peak held throughout
    ("prefix_hit_rate", "prefix hit", _pct),  # only when a prefix cache served some prompt
)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _prepare(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with a row-label column (`pd_ratio`: the P:D split, or in a sweep of other
    fields the values it varies) and the columns the sections read."""
    frame = summary.copy()
    generic = not is_pd_sweep(varying_fields(frame))
    if generic:
        frame[PD_RATIO] = sweep_labels(frame)
    elif {"prefill_instances", "decode_instances"} <= set(frame):
        frame = with_pd_ratio(frame)
    elif PD_RATIO not in frame:
        frame[PD_RATIO] = [f"run {i}" for i in range(len(frame))]
    if "prefill_share" not in frame:
        frame["prefill_share"] = 0.0
    if "goodput_req_s_per_gpu" not in frame and {"goodput_req_s", "num_gpus"} <= set(frame):
        frame["goodput_req_s_per_gpu"] = frame["goodput_req_s"] / frame["num_gpus"]
    if "request_rate" not in frame:
        frame["request_rate"] = math.nan
    keys = ["request_rate"] if generic else ["request_rate", "prefill_share", PD_RATIO]  # generic: sweep order
    return frame.sort_values(keys, kind="stable")


def _best(rows: pd.DataFrame, primary: str, secondary: str) -> pd.Series | None:
    """The row with the largest positive `primary`, ties broken by `secondary`, then fewer GPUs."""
    if primary not in rows:
        return None
    candidates = rows[rows[primary].fillna(0) > 0]
    if candidates.empty:
        return None
    keys, ascending = [primary], [False]
    if secondary in candidates:
        keys, ascending = keys + [secondary], ascending + [False]
    if "num_gpus" in candidates:
        keys, ascending = keys + ["num_gpus"], ascending + [True]
    return candidates.sort_values(keys, ascending=ascending, kind="stable").iloc[0]


def _best_section(frame: pd.DataFrame) -> str:
    # A P:D label does not say the client count; a label of another sweep already does.
    clients = ("concurrency" in frame and frame["concurrency"].nunique() > 1
               and is_pd_sweep(varying_fields(frame)))

    def name(row: pd.Series) -> str:
        return f"{row[PD_RATIO]} @ {int(row['concurrency'])} clients" if clients else row[PD_RATIO]

    rows = []
    for rate, part in frame.groupby("request_rate", sort=True, dropna=False):
        by_goodput = _best(part, "goodput_req_s_per_gpu", "slo_attainment")
        by_slo = _best(part, "slo_attainment", "goodput_req_s_per_gpu")
        rows.append([
            _rate(rate),
            _DASH if by_goodput is None else name(by_goodput),
            _DASH if by_goodput is None else _num(by_goodput["goodput_req_s_per_gpu"]),
            _DASH if by_slo is None else name(by_slo),
            _DASH if by_slo is None else _pct(by_slo["slo_attainment"]),
        ])
    table = _markdown_table(
        ["rate (req/s)", "best by goodput/GPU", "goodput/GPU (req/s)", "best by SLO attainment", "SLO met"],
        rows, [True, False, True, False, True])
    note = "A dash: no configuration served any request within the SLO at that rate."
    return f"## Best configuration per request rate\n\n{table}\n\n{note}\n"


def _label_header(frame: pd.DataFrame) -> str:
    fields = varying_fields(frame)
    return "P:D" if is_pd_sweep(fields) else ", ".join(short_field(f) for f in fields)


def _results_section(frame: pd.DataFrame) -> str:
    columns = [(c, _label_header(frame) if c == PD_RATIO else h, f)
               for c, h, f in _TABLE if c in frame and not frame[c].isna().all()
               and (c != "concurrency" or frame[c].any())  # open loop: no clients column
               and (c != "prefix_hit_rate" or shows_prefix_hits(frame))]
    rows = [[fmt(row[c]) for c, _, fmt in columns] for _, row in frame.iterrows()]
    numeric = [c not in (PD_RATIO,) for c, _, _ in columns]
    table = _markdown_table([h for _, h, _ in columns], rows, numeric)
    skipped = ("" if "skipped" not in frame else "".join(
        f"\n- {frame.at[i, PD_RATIO] if PD_RATIO in frame else f'point {i}'}: skipped, {reason}"
        for i, reason in frame["skipped"].items() if isinstance(reason, str) and reason))
    return f"## Results\n\n{table}\n{skipped}\n" if skipped else f"## Results\n\n{table}\n"


def _plots_section(plots: Sequence[Path], out_dir: Path) -> str:
    lines = ["## Plots", ""]
    missing = []
    for plot in plots:
        plot = Path(plot)
        if not plot.is_file():
            missing.append(plot.name)
            continue
        link = Path(os.path.relpath(plot.resolve(), out_dir.resolve())).as_posix()
        lines += [f"![{plot.stem.replace('_', ' ')}]({link})", ""]
    if missing:
        lines += [f"Missing plot files: {', '.join(missing)}.", ""]
    return "\n".join(lines)


def _fenced(text: str, info: str) -> str:
    longest, run = 0, 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def write_report(
    summary: pd.DataFrame,
    out_dir: str | Path,
    *,
    title: str,
    config_text: str | None,
    plots: Sequence[Path],
    slo: SLO | None = None,
    window: MeasurementWindow | None = None,
) -> Path:
    """Write `out_dir/report.md` for a sweep summary and return its path.

    `summary` has one row per (configuration, request rate) as `plots.plot_sweep` takes it.
    The report holds a header, the best configuration at each request rate by goodput per GPU
    (ties: higher SLO attainment, then fewer GPUs) and by SLO attainment (ties: higher goodput
    per GPU), a results table (latencies in ms), the plots linked relative to `out_dir`, and
    `config_text` (the experiment's YAML, say) verbatim.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = _prepare(summary)

    configs = list(dict.fromkeys(frame.sort_values("prefill_share", kind="stable")[PD_RATIO]))
    rates = [r for r in dict.fromkeys(frame["request_rate"]) if not _is_missing(r)]
    header = [f"# {title}", ""]
    header.append(f"{len(frame)} runs; configurations: {', '.join(map(str, configs)) or _DASH}; "
                  f"request rates: {', '.join(_rate(r) for r in rates) or _DASH} req/s.")
    if slo is not None:
        header.append(f"SLO: TTFT ≤ {_ms(slo.ttft_s)} ms and mean ITL per request ≤ {_ms(slo.itl_s)} ms. "
                      "SLO met: the share of the requests that arrived in the measurement window "
                      "meeting both (a failed request misses); goodput: those requests meeting "
                      "both per second of the window (zero when SLO met is 0%).")
    header.append((window or MeasurementWindow()).describe() + " " + COLUMN_DEFINITIONS)
    header.append("")

    sections = ["\n".join(header)]
    if not frame.empty:
        sections += [_best_section(frame), _results_section(frame)]
    if plots:
        sections.append(_plots_section(plots, out_dir))
    if config_text:
        sections.append("## Configuration\n\n" + _fenced(config_text, "yaml") + "\n")

    path = out_dir / "report.md"
    path.write_text("\n".join(sections), encoding="utf-8")
    return path
