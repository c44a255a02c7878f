"""Planning over several GPU types (a plan's `hardware` and its `gpu_types`): every deployment
of the plan's search space with each role on each type, prefill on one and decode on another
included, priced per role; the pre-filter measures each role on its own type, and the
survivors are simulated cheapest first. The report says whether the best mix beats the best
deployment on one type, and by what (docs/planning.md, "Heterogeneous hardware").

A plan with no `gpu_types` never comes here: `pdsim.planning.search.plan_one_hardware` searches it.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from pdsim.config import ConfigError, parse_experiment
from pdsim.planning.candidates import Candidate, enumerate_deployments, prefill_pp_sizes
from pdsim.planning.config import PlanConfig, price_per_gpu_hour
from pdsim.planning.early_stop import SloWatch
from pdsim.planning.launch import experiment_yaml, sglang_commands
from pdsim.planning.prefilter import Prefilter, RoleCapacity
from pdsim.planning.report import write_plan
from pdsim.planning.result import Choice, PlanResult
from pdsim.planning.search import (
    _bottleneck,
    _run_candidate,
    _sim_row,
    meets,
    pareto_frontier,
    rank_feasible,
    tpot_percentiles,
)
from pdsim.pools import open_pool
from pdsim.progress import phase, progress_bar
from pdsim.specs.hardware import HardwareSpec, load_hardware_spec
from pdsim.specs.models import ModelSpec, load_model_spec
from pdsim.workload import generate

# Candidates simulated between two updates of the cost cutoff: a fixed number, so that the
# plan is the same whatever the executor and its number of workers.
WAVE = 8


@dataclass(frozen=True)
class GpuOption:
    """A GPU type the plan may use: its spec, its price and the `hardware` field that names it
    in an experiment (the plan's, with the plan's price when it differs from the spec's)."""

    name: str
    usd_per_gpu_hour: float
    spec: HardwareSpec = field(compare=False)
    data: Any = field(compare=False)


def gpu_options(cfg: PlanConfig, base_dir: str | None) -> list[GpuOption]:
    """The plan's `hardware` then each of its `gpu_types`, loaded and priced."""
    entries = [(cfg.hardware, cfg.usd_per_gpu_hour, "hardware")] + [
        (t.hardware, t.usd_per_gpu_hour, f"gpu_types[{i}]") for i, t in enumerate(cfg.gpu_types)]
    out: list[GpuOption] = []
    for data, price, where in entries:
        try:
            spec = load_hardware_spec(data, base_dir)
            if any(o.name == spec.name for o in out):
                raise ValueError(f"GPU type {spec.name!r} is listed twice; give each type once "
                                 "(a mapping with its own `name` for a variant)")
            usd = price_per_gpu_hour(cfg.model_copy(update={"usd_per_gpu_hour": price}),
                                     spec.usd_per_gpu_hour, spec.name)
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if usd != spec.usd_per_gpu_hour:  # the experiment must price it as the plan does
            data = ({"base": data} if isinstance(data, str) else dict(data)) | {
                "name": spec.name, "usd_per_gpu_hour": usd}
        out.append(GpuOption(spec.name, usd, spec, data))
    return out


@dataclass(frozen=True, order=True)
class PlacedCandidate(Candidate):
    """A candidate with the GPU type of each of its roles (as `roles`)."""

    gpus: tuple[GpuOption, ...] = ()

    @property
    def label(self) -> str:
        parts = [f"{n}{role[0].upper()} {shape.label}" if role != "colocated"
                 else f"{n}x colocated {shape.label}"
                 for role, n, shape in self.roles]
        return " + ".join(f"{part} on {gpu.name}" for part, gpu in zip(parts, self.gpus))

    @property
    def mixed(self) -> bool:
        return len({g.name for g in self.gpus}) > 1

    @property
    def usd_per_hour(self) -> float:
        return sum(n * shape.gpus * gpu.usd_per_gpu_hour
                   for (_, n, shape), gpu in zip(self.roles, self.gpus))

    def hardware_name(self, role: str) -> str:
        return next(g.name for (r, _, _), g in zip(self.roles, self.gpus) if r == role)

    def experiment_data(self, plan: PlanConfig, name: str | None = None) -> dict[str, Any]:
        data = super().experiment_data(plan, name)
        data["hardware"] = self.gpus[0].data
        data["description"] = f"{self.label} ({plan.name})"
        for (role, _, _), gpu in zip(self.roles, self.gpus):
            if gpu is not self.gpus[0]:
                data["cluster"][role]["hardware"] = gpu.data
        return data


def placements(base: list[Candidate], options: list[GpuOption]) -> list[PlacedCandidate]:
    """Each candidate on every assignment of GPU types to its roles."""
    return [PlacedCandidate(c.mode, c.roles, gpus)
            for c in base for gpus in itertools.product(options, repeat=len(c.roles))]


class PairPrefilter(Prefilter):
    """The pre-filter of one placement: prefill capacities measured on the prefill type,
    decode and colocated ones on theirs (each type's Prefilter caches its own)."""

    def __init__(self, prefill: Prefilter, decode: Prefilter):
        super().__init__(decode.plan, decode.model, decode.hw, decode.workload, decode.base_dir)
        self._sides = {"prefill": prefill, "decode": decode, "colocated": decode}

    def capacity(self, role: str, shape) -> RoleCapacity | str:
        return self._sides[role].capacity(role, shape)


def plan_hardware_mix(cfg: PlanConfig, *, out_dir: str | Path | None = None,
                      jobs: int | None = None, progress: bool = False,
                      prefilter: bool | None = None, write: bool = True,
                      base_dir: str | None = None, executor: str = "local",
                      ray_address: str | None = None) -> PlanResult:
    """`pdsim.planning.plan` for a plan with `gpu_types` (same arguments)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    options = gpu_options(cfg, base_dir)
    try:
        model = load_model_spec(cfg.model, base_dir)
        workload = generate(cfg.workload_data(), base_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    base = enumerate_deployments(cfg, model, cfg.gpu_limit(options[0].spec.gpus_per_node),
                                 prefill_pp_sizes(cfg, workload.input_tokens))
    if not base:
        raise ConfigError("search: no deployment fits max_gpus with the TP sizes given")
    deployments = placements(base, options)
    timings["enumerate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    filters = _filters(cfg, model, options, workload, base_dir)
    use_filter = cfg.prefilter.enabled if prefilter is None else prefilter
    with phase(f"pre-filtering {len(deployments)} deployments on {len(options)} GPU types",
               progress):
        table = _prefilter_table(deployments, filters if use_filter else None)
    timings["prefilter_s"] = time.perf_counter() - t0
    timings["candidates"] = len(deployments)

    t0 = time.perf_counter()
    survivors = table[table["prefilter_keep"]].sort_values(["usd_per_hour", "candidate"])
    order = list(survivors["candidate"])[:cfg.search.max_simulations]
    results = _simulate(cfg, deployments, order, jobs, progress, base_dir, executor, ray_address)
    timings["simulate_s"] = time.perf_counter() - t0
    table, bottlenecks = _with_simulations(cfg, table, deployments, results, filters)
    timings["simulated"] = int(table["simulated"].sum())

    choices = [Choice(deployments[c], table[table["candidate"] == c].iloc[0], bottlenecks[c],
                      sglang_commands(deployments[c], cfg,
                                      min(g.spec.host_gpus for g in deployments[c].gpus)),
                      experiment_yaml(deployments[c], cfg))
               for c in rank_feasible(cfg, table)[:2]]
    result = PlanResult(cfg, options[0].usd_per_gpu_hour, table, pareto_frontier(table, cfg),
                        choices[0] if choices else None, choices[1] if len(choices) > 1 else None,
                        timings, hardware_lines=hardware_lines(cfg, options, table))
    if write:
        result.out_dir = write_plan(result, Path(out_dir) if out_dir else Path("results") / cfg.name)
    return result


def _filters(cfg: PlanConfig, model: ModelSpec, options: list[GpuOption], workload,
             base_dir: str | None) -> dict[tuple[str, str], Prefilter]:
    """One pre-filter per (prefill or colocated type, decode type)."""
    alone = {o.name: Prefilter(cfg.model_copy(update={"hardware": o.data}), model, o.spec,
                               workload, base_dir) for o in options}
    return {(p, d): PairPrefilter(alone[p], alone[d]) for p in alone for d in alone}


def _filter_of(filters: dict[tuple[str, str], Prefilter], dep: PlacedCandidate) -> Prefilter:
    return filters[(dep.gpus[0].name, dep.gpus[-1].name)]


def _prefilter_table(deployments: list[PlacedCandidate],
                     filters: dict[tuple[str, str], Prefilter] | None) -> pd.DataFrame:
    rows = []
    for i, dep in enumerate(deployments):
        v = _filter_of(filters, dep).check(dep) if filters is not None else None
        rows.append({"candidate": i, "label": dep.label, "mode": dep.mode,
                     "num_gpus": dep.num_gpus, "usd_per_hour": dep.usd_per_hour,
                     "prefill_hardware": dep.hardware_name("prefill")
                     if dep.mode == "disaggregated" else "",
                     "decode_hardware": dep.gpus[-1].name, "mixed": dep.mixed,
                     "prefilter_keep": True if v is None else v.keep,
                     "prefilter_reason": "" if v is None else v.reason,
                     "prefill_util_bound": math.nan if v is None else v.prefill_util,
                     "decode_util_bound": math.nan if v is None else v.decode_util})
    return pd.DataFrame(rows)


def _simulate(cfg: PlanConfig, deployments: list[PlacedCandidate], order: list[int],
              jobs: int | None, progress: bool, base_dir: str | None, executor: str,
              ray_address: str | None) -> dict:
    """Simulate `order` (cheapest first) in waves of WAVE; with the cost objective, a candidate
    costing more than (1 + cost_slack) x the cheapest one known to meet the SLO is skipped."""
    stop = partial(SloWatch, cfg) if cfg.search.early_stop and cfg.metrics.whole_run else None
    results: dict = {}
    cutoff = math.inf
    with progress_bar(f"simulating {cfg.name}", len(order), progress,
                      size=f"at most {len(order)}, cheapest first") as bar, \
            open_pool(executor, jobs, ray_address, tasks=len(order)) as pool:
        for start in range(0, len(order), WAVE):
            wave = [c for c in order[start:start + WAVE] if deployments[c].usd_per_hour <= cutoff]
            futures = {}
            for c in wave:
                data = deployments[c].experiment_data(cfg, name=f"{cfg.name}_{c}")
                exp = parse_experiment(data, f"plan {cfg.name}, candidate {deployments[c].label}")
                futures[c] = pool.submit(_run_candidate, c, exp, {}, base_dir, stop)
            for c, fut in futures.items():
                r = results[c] = fut.result()
                bar.advance()
                if isinstance(r, str):
                    continue
                r.summary.update(tpot_percentiles(r.requests))
                if cfg.objective == "cost" and meets(cfg, r.summary):
                    cutoff = min(cutoff, deployments[c].usd_per_hour * (1 + cfg.search.cost_slack))
        bar.total(len(results))
    return results


def _with_simulations(cfg: PlanConfig, table: pd.DataFrame,
                      deployments: list[PlacedCandidate], results: dict,
                      filters: dict[tuple[str, str], Prefilter]):
    """The table with each simulated candidate's summary priced per role, feasibility and
    bottleneck; the bottlenecks by candidate."""
    errors = {c: r for c, r in results.items() if isinstance(r, str)}
    done = {c: r for c, r in results.items() if not isinstance(r, str)}
    sims = pd.DataFrame([_sim_row(r, deployments[c].usd_per_hour / deployments[c].num_gpus)
                         for c, r in done.items()])
    if len(sims):
        table = table.merge(sims.drop(columns=["num_gpus", "usd_per_hour"]), on="candidate",
                            how="left")
    table["simulated"] = table["candidate"].isin(done)
    table["sim_error"] = [errors.get(c, "") for c in table["candidate"]]
    table["feasible"] = table["candidate"].map({c: meets(cfg, r.summary) for c, r in done.items()})
    bottlenecks = {c: _bottleneck(cfg, deployments[c], r, _filter_of(filters, deployments[c]),
                                  deployments[c].gpus[-1].spec) for c, r in done.items()}
    table["bottleneck"] = table["candidate"].map({c: b.name for c, b in bottlenecks.items()})
    table["bottleneck_detail"] = table["candidate"].map(
        {c: b.words for c, b in bottlenecks.items()})
    return table, bottlenecks


def hardware_lines(cfg: PlanConfig, options: list[GpuOption], table: pd.DataFrame) -> list[str]:
    """The report's words on the GPU types: each one's price and what a dollar buys of it,
    and whether the best mixed deployment beats the best on one type, by the plan's objective."""
    lines = ["GPU types: " + "; ".join(
        f"{o.name} ${o.usd_per_gpu_hour:g}/h ({_per_usd(o.spec.bf16_tflops, o)} BF16 TFLOPS "
        f"and {_per_usd(o.spec.hbm_gb_per_s, o)} GB/s of memory bandwidth per $/h)"
        for o in options) + "."]
    ranked = rank_feasible(cfg, table)
    rows = table.set_index("candidate")
    mixed = [c for c in ranked if rows.at[c, "mixed"]]
    same = [c for c in ranked if not rows.at[c, "mixed"]]
    if not mixed and not same:
        return lines
    if not mixed:
        return lines + [f"No mixed deployment meets the SLO; the best on one GPU type: "
                        f"{_figures(rows.loc[same[0]])}."]
    if not same:
        return lines + [f"Only mixed deployments meet the SLO; the best: "
                        f"{_figures(rows.loc[mixed[0]])}."]
    m, s = rows.loc[mixed[0]], rows.loc[same[0]]
    wins = ranked.index(mixed[0]) < ranked.index(same[0])
    key = "usd_per_hour" if cfg.objective == "cost" else "goodput_req_s_per_gpu"
    return lines + [
        f"The mix {'wins' if wins else 'loses'}: $/Mtok {m['usd_per_mtok']:.3f} mixed vs "
        f"{s['usd_per_mtok']:.3f} best homogeneous, ${m['usd_per_hour']:,.2f}/h vs "
        f"${s['usd_per_hour']:,.2f}/h, goodput {m['goodput_req_per_usd']:,.0f} vs "
        f"{s['goodput_req_per_usd']:,.0f} SLO-meeting requests per $ "
        f"(objective {cfg.objective}, by {key}).",
        f"Best mixed: {_figures(m)}.", f"Best homogeneous: {_figures(s)}."]


def _per_usd(value: float, o: GpuOption) -> str:
    return f"{value / o.usd_per_gpu_hour:,.0f}"


def _figures(row: pd.Series) -> str:
    return (f"{row['label']}, ${row['usd_per_hour']:,.2f}/h, ${row['usd_per_mtok']:.3f}/Mtok, "
            f"bottleneck {row['bottleneck']}")
