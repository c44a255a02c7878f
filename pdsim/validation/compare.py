"""Measured against simulated: the side-by-side table, the tolerance check and the plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pdsim.core.records import RequestRecord

# (row label, summarize() key). Percentiles of ITL pool every gap of every request.
METRICS = (
    ("TTFT mean", "ttft_mean_s"), ("TTFT P50", "ttft_p50_s"), ("TTFT P90", "ttft_p90_s"),
    ("TTFT P99", "ttft_p99_s"),
    ("ITL mean", "itl_mean_s"), ("ITL P50", "itl_p50_s"), ("ITL P90", "itl_p90_s"),
    ("ITL P99", "itl_p99_s"),
    ("E2E mean", "e2e_mean_s"), ("E2E P50", "e2e_p50_s"), ("E2E P90", "e2e_p90_s"),
    ("E2E P99", "e2e_p99_s"),
    ("throughput (output tok/s)", "output_tok_s"), ("throughput (req/s)", "request_throughput_req_s"),
    ("goodput (req/s)", "goodput_req_s"), ("goodput per GPU (req/s)", "goodput_req_s_per_gpu"),
    ("completed", "completed"),
)


@dataclass(frozen=True)
class Tolerance:
    """Largest relative error |sim − real| / real allowed per metric family.

    The defaults suit a CI-size run (tens of requests on a shared CPU): means of TTFT and ITL
    and the throughput move by several percent between two real runs of the same workload
    (scheduling jitter of the host, Python's GC), and a P90 over tens of values rests on a few
    requests, so it gets more room. P99 and goodput are reported, not checked: with so few
    requests they are one or two samples, and goodput counts an SLO's edge.
    """

    mean: float = 0.15  # TTFT mean, ITL mean, throughput
    p90: float = 0.25   # TTFT P90, ITL P90

    def limits(self) -> dict[str, float]:
        return {"TTFT mean": self.mean, "ITL mean": self.mean,
                "throughput (output tok/s)": self.mean,
                "TTFT P90": self.p90, "ITL P90": self.p90}


def side_by_side(real: dict, sim: dict, tolerance: Tolerance) -> pd.DataFrame:
    """One row per metric: real, sim, relative error, the limit (NaN: not checked), pass."""
    limits = tolerance.limits()
    rows = []
    for label, key in METRICS:
        r, s = float(real[key]), float(sim[key])
        err = (s - r) / r if r and not math.isnan(r) else float("nan")
        limit = limits.get(label, float("nan"))
        ok = True if math.isnan(limit) else (not math.isnan(err) and abs(err) <= limit)
        rows.append({"metric": label, "real": r, "sim": s, "error": err, "limit": limit,
                     "within": ok})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, title: str) -> str:
    """The table as markdown: latencies in ms, errors in %."""
    lines = [f"### {title}", "", "| metric | real | sim | error | limit | |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in table.itertuples():
        ms = not row.metric.startswith(("throughput", "goodput", "completed"))
        fmt = (lambda v: f"{v * 1e3:.1f} ms") if ms else (lambda v: f"{v:.2f}")
        err = "–" if math.isnan(row.error) else f"{row.error:+.1%}"
        limit = "–" if math.isnan(row.limit) else f"±{row.limit:.0%}"
        mark = "" if math.isnan(row.limit) else ("ok" if row.within else "**over**")
        lines.append(f"| {row.metric} | {fmt(row.real)} | {fmt(row.sim)} | {err} | {limit} | {mark} |")
    return "\n".join(lines) + "\n"


def plot(real: Sequence[RequestRecord], sim: Sequence[RequestRecord], path: str | Path,
         title: str) -> Path:
    """CDFs of TTFT, ITL and E2E (real and sim on one axis each) and a per-request scatter of
    simulated against measured TTFT (requests matched by `rid`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def values(records, what):
        done = [r for r in records if r.ok]
        if what == "ITL":
            return [b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:])]
        return [r.ttft_s if what == "TTFT" else r.e2e_s for r in done]

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, what in zip(axes, ("TTFT", "ITL", "E2E")):
        for name, records in (("real", real), ("sim", sim)):
            v = np.sort(np.asarray(values(records, what)) * 1e3)
            ax.plot(v, np.arange(1, len(v) + 1) / max(len(v), 1), label=name)
        ax.set(xlabel=f"{what} (ms)", ylabel="CDF", title=what)
        ax.legend()
    ax = axes[3]
    sim_by_rid = {s.rid: s for s in sim if s.ok}
    pairs = [(r.ttft_s * 1e3, sim_by_rid[r.rid].ttft_s * 1e3) for r in real
             if r.ok and r.rid in sim_by_rid]
    if pairs:
        x, y = zip(*pairs)
        ax.scatter(x, y, s=10)
        top = max(max(x), max(y))
        ax.plot([0, top], [0, top], color="grey", linewidth=1)
    ax.set(xlabel="measured TTFT (ms)", ylabel="simulated TTFT (ms)", title="TTFT per request")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
