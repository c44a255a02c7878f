"""Simulated requests per wall-second: 1 prefill + 1 decode instance, 10,000 requests of 1,024
input / 256 output tokens, Poisson arrivals at ~70% of the pair's capacity.

    python benchmarks/sim_speed.py [--requests N] [--profile]

Capacity comes from the cost model itself: prefill can finish 1 / t(1024-token extend)
requests/s; decode 256 running requests at once, each taking 256 steps of a full batch.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from pdsim.config import parse_experiment
from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim.specs import load_hardware_spec, load_model_spec

IN, OUT, MAX_RUNNING = 1024, 256, 256


def capacity_rps() -> tuple[float, float]:
    cost = make_cost_model("roofline", load_model_spec("llama-3.1-8b"), load_hardware_spec("h100"),
                           Parallelism())
    prefill = 1 / cost.step_time_s([BatchShape(IN, extend_attn_pairs(IN, 0))])
    ctx = MAX_RUNNING * (IN + OUT // 2)
    step = cost.step_time_s([BatchShape(decode_reqs=MAX_RUNNING, decode_context_tokens=ctx)])
    decode = MAX_RUNNING / (OUT * step)
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--profile", action="store_true", help="print where the time goes")
    args = ap.parse_args()
    prefill_cap, decode_cap = capacity_rps()
    rate = args.load * min(prefill_cap, decode_cap)
    cfg = parse_experiment({
        "name": "sim_speed", "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {"num_requests": args.requests, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": rate},
                     "input_len": {"dist": "fixed", "value": IN},
                     "output_len": {"dist": "fixed", "value": OUT}},
    })
    from pdsim.workload import generate

    wl = generate(cfg.workload)
    cluster = build_cluster(cfg)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    result = simulate(cluster, wl.arrival_s, wl.input_tokens, wl.output_tokens, seed=0)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    ok = sum(r.ok for r in result.records)
    steps = sum(i.steps for i in result.instances)
    print(f"capacity: prefill {prefill_cap:.1f} req/s, decode {decode_cap:.1f} req/s; "
          f"offered {rate:.1f} req/s ({args.load:.0%} of the smaller)")
    print(f"simulated {len(wl)} requests ({ok} ok), {result.sim_time_s:.1f} s of serving, "
          f"{steps} forward steps")
    print(f"wall {wall:.2f} s -> {len(wl) / wall:,.0f} simulated requests per wall-second, "
          f"{result.sim_time_s / wall:,.0f}x real time")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
