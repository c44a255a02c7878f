"""A fingerprint of the simulator's records: one SHA-256 per sweep point of the bundled
experiments, over every field of every request record (floats by their exact bits). A change
meant to keep behaviour (a refactor, a speed-up) must leave every line unchanged.

    python benchmarks/records_fingerprint.py [--requests N] [--only NAME ...] > before.txt
    ... change ...
    python benchmarks/records_fingerprint.py [--requests N] > after.txt; diff before.txt after.txt

Each point runs at most --requests requests (default 300); most points take seconds, the large-EP
ones (ep_scaling, ep_eplb) minutes each, so `--only` the experiments a change touches. Experiments
that need the real backend or a trace missing here are skipped, and say so.
"""

from __future__ import annotations

import argparse
import hashlib
import struct
import sys
from pathlib import Path

from pdsim.config import expand_sweep, load_experiment, parse_experiment
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.workload import generate

ROOT = Path(__file__).resolve().parents[1]


def _bits(value) -> bytes:
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        return b"[" + b",".join(_bits(float(v)) for v in value) + b"]"
    return repr(value).encode()


def fingerprint(records) -> str:
    h = hashlib.sha256()
    for rec in records:
        for name in sorted(vars(rec) if hasattr(rec, "__dict__") else rec.__slots__):
            h.update(name.encode())
            h.update(_bits(getattr(rec, name)))
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--only", nargs="*", help="experiment names (file stems)")
    args = ap.parse_args()
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        if args.only and path.stem not in args.only:
            continue
        try:
            _, raw = load_experiment(path)
        except Exception as exc:  # a plan or serve config: not an experiment
            print(f"{path.stem}: skipped ({type(exc).__name__})", file=sys.stderr)
            continue
        wl = raw.get("workload", {})
        if "num_requests" in wl:
            wl["num_requests"] = min(args.requests, wl["num_requests"])
        base_dir = str(path.parent)
        cfg = parse_experiment(raw, str(path))
        for i, (_swept, point) in enumerate(expand_sweep(cfg, raw, str(path))):
            try:
                work = generate(point.workload, base_dir=base_dir)
            except Exception as exc:
                print(f"{path.stem}[{i}]: skipped ({exc})", file=sys.stderr)
                continue
            result = simulate(build_cluster(point, base_dir), work.arrival_s, work.input_tokens,
                              work.output_tokens, seed=point.seed,
                              max_duration_s=point.max_duration_s,
                              closed_loop=work.closed_loop, prefix=work.prefix)
            print(f"{path.stem}[{i}] {fingerprint(result.records)} n={len(result.records)}",
                  flush=True)


if __name__ == "__main__":
    main()
