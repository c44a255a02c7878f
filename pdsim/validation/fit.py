"""`pdsim calibrate CONFIG --measured FILE`: fit what a measured run can tell about the deployment
into a calibration overlay (the shape `pdsim calibrate` writes and `--calibration` reads).

Two component-like figures, never an end-to-end figure under load:

- **decode step** (`cost_model.params.step_overhead_s`): the gaps between a request's tokens
  while nothing else changed (no request waiting for its first token, none joining or leaving
  decode during the gap) are steady-state decode steps at a known batch: the requests in decode
  then. Their mean per batch size, against the cost model's step at that batch (contexts of the
  file's mean prompt plus half its mean output) with no step overhead, gives the overhead: the
  mean difference over every such gap. Only where one instance serves every decode (the file
  does not say which of several served a request) and attention is not data-parallel.
- **per-request fixed cost** (`router.frontend_latency_s`): requests alone in the system from
  their send to their first token (concurrency 1) are simulated alone, with the fitted step;
  the median of measured minus simulated TTFT moves the front end's latency.

The report says how far each parameter moved. Everything else stays as the YAML has it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.records import RequestRecord

MAX_LONE_REQUESTS = 200  # simulated one at a time: enough for a median


@dataclass
class Fit:
    """What was fitted, and the evidence (what the report and the file's `measured` hold)."""

    overlay: dict
    lines: list[str] = field(default_factory=list)  # the report, one line per parameter


def _role(cluster):
    return cluster.decode if cluster.mode == "disaggregated" else cluster.colocated


def steady_gaps(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(gap_s, batch) of every steady decode gap (module docstring) of the completed requests."""
    done = [r for r in records if r.ok and len(r.token_times_s) > 1]
    if not done:
        return np.array([]), np.array([], dtype=int)
    starts = np.sort([r.token_times_s[0] for r in done])
    ends = np.sort([r.token_times_s[-1] for r in done])
    waiting = [r for r in records if r.ok]  # send -> first token: a prefill is pending
    w_from = np.sort([r.arrival_s for r in waiting])
    w_to = np.sort([r.first_token_s for r in waiting])
    a = np.concatenate([r.token_times_s[:-1] for r in done])
    b = np.concatenate([r.token_times_s[1:] for r in done])
    inside = lambda sorted_s: (np.searchsorted(sorted_s, b, "left")  # noqa: E731
                               - np.searchsorted(sorted_s, a, "right"))
    pending = np.searchsorted(w_from, b, "left") - np.searchsorted(w_to, a, "right")
    batch = np.searchsorted(starts, a, "right") - np.searchsorted(ends, a, "right")
    keep = (b > a) & (inside(starts) == 0) & (inside(ends) == 0) & (pending == 0) & (batch > 0)
    return (b - a)[keep], batch[keep]


def lone_requests(records: list[RequestRecord]) -> list[RequestRecord]:
    """Completed requests nothing else overlapped from their send to their first token: no
    earlier request still in flight at their send, none sent before their first token."""
    order = sorted(records, key=lambda r: r.arrival_s)
    out = []
    busy_until = -math.inf  # the latest finish of the requests sent so far
    for i, r in enumerate(order):
        next_sent = order[i + 1].arrival_s if i + 1 < len(order) else math.inf
        if r.ok and busy_until <= r.arrival_s and next_sent >= r.first_token_s:
            out.append(r)
        busy_until = max(busy_until, r.finish_s)
    return out


def _with(raw: dict, params: dict | None = None, frontend_s: float | None = None) -> dict:
    data = dict(raw)
    if params is not None:
        data["cost_model"] = {**raw.get("cost_model", {}), "params": params}
    if frontend_s is not None:
        data["router"] = {**raw.get("router", {}), "frontend_latency_s": frontend_s}
    return data


def fit_measured(config_path: str | Path, records: list[RequestRecord], raw: dict,
                 base_dir: str) -> Fit:
    """Fit the overlay of `config_path`'s deployment (`raw`, its YAML with a workload) to
    `records` (module docstring)."""
    from pdsim.core.batch import BatchShape
    from pdsim.sim.build import build_cluster
    from pdsim.sim.cluster import simulate

    source = str(config_path)
    cfg = parse_experiment(raw, source)
    params = dict(raw.get("cost_model", {}).get("params") or {})
    if "timings" in params:  # the overlay is read relative to itself: make it absolute
        params["timings"] = str((Path(base_dir) / params["timings"]).resolve())
    fit = Fit(overlay={})
    measured: dict = {}

    def step_model(overhead_s: float):
        role = _role(build_cluster(parse_experiment(
            _with(raw, {**params, "step_overhead_s": overhead_s}), source), base_dir))
        return role, role.cost()

    try:
        role, cost0 = step_model(0.0)
    except ConfigError as exc:
        raise ConfigError(f"{source}: its cost model ({cfg.cost_model.name}) takes no "
                          f"step_overhead_s, so the decode step cannot be fitted: {exc}") from None
    done = [r for r in records if r.ok]
    context = float(np.mean([r.input_tokens + r.output_tokens / 2 for r in done]))
    gaps, batch = steady_gaps(records)
    overhead_s = None
    if role.instances != 1 or role.dp_attention != 1:
        fit.lines.append(f"decode step: not fitted: {role.instances} instances x attention DP "
                         f"{role.dp_attention} serve decode, and the file does not say which "
                         "served a request")
    elif not len(gaps):
        fit.lines.append("decode step: not fitted: no steady gap between tokens in the file "
                         "(every gap saw a request join, leave or wait for its first token)")
    else:
        rows, diffs = [], []
        for b in np.unique(batch):
            sel = gaps[batch == b]
            model_s = cost0.step_time_s([BatchShape(decode_reqs=int(b),
                                                    decode_context_tokens=int(b * context))])
            rows.append({"batch": int(b), "gaps": int(len(sel)),
                         "measured_s": round(float(sel.mean()), 7), "model_s": round(model_s, 7)})
            diffs.append((float(sel.mean()) - model_s) * len(sel))
        overhead_s = max(0.0, sum(diffs) / len(gaps))
        cost_now = _role(build_cluster(cfg, base_dir)).cost()  # the YAML as written
        shape = [BatchShape(decode_reqs=1, decode_context_tokens=int(context))]
        old_s = cost_now.step_time_s(shape) - cost0.step_time_s(shape)
        measured["decode_steps"] = rows
        fit.overlay["cost_model"] = {"name": cfg.cost_model.name,
                                     "params": {**params, "step_overhead_s": round(overhead_s, 7)}}
        fit.lines.append(
            f"cost_model.params.step_overhead_s: {old_s * 1e3:.3f} ms -> {overhead_s * 1e3:.3f} ms"
            f" ({(overhead_s - old_s) * 1e3:+.3f} ms) from {len(gaps)} steady gaps at batch "
            f"{int(batch.min())}-{int(batch.max())}")

    lone = lone_requests(records)[:MAX_LONE_REQUESTS]
    if not lone:
        fit.lines.append("per-request cost: not fitted: no request was alone from its send to "
                         "its first token")
    else:
        fitted = _with(raw, {**params, "step_overhead_s": overhead_s}) if overhead_s is not None \
            else raw
        cluster = build_cluster(parse_experiment(fitted, source), base_dir)
        sim_ttft = [simulate(cluster, [0.0], [r.input_tokens], [r.output_tokens],
                             seed=cfg.seed).records[0].ttft_s for r in lone]
        real_ttft = [r.ttft_s for r in lone]
        delta_s = float(np.median(np.subtract(real_ttft, sim_ttft)))
        old_s = cfg.router.frontend_latency_s
        new_s = max(0.0, old_s + delta_s)
        measured["lone_requests"] = {
            "count": len(lone), "measured_ttft_s": round(float(np.median(real_ttft)), 7),
            "simulated_ttft_s": round(float(np.median(sim_ttft)), 7)}
        fit.overlay["router"] = {"frontend_latency_s": round(new_s, 7)}
        fit.lines.append(
            f"router.frontend_latency_s: {old_s * 1e3:.3f} ms -> {new_s * 1e3:.3f} ms "
            f"({(new_s - old_s) * 1e3:+.3f} ms) from {len(lone)} requests alone (median TTFT "
            f"measured {np.median(real_ttft) * 1e3:.2f} ms, simulated "
            f"{np.median(sim_ttft) * 1e3:.2f} ms)")
    fit.overlay = {"measured": measured, **fit.overlay}
    return fit


def calibrate_measured(config_path: str | Path, measured_path: str | Path, out_path: str | Path,
                       *, fmt: str = "auto", run: int | None = None, log=print) -> Path:
    """Read the file, fit (`fit_measured`), write the overlay; returns its path."""
    import yaml

    from pdsim.config import read_config_file
    from pdsim.validation.measured import read_measured
    from pdsim.validation.validate import UNUSED_WORKLOAD

    path = Path(config_path)
    raw = read_config_file(path, "experiment")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a deployment YAML (a mapping) expected")
    raw = raw if "workload" in raw else {**raw, "workload": UNUSED_WORKLOAD}
    seed = int(raw.get("seed", 0) or 0)
    measured = read_measured(measured_path, fmt, seed=seed, run=run)
    if not any(r.ok for r in measured.records):
        raise ConfigError(f"{measured_path}: every request failed; nothing to fit")
    fit = fit_measured(path, measured.records, raw, str(path.parent.resolve()))
    for line in fit.lines:
        log(line)
    if len(fit.overlay) == 1:  # `measured` alone: nothing was fitted
        raise ConfigError(f"{measured_path}: nothing could be fitted (see above)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    timings = fit.overlay.get("cost_model", {}).get("params", {}).get("timings")
    if timings is not None:
        fit.overlay["cost_model"]["params"]["timings"] = os.path.relpath(
            timings, out_path.parent.resolve())
    fit.overlay["measured"] = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "from": str(measured_path), "source": measured.source, "config": str(config_path),
        "requests": len(measured.records), "notes": measured.notes, **fit.overlay["measured"]}
    out_path.write_text(f"# pdsim calibrate --measured: fitted to {measured_path} "
                        "(pdsim/validation/fit.py)\n"
                        + yaml.safe_dump(fit.overlay, sort_keys=False))
    return out_path

