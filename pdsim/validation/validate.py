"""`pdsim validate CONFIG`: serve the deployment for real, replay its workload, simulate the same
deployment (with a calibration laid over it) on the same arrivals and lengths, compare.

Writes to the output directory: `validation.csv` and `validation.md` (the side-by-side table;
the markdown also holds the phase table), `phases.csv` (per-phase means, sim against real, see
`pdsim.validation.phases`), `validation.png` (CDFs and the per-request TTFT scatter),
`real_requests.csv` and `sim_requests.csv` (one row per request; the real ones carry the PD
workers' phase stamps on the client's clock).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pdsim.config import (
    ConfigError, ExperimentConfig, load_experiment, parse_experiment, read_config_file,
)
from pdsim.core.records import RequestRecord
from pdsim.metrics import records_frame, summarize
from pdsim.validation import phases
from pdsim.validation.compare import Tolerance, markdown, plot, side_by_side

# Sections of a calibration file that lie over the experiment (runtime/calibration.py).
OVERLAY_KEYS = ("cost_model", "network", "router", "kv_dtype_bytes", "cluster")


@dataclass
class Validation:
    table: pd.DataFrame
    phases: pd.DataFrame
    real: list[RequestRecord]
    sim: list[RequestRecord]
    out_dir: Path

    @property
    def passed(self) -> bool:
        return bool(self.table["within"].all())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "params":
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
    timings = overlay.get("cost_model", {}).get("params", {}).get("timings")
    if timings is not None:
        overlay["cost_model"]["params"]["timings"] = str((path.parent / timings).resolve())
    return overlay


def calibrated(raw: dict, source: str, calibration: str | Path | None) -> ExperimentConfig:
    """The experiment to simulate: the YAML as written, with the calibration over it."""
    data = raw if calibration is None else _merge(raw, load_calibration(calibration))
    return parse_experiment(data, f"{source}" + (f" + {calibration}" if calibration else ""))


def _serve_name(path: Path) -> str:
    from runtime.serve_config import load_serve_config

    return load_serve_config(path).model_name


def validate(config_path: str | Path, *, calibration: str | Path | None = None,
             tolerance: Tolerance = Tolerance(), out_dir: str | Path | None = None,
             log=print) -> Validation:
    from pdsim.progress import phase
    from pdsim.sim.build import build_cluster
    from pdsim.sim.cluster import simulate
    from pdsim.validation.deployment import RealDeployment
    from pdsim.validation.replay import replay
    from pdsim.workload import generate
    from runtime.security import new_secret

    path = Path(config_path)
    cfg, raw = load_experiment(path)
    if cfg.sweep:
        raise ConfigError(f"{path}: validate runs one deployment; drop its `sweep:`")
    base_dir = str(path.parent.resolve())
    sim_cfg = calibrated(raw, str(path), calibration)
    cluster = build_cluster(sim_cfg, base_dir)  # before serving: a bad config fails fast
    work = generate(cfg.workload, base_dir=base_dir)
    if work.closed_loop is not None:
        raise ConfigError(f"{path}: workload: validate replays open-loop arrivals; a closed "
                          "loop's send times depend on the backend")
    out = Path(out_dir or Path("results") / f"validate_{cfg.name}")
    out.mkdir(parents=True, exist_ok=True)

    log(f"real: pdsim serve {path} ({len(work.arrival_s)} requests)")
    with phase("starting the deployment"):
        real_dep = RealDeployment(path, secret=new_secret())
    with real_dep, phase(f"replaying {len(work.arrival_s)} requests"):
        real = replay(real_dep.url, _serve_name(path), work.arrival_s, work.input_tokens,
                      work.output_tokens, seed=cfg.seed)
        real = phases.merge_worker_records(real, real_dep.worker_records("prefill"),
                                           real_dep.worker_records("decode"))
    log("sim: " + (f"calibrated by {calibration}" if calibration else "as configured"))
    with phase("simulating"):
        sim = simulate(cluster, work.arrival_s, work.input_tokens, work.output_tokens,
                       seed=sim_cfg.seed, max_duration_s=sim_cfg.max_duration_s).records

    r = summarize(real, num_gpus=cluster.num_gpus, slo=cfg.slo)
    s = summarize(sim, num_gpus=cluster.num_gpus, slo=cfg.slo)
    table = side_by_side(r, s, tolerance)
    table.to_csv(out / "validation.csv", index=False)
    phase_table = phases.phase_table(real, sim)
    phase_table.to_csv(out / "phases.csv", index=False)
    title = f"{cfg.name}: {len(work.arrival_s)} requests, real vs simulated"
    (out / "validation.md").write_text(
        markdown(table, title) + "\n" + phases.markdown(phase_table, "Where TTFT goes (means)"))
    plot(real, sim, out / "validation.png", title)
    records_frame(real).to_csv(out / "real_requests.csv", index=False)
    records_frame(sim).to_csv(out / "sim_requests.csv", index=False)
    return Validation(table, phase_table, real, sim, out)
