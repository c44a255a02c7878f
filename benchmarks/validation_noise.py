"""Real-vs-real noise at the size of the CI validation test: serve one deployment, replay the
same workload several times (a fresh deployment each time), and print how far each checked
metric of a run lies from the median run. tests/test_validate.py's tolerance is the matrix's
goal plus this noise (docs/validation.md, "In CI").

    python benchmarks/validation_noise.py [--config experiments/validation/pd_1p1d_low.yaml]
                                          [--requests 12] [--runs 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdsim.metrics import SLO, summarize  # noqa: E402
from pdsim.validation.compare import METRICS  # noqa: E402
from pdsim.validation.deployment import RealDeployment  # noqa: E402
from pdsim.validation.replay import replay  # noqa: E402
from pdsim.workload import generate  # noqa: E402
from pdsim.config import parse_experiment  # noqa: E402
from runtime.security import new_secret  # noqa: E402

CHECKED = ("TTFT mean", "ITL mean", "throughput (output tok/s)", "TTFT P90", "ITL P90")


def run_once(config: Path, raw: dict) -> dict[str, float]:
    cfg = parse_experiment(raw, str(config))
    work = generate(cfg.workload, base_dir=str(config.parent))
    with RealDeployment(config, secret=new_secret()) as real:
        records = replay(real.url, cfg.model, work.arrival_s, work.input_tokens,
                         work.output_tokens, seed=cfg.seed)
    summary = summarize(records, num_gpus=cfg.cluster.num_gpus, slo=SLO())
    return {label: float(summary[key]) for label, key in METRICS if label in CHECKED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path,
                    default=REPO / "experiments" / "validation" / "pd_1p1d_low.yaml")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    raw = yaml.safe_load(args.config.read_text())
    raw["workload"]["num_requests"] = args.requests
    raw.pop("cost_model", None)  # sim only, and a path relative to the config's folder
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / args.config.name
        config.write_text(yaml.safe_dump(raw))
        runs = []
        for i in range(args.runs):
            print(f"== run {i + 1}/{args.runs} (load {os.getloadavg()[0]:.1f})", flush=True)
            runs.append(run_once(config, raw))
    print(f"\n{args.config.name}, {args.requests} requests, {args.runs} real runs: "
          "|run − median run| / median run")
    print(f"{'metric':<28} {'median':>10} {'largest':>8} {'runs':>40}")
    for label in CHECKED:
        values = np.array([r[label] for r in runs])
        med = float(np.median(values))
        spread = np.abs(values / med - 1)
        shown = " ".join(f"{v:.4g}" for v in values)
        print(f"{label:<28} {med:>10.4g} {spread.max():>7.0%} {shown:>40}")


if __name__ == "__main__":
    main()
