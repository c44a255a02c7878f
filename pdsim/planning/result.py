"""What a plan returns (`PlanResult`, its `Choice`s) and the summary columns it is judged on:
shared by the search that builds it and the report that writes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pdsim.planning.bottleneck import Bottleneck
from pdsim.planning.candidates import Candidate
from pdsim.planning.config import PlanConfig
from pdsim.planning.launch import LaunchCommands
from pdsim.tables import counted


@dataclass
class Choice:
    """A simulated deployment the plan picked, with what limits it and how to launch it."""

    deployment: Candidate
    summary: pd.Series
    bottleneck: Bottleneck
    launch: LaunchCommands
    experiment_yaml: str


@dataclass
class PlanResult:
    """Everything a plan found. `candidates` has one row per deployment enumerated (pre-filter
    verdict, and the simulated summary where it ran); `frontier` the Pareto-optimal simulated
    rows (tok/s/GPU up, TTFT and ITL percentiles down)."""

    plan: PlanConfig
    usd_per_gpu_hour: float
    candidates: pd.DataFrame
    frontier: pd.DataFrame
    recommended: Choice | None
    runner_up: Choice | None
    timings_s: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    # A plan over several GPU types: their prices, and whether a mix beats one type
    # (pdsim.planning.hardware_mix); empty for one type.
    hardware_lines: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> pd.DataFrame:
        return self.candidates[self.candidates["feasible"] == True]  # noqa: E712 (NaN rows)


def choice_line(title: str, c: Choice) -> str:
    """One line on a pick, as `pdsim plan` prints it (and the docs quote it)."""
    s = c.summary
    return (f"{title}: {c.deployment.label}, {counted(c.deployment.num_gpus, 'GPU')}, "
            f"${s['usd_per_hour']:,.2f}/h, ${s['usd_per_mtok']:,.3f}/Mtok; bottleneck: "
            f"{c.bottleneck.name} ({c.bottleneck.words})")


def latency_columns(cfg: PlanConfig) -> list[str]:
    """The summary's latency columns a plan is judged on: its targets, and the TTFT and ITL
    columns of the plots."""
    return list(dict.fromkeys([axis_column(cfg, "ttft"), axis_column(cfg, "itl"),
                               *cfg.slo.targets()]))


def axis_column(cfg: PlanConfig, metric: str) -> str:
    """The summary column a metric is judged by: its highest percentile target, else p90."""
    targets = cfg.slo.percentile_targets(metric)
    q = targets[-1][0] if targets else 90
    return f"{metric}_p{q}_s"
