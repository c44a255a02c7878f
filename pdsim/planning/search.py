"""The search of a plan on one GPU type: enumerate deployments, pre-filter them analytically, simulate the survivors
cheapest first, and pick the recommendation, the runner-up and the Pareto frontier."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import numpy as np
import pandas as pd

from pdsim.config import ConfigError, parse_experiment
from pdsim.deployment import RoleConfig
from pdsim.pools import open_pool
from pdsim.metrics import price_columns
from pdsim.planning.bottleneck import Bottleneck, find_bottleneck
from pdsim.planning.candidates import Candidate, RoleShape, enumerate_deployments, prefill_pp_sizes
from pdsim.planning.config import PERCENTILES, PlanConfig, price_per_gpu_hour
from pdsim.planning.early_stop import SloWatch
from pdsim.planning.launch import experiment_yaml, sglang_commands
from pdsim.planning.prefilter import Prefilter, RoleCapacity, Verdict
from pdsim.planning.report import write_plan
from pdsim.planning.result import Choice, PlanResult, latency_columns
from pdsim.progress import phase
from pdsim.runner import PointResult, run_point
from pdsim.specs.hardware import HardwareSpec, load_hardware_spec
from pdsim.specs.models import load_model_spec
from pdsim.workload import generate


def plan_one_hardware(cfg: PlanConfig, *, out_dir: str | Path | None = None,
                      jobs: int | None = None, progress: bool = False,
                      prefilter: bool | None = None, write: bool = True,
                      base_dir: str | None = None, executor: str = "local",
                      ray_address: str | None = None) -> PlanResult:
    """`pdsim.planning.plan` for a plan on its one `hardware` (same arguments)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        model = load_model_spec(cfg.model, base_dir)
        hw = load_hardware_spec(cfg.hardware, base_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    price = price_per_gpu_hour(cfg, hw.usd_per_gpu_hour, hw.name)
    try:
        workload = generate(cfg.workload_data(), base_dir)
    except ValueError as exc:
        raise ConfigError(f"workload: {exc}") from None
    deployments = enumerate_deployments(cfg, model, cfg.gpu_limit(hw.gpus_per_node),
                                        prefill_pp_sizes(cfg, workload.input_tokens))
    if not deployments:
        raise ConfigError("search: no deployment fits max_gpus with the TP sizes given")
    timings["enumerate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    filt = Prefilter(cfg, model, hw, workload, base_dir)
    use_filter = cfg.prefilter.enabled if prefilter is None else prefilter
    with phase(f"pre-filtering {len(deployments)} deployments", progress):
        table = _prefilter_table(deployments, filt if use_filter else None, price)
    timings["prefilter_s"] = time.perf_counter() - t0
    timings["candidates"] = len(deployments)

    t0 = time.perf_counter()
    survivors = table[table["prefilter_keep"]].sort_values(["usd_per_hour", "candidate"])
    results = _simulate(cfg, deployments, list(survivors["candidate"]), price, jobs, progress,
                        base_dir, executor, ray_address)
    timings["simulate_s"] = time.perf_counter() - t0
    table, results, bottlenecks = _with_simulations(cfg, table, deployments, results, price,
                                                    filt, hw)
    timings["simulated"] = len(results)

    choices = [Choice(deployments[c], table[table["candidate"] == c].iloc[0], bottlenecks[c],
                      sglang_commands(deployments[c], cfg, hw.host_gpus),
                      experiment_yaml(deployments[c], cfg))
               for c in rank_feasible(cfg, table)[:2]]
    result = PlanResult(cfg, price, table, pareto_frontier(table, cfg),
                        choices[0] if choices else None, choices[1] if len(choices) > 1 else None,
                        timings)
    if write:
        result.out_dir = write_plan(result, Path(out_dir) if out_dir else Path("results") / cfg.name)
    return result


def _prefilter_table(deployments: list[Candidate], filt: Prefilter | None,
                     price: float) -> pd.DataFrame:
    """One row per deployment with its cost and the pre-filter's verdict (None: all kept)."""
    rows = []
    for i, dep in enumerate(deployments):
        v = filt.check(dep) if filt is not None else Verdict(True)
        rows.append({"candidate": i, "label": dep.label, "mode": dep.mode, "num_gpus": dep.num_gpus,
                     "usd_per_hour": dep.num_gpus * price, "prefilter_keep": v.keep,
                     "prefilter_reason": v.reason, "prefill_util_bound": v.prefill_util,
                     "decode_util_bound": v.decode_util})
    return pd.DataFrame(rows)


def _with_simulations(cfg: PlanConfig, table: pd.DataFrame, deployments: list[Candidate],
                      results: dict[int, PointResult | str], price: float, filt: Prefilter,
                      hw: HardwareSpec):
    """The table with each simulated candidate's summary, price columns, feasibility and
    bottleneck; the successful results; the bottlenecks by candidate."""
    errors = {c: r for c, r in results.items() if isinstance(r, str)}
    results = {c: r for c, r in results.items() if isinstance(r, PointResult)}
    sims = pd.DataFrame([_sim_row(r, price) for r in results.values()])
    if len(sims):
        table = table.merge(sims.drop(columns=["num_gpus", "usd_per_hour"]), on="candidate",
                            how="left")
    table["simulated"] = table["candidate"].isin(results)
    table["sim_error"] = [errors.get(c, "") for c in table["candidate"]]
    table["feasible"] = table["candidate"].map(
        {c: meets(cfg, r.summary) for c, r in results.items()})
    bottlenecks = {c: _bottleneck(cfg, deployments[c], r, filt, hw) for c, r in results.items()}
    table["bottleneck"] = table["candidate"].map({c: b.name for c, b in bottlenecks.items()})
    table["bottleneck_detail"] = table["candidate"].map(
        {c: b.words for c, b in bottlenecks.items()})
    return table, results, bottlenecks


def meets(cfg: PlanConfig, summary: dict) -> bool:
    """The plan's SLO: every percentile target met, no request failed."""
    if summary["failed"] or summary["completed"] == 0:
        return False
    return all(summary[col] <= bound for col, bound in cfg.slo.targets().items())


def rank_feasible(cfg: PlanConfig, table: pd.DataFrame) -> list[int]:
    """The feasible candidates, best first by the plan's objective."""
    ok = table[table["feasible"] == True]  # noqa: E712
    if cfg.objective == "cost":
        ok = ok.sort_values(["usd_per_hour", "usd_per_mtok", "candidate"])
    else:
        ok = ok.sort_values(["goodput_req_s_per_gpu", "usd_per_hour", "candidate"],
                            ascending=[False, True, True])
    return list(ok["candidate"])


def pareto_frontier(table: pd.DataFrame, cfg: PlanConfig) -> pd.DataFrame:
    """Simulated rows no other row beats on tok/s/GPU and every latency the SLO targets (the
    TTFT and ITL p90 when it targets none) at once. A run stopped early (its SLO out of reach)
    has partial figures and takes no part."""
    sims = table[table["simulated"] & table["output_tok_s_per_gpu"].notna()]
    if "stopped" in sims:
        sims = sims[sims["stopped"].fillna("") == ""]
    if sims.empty:
        return sims
    vals = np.column_stack([-sims["output_tok_s_per_gpu"].to_numpy(float)]
                           + [sims[col].to_numpy(float) for col in latency_columns(cfg)])
    vals = np.nan_to_num(vals, nan=np.inf)
    keep = [not np.any(np.all(vals <= v, axis=1) & np.any(vals < v, axis=1)) for v in vals]
    return sims[keep].sort_values("output_tok_s_per_gpu", ascending=False)


def _sim_row(r: PointResult, price: float) -> dict:
    row = {"candidate": r.index, **{k: v for k, v in r.summary.items()
                                    if k not in ("point", "mode", "label")}}
    row.update(price_columns(r.summary, price))
    return row


def tpot_percentiles(requests: pd.DataFrame) -> dict[str, float]:
    """Percentiles over completed requests (in the measurement window) of each one's mean ITL
    (its TPOT), which the summary gives only as a mean."""
    done = requests[(requests["status"] == "ok") & requests["in_window"]]
    tpot = done["itl_mean_s"].to_numpy(float)
    tpot = tpot[np.isfinite(tpot)]
    return {f"tpot_p{q}_s": float(np.percentile(tpot, q)) if len(tpot) else math.nan
            for q in PERCENTILES}


def _bottleneck(cfg: PlanConfig, dep: Candidate, r: PointResult, filt: Prefilter,
                hw: HardwareSpec) -> Bottleneck:
    role, n, shape = dep.roles[-1]
    cap = filt.capacity(role, shape)
    mean_ctx = float(np.mean(filt.workload.input_tokens + filt.workload.output_tokens / 2))
    ranks = n * shape.dp_attention
    kv_batch, request_cap, why = 0.0, 0.0, ""
    if isinstance(cap, RoleCapacity):
        kv_batch = ranks * cap.kv_tokens_per_rank / mean_ctx
        request_cap = ranks * cap.max_running_per_rank
        why = request_cap_words(shape, cap.max_running_per_rank, ranks)
    nic = n * shape.tp * hw.rdma_gb_per_s * 1e9
    ttft = cfg.slo.percentile_targets("ttft")
    decode = [(m, q, v) for m in ("itl", "tpot") for q, v in cfg.slo.percentile_targets(m)]
    return find_bottleneck(r.summary, r.requests, ttft_target_s=ttft[-1][1] if ttft else None,
                           latency_targets=decode, decode_kv_batch=kv_batch,
                           decode_request_cap=request_cap, request_cap_why=why,
                           decode_nic_bytes_s=nic)


def request_cap_words(shape: RoleShape, per_rank: int, ranks: int) -> str:
    """What caps a decode (or colocated) rank's running requests at `per_rank`: DeepEP's
    low-latency dispatch (its tokens per rank and call, one request a token; a call per
    micro-batch under two-batch overlap: pdsim.sim.build), else --max-running-requests."""
    tokens = RoleConfig.model_fields["num_max_dispatch_tokens_per_rank"].default
    calls = 2 if shape.two_batch_overlap else 1
    if shape.moe_a2a == "deepep" and per_rank == tokens * calls:
        why = (f"DeepEP low-latency dispatch's {tokens} tokens per rank"
               + (" and micro-batch" if calls > 1 else "")
               + ", SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK")
    else:
        why = "--max-running-requests"
    return f"{per_rank:,} per rank x {ranks} ranks, {why}" if ranks > 1 else why


def _run_candidate(index: int, cfg, swept: dict, base_dir: str | None,
                   stop: Callable | None = None) -> PointResult | str:
    """One simulation; a deployment the simulator cannot build (its weights do not fit, say)
    comes back as the reason instead of failing the plan."""
    try:
        return run_point(index, cfg, swept, base_dir, stop)
    except ConfigError as exc:
        return str(exc)


def _simulate(cfg: PlanConfig, deployments: list[Candidate], order: list[int], price: float,
              jobs: int | None, progress: bool, base_dir: str | None, executor: str = "local",
              ray_address: str | None = None) -> dict[int, PointResult | str]:
    """Simulate candidates cheapest first, at most `search.max_simulations`; with the cost
    objective, once one meets the SLO stop submitting those costing more than (1 + cost_slack)
    times it. A candidate that cannot be built maps to the reason.

    Workers return out of order, so more may be submitted than that rule needs (a cheaper
    candidate's result can arrive after dearer ones went out); the rule is then replayed in
    cost order over the results (`_kept_in_cost_order`), so the plan is the same whatever the
    executor, the number of workers or the timing."""
    from pdsim.progress import point_shares, progress_bar, share_stop

    survivors, order = len(order), order[:cfg.search.max_simulations]
    results: dict[int, PointResult] = {}
    cutoff = math.inf
    # A run whose SLO is already out of reach stops there (pdsim.planning.early_stop).
    watch = partial(SloWatch, cfg) if cfg.search.early_stop and cfg.metrics.whole_run else None

    def cost(c: int) -> float:
        return deployments[c].num_gpus * price

    def args(c: int):
        data = deployments[c].experiment_data(cfg, name=f"{cfg.name}_{c}")
        where = f"plan {cfg.name}, candidate {deployments[c].label}"
        stop = watch if shares is None else partial(share_stop, shares.reporter(c), watch)
        return c, parse_experiment(data, where), {}, base_dir, stop

    def done(c: int, r: PointResult | str) -> None:
        nonlocal cutoff
        results[c] = r
        bar.advance()
        if isinstance(r, str):
            return
        r.summary.update(tpot_percentiles(r.requests))
        if cfg.objective == "cost" and meets(cfg, r.summary):
            cutoff = min(cutoff, cost(c) * (1 + cfg.search.cost_slack))
            # the bar counts only what will still run: pending is cheapest first
            bar.total(len(results) + len(running) + sum(cost(p) <= cutoff for p in pending))

    with progress_bar(f"simulating {cfg.name}", len(order), progress,
                      size=f"at most {len(order)}, cheapest first") as bar, \
            open_pool(executor, jobs, ray_address, tasks=len(order)) as pool, \
            point_shares(bar, pool) as shares:
        pending = list(order)
        running: dict = {}  # with one local worker each task runs as it is submitted
        while pending or running:
            while pending and len(running) < pool.workers and cost(pending[0]) <= cutoff:
                c = pending.pop(0)
                running[pool.submit(_run_candidate, *args(c))] = c
            if not running:
                break
            finished, _ = wait(running, timeout=None if shares is None else REFRESH_S,
                               return_when=FIRST_COMPLETED)
            for fut in finished:
                done(running.pop(fut), fut.result())
            if shares is not None:
                shares.refresh(running.values())
        bar.note(_simulated_note(len(results), survivors, len(order), cutoff))
    return _kept_in_cost_order(cfg, deployments, order, results, price)


# How often the bar reads the share done of the candidates in flight (seconds).
REFRESH_S = 0.5


def _simulated_note(simulated: int, survivors: int, cap: int, cutoff: float) -> str:
    """How many candidates ran, of those past the pre-filter, and why not the others."""
    why = []
    if cap - simulated:
        why.append(f"{cap - simulated} cost over ${cutoff:,.2f}/h, (1 + search.cost_slack) x "
                   "the cheapest that meets the SLO")
    if survivors - cap:
        why.append(f"{survivors - cap} past search.max_simulations ({cap})")
    return (f"simulated {simulated} of the {survivors} candidates past the pre-filter"
            + (f"; not simulated: {'; '.join(why)}" if why else ""))


def _kept_in_cost_order(cfg: PlanConfig, deployments: list[Candidate], order: list[int],
                        results: dict[int, PointResult | str], price: float
                        ) -> dict[int, PointResult | str]:
    """The results the cheapest-first rule of `_simulate` keeps when applied in `order` (the
    cutoff from each candidate that meets the SLO bounds only the ones after it). Everything
    the rule keeps was submitted: a cutoff known at submission time came from a subset of
    the results the rule has seen by then, so it was never lower."""
    kept: dict[int, PointResult | str] = {}
    cutoff = math.inf
    for c in order:
        cost = deployments[c].num_gpus * price
        if c not in results or cost > cutoff:
            continue
        r = kept[c] = results[c]
        if not isinstance(r, str) and cfg.objective == "cost" and meets(cfg, r.summary):
            cutoff = min(cutoff, cost * (1 + cfg.search.cost_slack))
    return kept
