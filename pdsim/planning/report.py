"""Write a plan's results: candidates.csv, frontier.csv, frontier.png,
throughput_vs_interactivity.png, report.md, recommended.yaml (pdsim's experiment), launch.sh
(SGLang's commands) and plan.yaml (the plan as validated: the keys it set, which `pdsim plan`
reads again)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from pdsim.planning.result import Choice, PlanResult, axis_column, latency_columns
from pdsim.tables import counted

# pdsim.plots.INTERACTIVITY_PNG, not imported from there: pdsim.plots loads matplotlib, which
# the simulation workers (they import this package) do without.
INTERACTIVITY_PNG = "throughput_vs_interactivity.png"
_FRONTIER_METRICS = ("ttft", "itl", "tpot")  # the frontier's panel columns, left to right
FRONTIER_COLUMNS = ("label", "num_gpus", "usd_per_hour", "output_tok_s_per_gpu", "usd_per_mtok",
                    "goodput_req_s_per_gpu", "goodput_req_per_usd", "feasible", "bottleneck")


def write_plan(result: PlanResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = result.plan
    result.candidates.to_csv(out / "candidates.csv", index=False)
    result.frontier.to_csv(out / "frontier.csv", index=False)
    plots = []
    if len(result.frontier):
        plots = [plot_frontier(result, out / "frontier.png"),
                 *plot_interactivity_chart(result, out / INTERACTIVITY_PNG)]
    if result.recommended:
        (out / "recommended.yaml").write_text(result.recommended.experiment_yaml)
        (out / "launch.sh").write_text(result.recommended.launch.script())
    (out / "report.md").write_text(report_text(result, [p.name for p in plots]))
    # The keys the plan set, not those equal to a default: a tagged union's tag (the arrival
    # process, a length distribution) is required even where it equals its default.
    (out / "plan.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True),
                                                  sort_keys=False))
    return out


def plot_frontier(result: PlanResult, path: Path) -> Path:
    """tok/s/GPU and $/Mtok against the TTFT, ITL and TPOT percentiles: every simulated
    candidate, the feasible ones filled, each panel's own Pareto frontier as a staircase, the
    recommendation starred, the targets dashed."""
    from matplotlib.figure import Figure

    from pdsim.plots import legend_outside, log_axis

    cfg, table = result.plan, result.candidates
    sims = table[table["simulated"]]
    ok = sims[sims["feasible"] == True]  # noqa: E712
    metrics = [m for m in _FRONTIER_METRICS if axis_column(cfg, m) in sims]
    fig = Figure(figsize=(4.6 * len(metrics) + 2.2, 8), layout="constrained")
    axes = fig.subplots(2, len(metrics), squeeze=False)
    for col, metric in enumerate(metrics):
        x = axis_column(cfg, metric)
        bound = cfg.slo.targets().get(x)
        for row, y in enumerate(("output_tok_s_per_gpu", "usd_per_mtok")):
            ax = axes[row][col]
            ax.scatter(sims[x] * 1e3, sims[y], s=14, facecolors="none", edgecolors="0.6",
                       label="simulated")
            ax.scatter(ok[x] * 1e3, ok[y], s=18, color="tab:blue", label="meets the SLO")
            f = _frontier_2d(sims, x, y, higher_is_better=y.startswith("output"))
            ax.step(f[x] * 1e3, f[y], where="post", color="tab:orange", lw=1.2, marker="o", ms=3,
                    label="frontier")
            if result.recommended is not None:
                s = result.recommended.summary
                ax.scatter([s[x] * 1e3], [s[y]], marker="*", s=180, color="tab:red",
                           label="recommended", zorder=5)
            if bound:
                ax.axvline(bound * 1e3, ls="--", color="0.3", lw=0.8, label="SLO target")
            log_axis(ax.xaxis)
            ax.set_xlabel(f"{metric.upper()} p{x.split('_p')[1][:-2]} (ms)")
            ax.set_ylabel("output tok/s per GPU" if y.startswith("output")
                          else "USD per M output tokens")
            ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    legend_outside(axes[0][-1], list(handles.values()))
    fig.suptitle(f"{cfg.name}: {len(sims)} deployments simulated")
    fig.savefig(path, dpi=110, format="png")
    return path


def plot_interactivity_chart(result: PlanResult, path: Path) -> list[Path]:
    """tok/s/GPU against tok/s/user (pdsim.plots.plot_interactivity): one point per simulated
    candidate, by whether it meets the SLO, the recommendation starred."""
    from pdsim.plots import per_user_tok_s, plot_interactivity

    sims = result.candidates[result.candidates["simulated"]]
    sims = sims.assign(_slo=np.where(sims["feasible"] == True,  # noqa: E712
                                     "meets the SLO", "misses the SLO"))
    star = None
    if result.recommended is not None:
        s = result.recommended.summary
        star = (float(per_user_tok_s(pd.DataFrame([s])).iloc[0]), s["output_tok_s_per_gpu"])
    return plot_interactivity(sims, path, group="_slo", star=star,
                              title=f"{result.plan.name}: throughput per GPU against speed "
                                    "per user, one point per deployment")


def _frontier_2d(rows: pd.DataFrame, x: str, y: str, higher_is_better: bool) -> pd.DataFrame:
    """The rows no other beats on both `x` (lower is better) and `y`, by increasing `x`."""
    rows = rows.dropna(subset=[x, y]).sort_values([x, y], ascending=[True, not higher_is_better])
    best, keep = None, []
    for v in rows[y]:
        better = best is None or (v > best if higher_is_better else v < best)
        keep.append(better)
        best = v if better else best
    return rows[keep]


def _fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if unit == "ms":
        return f"{v * 1e3:,.1f}"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def _choice_md(title: str, c: Choice, cfg) -> list[str]:
    s = c.summary
    lines = [f"## {title}: {c.deployment.label}", "",
             f"- {counted(int(s['num_gpus']), 'GPU')}, ${_fmt(s['usd_per_hour'])}/hour, "
             f"${_fmt(s['usd_per_mtok'])} per million output tokens",
             f"- {_fmt(s['output_tok_s_per_gpu'])} output tok/s per GPU, goodput "
             f"{_fmt(s['goodput_req_s_per_gpu'])} req/s per GPU, {_fmt(s['goodput_req_per_usd'])} "
             "SLO-meeting requests per USD"]
    lines.append("- latencies: " + ", ".join(
        f"{col.removesuffix('_s').replace('_', ' ')} {_fmt(s[col], 'ms')} ms (target "
        f"{bound * 1e3:,.1f})" for col, bound in cfg.slo.targets().items()))
    lines += [f"- **bottleneck: {c.bottleneck.name}** ({c.bottleneck.words})", ""]
    return lines


def report_text(result: PlanResult, plots: list[str]) -> str:
    cfg, table, t = result.plan, result.candidates, result.timings_s
    kept = int(table["prefilter_keep"].sum())
    lines = [f"# Plan: {cfg.name}", ""]
    if cfg.description:
        lines += [cfg.description, ""]
    where = ("the GPU types below" if result.hardware_lines
             else f"{cfg.hardware if isinstance(cfg.hardware, str) else 'custom hardware'} at "
             f"${result.usd_per_gpu_hour:g} per GPU-hour")
    lines += [
        f"{cfg.model if isinstance(cfg.model, str) else 'custom model'} on {where}; SLO: "
        + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} <= {v * 1e3:,.1f} ms"
            for k, v in cfg.slo.targets().items()) + "; objective: " + cfg.objective + ".",
        "",
        f"{len(table)} deployments enumerated, {kept} kept by the analytic pre-filter "
        f"({t.get('prefilter_s', 0):.2f} s), {int(table['simulated'].sum())} simulated "
        f"({t.get('simulate_s', 0):.1f} s), {len(result.feasible)} of them meet the SLO.", ""]
    if result.hardware_lines:
        lines += ["## Heterogeneous hardware", "", *[f"- {line}" for line in result.hardware_lines],
                  ""]
    if result.recommended is None:
        lines += ["**No simulated deployment meets the SLO.** Raise max_gpus, relax the SLO or "
                  "widen the search space.", ""]
    else:
        lines += _choice_md("Recommended", result.recommended, cfg)
        if result.runner_up is not None:
            lines += _choice_md("Runner-up", result.runner_up, cfg)
        lines += ["## Launch (SGLang)", "", "```bash", result.recommended.launch.script().strip(),
                  "```", "", "pdsim's experiment for it: `recommended.yaml` "
                  "(`pdsim run recommended.yaml` reproduces these figures).", ""]
    lines += ["## Pareto frontier", "",
              "Deployments no other beats on tok/s/GPU and every targeted latency at once, "
              "feasible or not (`frontier.csv`; every candidate with its pre-filter verdict in "
              "`candidates.csv`).", ""]
    lat = latency_columns(cfg)
    cols = list(FRONTIER_COLUMNS[:2]) + lat + list(FRONTIER_COLUMNS[2:])
    lines.append("| " + " | ".join(c.removesuffix("_s").replace("_", " ") + " (ms)"
                                   if c in lat else c.replace("_", " ") for c in cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for _, row in result.frontier.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], "ms" if c in lat else "") for c in cols)
                     + " |")
    lines.append("")
    stopped = stopped_frame(result)
    if result.frontier.empty and not stopped.empty:
        lines += ["## Stopped early", "", "Simulated candidates whose run stopped once their SLO "
                  "was out of reach, with why (`stopped` in `candidates.csv`):", "",
                  "| label | num gpus | stopped |", "|---|---|---|"]
        lines += [f"| {r.label} | {r.num_gpus} | {r.stopped} |" for r in stopped.itertuples()]
        lines.append("")
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    reasons = table.loc[~table["prefilter_keep"], "prefilter_reason"].str.split(":").str[0]
    if len(reasons):
        lines += ["## Pre-filter", "", "Discarded without simulation, by reason: " + ", ".join(
            f"{k} {v}" for k, v in reasons.value_counts().items()) + ".", ""]
    return "\n".join(lines)


def stopped_frame(result: PlanResult) -> pd.DataFrame:
    """The simulated candidates whose run stopped early (their SLO out of reach): label,
    GPUs and why, most GPUs first (the nearest misses)."""
    table = result.candidates
    if "stopped" not in table:
        return pd.DataFrame(columns=["label", "num_gpus", "stopped"])
    rows = table[table["simulated"] & (table["stopped"].fillna("") != "")]
    return rows.sort_values(["num_gpus", "candidate"], ascending=[False, True])[
        ["label", "num_gpus", "stopped"]]


def summary_frame(result: PlanResult) -> pd.DataFrame:
    """The frontier with the columns the CLI prints."""
    cfg = result.plan
    cols = ["label", "num_gpus", *latency_columns(cfg), "output_tok_s_per_gpu", "usd_per_mtok",
            "feasible", "bottleneck"]
    return result.frontier[cols]
