"""How fast `pdsim plan` searches: candidates per second in the analytic pre-filter and in
simulation, and the wall time of a 200-configuration plan.

    python benchmarks/plan_speed.py [PLAN.yaml] [--jobs N]

Default plan: experiments/plan_qwen3_32b.yaml (Qwen3-32B on up to 16 H200, 400 requests of
4000/500 tokens). Three measurements:

1. the pre-filter over every enumerated candidate, cold (role capacities built: one cost model
   per role and parallelism) and warm (capacities cached);
2. a 200-configuration plan: the pre-filter off, the first 200 candidates by cost simulated
   (no early stop), the whole `plan()` call timed, in wall time and in CPU time (workers
   included: the figure that does not grow when other jobs share the machine);
3. the plan as written (pre-filter and early stop on, the defaults), timed the same way.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import yaml

from pdsim.planning import parse_plan, plan
from pdsim.planning.candidates import enumerate_deployments
from pdsim.planning.prefilter import Prefilter
from pdsim.specs.hardware import load_hardware_spec
from pdsim.specs.models import load_model_spec
from pdsim.workload import generate

ROOT = Path(__file__).resolve().parent.parent


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the pool's workers): unlike
    wall time, not stretched when other jobs share the machine."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", nargs="?", default=str(ROOT / "experiments" / "plan_qwen3_32b.yaml"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()
    raw = yaml.safe_load(Path(args.plan).read_text())
    cfg = parse_plan(raw, args.plan)

    model, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    deployments = enumerate_deployments(cfg, model, cfg.gpu_limit(hw.gpus_per_node))
    workload = generate(cfg.workload_data())
    filt = Prefilter(cfg, model, hw, workload)
    t0 = time.perf_counter()
    kept = sum(filt.check(d).keep for d in deployments)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in deployments:
        filt.check(d)
    warm = time.perf_counter() - t0
    print(f"pre-filter: {len(deployments)} candidates, {kept} kept; cold {cold:.2f} s "
          f"({len(deployments) / cold:,.0f} candidates/s, role capacities built), warm "
          f"{warm:.3f} s ({len(deployments) / warm:,.0f} candidates/s)")

    grid = parse_plan({**raw, "search": {**raw.get("search", {}), "max_simulations": 200,
                                         "cost_slack": 1e9, "early_stop": False}}, args.plan)
    t0, c0 = time.perf_counter(), cpu_s()
    result = plan(grid, prefilter=False, write=False, jobs=args.jobs)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    t = result.timings_s
    print(f"200-configuration plan (pre-filter off, {args.jobs} processes): {t['simulated']} "
          f"simulated in {t['simulate_s']:.1f} s ({t['simulated'] / t['simulate_s']:.2f} "
          f"candidates/s); wall {wall:.1f} s (goal < 120 s); CPU {cpu:.1f} s "
          f"({cpu / t['simulated']:.2f} s per candidate), so {cpu / args.jobs:.0f} s wall "
          f"on {args.jobs} idle cores")

    t0, c0 = time.perf_counter(), cpu_s()
    result = plan(cfg, write=False, jobs=args.jobs)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    t = result.timings_s
    rec = result.recommended.deployment.label if result.recommended else "none"
    stopped = int((result.candidates["stopped"].fillna("") != "").sum())
    print(f"plan as written: {t['candidates']} candidates, {t['simulated']} simulated "
          f"({stopped} stopped early) in {t['simulate_s']:.1f} s; wall {wall:.1f} s, CPU "
          f"{cpu:.1f} s; recommended: {rec}")


if __name__ == "__main__":
    main()
