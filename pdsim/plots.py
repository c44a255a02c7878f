"""Plots of an experiment: metrics across its sweep, and latency CDFs per configuration.

`plot_experiment` looks at what the sweep varies (the summary's `sweep.<field>` columns): a P:D
sweep (nothing varies but the P:D split, the request rate and the client count) is drawn
against the P:D configuration, one line per request rate or client count (a single
configuration: against the rate or the clients); any other sweep against its first numeric
field, one line per combination of the other fields that do not move with it. A sweep of
categories only (a router policy, a hardware preset, a flag) puts the first of them on the x
axis as categories and draws points, not lines, one colour per combination of the others. When the number
of closed-loop clients varies it also draws throughput per GPU against TTFT and ITL, one point
per client count, the curve benchmark users read. Every sweep also gets output tokens/s per
GPU against tokens/s per user (1 / a request's mean ITL), one point per sweep point, its Pareto
frontier drawn (`plot_interactivity`; a plan draws its candidates the same way). The experiment's
SLO bounds are dashed on the latency panels; legends sit outside the data, naming swept fields in
words (`field_title`). `sweep_labels` names each point after what varies, for tables and CDF
legends.

Figures are built on `matplotlib.figure.Figure` and saved as PNG through the Agg renderer, never
through pyplot: nothing is shown, no global backend is switched, and no figure outlives its call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

PD_RATIO = "pd_ratio"
SWEPT = "sweep."  # prefix of the summary columns holding each point's swept values
# Swept fields that change the P:D configuration, and those the rate / client columns carry.
PD_FIELDS = ("cluster.mode", "cluster.prefill.instances", "cluster.decode.instances",
             "cluster.colocated.instances")
RATE_FIELDS = ("workload.arrival.rate_rps", "workload.target_rate_rps", "workload.rate_scale")
CONCURRENCY_FIELDS = ("workload.arrival.concurrency", "workload.closed_loop.concurrency")
_LOG_SPREAD = 100.0  # use a log axis when the largest positive value is this many times the smallest
_DPI = 120


@dataclass(frozen=True)
class _Series:
    column: str
    label: str  # "" when the panel has a single series
    linestyle: str
    marker: str


@dataclass(frozen=True)
class _Panel:
    name: str  # file stem
    title: str
    ylabel: str
    series: tuple[_Series, ...]
    scale: float = 1.0  # multiply values by this before plotting (1e3: seconds to ms)
    slo: str = ""  # the SLO field bounding this metric, dashed across the panel


_P50 = ("p50", "-", "o")
_P99 = ("p99", "--", "s")
_SWEEP_PANELS = (
    _Panel("ttft", "Time to first token", "TTFT (ms)",
           (_Series("ttft_p50_s", *_P50), _Series("ttft_p99_s", *_P99)), 1e3, "ttft_s"),
    _Panel("itl", "Inter-token latency", "ITL (ms)",
           (_Series("itl_p50_s", *_P50), _Series("itl_p99_s", *_P99)), 1e3, "itl_s"),
    _Panel("output_throughput_per_gpu", "Output throughput per GPU", "output tokens/s per GPU",
           (_Series("output_tok_s_per_gpu", "", "-", "o"),)),
    _Panel("goodput_per_gpu", "Goodput per GPU (requests meeting the SLO)", "requests/s per GPU",
           (_Series("goodput_req_s_per_gpu", "", "-", "o"),)),
)


def pd_label(prefill_instances: int, decode_instances: int) -> str:
    """Short name of a P:D configuration, e.g. "1P:3D"; "colocated ×4" for a colocated one,
    whose summary rows hold no prefill instances and its instances as decode's."""
    if not prefill_instances:
        return f"colocated ×{int(decode_instances)}"
    return f"{int(prefill_instances)}P:{int(decode_instances)}D"


def with_pd_ratio(summary: pd.DataFrame) -> pd.DataFrame:
    """A copy of `summary` with a `pd_ratio` label column and `prefill_share` = P / (P + D)."""
    out = summary.copy()
    p, d = out["prefill_instances"].astype(int), out["decode_instances"].astype(int)
    out[PD_RATIO] = [pd_label(a, b) for a, b in zip(p, d)]
    out["prefill_share"] = p / (p + d).where(p + d > 0, 1)
    return out


def _with_per_gpu(summary: pd.DataFrame) -> pd.DataFrame:
    if "goodput_req_s_per_gpu" not in summary and {"goodput_req_s", "num_gpus"} <= set(summary):
        summary = summary.assign(goodput_req_s_per_gpu=summary["goodput_req_s"] / summary["num_gpus"])
    return summary


def _wide_spread(values: np.ndarray) -> bool:
    """Whether `values` span enough orders of magnitude to need a log axis."""
    positive = values[np.isfinite(values) & (values > 0)]
    return bool(len(positive)) and positive.max() / positive.min() > _LOG_SPREAD


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def legend_outside(ax, handles=None, title: str | None = None):
    """The axes' legend to the right of the data, never over it (constrained layout makes room)."""
    return ax.legend(handles=handles, title=title, fontsize="small", title_fontsize="small",
                     loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _integer_ticks(axis, values) -> None:
    """Whole-number ticks on an axis whose values are all whole numbers (instances, clients)."""
    values = np.asarray(values, dtype=float)
    if len(values) and np.all(np.isfinite(values)) and np.all(values == np.round(values)):
        axis.set_major_locator(MaxNLocator(integer=True))


def log_axis(axis) -> None:
    """Put `axis` (`ax.xaxis`, `ax.yaxis`) on a log scale labelled in plain numbers ("5", "20",
    "300", not 5×10^0). Minor ticks are labelled too, fewer the more decades the axis spans
    (every one within a factor 4; 2, 3 and 5 within a decade; 2 and 5 within two; none beyond),
    so that a narrow axis still reads and labels never run into each other."""
    if axis is axis.axes.xaxis:
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")

    def minor(value: float, _pos) -> str:
        lo, hi = sorted(axis.get_view_interval())
        spread = hi / lo if lo > 0 else np.inf
        digits = range(2, 10) if spread < 4 else (2, 3, 5) if spread < 10 else \
            (2, 5) if spread < 100 else ()
        mantissa = value / 10 ** np.floor(np.log10(value))
        return f"{value:g}" if any(abs(mantissa - d) < 1e-6 for d in digits) else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


_SLO_NAMES = {"ttft_s": "TTFT", "itl_s": "mean ITL per request"}


def _slo_line(ax, slo, field: str, scale: float) -> Line2D | None:
    """The SLO bound `slo.<field>` dashed across `ax` (values times `scale`); its legend handle.
    A bound far above the data (more than half the axis again) is left off the top, its label
    saying so, rather than squash the data into the bottom of the plot."""
    bound = getattr(slo, field, None) if slo is not None and field else None
    if bound is None:
        return None
    ax.autoscale_view()
    limits = ax.get_ylim()
    label = f"SLO: {_SLO_NAMES.get(field, field)} ≤ {bound * scale:g} ms"
    far = bound * scale > limits[1] + 0.5 * (limits[1] - limits[0])
    line = ax.axhline(bound * scale, color="tab:red", linestyle="--", linewidth=1.1,
                      label=label + (" (above the plot)" if far else ""))
    if far:
        ax.set_ylim(limits)
    return line


def _colors(n: int) -> list:
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](v) for v in np.linspace(0.0, 0.95, n)]


def plot_sweep(
    summary: pd.DataFrame,
    out_dir: str | Path,
    x: str = PD_RATIO,
    group: str = "request_rate",
    *,
    slo=None,
    legend_title: str | None = None,
) -> list[Path]:
    """Plot TTFT, ITL (p50 and p99), output throughput per GPU and goodput per GPU of a sweep.

    `summary` holds one row per (configuration, request rate): `prefill_instances`,
    `decode_instances`, `request_rate` and the columns of `pdsim.metrics.summarize`.
    With ``x="pd_ratio"`` the x axis lists configurations as "1P:3D", ordered by prefill share;
    any other `x` must be a numeric column. One line per value of `group` (`legend_title` heads
    their legend). When the sweep holds a single configuration, the metrics are plotted against
    `group` instead. Rows repeating the same (x, group) pair (several seeds, say) are averaged.
    `slo` (a `pdsim.metrics.SLO`): its TTFT and ITL bounds dashed on those panels. Returns the
    PNG paths written (one per metric whose columns are present).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if summary.empty:
        return []
    frame = _with_per_gpu(summary)
    ticks_text = {}
    if x == PD_RATIO:
        if {"prefill_instances", "decode_instances"} <= set(frame):
            frame = with_pd_ratio(frame)
            ticks_text = _pd_ticks(frame)
        elif PD_RATIO in frame:
            frame = frame.assign(prefill_share=frame.get("prefill_share", 0.0))
        else:
            raise ValueError("plot_sweep(x='pd_ratio') needs columns prefill_instances and "
                             f"decode_instances (or pd_ratio); the summary has {list(frame.columns)}")
    elif x not in frame:
        raise ValueError(f"plot_sweep: no column {x!r} in the summary; it has {list(frame.columns)}")
    elif not pd.api.types.is_numeric_dtype(frame[x]) or pd.api.types.is_bool_dtype(frame[x]):
        frame = frame.assign(**{x: frame[x].astype(str)})  # categories, in order of appearance
    has_groups = group in frame and frame[group].notna().any()
    if frame[x].nunique() == 1 and has_groups and frame[group].nunique() > 1:
        # One configuration: nothing to compare across it, so plot against the group instead.
        only = str(frame[x].iloc[0])
        frame = frame.assign(_line=ticks_text.get(only, only).replace("\n", ", "))
        x, group, legend_title = group, "_line", None
    elif not has_groups:
        frame = frame.assign(_line="all")
        group = "_line"

    numeric = [s.column for panel in _SWEEP_PANELS for s in panel.series if s.column in frame]
    keys = [x, group] + (["prefill_share"] if x == PD_RATIO else [])
    table = frame.groupby(keys, sort=False, dropna=False)[numeric].mean().reset_index()

    if x == PD_RATIO:  # categorical axis ordered by prefill share, then by label
        order = (table[[PD_RATIO, "prefill_share"]].drop_duplicates(PD_RATIO)
                 .sort_values(["prefill_share", PD_RATIO]))[PD_RATIO].tolist()
        position = {label: i for i, label in enumerate(order)}
        table["_x"] = table[PD_RATIO].map(position).astype(float)
        xlabel, ticks = "P:D configuration (prefill:decode instances)", order
        if ticks_text:
            xlabel = "P:D configuration (prefill:decode instances), GPUs, parallelism"
    elif not pd.api.types.is_numeric_dtype(table[x]):  # categories (strings, booleans)
        order = list(dict.fromkeys(table[x]))
        table["_x"] = table[x].map({label: i for i, label in enumerate(order)}).astype(float)
        xlabel, ticks = _axis_label(x), order
    else:
        table["_x"] = table[x].astype(float)
        xlabel, ticks = _axis_label(x), None

    line_values = sorted(table[group].unique(), key=_sort_key)
    colors = dict(zip(line_values, _colors(len(line_values))))
    # Unordered categories (a policy, a preset, a flag): points, not lines between them, each
    # line's points shifted a little so that equal values at one category stay apart.
    unordered = ticks is not None and x != PD_RATIO
    step = min(0.08, 0.5 / len(line_values)) if unordered else 0.0
    shift = {v: (i - (len(line_values) - 1) / 2) * step for i, v in enumerate(line_values)}
    written = []
    for panel in _SWEEP_PANELS:
        series = [s for s in panel.series if s.column in table]
        if not series:
            continue
        fig = Figure(figsize=(9.0, 4.8), layout="constrained")
        ax = fig.add_subplot()
        for value in line_values:
            rows = table[table[group] == value].sort_values("_x")
            for s in series:
                ax.plot(rows["_x"] + shift[value], rows[s.column] * panel.scale,
                        color=colors[value], linestyle="none" if unordered else s.linestyle,
                        marker=s.marker, markersize=5 if unordered else 4, linewidth=1.6)
        if _wide_spread(np.concatenate([table[s.column].to_numpy(float) for s in series])):
            log_axis(ax.yaxis)
        bound = _slo_line(ax, slo, panel.slo, panel.scale)
        if ticks is None and _wide_spread(table["_x"].to_numpy(float)):  # 1 ... 256 clients
            values = sorted(table["_x"].unique())
            log_axis(ax.xaxis)
            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.minorticks_off()
        elif ticks is None:
            _integer_ticks(ax.xaxis, table["_x"])
        if ticks is not None:
            labels = [ticks_text.get(t, t) for t in ticks]
            ax.set_xticks(range(len(ticks)), labels, rotation=30 if len(ticks) > 6 else 0,
                          ha="right" if len(ticks) > 6 else "center", fontsize="small")
        if unordered:
            ax.set_xlim(-0.5, len(ticks) - 0.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
        handles = [Line2D([], [], color=colors[v], linewidth=2, label=_line_label(group, v),
                          **({"linestyle": "none", "marker": "o"} if unordered else {}))
                   for v in line_values]
        if len(series) > 1:
            handles += [Line2D([], [], color="0.3", linestyle="none" if unordered else s.linestyle,
                               marker=s.marker, markersize=4, label=s.label) for s in series]
        if bound is not None:
            handles.append(bound)
        legend_outside(ax, handles, legend_title)
        written.append(_save(fig, out_dir / f"{panel.name}.png"))
    return written


def _pd_ticks(frame: pd.DataFrame) -> dict[str, str]:
    """Each P:D label's tick text: "2P:6D", then its GPUs and each role's parallelism, e.g.
    "2P:6D\n32 GPU, tp4" ("tp8 / tp4 dp4" when prefill's and decode's differ)."""
    if "num_gpus" not in frame:
        return {}
    out = {}
    for label, rows in frame.groupby(PD_RATIO, sort=False):
        row = rows.iloc[0]
        roles = [_parallel(row.get(f"{role}_tp"), row.get(f"{role}_dp_attention"))
                 for role in ("prefill", "decode") if row.get(f"{role}_instances", 0)]
        gpus = sorted({int(n) for n in rows["num_gpus"]})
        text = f"{label}\n{'/'.join(map(str, gpus))} GPU"
        if roles and all(roles):
            text += ", " + (roles[0] if len(set(roles)) == 1 else " / ".join(roles))
        out[label] = text
    return out


def _parallel(tp, dp) -> str:
    """"tp8", or "tp8 dp8" with DP attention; "" where the summary does not say (NaN, None)."""
    if not tp or tp != tp:
        return ""
    return f"tp{int(tp)}" + (f" dp{int(dp)}" if dp and dp == dp and dp > 1 else "")


def _sort_key(value):
    return (0, float(value), "") if isinstance(value, (int, float, np.number)) else (1, 0.0, str(value))


def _axis_label(column: str) -> str:
    named = {"request_rate": "request rate (req/s)", "concurrency": "concurrent clients"}
    return named.get(column, column.replace("_", " "))


# Swept fields whose name in words is not their path's words (`field_title`).
_FIELD_TITLES = {
    "workload.arrival.rate_rps": "request rate (req/s)",
    "workload.target_rate_rps": "target request rate (req/s)",
    "workload.rate_scale": "rate scale",
    "workload.arrival.concurrency": "concurrent clients",
    "workload.closed_loop.concurrency": "concurrent clients",
    "cluster.prefill.scheduler.disable_radix_cache": "prefill radix cache disabled",
    "cluster.decode.scheduler.disable_radix_cache": "decode radix cache disabled",
    "cluster.colocated.scheduler.disable_radix_cache": "radix cache disabled",
}
# Path parts that say where a field sits, not what it is.
_PLACES = {"cluster", "workload", "arrival", "closed_loop", "scheduler", "params"}


def field_title(field: str) -> str:
    """A swept field's name in words for axes and legends: `cluster.decode.tp` -> "decode tp",
    `router.policy` -> "router policy" (a few by name: `_FIELD_TITLES`)."""
    if field in _FIELD_TITLES:
        return _FIELD_TITLES[field]
    parts = [part for part in field.split(".") if part not in _PLACES] or field.split(".")[-1:]
    return " ".join(part.replace("_", " ") for part in parts)  # a place alone names itself


def _legend_value(field: str, value) -> str:
    """A swept value in a legend headed by its field's title: the value, with its unit."""
    if field in CONCURRENCY_FIELDS:
        return _clients(value)
    if field in RATE_FIELDS and field.endswith("_rps"):
        return f"{float(value):g} req/s"
    return str(value)


def _line_label(group: str, value) -> str:
    if group == "request_rate":
        return f"{value:g} req/s"
    if group == "concurrency":
        return f"{value:g} clients"
    if group == "_line":
        return str(value)
    return f"{group} = {value}"


# --------------------------------------------------------------------------------------------
# What a sweep varies, and plots chosen from it


def varying_fields(summary: pd.DataFrame) -> list[str]:
    """The swept fields (`sweep.` columns, prefix dropped) that take more than one value."""
    return [c[len(SWEPT):] for c in summary.columns
            if c.startswith(SWEPT) and summary[c].astype(str).nunique() > 1]


def short_field(field: str) -> str:
    """A swept field's name in labels: `decode.ep`, `arrival.concurrency`, `speculative.method`."""
    for prefix in ("cluster.", "workload."):
        if field.startswith(prefix):
            return field[len(prefix):]
    return field


def _value_text(field: str, value) -> str:
    if field in CONCURRENCY_FIELDS:
        return _clients(value)
    if field in RATE_FIELDS and field.endswith("_rps"):
        return f"{float(value):g} req/s"
    return f"{short_field(field)}={value}"


def _clients(n) -> str:
    return f"{int(n)} client{'' if int(n) == 1 else 's'}"


def is_pd_sweep(fields: list[str]) -> bool:
    """Whether a sweep over `fields` (see `varying_fields`) is read as P:D configurations under
    some loads: it varies nothing but the P:D split, the request rate and the client count."""
    return all(f in PD_FIELDS + RATE_FIELDS + CONCURRENCY_FIELDS for f in fields)


def sweep_axes(summary: pd.DataFrame) -> tuple[str, list[str]]:
    """Of a sweep that is not a P:D sweep: the field on the x axis (the first numeric one that
    varies) and the fields that tell its lines apart (those that do not move with x)."""
    fields = varying_fields(summary)
    numeric = [f for f in fields if pd.api.types.is_numeric_dtype(summary[SWEPT + f])
               and not pd.api.types.is_bool_dtype(summary[SWEPT + f])]
    x = numeric[0] if numeric else fields[0]
    text = summary[[SWEPT + f for f in fields]].astype(str)  # lists (acceptance rates) too
    along = text.groupby(SWEPT + x)
    return x, [f for f in fields if f != x and (along[SWEPT + f].nunique() > 1).any()]


def sweep_labels(summary: pd.DataFrame) -> list[str]:
    """One label per summary row naming what the sweep varies: "2P:6D @ 20 req/s" for a P:D
    sweep ("1P:1D @ 64 clients" in a closed loop); otherwise its x field and line fields
    (`sweep_axes`), "decode.ep=16, decode.two_batch_overlap=True": fields that only move
    along with x are not repeated."""
    fields = varying_fields(summary)
    if not is_pd_sweep(fields):
        x, lines = sweep_axes(summary)
        return [", ".join(_value_text(f, row[SWEPT + f]) for f in [x] + lines)
                for _, row in summary.iterrows()]
    labels = []
    for _, row in summary.iterrows():
        head = pd_label(row["prefill_instances"], row["decode_instances"])
        clients = row.get("concurrency", 0)
        load = _clients(clients) if clients == clients and clients else f"{row['request_rate']:g} req/s"
        labels.append(f"{head} @ {load}")
    return labels


def plot_experiment(summary: pd.DataFrame, out_dir: str | Path, slo=None) -> list[Path]:
    """The sweep plots an experiment's summary calls for (see the module docstring); `slo` (a
    `pdsim.metrics.SLO`) dashed on the latency panels."""
    out_dir = Path(out_dir)
    fields = varying_fields(summary)
    concurrency_varies = "concurrency" in summary and summary["concurrency"].nunique() > 1
    if is_pd_sweep(fields):
        written = plot_sweep(summary, out_dir, slo=slo,
                             group="concurrency" if concurrency_varies else "request_rate")
        frame = with_pd_ratio(summary) if "prefill_instances" in summary else summary
        group = None
        if PD_RATIO in frame:  # legends: "1P:3D, 8 GPU, tp2", "colocated ×4, 4 GPU, tp1"
            names = {k: v.replace("\n", ", ") for k, v in _pd_ticks(frame).items()}
            frame = frame.assign(_config=frame[PD_RATIO].map(lambda k: names.get(k, k)))
            group = "_config"
        if concurrency_varies:
            written += plot_throughput_latency(frame, out_dir, group=group,
                                               legend_title="configuration")
        written += plot_interactivity(frame, out_dir / INTERACTIVITY_PNG, group=group,
                                      legend_title="configuration")
        return written
    x, lines = sweep_axes(summary)
    x_column = "concurrency" if x in CONCURRENCY_FIELDS else field_title(x)
    frame = summary.assign(**{x_column: summary[SWEPT + x]})
    frame["_line"] = _joined(frame, lines)
    written = plot_sweep(frame, out_dir, x=x_column, group="_line" if lines else "", slo=slo,
                         legend_title=_titles(lines))
    # one curve (one colour) per setting of everything but the load
    curves = [f for f in [x] + lines if f not in CONCURRENCY_FIELDS + RATE_FIELDS]
    frame["_curve"] = _joined(frame, curves)
    if concurrency_varies:
        written += plot_throughput_latency(frame, out_dir, group="_curve" if curves else None,
                                           legend_title=_titles(curves))
    written += plot_interactivity(frame, out_dir / INTERACTIVITY_PNG,
                                  group="_curve" if curves else None,
                                  legend_title=_titles(curves))
    return written


def _titles(fields: list[str]) -> str | None:
    return ", ".join(field_title(f) for f in fields) or None


def _joined(frame: pd.DataFrame, fields: list[str]) -> list[str]:
    """Each row's values of `fields`, for a legend headed by `_titles(fields)`."""
    return [", ".join(_legend_value(f, row[SWEPT + f]) for f in fields)
            for _, row in frame.iterrows()]


_TRADEOFFS = (
    ("throughput_vs_ttft", "ttft_p50_s", "TTFT p50 (ms)"),
    ("throughput_vs_itl", "itl_p50_s", "ITL p50 (ms)"),
)


def plot_throughput_latency(summary: pd.DataFrame, out_dir: str | Path,
                            group: str | None = None, legend_title: str | None = None
                            ) -> list[Path]:
    """Output tokens/s per GPU against TTFT and against ITL (p50), one point per client count
    (`concurrency`), labelled with it; one curve per value of `group`. Returns the PNG paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = summary if group else summary.assign(_all="all")
    group = group or "_all"
    curves = sorted(frame[group].unique(), key=_sort_key)
    colors = dict(zip(curves, _colors(len(curves))))
    written = []
    for stem, column, xlabel in _TRADEOFFS:
        if column not in frame or "output_tok_s_per_gpu" not in frame:
            continue
        fig = Figure(figsize=(9.0, 4.8), layout="constrained")
        ax = fig.add_subplot()
        for curve in curves:
            rows = frame[frame[group] == curve].sort_values("concurrency")
            x = rows[column].to_numpy(float) * 1e3
            y = rows["output_tok_s_per_gpu"].to_numpy(float)
            ax.plot(x, y, color=colors[curve], marker="o", markersize=4, linewidth=1.6,
                    label=None if group == "_all" else str(curve))
            for xi, yi, n in zip(x, y, rows["concurrency"]):
                ax.annotate(f"{int(n)}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                            fontsize="x-small", color=colors[curve])
        if _wide_spread(frame[column].to_numpy(float)):
            log_axis(ax.xaxis)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output tokens/s per GPU")
        ax.set_title(f"Throughput against {xlabel.split()[0]} (points: concurrent clients)")
        ax.grid(True, which="major", alpha=0.35)
        if group != "_all":
            legend_outside(ax, title=legend_title)
        written.append(_save(fig, out_dir / f"{stem}.png"))
    return written


INTERACTIVITY_PNG = "throughput_vs_interactivity.png"
USER_TOK_S = "output_tok_s_per_user"  # 1 / tpot_mean_s: the output speed one user sees


def per_user_tok_s(frame: pd.DataFrame) -> pd.Series:
    """Tokens/s one user sees: 1 / the mean over requests of each one's mean ITL (TPOT)."""
    tpot = frame["tpot_mean_s"].astype(float)
    return 1.0 / tpot.where(tpot > 0)


def pareto_upper_right(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Which points no other beats on both `x` and `y` (higher is better on both); NaN never."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    keep = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        beaten = ok & (x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i]))
        keep[i] = not beaten.any()
    return keep


def plot_interactivity(points: pd.DataFrame, path: str | Path, *, group: str | None = None,
                       legend_title: str | None = None, title: str | None = None,
                       star: tuple[float, float] | None = None) -> list[Path]:
    """Output tokens/s per GPU against tokens/s per user (`per_user_tok_s`), one point per row
    of `points` (a sweep point, a plan candidate), coloured by `group`; the Pareto frontier
    (`pareto_upper_right`) joined and ringed; `star`: a (per-user, per-GPU) point to mark, the
    plan's recommendation. The throughput-against-interactivity chart: moving right along the
    frontier, each user is served faster and each GPU serves fewer tokens. Returns [path], or
    [] when no point has both figures."""
    if not {"tpot_mean_s", "output_tok_s_per_gpu"} <= set(points):
        return []
    frame = points.assign(**{USER_TOK_S: per_user_tok_s(points)})
    frame = frame[np.isfinite(frame[USER_TOK_S]) & frame["output_tok_s_per_gpu"].notna()]
    if frame.empty:
        return []
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(9.0, 5.2), layout="constrained")
    ax = fig.add_subplot()
    x, y = frame[USER_TOK_S].to_numpy(float), frame["output_tok_s_per_gpu"].to_numpy(float)
    if group is None:
        ax.scatter(x, y, s=22, color="tab:blue", label="sweep point" if star is None else None)
    else:
        values = sorted(frame[group].unique(), key=_sort_key)
        for value, color in zip(values, _colors(len(values))):
            mine = (frame[group] == value).to_numpy()
            ax.scatter(x[mine], y[mine], s=22, color=color, label=str(value))
    front = pareto_upper_right(x, y)
    order = np.argsort(x[front])
    ax.plot(x[front][order], y[front][order], color="0.15", linewidth=1.3, zorder=3,
            label="Pareto frontier")
    ax.scatter(x[front], y[front], s=70, facecolors="none", edgecolors="0.15", linewidths=1.2,
               zorder=4)
    if star is not None:
        ax.scatter([star[0]], [star[1]], marker="*", s=220, color="tab:red", zorder=5,
                   label="recommended")
    if _wide_spread(x):
        log_axis(ax.xaxis)
    ax.set_xlabel("output tokens/s per user (1 / mean ITL of a request)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title or "Throughput per GPU against speed per user")
    ax.grid(True, which="major", alpha=0.35)
    legend_outside(ax, title=legend_title)
    return [_save(fig, path)]


_CDF_METRICS = (
    ("ttft_s", "ttft_cdf", "TTFT", "TTFT (ms)"),
    ("itl_mean_s", "itl_cdf", "per-request mean inter-token latency", "mean ITL of a request (ms)"),
)


def _pick_curves(requests: pd.DataFrame, by: str, max_curves: int) -> tuple[list, int]:
    """Up to `max_curves` of the most distinct curve names, ordered by median TTFT.

    Each point is described by log10 of its TTFT p50 and p99 and its mean-ITL p50, each scaled to
    [0, 1] over all points; starting from the lowest median TTFT, the point farthest from those
    already chosen is added until `max_curves` are chosen (so best, worst and the spread between
    are kept, near-duplicates dropped).
    """
    grouped = requests.groupby(by, sort=False)
    features = pd.DataFrame({
        "ttft_p50": grouped["ttft_s"].median(),
        "ttft_p99": grouped["ttft_s"].quantile(0.99),
        "itl_p50": grouped["itl_mean_s"].median() if "itl_mean_s" in requests else 0.0,
    })
    median = features["ttft_p50"].fillna(np.inf)
    ordered = sorted(features.index, key=lambda k: (median[k], str(k)))
    if len(ordered) <= max_curves:
        return ordered, len(ordered)
    values = np.log10(features.loc[ordered].to_numpy(float).clip(min=1e-9))
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    span = values.max(axis=0) - values.min(axis=0)
    values = (values - values.min(axis=0)) / np.where(span > 0, span, 1.0)
    chosen = [0]
    distance = np.linalg.norm(values - values[0], axis=1)
    while len(chosen) < max_curves:
        distance[chosen] = -np.inf
        nxt = int(np.argmax(distance))  # ties: the lower median TTFT
        chosen.append(nxt)
        distance = np.minimum(distance, np.linalg.norm(values - values[nxt], axis=1))
    return [ordered[i] for i in sorted(chosen)], len(ordered)


def plot_latency_cdfs(
    requests: pd.DataFrame,
    out_dir: str | Path,
    by: str = "point",
    *,
    max_curves: int = 8,
    split: str | None = None,
) -> list[Path]:
    """Plot CDFs of TTFT and of each request's mean ITL, one curve per value of `by`.

    `requests` is `pdsim.metrics.records_frame` output of several runs with a `by` column naming
    each run's configuration point; only completed requests are used. With more than
    `max_curves` points the most distinct ones are kept (see `_pick_curves`) and the title says
    how many. With `split` (a column such as
    `request_rate`) one pair of figures is drawn per value of that column. Returns the PNG paths.
    """
    if max_curves < 1:
        raise ValueError(f"max_curves must be at least 1, got {max_curves}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = requests
    if "status" in frame:
        frame = frame[frame["status"] == "ok"]
    if by not in frame:
        frame = frame.assign(**{by: "all"})
    if frame.empty:
        return []

    parts = [(None, frame)] if split is None else [
        (value, frame[frame[split] == value]) for value in sorted(frame[split].unique(), key=_sort_key)
    ]
    written = []
    for split_value, part in parts:
        names, total = _pick_curves(part, by, max_curves)
        colors = _colors(len(names))
        suffix = "" if split is None else f"_{_slug(split)}-{_slug(split_value)}"
        for column, stem, title, xlabel in _CDF_METRICS:
            if column not in part:
                continue
            fig = Figure(figsize=(9.0, 4.8), layout="constrained")
            ax = fig.add_subplot()
            drawn = []
            for name, color in zip(names, colors):
                values = np.sort(part.loc[part[by] == name, column].to_numpy(float))
                values = values[np.isfinite(values)] * 1e3
                if not len(values):
                    continue
                y = np.arange(1, len(values) + 1) / len(values)
                ax.plot(values, y, drawstyle="steps-post", color=color, linewidth=1.6,
                        label=f"{name} (n={len(values)})")
                drawn.append(values)
            if not drawn:
                continue
            if _wide_spread(np.concatenate(drawn)):
                log_axis(ax.xaxis)
            for level in (0.5, 0.99):
                ax.axhline(level, color="0.5", linewidth=0.8, linestyle=":")
            full_title = f"CDF of {title}"
            if split is not None:
                full_title += f", {_line_label(split, split_value)}"
            if len(names) < total:
                full_title += f"\n({len(names)} of {total} points, most distinct shown)"
            ax.set_title(full_title)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("fraction of completed requests")
            ax.set_ylim(0, 1.01)
            ax.grid(True, which="major", alpha=0.35)
            legend_outside(ax, title=by)
            written.append(_save(fig, out_dir / f"{stem}{suffix}.png"))
    return written


def _slug(value) -> str:
    text = f"{value:g}" if isinstance(value, (float, np.floating)) else str(value)
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)



def plot_timeline(timeline: pd.DataFrame, path: str | Path, slo=None) -> Path:
    """An autoscaled run over time, one colour per sweep point (`label`): the load (arrivals
    per second of each window), the instances of each role serving at the window's end
    (prefill solid, decode dashed), TTFT p90 and the p90 of requests' mean ITL by arrival
    window, and the share of each window's arrivals that met the SLO. `timeline` is the
    runner's timeline.csv (pdsim.sim.autoscaler.timeline_frame)."""
    path = Path(path)
    labels = list(dict.fromkeys(timeline["label"])) if "label" in timeline else [""]
    colors = dict(zip(labels, _colors(len(labels))))
    fig = Figure(figsize=(10, 11), layout="constrained")
    load, inst, ttft, itl, met = fig.subplots(5, 1, sharex=True)
    first = timeline[timeline["label"] == labels[0]] if "label" in timeline else timeline
    minutes = first["end_s"] / 60
    load.step(minutes, first["arrival_rate_rps"], where="pre", color="black")
    load.set(title="Load", ylabel="arrivals (req/s)")
    for label in labels:
        part = timeline[timeline["label"] == label] if "label" in timeline else timeline
        x, c = part["end_s"] / 60, colors[label]
        for role, style in (("prefill", "-"), ("decode", "--")):
            if f"{role}_running" in part:
                inst.step(x, part[f"{role}_running"], where="post", color=c, linestyle=style)
        ttft.plot(x, part["ttft_p90_s"] * 1e3, color=c, marker=".")
        itl.plot(x, part["itl_p90_s"] * 1e3, color=c, marker=".")
        met.plot(x, part["slo_attainment"] * 100, color=c, marker=".", label=label)
    inst.set(title="Instances serving", ylabel="instances")
    inst.yaxis.set_major_locator(MaxNLocator(integer=True))
    legend_outside(inst, [Line2D([], [], color="grey", linestyle="-", label="prefill"),
                          Line2D([], [], color="grey", linestyle="--", label="decode")])
    ttft.set(title="TTFT p90 by arrival window", ylabel="TTFT (ms)")
    itl.set(title="Mean ITL per request, p90 by arrival window", ylabel="ITL (ms)")
    for ax, field in ((ttft, "ttft_s"), (itl, "itl_s")):
        if ax.has_data():
            log_axis(ax.yaxis)
        line = _slo_line(ax, slo, field, 1e3)
        if line is not None:
            legend_outside(ax, [line])
    met.set(title="SLO attainment by arrival window", ylabel="met (%)", xlabel="time (min)",
            ylim=(-2, 102))
    if "label" in timeline:
        legend_outside(met)
    return _save(fig, path)
