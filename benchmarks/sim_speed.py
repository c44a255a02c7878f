"""Simulated requests per wall-second: 1 prefill + 1 decode instance, 10,000 requests of 1,024
input / 256 output tokens, Poisson arrivals at ~70% of the pair's capacity.

    python benchmarks/sim_speed.py [--requests N] [--cost roofline|silicon|...] [--profile]

Without --cost it runs the roofline (the like-for-like figure against earlier measurements)
and the default `auto` (silicon where tables exist). Wall time and process CPU time, each the
best of --repeat runs, are both printed: on a shared machine CPU time is the steadier figure.

Capacity comes from the cost model itself: prefill can finish 1 / t(1024-token extend)
requests/s; decode 256 running requests at once, each taking 256 steps of a full batch.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


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


def run_once(cost: str, requests: int, load: float, prefill_cap: float, decode_cap: float,
             profile: bool, repeat: int = 1) -> float:
    """Simulate with cost model `cost` (the best of `repeat` runs); print the figures; return
    requests per CPU-second."""
    from pdsim.sim.silicon import resolve_cost_model
    from pdsim.workload import generate

    rate = load * min(prefill_cap, decode_cap)
    cfg = parse_experiment({
        "name": "sim_speed", "model": "llama-3.1-8b", "hardware": "h100",
        "cost_model": {"name": cost},
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {"num_requests": requests, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": rate},
                     "input_len": {"dist": "fixed", "value": IN},
                     "output_len": {"dist": "fixed", "value": OUT}},
    })
    wl = generate(cfg.workload)
    cluster = build_cluster(cfg)
    prof = cProfile.Profile() if profile else None
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        result = simulate(cluster, wl.arrival_s, wl.input_tokens, wl.output_tokens, seed=0)
        if prof:
            prof.disable()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    ok = sum(r.ok for r in result.records)
    steps = sum(i.steps for i in result.instances)
    print(f"[{cost} -> {resolve_cost_model(cost, load_hardware_spec('h100'))}] simulated "
          f"{len(wl)} requests ({ok} ok), {result.sim_time_s:.1f} s of serving, {steps} forward "
          f"steps; wall {wall:.2f} s -> {len(wl) / wall:,.0f} req/s; CPU {cpu:.2f} s -> "
          f"{len(wl) / cpu:,.0f} req/s, {result.sim_time_s / cpu:,.0f}x real time")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return len(wl) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--cost", action="append",
                    help="cost model(s) to run (repeatable); default: roofline and auto")
    ap.add_argument("--repeat", type=int, default=3, help="report the best of this many runs")
    ap.add_argument("--profile", action="store_true", help="print where the time goes")
    args = ap.parse_args()
    prefill_cap, decode_cap = capacity_rps()
    print(f"capacity (roofline): prefill {prefill_cap:.1f} req/s, decode {decode_cap:.1f} req/s; "
          f"offered {args.load * min(prefill_cap, decode_cap):.1f} req/s ({args.load:.0%} of the "
          "smaller)")
    for cost in args.cost or ["roofline", "auto"]:
        run_once(cost, args.requests, args.load, prefill_cap, decode_cap, args.profile,
                 1 if args.profile else args.repeat)


if __name__ == "__main__":
    main()
