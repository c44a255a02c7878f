"""The simulator against the real backend on one workload: the same core scheduler, once driving
a torch model on this CPU, once driving the SimPy clock with the `profiled` cost model fitted to
that run's own measured forwards.

    python benchmarks/sim_vs_real.py [--requests 200] [--rate 30] [--model tiny-llama]

Real: colocated `Engine` in this process (no HTTP), requests submitted at their Poisson arrival
times. Sim: the same arrivals and lengths, the same scheduler limits. Printed: latency
percentiles side by side and their ratio. The fit is in-sample (a calibration check of the
simulator's queueing and batching, not of the fit's extrapolation).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pdsim.config import parse_experiment
from pdsim.metrics import SLO, summarize
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import simulate
from runtime.driver import Engine
from runtime.executor import ModelExecutor
from runtime.model import ModelConfig, build_model
from runtime.sampling import SamplingParams

PAGES, PAGE_SIZE = 1024, 16
SCHED = dict(max_running_requests=32, max_prefill_tokens=1024, chunked_prefill_size=512,
             num_reserved_decode_tokens=32)


def workload(n: int, rate: float, seed: int):
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    arrival -= arrival[0]
    return arrival, rng.integers(64, 513, n), rng.integers(16, 65, n)


def run_real(model: str, arrival, n_in, n_out):
    from pdsim.deployment import SchedulerKnobs

    executor = ModelExecutor(build_model(ModelConfig.preset(model), seed=0), num_pages=PAGES,
                             page_size=PAGE_SIZE)
    executor.warmup()
    engine = Engine(executor, SchedulerKnobs(page_size=PAGE_SIZE, **SCHED).build(PAGES))
    engine.start()
    done = threading.Semaphore(0)
    rng = np.random.default_rng(7)
    start = time.monotonic()
    for t, i, o in zip(arrival, n_in, n_out):
        delay = start + t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        prompt = [int(x) for x in rng.integers(0, 256, int(i))]
        engine.submit(prompt, int(o), lambda e: e.finished and done.release(),
                      sampling=SamplingParams())
    for _ in arrival:
        done.acquire()
    engine.stop()
    return list(engine.records), executor.timings_frame()


def run_sim(model: str, timings, arrival, n_in, n_out):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timings.csv"
        timings.to_csv(path, index=False)
        cfg = parse_experiment({
            "name": "sim_vs_real", "model": model,
            "cluster": {"mode": "colocated", "colocated": {"instances": 1, "scheduler": {
                "num_pages": PAGES, "page_size": PAGE_SIZE, **SCHED}}},
            "cost_model": {"name": "profiled", "params": {"timings": str(path)}},
            "router": {"frontend_latency_s": 0.0},  # the real side is an Engine, no HTTP
            "workload": {"num_requests": 1, "seed": 0,
                         "arrival": {"process": "poisson", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": 1},
                         "output_len": {"dist": "fixed", "value": 1}},  # replaced below
        })
        return simulate(build_cluster(cfg), arrival, n_in, n_out).records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()
    arrival, n_in, n_out = workload(args.requests, args.rate, seed=0)
    real, timings = run_real(args.model, arrival, n_in, n_out)
    sim = run_sim(args.model, timings, arrival, n_in, n_out)
    slo = SLO(ttft_s=1.0, itl_s=0.1)
    r, s = summarize(real, num_gpus=1, slo=slo), summarize(sim, num_gpus=1, slo=slo)
    print(f"{args.model} colocated on this CPU, {args.requests} requests, Poisson {args.rate} "
          f"req/s, input 64-512, output 16-64 tokens; {len(timings)} measured forwards")
    print(f"{'':16}{'real':>12}{'sim':>12}{'sim/real':>10}")
    for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "e2e_mean_s"):
        print(f"{key:16}{r[key] * 1e3:10.2f}ms{s[key] * 1e3:10.2f}ms{s[key] / r[key]:10.2f}")
    print(f"{'output tok/s':16}{r['output_tok_s']:12.1f}{s['output_tok_s']:12.1f}"
          f"{s['output_tok_s'] / r['output_tok_s']:10.2f}")


if __name__ == "__main__":
    main()
