"""Run an experiment: every sweep point simulated, then tables, plots and a report written.
A point whose deployment cannot run is skipped (`screen_points`), its summary row saying why.

Outputs in `results/<experiment>/`: summary.csv (one row per point), requests.parquet (one row
per request of every point simulated), timeline.csv (with autoscaling: one row per point and
policy interval), PNG plots, report.md and the config that produced them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from pdsim.config import ConfigError, ExperimentConfig, check_files, expand_sweep, load_experiment
from pdsim.deployment import servable_presets
from pdsim.pools import Pool, open_pool
from pdsim.faults import fault_summary, first_kill_s
from pdsim.metrics import price_columns, records_frame, summarize
from pdsim.sim.autoscaler import AutoscaleSetup, timeline_frame
from pdsim.sim.build import build_cluster, role_hardware, usd_per_gpu_hour
from pdsim.sim.cluster import simulate
from pdsim.sim.cost import SHARE_GROUPS, part_group
from pdsim.sim.silicon import cost_columns
from pdsim.core.request import Request
from pdsim.specs.models import load_model_spec, model_preset_names
from pdsim.workload import ClosedLoop, Workload, WorkloadError, closed_loop_clients, generate


@dataclass
class PointResult:
    index: int
    summary: dict[str, Any]
    requests: pd.DataFrame
    timeline: pd.DataFrame | None = None  # with autoscaling: one row per policy interval


def point_columns(cfg: ExperimentConfig, request_rate: float,
                  closed_loop: ClosedLoop | None = None) -> dict[str, Any]:
    """The configuration columns of a summary row (`concurrency`: closed-loop clients, 0 for
    open-loop arrivals)."""
    c = cfg.cluster
    if c.mode == "colocated":
        p_inst, d_inst, p_tp, d_tp = 0, c.colocated.instances, 0, c.colocated.tp
    else:
        p_inst, d_inst, p_tp, d_tp = c.prefill.instances, c.decode.instances, c.prefill.tp, c.decode.tp
    return {
        "mode": c.mode,
        "prefill_instances": p_inst,
        "decode_instances": d_inst,
        "prefill_tp": p_tp,
        "decode_tp": d_tp,
        "prefill_dp_attention": c.prefill.dp_attention if c.mode != "colocated" else 0,
        "decode_dp_attention": (c.colocated if c.mode == "colocated" else c.decode).dp_attention,
        "request_rate": request_rate,
        "concurrency": closed_loop.concurrency if closed_loop else 0,
        "router_policy": cfg.router.policy,
        "network_enabled": cfg.network.enabled,
    }


def run_point(index: int, cfg: ExperimentConfig, swept: dict[str, Any], base_dir: str | None,
              stop: Callable[[Workload], Callable[[Request], str]] | None = None) -> PointResult:
    """Simulate one configuration; also the unit of work of a parallel sweep. `stop` makes,
    from the workload, a check that may end the run early (`pdsim.sim.cluster.simulate`);
    the summary's `stopped` says why it did ("" when the run went to the end)."""
    workload = generate(cfg.workload, base_dir=base_dir)
    cluster = build_cluster(cfg, base_dir)
    result = simulate(
        cluster, workload.arrival_s, workload.input_tokens, workload.output_tokens,
        seed=cfg.seed, max_duration_s=cfg.max_duration_s, closed_loop=workload.closed_loop,
        prefix=workload.prefix, stop=None if stop is None else stop(workload),
        autoscale=None if cfg.autoscaling is None else AutoscaleSetup(cfg.autoscaling, cfg.slo.itl_s),
    )
    if all(r.ok for r in result.records):
        result.check_pools_full()  # an idle cluster must have every page and slot back
    rate = offered_rate(cfg)
    if rate is None:
        rate = round(workload.mean_rate_rps, 3)  # NaN for a closed loop
    row = {"point": index, **point_columns(cfg, rate, workload.closed_loop),
           **{f"sweep.{k}": v for k, v in swept.items()}}
    # With autoscaling the GPUs change over the run: per-GPU figures and prices use the mean
    # held (GPU-hours / the run), and the scaling columns say what was held when.
    scaling = None if result.autoscaler is None else result.autoscaler.summary(result.sim_time_s)
    num_gpus = cluster.num_gpus if scaling is None else scaling["mean_gpus"]
    row.update(summarize(result.records, num_gpus=num_gpus, slo=cfg.slo, window=cfg.metrics))
    # usd_per_hour, usd_per_mtok, goodput_req_per_usd at each role's hardware price (NaN: none)
    price = usd_per_gpu_hour(cfg, base_dir)
    row.update(price_columns(row, price))
    if scaling is not None:
        row.update(scaling)
        row["usd"] = scaling["gpu_hours"] * (math.nan if price is None else price)
    row["sim_time_s"] = result.sim_time_s
    row["prefill_busy_frac"] = result.prefill_busy_frac
    row["decode_busy_frac"] = result.decode_busy_frac
    row["kv_transfer_gb"] = result.kv_transfer_gb
    row["decode_mean_batch"] = result.decode_mean_batch
    row["retractions"] = result.retractions
    if stop is not None:
        row["stopped"] = result.stopped
    row.update(cost_columns(cfg.cost_model.name, [inst.cost for inst in result.instances]))
    row.update(share_columns(result.instances))  # after cost_columns: pricing adds lookups
    if cfg.faults.any:  # failed requests, their latency to error, recovery after a kill
        row.update(fault_summary(result.records, first_kill_s(cfg.faults)))
    frame = records_frame(result.records)
    frame["in_window"] = cfg.metrics.mask(frame["arrival_s"].to_numpy(float),
                                          frame["finish_s"].to_numpy(float))
    frame.insert(0, "point", index)
    timeline = None
    if result.autoscaler is not None:
        timeline = timeline_frame(result.autoscaler, result.records, result.sim_time_s, cfg.slo)
        timeline.insert(0, "point", index)
    return PointResult(index, row, frame, timeline)


class PointError(RuntimeError):
    """A sweep point failed while simulating. The message names the point and the cause; the
    worker's traceback stays chained (`__cause__`) for a Python caller, the CLI prints the
    message alone."""


def _run_named_point(index: int, cfg: ExperimentConfig, swept: dict[str, Any],
                     base_dir: str | None, progress: Callable | None = None) -> PointResult:
    """`run_point`, a failure raised as a PointError naming the point. `progress`: a `stop`
    factory that only reports the point's progress (pdsim.progress.share_stop), never stops it."""
    try:
        result = run_point(index, cfg, swept, base_dir, progress)
        result.summary.pop("stopped", None)  # "" always: the run was never to stop early
        return result
    except Exception as exc:
        raise PointError(f"{point_name(index, swept)}: {type(exc).__name__}: {exc}") from exc


def share_columns(instances: list) -> dict[str, float]:
    """`{role}_share_{group}` for each role the run has and each SHARE_GROUPS group: the
    share of that role's simulated forward time the group took, summing to 1 per role. A role
    whose cost model has no step breakdown (speculative decoding, profiled) has none."""
    seconds: dict[str, dict[str, float]] = {}
    for inst in instances:
        role = getattr(getattr(inst.cost, "params", None), "role", None)
        parts = inst.executor.breakdown_s()
        if role is None or parts is None:
            continue
        groups = seconds.setdefault(role, dict.fromkeys(SHARE_GROUPS, 0.0))
        for part, part_s in parts.items():
            groups[part_group(part, part_s)] += part_s
    row = {}
    for role, groups in seconds.items():
        total = sum(groups.values())
        for group, group_s in groups.items():
            row[f"{role}_share_{group}"] = group_s / total if total > 0 else float("nan")
    return row


def run_experiment(path: str | Path, out_dir: str | Path | None = None, jobs: int | None = None,
                   progress: bool = True, executor: str = "local",
                   ray_address: str | None = None) -> tuple[pd.DataFrame, Path]:
    """Run every sweep point of the experiment at `path`; return the summary and the output dir.
    `executor`: `local` (a process pool of `jobs` processes) or `ray` (one Ray task per point,
    on the cluster at `ray_address`, default a local instance); pdsim.pools."""
    # Here, not at import: pool workers import this module to run points and never plot
    # (matplotlib takes ~0.25 s to import).
    from pdsim.plots import plot_experiment, plot_latency_cdfs, plot_timeline, sweep_labels
    from pdsim.report import write_report

    path = Path(path)
    cfg, raw = load_experiment(path)
    points = expand_sweep(cfg, raw, str(path))
    base_dir = str(path.parent.resolve())
    notes, skipped = screen_points(points, base_dir, str(path))
    out = Path(out_dir) if out_dir else Path("results") / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    args = [(i, pcfg, swept, base_dir) for i, (swept, pcfg) in enumerate(points)
            if i not in skipped]
    with open_pool(executor, jobs, ray_address, tasks=len(args)) as pool:
        results = _execute(pool, args, progress, cfg.name)
    results.sort(key=lambda r: r.index)
    rows = [r.summary for r in results] + [
        skipped_row(i, points[i][1], points[i][0], why, base_dir) for i, why in skipped.items()]
    summary = pd.DataFrame(rows).sort_values("point", kind="stable", ignore_index=True)
    summary.insert(1, "label", sweep_labels(summary))
    summary.attrs["notes"] = notes
    requests = pd.concat([r.requests for r in results], ignore_index=True)
    requests.insert(1, "label", requests["point"].map(dict(zip(summary["point"], summary["label"]))))
    summary.to_csv(out / "summary.csv", index=False)
    requests.to_parquet(out / "requests.parquet", index=False)
    (out / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    plots = plot_experiment(summary, out, slo=cfg.slo) + plot_latency_cdfs(requests, out, by="label")
    timelines = [r.timeline for r in results if r.timeline is not None]
    if timelines:
        timeline = pd.concat(timelines, ignore_index=True)
        timeline.insert(1, "label", timeline["point"].map(dict(zip(summary["point"], summary["label"]))))
        timeline.to_csv(out / "timeline.csv", index=False)
        plots.append(plot_timeline(timeline, out / "timeline.png", slo=cfg.slo))
    write_report(summary, out, title=cfg.name, config_text=path.read_text(), plots=plots, slo=cfg.slo,
                 window=cfg.metrics)
    summary.attrs["measurement"] = cfg.metrics.describe()
    return summary, out


def check_points(points: list, base_dir: str, source: str) -> list[str]:
    """Check every sweep point before any is simulated; return the notes (`screen_points`)."""
    return screen_points(points, base_dir, source)[0]


def screen_points(points: list, base_dir: str, source: str) -> tuple[list[str], dict[int, str]]:
    """Sort the sweep's points into those to simulate and those that cannot run; return the
    notes, each once, on what SGLang would not run as configured or runs by a default the
    config does not show (`ClusterSpec.notes`, `first_wave_note`) and on each point to be skipped, and why each of those cannot run, by
    point index.

    A mistake in the config raises a ConfigError here, whichever point has it: a model, draft
    or hardware that does not load (a typo), a missing file, a trace window without the
    requests asked for (typos, unknown keys and invalid values already failed validation).
    A point whose deployment cannot run as configured is skipped instead, so that the rest
    of the sweep still runs: whatever the cluster build refuses (the weights or a KV page do
    not fit, the heads do not split over tp, SGLang's derived memory fraction is not
    positive, a combination pdsim does not model) and `mtp_error`. When no point can run
    there is nothing to simulate: that is a ConfigError too, one point's reason as it is."""
    notes: dict[str, None] = {}
    skipped: dict[int, str] = {}
    checked: set[str] = set()  # the workloads already checked: sweep points share them
    for index, (swept, point_cfg) in enumerate(points):
        check_names(point_cfg, base_dir)
        check_files(point_cfg.workload, base_dir, source)
        if (key := point_cfg.workload.model_dump_json()) not in checked:
            try:
                point_cfg.workload.check(base_dir)
            except WorkloadError as exc:  # named by the point where the sweep varies it
                where = [point_name(index, swept)] * any(k.startswith("workload.") for k in swept)
                raise ConfigError(": ".join([source, *where, str(exc)])) from None
            checked.add(key)
        try:
            cluster = build_cluster(point_cfg, base_dir)
        except ConfigError as exc:
            skipped[index] = str(exc)
            continue
        if (why := mtp_error(point_cfg)) is not None:
            skipped[index] = why
            continue
        notes.update(dict.fromkeys(cluster.notes))
        if (note := first_wave_note(point_cfg)) is not None:
            notes[note] = None
    notes.update({f"{point_name(i, points[i][0])} cannot run, skipped: {why}": None
                  for i, why in skipped.items()})
    if len(skipped) == len(points):
        reasons = list(dict.fromkeys(skipped.values()))
        if len(reasons) == 1:  # one point, or every point alike: its error as it is
            raise ConfigError(reasons[0])
        raise ConfigError("\n".join([f"{source}: no sweep point can run"] + [
            f"  {point_name(i, points[i][0])}: {why}" for i, why in skipped.items()]))
    return list(notes), skipped


def check_names(cfg: ExperimentConfig, base_dir: str | None) -> None:
    """A ConfigError for a model, draft model or hardware of the config that does not load:
    a typo or a missing file, wrong at every point, never a deployment that cannot run."""
    # the draft as pdsim.sim.speculative loads it: no base_dir
    for field, model, where in (("model", cfg.model, base_dir),
                                ("speculative.draft_model", cfg.speculative.draft_model, None)):
        if model is None:
            continue
        try:
            load_model_spec(model, where)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"{field}: {exc}") from None
    role_hardware(cfg, base_dir)


# Presets whose checkpoints ship MTP layers (config.json's `num_nextn_predict_layers`, Qwen3-Next's
# `mtp_num_hidden_layers`): the draft of SGLang's NEXTN. Kimi-K2's has none (0).
MTP_PRESETS = ("deepseek-r1", "deepseek-v3", "deepseek-v3.1", "qwen3-next-80b-a3b")


def mtp_error(cfg: ExperimentConfig) -> str | None:
    """Why `speculative.method: mtp` cannot run on the config's model, or None. SGLang's MTP
    drafts with the checkpoint's own MTP layers; a preset whose checkpoint has none would be
    priced with a made-up layer of its own kind, as EAGLE's default draft for a dense model.
    A ModelSpec does not record MTP layers, so a model given as a file or mapping is taken
    as configured, and the real backend's presets have an MTP head of their own
    (runtime/model/draft.py)."""
    model = cfg.model
    if (cfg.speculative.method != "mtp" or not isinstance(model, str) or model in MTP_PRESETS
            or model not in model_preset_names() or model in servable_presets()):
        return None
    return (f"speculative.method mtp: {model}'s checkpoint has no MTP layers for SGLang's "
            f"MTP (NEXTN) draft; presets with them: {', '.join(MTP_PRESETS)}. Use method eagle "
            "with its draft_model (a preset or config.json), or without one for draft_layers "
            "layers of the target's attention with a dense MLP")


def point_name(index: int, swept: dict[str, Any]) -> str:
    values = ", ".join(f"{k}={v}" for k, v in swept.items()) or "no sweep"
    return f"sweep point {index} ({values})"


def skipped_row(index: int, cfg: ExperimentConfig, swept: dict[str, Any], why: str,
                base_dir: str | None) -> dict[str, Any]:
    """The summary row of a point that cannot run: its configuration columns and GPUs, its
    request rate as `run_point` gives it, `skipped` saying why; every metric NaN."""
    rate, closed_loop = offered_rate(cfg), None
    if rate is None:
        workload = generate(cfg.workload, base_dir=base_dir)
        rate, closed_loop = round(workload.mean_rate_rps, 3), workload.closed_loop
    return {"point": index, **point_columns(cfg, rate, closed_loop),
            **{f"sweep.{k}": v for k, v in swept.items()},
            "num_gpus": cfg.cluster.num_gpus, "skipped": why}


def offered_rate(cfg: ExperimentConfig) -> float | None:
    """The arrival process's `rate_rps`; None where the rate comes from the workload drawn (a
    trace, a changing rate: its mean; a closed loop: NaN)."""
    return getattr(getattr(cfg.workload, "arrival", None), "rate_rps", None)


def first_wave_note(cfg: ExperimentConfig) -> str | None:
    """A closed loop sends its first wave, one request a client, at 0 s: a window that starts
    by `warmup_requests` fewer than the clients starts inside it and counts it."""
    clients = closed_loop_clients(cfg.workload)
    m = cfg.metrics
    if clients is None or m.warmup_s or not 0 < m.warmup_requests < clients:
        return None
    return (f"metrics.warmup_requests={m.warmup_requests} is below the closed loop's {clients} "
            f"clients, so the window starts inside their first wave (all sent at 0 s) and "
            f"counts it; give at least {clients} to leave it out")


def _execute(pool: Pool, args: list, show: bool, name: str) -> list[PointResult]:
    from pdsim.progress import point_shares, progress_bar, share_stop

    with progress_bar(f"simulating {name}", len(args), show) as bar, \
            point_shares(bar, pool) as shares:
        if shares is not None:  # the bar moves within each point as its requests finish
            args = [(*a, partial(share_stop, shares.reporter(a[0]), None)) for a in args]
        running = {pool.submit(_run_named_point, *a): a[0] for a in args}
        results = []
        while running:
            finished, _ = wait(running, timeout=None if shares is None else 0.5,
                               return_when=FIRST_COMPLETED)
            for fut in finished:
                del running[fut]
                results.append(fut.result())
                bar.advance()
            if shares is not None:
                shares.refresh(running.values())
        return results
