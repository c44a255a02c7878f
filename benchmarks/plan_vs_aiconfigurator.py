"""`pdsim plan` side by side with NVIDIA's aiconfigurator on the same inputs.

    python benchmarks/plan_vs_aiconfigurator.py [--case qwen3-32b|deepseek-v3|all] [--jobs N]

Cases (SGLang backend, H200 SXM, ISL 4000 / OSL 500, TTFT 2 s, TPOT 40 ms):
  qwen3-32b:   Qwen3-32B on 16 GPUs;
  deepseek-v3: DeepSeek-V3 on 32 GPUs.

Per case:
1. aiconfigurator (pinned, in its own virtualenv under .bench/aic-venv, created on first use;
   never a dependency of pdsim) runs `aiconfigurator cli default` on the GPU budget; its
   recommendation (the best of its agg and disagg searches by tokens/s/GPU) is parsed from its
   saved best_config_topn.csv: P/D worker counts and parallelism, replicas to the budget, and the
   request rate it predicts the deployment sustains within the SLO.
2. `pdsim plan` searches the same budget at that request rate (Poisson arrivals, fixed 4000/500
   lengths) with percentile targets TTFT p90 <= 2 s and TPOT p90 <= 40 ms (aiconfigurator's
   figures are steady-state averages; a percentile target is the stricter reading), with
   `search.early_stop` (a candidate's run ends once its SLO is out of reach: the same
   recommendation, found sooner; the question here is the recommendation, not the frontier).
3. pdsim simulates aiconfigurator's recommendation on the same workload.
It prints both recommendations, their goodput per GPU (aiconfigurator's own prediction and
pdsim's simulation) and both search times, wall and CPU (the machine's load average is
printed with them). When aiconfigurator cannot be installed or run the
reason is printed and pdsim's side still runs, at the case's fallback rate.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pdsim.config import ConfigError, parse_experiment
from pdsim.planning import meets, parse_plan, plan
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.search import tpot_percentiles
from pdsim.runner import run_point

ROOT = Path(__file__).resolve().parent.parent
AIC_VERSION = "0.12.0"
AIC_VENV = ROOT / ".bench" / "aic-venv"
AIC_OUT = ROOT / ".bench" / "aic-out"
ISL, OSL, TTFT_S, TPOT_S = 4000, 500, 2.0, 0.040


@dataclass(frozen=True)
class Case:
    model: str                # pdsim preset
    hf_model: str             # aiconfigurator's --model-path
    gpus: int
    search: dict              # pdsim's search space
    fallback_rate_rps: float  # the load when aiconfigurator gives none
    aic_args: tuple = ()


CASES = {
    "qwen3-32b": Case("qwen3-32b", "Qwen/Qwen3-32B", 16,
                      {"modes": ["disaggregated", "colocated"], "tp": [1, 2, 4, 8]}, 20.0),
    "deepseek-v3": Case("deepseek-v3", "deepseek-ai/DeepSeek-V3", 32,
                        {"modes": ["disaggregated", "colocated"], "tp": [8, 16],
                         "dp_attention": [1, 8, 16], "ep": [1, 8, 16]}, 20.0),
}


@dataclass
class AicChoice:
    deployment: Candidate | None
    described: str            # as aiconfigurator reports it
    tok_s_per_gpu: float      # aiconfigurator's prediction
    rate_rps: float           # request rate the deployment sustains, by aiconfigurator
    ttft_ms: float
    tpot_ms: float
    search_s: float
    search_cpu_s: float
    note: str = ""
    errors: list[str] = field(default_factory=list)


def ensure_aiconfigurator(venv: Path) -> Path:
    """The pinned aiconfigurator CLI in its own virtualenv, installed on first use."""
    cli = venv / "bin" / "aiconfigurator"
    if cli.exists():
        return cli
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    proc = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                           f"aiconfigurator=={AIC_VERSION}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install aiconfigurator=={AIC_VERSION} failed: "
                           f"{proc.stderr.strip()[-2000:]}")
    return cli


def run_aiconfigurator(cli: Path, case: Case, name: str) -> list[AicChoice]:
    """aiconfigurator's recommendation (its chosen mode) first, then its best of the other mode."""
    save = AIC_OUT / name
    save.mkdir(parents=True, exist_ok=True)
    argv = [str(cli), "cli", "default", "--model-path", case.hf_model, "--total-gpus",
            str(case.gpus), "--system", "h200_sxm", "--backend", "sglang", "--isl", str(ISL),
            "--osl", str(OSL), "--ttft", str(TTFT_S * 1e3), "--tpot", str(TPOT_S * 1e3),
            "--save-dir", str(save), *case.aic_args]
    print("$ aiconfigurator", " ".join(argv[1:]), flush=True)
    started = time.time()
    t0, cpu0 = time.perf_counter(), cpu_s(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, cpu_s(resource.RUSAGE_CHILDREN) - cpu0
    log = proc.stdout + proc.stderr
    (save / "aiconfigurator.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"aiconfigurator exited {proc.returncode}: {log.strip()[-2000:]}")
    rows = {}
    for mode in ("agg", "disagg"):
        fresh = [p for p in save.rglob(f"{mode}/best_config_topn.csv") if p.stat().st_mtime >= started]
        if fresh:
            rows[mode] = pd.read_csv(fresh[0])
    if not rows:
        raise RuntimeError(f"aiconfigurator wrote no best_config_topn.csv under {save}")
    chosen = re.search(r"Best Experiment Chosen: (\w+)", log)
    first = chosen.group(1) if chosen else max(
        rows, key=lambda m: rows[m]["tokens/s/gpu_cluster"].iloc[0])
    return [_choice(mode, rows[mode], case, wall, cpu, recommended=mode == first)
            for mode in sorted(rows, key=lambda m: m != first)]


def cpu_s(*who: int) -> float:
    """User + system CPU seconds of `who` (RUSAGE_SELF, RUSAGE_CHILDREN: finished children,
    the pool's workers and aiconfigurator's process): unlike wall time, not stretched when
    other jobs share the machine."""
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime for w in who)


def _choice(mode: str, table: pd.DataFrame, case: Case, wall: float, cpu: float,
            recommended: bool) -> AicChoice:
    """aiconfigurator's best row of one mode that pdsim can express (no pipeline stages)."""
    errors = []
    for rank, (_, row) in enumerate(table.iterrows(), 1):
        try:
            dep, described, gpus_used = _to_pdsim(mode, row, case.gpus)
            break
        except ValueError as exc:
            errors.append(str(exc))
    else:
        raise RuntimeError(f"none of aiconfigurator's {mode} configurations maps to pdsim: "
                           + "; ".join(errors))
    tok_s_gpu = float(row["tokens/s/gpu_cluster"])
    what = "recommended" if recommended else f"best {mode}"
    return AicChoice(dep, described, tok_s_gpu, tok_s_gpu * case.gpus / OSL, float(row["ttft"]),
                     float(row["tpot"]), wall, cpu, errors=errors,
                     note=f"{what}; its {mode} rank {rank}; {gpus_used} of {case.gpus} GPUs used")


def _shape(row, prefix: str = "") -> RoleShape:
    """aiconfigurator's attention tp x dp (GPUs per worker) and MoE ep as SGLang's flags:
    --tp-size tp*dp --dp-size dp --enable-dp-attention --ep-size ep."""
    get = lambda k: int(row[f"{prefix}{k}"])  # noqa: E731
    if get("pp") != 1:
        raise ValueError(f"{row[prefix + 'parallel']}: pdsim has no pipeline parallelism")
    tp, dp, ep = get("tp"), get("dp"), get("moe_ep")
    return RoleShape(tp * dp, dp, ep)


def _to_pdsim(mode: str, row, budget: int) -> tuple[Candidate, str, int]:
    """aiconfigurator's row → pdsim Candidate, replicated to the GPU budget as its report
    does (replicas = budget // GPUs per replica)."""
    if mode == "agg":
        shape = _shape(row)
        replicas = budget // shape.tp
        return (Candidate("colocated", (("colocated", replicas, shape),)),
                f"{replicas}x agg {row['parallel']} bs {int(row['bs'])}", replicas * shape.tp)
    if mode != "disagg":
        raise ValueError(f"mode {mode}: pdsim compares agg and disagg only")
    ps, ds = _shape(row, "(p)"), _shape(row, "(d)")
    pw, dw = int(row["(p)workers"]), int(row["(d)workers"])
    replicas = budget // (pw * ps.tp + dw * ds.tp)
    dep = Candidate("disaggregated", (("prefill", pw * replicas, ps),
                                       ("decode", dw * replicas, ds)))
    return (dep, f"{replicas} x ({pw}P {row['(p)parallel']} + {dw}D {row['(d)parallel']} "
                 f"bs {int(row['(d)bs'])})", dep.num_gpus)


def plan_data(case: Case, name: str, rate_rps: float, duration_s: float) -> dict:
    return {
        "name": f"vs_aic_{name}",
        "model": case.model,
        "hardware": "h200",
        "max_gpus": case.gpus,
        "target_rate_rps": round(rate_rps, 3),
        "workload": {"num_requests": max(200, round(rate_rps * duration_s)), "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": round(rate_rps, 3)},
                     "input_len": {"dist": "fixed", "value": ISL},
                     "output_len": {"dist": "fixed", "value": OSL}},
        "slo": {"ttft_p90_s": TTFT_S, "tpot_p90_s": TPOT_S},
        "search": {**case.search, "early_stop": True},
        "router": {"policy": "least_loaded"},
    }


def simulate(dep: Candidate, cfg) -> dict:
    """pdsim's simulation of one deployment under the plan's workload and SLO."""
    exp = parse_experiment(dep.experiment_data(cfg, name=f"{cfg.name}_aic"), "aiconfigurator's")
    r = run_point(0, exp, {}, None)
    summary = dict(r.summary)
    summary.update(tpot_percentiles(r.requests))
    summary["meets_slo"] = meets(cfg, summary)
    return summary


def _row(tool: str, label: str, gpus: int, s: dict | None, search_s: float, search_cpu_s: float,
         aic: AicChoice | None = None) -> dict:
    row = {"tool": tool, "deployment": label, "GPUs": gpus,
           "aic tok/s/GPU": aic.tok_s_per_gpu if aic else None,
           "aic req/s/GPU": aic.tok_s_per_gpu / OSL if aic else None, "search s": round(search_s, 1),
           "search CPU s": round(search_cpu_s, 1)}
    if s is not None:
        row.update({"pdsim TTFT p90 ms": s["ttft_p90_s"] * 1e3,
                    "pdsim TPOT p90 ms": s["tpot_p90_s"] * 1e3,
                    "pdsim tok/s/GPU": s["output_tok_s_per_gpu"],
                    "pdsim goodput req/s/GPU": s["goodput_req_s_per_gpu"],
                    "meets SLO in pdsim": s["meets_slo"]})
    return row


def run_case(name: str, case: Case, jobs: int, duration_s: float, executor: str,
             rate_rps: float | None = None) -> pd.DataFrame:
    print(f"\n== {name}: {case.hf_model} on {case.gpus} H200, ISL {ISL} / OSL {OSL}, "
          f"TTFT {TTFT_S:g} s, TPOT {TPOT_S * 1e3:g} ms (load average "
          f"{os.getloadavg()[0]:.1f}) ==", flush=True)
    aic: list[AicChoice] = []
    try:
        aic = run_aiconfigurator(ensure_aiconfigurator(AIC_VENV), case, name)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"aiconfigurator did not run: {exc}", flush=True)
    for a in aic:
        print(f"aiconfigurator {AIC_VERSION}: {a.described} ({a.note}): predicts "
              f"{a.tok_s_per_gpu:,.1f} tok/s/GPU = {a.rate_rps:.2f} req/s, TTFT "
              f"{a.ttft_ms:,.0f} ms, TPOT {a.tpot_ms:.1f} ms; search {a.search_s:.1f} s wall, "
              f"{a.search_cpu_s:.1f} CPU-s", flush=True)
        for err in a.errors:
            print(f"  (skipped a higher-ranked configuration: {err})")
    rate = rate_rps or (aic[0].rate_rps if aic else case.fallback_rate_rps)
    cfg = parse_plan(plan_data(case, name, rate, duration_s), f"{name} plan")
    print(f"pdsim plan at {rate:.2f} req/s, {cfg.workload.num_requests} requests ...", flush=True)
    t0, cpu0 = time.perf_counter(), cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    result = plan(cfg, write=False, jobs=jobs, progress=False, executor=executor)
    plan_s = time.perf_counter() - t0
    plan_cpu_s = cpu_s(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) - cpu0
    t = result.timings_s
    stopped = int((result.candidates.get("stopped", pd.Series(dtype=str)).fillna("") != "").sum())
    print(f"pdsim plan: {t['candidates']} deployments, {int(result.candidates['prefilter_keep'].sum())}"
          f" past the pre-filter, {t['simulated']} simulated ({stopped} stopped once their SLO "
          f"was out of reach), {plan_s:.1f} s wall, {plan_cpu_s:.1f} CPU-s (load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)
    rows = []
    for a in aic:
        try:
            s = simulate(a.deployment, cfg)
        except ConfigError as exc:
            s = None
            print(f"pdsim cannot build aiconfigurator's {a.deployment.label}: {exc}")
        rows.append(_row(f"aiconfigurator ({a.note.split(';')[0]})",
                         f"{a.deployment.label} ({a.described})", a.deployment.num_gpus, s,
                         a.search_s, a.search_cpu_s, a))
    rec = result.recommended
    if rec is None:
        print("pdsim plan: no deployment meets the SLO")
        rows.append({"tool": "pdsim plan", "deployment": "none meets the SLO",
                     "search s": round(plan_s, 1), "search CPU s": round(plan_cpu_s, 1)})
    else:
        s = {**rec.summary.to_dict(), "meets_slo": True}
        rows.append(_row("pdsim plan", rec.deployment.label, rec.deployment.num_gpus, s, plan_s,
                         plan_cpu_s))
        print(f"pdsim recommends {rec.deployment.label}; bottleneck: {rec.bottleneck.name} "
              f"({rec.bottleneck.words})")
    frame = pd.DataFrame(rows)
    frame.insert(0, "case", f"{name} @ {rate:.2f} req/s")
    return frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--duration-s", type=float, default=40.0,
                    help="seconds of arrivals simulated per candidate (requests = rate x this)")
    ap.add_argument("--executor", choices=["local", "ray"], default="local")
    ap.add_argument("--rate", type=float, default=None,
                    help="offered load in req/s (default: the rate aiconfigurator predicts for "
                    "its recommendation)")
    args = ap.parse_args()
    names = list(CASES) if args.case == "all" else [args.case]
    frames = [run_case(n, CASES[n], args.jobs, args.duration_s, args.executor, args.rate)
              for n in names]
    table = pd.concat(frames, ignore_index=True)
    print()
    print(markdown(table))


def markdown(frame: pd.DataFrame) -> str:
    """The table as Markdown (for docs/planning.md)."""
    def cell(v) -> str:
        if isinstance(v, bool) or v is None or (isinstance(v, float) and v != v):
            return {True: "yes", False: "no"}.get(v, "–")
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |"
              for row in frame.itertuples(index=False)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
