"""pdsim against Vidur 0.0.26 on Vidur's own scenario: CodeLlama-34B on A100 at TP 2, one
replica, Poisson 2 req/s, 1,024 input / 256 output tokens.

    python benchmarks/vs_vidur.py [--requests 10000 100000] [--vidur-requests 10000]
                                  [--skip-vidur]

Each simulator runs as a whole process (imports, simulation, metrics), timed from outside;
peak memory is the child's `ru_maxrss`. pdsim runs the roofline on a colocated instance
(chunked prefill, its default scheduler) and computes its summary metrics; Vidur runs from
its own virtual environment, `.bench/vidur-venv` (gitignored, never a pdsim dependency):

    python -m venv .bench/vidur-venv && .bench/vidur-venv/bin/pip install vidur==0.0.26

Vidur needs its A100 profiling tables: VIDUR_DATA (default /work/shared/anchors/vidur-data)
must hold its `data/profiling/...` tree; `prepare_vidur_data` lays them out in the offline
form 0.0.26 reads under `.bench/vidur-work`. Vidur's execution-time forests are trained and
their prediction tables built on its first run (one small forest per op rather than its
27-point grid search: tens of minutes here, cached); a 10-request Vidur run before the timed
ones makes sure that is not timed. On a shared machine compare CPU times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".bench"
VIDUR_PY = BENCH / "vidur-venv" / "bin" / "python"
RATE_RPS, IN, OUT, SEED = 2.0, 1024, 256, 0

# codellama/CodeLlama-34b-Instruct-hf config.json
CODELLAMA_34B = dict(name="codellama-34b", num_layers=48, hidden_size=8192,
                     num_attention_heads=64, num_kv_heads=8, head_dim=128,
                     intermediate_size=22016, vocab_size=32000)


def pdsim_child(requests: int) -> None:
    """The measured pdsim process: build, simulate, summarise; print one JSON line."""
    from pdsim.config import parse_experiment
    from pdsim.metrics import summarize
    from pdsim.sim.build import build_cluster
    from pdsim.sim.cluster import simulate
    from pdsim.workload import generate

    cfg = parse_experiment({
        "name": "vs_vidur", "model": CODELLAMA_34B, "hardware": "a100",
        "cost_model": {"name": "roofline"},
        "cluster": {"mode": "colocated", "colocated": {"instances": 1, "tp": 2}},
        "workload": {"num_requests": requests, "seed": SEED,
                     "arrival": {"process": "poisson", "rate_rps": RATE_RPS},
                     "input_len": {"dist": "fixed", "value": IN},
                     "output_len": {"dist": "fixed", "value": OUT}},
    })
    wl = generate(cfg.workload)
    result = simulate(build_cluster(cfg), wl.arrival_s, wl.input_tokens, wl.output_tokens,
                      seed=cfg.seed)
    sim_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = summarize(result.records, num_gpus=2, slo=cfg.slo)
    print(json.dumps({"peak_rss_mb_before_metrics": round(sim_rss_mb),
                      "completed": summary["completed"], "ttft_p50_s": summary["ttft_p50_s"],
                      "itl_p50_s": summary["itl_p50_s"], "sim_time_s": result.sim_time_s}))


# Runs argv[1:] and reports its peak RSS: a fresh process per measurement, so that
# RUSAGE_CHILDREN holds that one child alone.
_WRAP = """import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print("CPU_S", use.ru_utime + use.ru_stime, "MAXRSS_KB", use.ru_maxrss)
sys.exit(rc)
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, float, str]:
    """Run `cmd`; (wall seconds, CPU seconds, peak RSS MB of the child, its stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{proc.stderr[-3000:]}")
    out, _, tail = proc.stdout.rstrip().rpartition("CPU_S ")
    cpu, _, rss = tail.split()
    return wall, float(cpu), int(rss) / 1024, out


VIDUR_DATA = Path(os.environ.get("VIDUR_DATA", "/work/shared/anchors/vidur-data"))
VIDUR_WORK = BENCH / "vidur-work"
VIDUR_MODEL = "codellama/CodeLlama-34b-Instruct-hf"
COMPUTE_REPO, NETWORK_REPO = "local/codellama-34b-a100", "local/a100-pairwise-nvlink"


def prepare_vidur_data() -> Path:
    """Vidur 0.0.26 fetches its profiles as Hugging Face datasets (`*.csv.xz` and a
    config.json); lay the CSVs out as such a dataset in an offline cache under VIDUR_WORK."""
    import lzma

    cache = VIDUR_WORK / "cache"
    src = VIDUR_DATA / "data" / "profiling"
    sets = {
        COMPUTE_REPO: (src / "compute/a100/codellama/CodeLlama-34b-Instruct-hf",
                       {"model": VIDUR_MODEL, "device_sku": "a100"}),
        NETWORK_REPO: (src / "network/a100_pairwise_nvlink", {"sku": "a100_pairwise_nvlink"}),
    }
    for repo, (folder, config) in sets.items():
        kind = "compute" if repo == COMPUTE_REPO else "network"
        root = cache / "profiling_data" / kind / f"datasets--{repo.replace('/', '--')}"
        snap = root / "snapshots" / ("0" * 40)
        if not (snap / "config.json").is_file():
            snap.mkdir(parents=True, exist_ok=True)
            for csv in folder.glob("*.csv"):
                (snap / f"{csv.name}.xz").write_bytes(lzma.compress(csv.read_bytes()))
            (snap / "config.json").write_text(json.dumps(config))
            (root / "refs").mkdir(exist_ok=True)
            (root / "refs" / "main").write_text("0" * 40)
    return cache


def vidur_command(requests: int, cache: Path) -> list[str]:
    pred = "random_forrest_execution_time_predictor_config"
    return [
        str(VIDUR_PY), "-m", "vidur.main", "--seed", str(SEED),
        "--replica_config_model_name", VIDUR_MODEL, "--replica_config_device", "a100",
        "--replica_config_network_device", "a100_pairwise_nvlink",
        "--replica_config_tensor_parallel_size", "2", "--replica_config_num_pipeline_stages", "1",
        "--cluster_config_num_replicas", "1",
        "--request_generator_config_type", "synthetic",
        "--synthetic_request_generator_config_num_requests", str(requests),
        "--length_generator_config_type", "fixed",
        "--fixed_request_length_generator_config_prefill_tokens", str(IN),
        "--fixed_request_length_generator_config_decode_tokens", str(OUT),
        "--interval_generator_config_type", "poisson",
        "--poisson_request_interval_generator_config_qps", str(RATE_RPS),
        "--execution_time_predictor_config_type", "random_forrest",
        # One small forest instead of a 27-point grid search: training is a one-time cost
        # (cached) and the simulator's own speed does not depend on the forest.
        f"--{pred}_num_estimators", "50", f"--{pred}_max_depth", "16",
        f"--{pred}_min_samples_split", "5", f"--{pred}_k_fold_cv_splits", "2",
        f"--{pred}_model_profiling_dataset", COMPUTE_REPO,
        f"--{pred}_network_profiling_dataset", NETWORK_REPO,
        f"--{pred}_cache_dir", str(cache),
        "--metrics_config_output_dir", str(VIDUR_WORK / "out"),
        "--no-metrics_config_store_plots", "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_write_json_trace",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--vidur-requests", type=int, nargs="*",
                    help="request counts Vidur runs (default: --requests)")
    ap.add_argument("--skip-vidur", action="store_true")
    ap.add_argument("--pdsim-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pdsim_child:
        pdsim_child(args.pdsim_child)
        return
    vidur_counts = [] if args.skip_vidur else (
        args.requests if args.vidur_requests is None else args.vidur_requests)
    if vidur_counts and not VIDUR_PY.is_file():
        raise SystemExit(f"no Vidur environment at {VIDUR_PY}; see this script's docstring, "
                         "or pass --skip-vidur")
    cache = prepare_vidur_data() if vidur_counts else None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    if cache is not None:  # the first run trains Vidur's forests and caches them: not timed
        timed(vidur_command(10, cache), env)
    for n in sorted(set(args.requests) | set(vidur_counts)):
        if n in args.requests:
            wall, cpu, peak_mb, out = timed([sys.executable, __file__, "--pdsim-child", str(n)])
            print(f"pdsim {n:>7} requests: wall {wall:6.1f} s, CPU {cpu:6.1f} s, peak RSS "
                  f"{peak_mb:,.0f} MB; {out.strip()}", flush=True)
        if n in vidur_counts:
            v_wall, v_cpu, v_peak, _ = timed(vidur_command(n, cache), env)
            print(f"vidur {n:>7} requests: wall {v_wall:6.1f} s, CPU {v_cpu:6.1f} s, peak RSS "
                  f"{v_peak:,.0f} MB", flush=True)
            if n in args.requests:
                print(f"  pdsim is {v_wall / wall:.1f}x faster by wall time, "
                      f"{v_cpu / cpu:.1f}x by CPU time", flush=True)


if __name__ == "__main__":
    main()
