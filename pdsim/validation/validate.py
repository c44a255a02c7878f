"""`pdsim validate CONFIG` and `pdsim compare CONFIG --measured FILE`: a real run of the
deployment against its simulation (with a calibration laid over it) on the same arrivals and
lengths.

The real run is one of: the deployment served here (`pdsim serve`) and the config's workload
replayed; the workload replayed against an endpoint already running (`--url`: a real SGLang
PD deployment, vLLM, Dynamo, `pdsim serve`); or a benchmark client's per-request results
(pdsim.validation.measured). Writes to the output directory: `validation.csv` and
`validation.md` (the side-by-side table; the markdown also holds the phase table), `phases.csv`
(per-phase means, sim against real, see `pdsim.validation.phases`), `validation.png` (CDFs and the per-request TTFT scatter),
`real_requests.csv` and `sim_requests.csv` (one row per request, matched by `rid`; served here,
the real ones carry the PD workers' phase stamps on the client's clock). Replayed,
`lengths.csv` (and a table in validation.md) compares the token counts the endpoint reported
with the workload's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pdsim.config import ConfigError, ExperimentConfig, parse_experiment, read_config_file
from pdsim.core.records import RequestRecord
from pdsim.metrics import records_frame, summarize
from pdsim.validation import phases
from pdsim.validation.compare import Tolerance, markdown, plot, side_by_side

# Sections of a calibration file that lie over the experiment (runtime/calibration.py).
OVERLAY_KEYS = ("cost_model", "network", "router", "kv_dtype_bytes", "cluster", "speculative")
# Overlay sections that replace the experiment's whole, not key by key: a measured
# `acceptance` (mean_accept_len) must not meet configured `rates`.
REPLACED_WHOLE = ("params", "acceptance")


@dataclass
class Validation:
    table: pd.DataFrame
    phases: pd.DataFrame
    real: list[RequestRecord]
    sim: list[RequestRecord]
    out_dir: Path
    lengths: pd.DataFrame | None = None  # replayed: the token counts reported (lengths.py)
    notes: list[str] = field(default_factory=list)  # what a measured file made us assume

    @property
    def passed(self) -> bool:
        return bool(self.table["within"].all())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in REPLACED_WHOLE:
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_calibration(path: str | Path) -> dict[str, Any]:
    """The experiment fields a calibration file sets, its timings path made absolute."""
    path = Path(path)
    data = read_config_file(path, "calibration", " (write one with `pdsim calibrate`)") or {}
    unknown = sorted(set(data) - set(OVERLAY_KEYS) - {"measured"})
    if unknown:
        raise ConfigError(f"{path}: unknown calibration keys {unknown}; allowed: "
                          f"{', '.join(OVERLAY_KEYS)}, measured")
    overlay = {k: data[k] for k in OVERLAY_KEYS if k in data}
    params = overlay.get("cost_model", {}).get("params", {})
    for where in (params, *(params.get("roles") or {}).values()):
        if isinstance(where, dict) and where.get("timings") is not None:
            where["timings"] = str((path.parent / where["timings"]).resolve())
    return overlay


def calibrated(raw: dict, source: str, calibration: str | Path | None) -> ExperimentConfig:
    """The experiment to simulate: the YAML as written, with the calibration over it."""
    data = raw if calibration is None else _merge(raw, load_calibration(calibration))
    return parse_experiment(data, f"{source}" + (f" + {calibration}" if calibration else ""))



@dataclass
class Experiment:
    """The deployment YAML to validate, checked, with the calibration laid over it."""

    path: Path
    cfg: ExperimentConfig  # as written (what is served)
    sim_cfg: ExperimentConfig  # with the calibration (what is simulated)
    cluster: Any  # pdsim.sim.cluster.ClusterSpec of sim_cfg
    base_dir: str
    calibration: str | Path | None


# `pdsim compare` simulates the measured file's requests: a deployment YAML without a workload
# gets this one only to pass the experiment's schema; it is never generated.
UNUSED_WORKLOAD = {"num_requests": 1, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                   "input_len": {"dist": "fixed", "value": 1},
                   "output_len": {"dist": "fixed", "value": 1}}


def load_experiment_for(config_path: str | Path, calibration: str | Path | None,
                        what: str = "validate") -> Experiment:
    """`what` "compare" takes a deployment without a workload (the file brings the requests)."""
    from pdsim.sim.build import build_cluster

    path = Path(config_path)
    raw = read_config_file(path, "experiment")
    if what == "compare" and isinstance(raw, dict) and "workload" not in raw:
        raw = {**raw, "workload": UNUSED_WORKLOAD}
    cfg = parse_experiment(raw, str(path))
    if cfg.sweep:
        raise ConfigError(f"{path}: {what} runs one deployment; drop its `sweep:`")
    base_dir = str(path.parent.resolve())
    sim_cfg = calibrated(raw, str(path), calibration)
    return Experiment(path, cfg, sim_cfg, build_cluster(sim_cfg, base_dir), base_dir, calibration)


def compare_runs(exp: Experiment, real: list[RequestRecord], sim_rids: Sequence[str],
                 arrival_s: Sequence[float], input_tokens: Sequence[int],
                 output_tokens: Sequence[int], *, out: Path, title: str, tolerance: Tolerance,
                 sections: Sequence[str] = (), log=print) -> Validation:
    """Simulate `exp` on the given arrivals and lengths (request i named `sim_rids[i]`, the
    real record it stands for), compare with `real` and write the output directory's files
    (module docstring); `sections` are markdown appended to validation.md."""
    from pdsim.progress import phase
    from pdsim.sim.cluster import simulate

    log("sim: " + (f"calibrated by {exp.calibration}" if exp.calibration else "as configured"))
    with phase("simulating"):
        sim = simulate(exp.cluster, arrival_s, input_tokens, output_tokens,
                       seed=exp.sim_cfg.seed, max_duration_s=exp.sim_cfg.max_duration_s).records
    for rec, rid in zip(sim, sim_rids):
        rec.rid = rid
    num_gpus = exp.cluster.num_gpus
    table = side_by_side(summarize(real, num_gpus=num_gpus, slo=exp.cfg.slo),
                         summarize(sim, num_gpus=num_gpus, slo=exp.cfg.slo), tolerance)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "validation.csv", index=False)
    phase_table = phases.phase_table(real, sim)
    phase_table.to_csv(out / "phases.csv", index=False)
    (out / "validation.md").write_text("\n".join(
        [markdown(table, title), *sections, phases.markdown(phase_table,
                                                            "Where TTFT goes (means)")]))
    plot(real, sim, out / "validation.png", title)
    records_frame(real).to_csv(out / "real_requests.csv", index=False)
    records_frame(sim).to_csv(out / "sim_requests.csv", index=False)
    return Validation(table, phase_table, real, sim, out)


def state_check(exp: Experiment, held: dict[str, int]) -> str:
    """The recurrent state per request on one rank each real worker holds (`held`, keyed
    "prefill 0", ...) against what the simulator prices for its role; "" for a model without
    one."""
    from pdsim.specs.models import load_model_spec

    model = load_model_spec(exp.sim_cfg.model, exp.base_dir)
    if not held or not model.num_linear_layers:
        return ""
    parts, same = [], True
    for worker, real in held.items():
        role = exp.sim_cfg.cluster.roles[worker.split()[0]]
        sim = model.recurrent_state_bytes_per_request_per_rank(role.tp // role.dp_attention)
        same = same and real == sim
        parts.append(f"{worker}: real {real:,} B, sim {sim:,} B")
    verdict = "equal" if same else "they differ"
    return f"recurrent state per request per rank ({verdict}): " + "; ".join(parts)


def _serve_name(path: Path) -> str:
    from runtime.serve_config import load_serve_config

    return load_serve_config(path).model_name


def endpoint_model(url: str, api_key: str | None) -> str:
    """The first model an OpenAI-compatible endpoint lists at /v1/models."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers={
        "Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            models = json.loads(resp.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConfigError(f"--url {url}: cannot list its models at /v1/models ({exc}); give "
                          "--model") from None
    if not models:
        raise ConfigError(f"--url {url}: /v1/models lists no model; give --model")
    return str(models[0]["id"])


def validate(config_path: str | Path, *, calibration: str | Path | None = None,
             tolerance: Tolerance = Tolerance(), out_dir: str | Path | None = None,
             url: str | None = None, api: str = "completions", tokenizer: str | Path | None = None,
             api_key: str | None = None, model: str | None = None, log=print) -> Validation:
    """Replay the config's workload on the deployment served here (`url` None) or on the
    endpoint at `url` (its API root, without /v1), simulate, compare (module docstring)."""
    from pdsim.progress import phase
    from pdsim.validation import lengths
    from pdsim.validation.deployment import RealDeployment, ServeError
    from pdsim.validation.prompts import TextPrompts
    from pdsim.validation.replay import replay_endpoint
    from pdsim.workload import generate
    from runtime.security import new_secret

    if url is None and (tokenizer or api_key or model or api != "completions"):
        raise ConfigError("--tokenizer, --api-key, --model and --api go with --url")
    if api == "generate" and tokenizer:
        raise ConfigError("--tokenizer builds text prompts for --api completions; /generate "
                          "takes token ids (input_ids)")
    exp = load_experiment_for(config_path, calibration)  # before serving: a bad config fails fast
    cfg = exp.cfg
    work = generate(cfg.workload, base_dir=exp.base_dir)
    if work.closed_loop is not None:
        raise ConfigError(f"{exp.path}: workload: validate replays open-loop arrivals; a closed "
                          "loop's send times depend on the backend")
    out = Path(out_dir or Path("results") / f"validate_{cfg.name}")
    n = len(work.arrival_s)
    title = f"{cfg.name}: {n} requests, real vs simulated"
    if url is None:
        log(f"real: pdsim serve {exp.path} ({n} requests)")
        with phase("starting the deployment"):
            real_dep = RealDeployment(exp.path, secret=new_secret())
        with real_dep, phase(f"replaying {n} requests"):
            replies = replay_endpoint(real_dep.url, _serve_name(exp.path), work.arrival_s,
                                      work.input_tokens, work.output_tokens, seed=cfg.seed)
            real = phases.merge_worker_records([r.record for r in replies],
                                               real_dep.worker_records("prefill"),
                                               real_dep.worker_records("decode"))
            leaks = {w: d for w, d in real_dep.worker_pools().items() if d}
            held = real_dep.worker_state_bytes()
        if real_dep.workers:
            log("real: " + ("; ".join(f"{w}: pools not full: {d}" for w, d in leaks.items())
                           or "every worker's pages and slots came back"))
        if line := state_check(exp, held):
            log(line)
    else:
        prompts = TextPrompts(tokenizer).prompts(work.input_tokens, cfg.seed) if tokenizer else None
        if api != "generate" and model is None:
            model = endpoint_model(url, api_key)
        log(f"real: {url} ({api}, {'text' if tokenizer else 'token-id'} prompts, {n} requests)")
        with phase(f"replaying {n} requests"):
            replies = replay_endpoint(url, model or "", work.arrival_s, work.input_tokens,
                                      work.output_tokens, api=api, prompts=prompts,
                                      api_key=api_key, seed=cfg.seed)
        real = [r.record for r in replies]
        title = f"{cfg.name}: {n} requests, {url} vs simulated"
    if not any(r.ok for r in real):
        raise ServeError(f"every request to {url or exp.path} failed; the first: {real[0].error}")
    check = lengths.length_check(replies, work.input_tokens, work.output_tokens)
    out.mkdir(parents=True, exist_ok=True)
    check.to_csv(out / "lengths.csv", index=False)
    # What the endpoint processed (its reported counts); a failed request as it was asked for.
    n_in = [r.input_tokens if r.ok else int(w) for r, w in zip(real, work.input_tokens)]
    n_out = [r.output_tokens if r.ok else int(w) for r, w in zip(real, work.output_tokens)]
    result = compare_runs(exp, real, [r.rid for r in real], work.arrival_s, n_in, n_out, out=out,
                          title=title, tolerance=tolerance, sections=[lengths.markdown(check)],
                          log=log)
    result.lengths = check
    return result


def compare_measured(config_path: str | Path, measured_path: str | Path, *, fmt: str = "auto",
                     run: int | None = None, calibration: str | Path | None = None,
                     tolerance: Tolerance = Tolerance(), out_dir: str | Path | None = None,
                     log=print) -> Validation:
    """`pdsim compare`: a benchmark client's per-request results against the deployment
    simulated on the same send times and lengths (the requests that failed are not)."""
    from pdsim.validation.measured import read_measured

    exp = load_experiment_for(config_path, calibration, "compare")
    measured = read_measured(measured_path, fmt, seed=exp.cfg.seed, run=run)
    real = measured.records
    done = [r for r in real if r.ok]
    if not done:
        raise ConfigError(f"{measured_path}: every request failed; nothing to compare")
    out = Path(out_dir or Path("results") / f"compare_{exp.cfg.name}")
    log(f"real: {measured_path} ({measured.source}, {len(real)} requests)")
    for note in measured.notes:
        log(f"  note: {note}")
    sections = ["### What the file left to assume\n\n" + "".join(
        f"- {note}\n" for note in measured.notes)] if measured.notes else []
    result = compare_runs(
        exp, real, [r.rid for r in done], [r.arrival_s for r in done],
        [r.input_tokens for r in done], [r.output_tokens for r in done], out=out,
        title=f"{exp.cfg.name}: {len(real)} requests of {Path(measured_path).name} vs simulated",
        tolerance=tolerance, sections=sections, log=log)
    result.notes = measured.notes
    return result
