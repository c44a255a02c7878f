"""The `pdsim` command."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from pdsim.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate and run prefill/decode disaggregated LLM serving.")
console = Console()


@contextmanager
def _exits_on(*errors: type[Exception], status: int = 2) -> Iterator[None]:
    """A mistake the user can fix (`errors`): its message in red, exit `status`, no traceback."""
    from rich.markup import escape

    try:
        yield
    except errors as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(status) from None
# Piped or captured output gets a table wide enough to read, not the 80-column fallback.
table_console = console if console.is_terminal else Console(width=140)

TABLE_COLUMNS = (
    ("point", None), ("req/s", "request_rate"), ("GPUs", "num_gpus"), ("ok", "completed"),
    ("failed", "failed"), ("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"),
    ("ITL p50", "itl_p50_s"), ("ITL p99", "itl_p99_s"),
    ("tok/s/GPU", "output_tok_s_per_gpu"), ("goodput/GPU", "goodput_req_s_per_gpu"),
    ("SLO met", "slo_attainment"), ("P busy", "prefill_busy_frac"), ("D batch", "decode_mean_batch"),
)


EXECUTOR_OPTION = typer.Option(
    "local", help="where simulations run: local (a process pool) or ray (one Ray task each)")
RAY_ADDRESS_OPTION = typer.Option(
    None, help="--executor ray: the cluster to join (auto, ray://HEAD:10001); default: start a "
    "local Ray instance")


def _fmt(col: str | None, row) -> str:
    if col is None:  # what the sweep varies at this point (pdsim.plots.sweep_labels)
        return str(row["label"])
    v = row[col]
    if col.endswith("_s") and not col.startswith("goodput"):
        return f"{v * 1e3:.1f}"
    if v != v:  # NaN: the column does not apply (no prefill instances, say)
        return "–"
    if col == "slo_attainment":
        return f"{v:.1%}"
    if col == "prefill_busy_frac":
        return f"{v:.0%}"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


@app.command()
def run(
    experiment: Path = typer.Argument(..., help="experiment YAML, e.g. experiments/ratio_sweep.yaml"),
    out: Optional[Path] = typer.Option(None, help="output directory (default results/<name>)"),
    jobs: Optional[int] = typer.Option(None, help="sweep points run in parallel (default: CPUs, "
                                       "or the Ray cluster's)"),
    quiet: bool = typer.Option(False, help="no progress bar or table"),
    executor: str = EXECUTOR_OPTION,
    ray_address: Optional[str] = RAY_ADDRESS_OPTION,
) -> None:
    """Simulate every point of an experiment and write tables, plots and a report."""
    from pdsim.runner import run_experiment
    from pdsim.sim.silicon import roofline_reliance_warning

    with _exits_on(ConfigError):
        summary, out_dir = run_experiment(experiment, out, jobs, progress=not quiet,
                                          executor=executor, ray_address=ray_address)
    if not quiet:
        table = Table(title=f"{experiment.stem}: {len(summary)} points",
                      caption="latencies in ms; goodput: requests/s meeting the SLO")
        for name, col in TABLE_COLUMNS:
            table.add_column(name, justify="right", no_wrap=col is None)
        for _, row in summary.iterrows():
            table.add_row(*(_fmt(col, row) for _, col in TABLE_COLUMNS))
        table_console.print(table)
    warning = roofline_reliance_warning(summary.to_dict("records"))
    if warning:
        console.print(warning, style="yellow", markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out_dir}/summary.csv, requests.parquet, report.md and plots")


@app.command()
def check(experiment: Path = typer.Argument(..., help="experiment YAML")) -> None:
    """Check an experiment config and list its sweep points without simulating."""
    from pdsim.config import expand_sweep, load_experiment
    from pdsim.sim.build import build_cluster

    with _exits_on(ConfigError):
        cfg, raw = load_experiment(experiment)
        points = expand_sweep(cfg, raw, str(experiment))
        for _, pcfg in points:
            build_cluster(pcfg, str(experiment.parent.resolve()))
    console.print(f"{experiment}: valid, {len(points)} point(s)")
    for swept, _ in points:
        console.print("  " + (", ".join(f"{k}={v}" for k, v in swept.items()) or "(no sweep)"))


@app.command()
def validate(
    config: Path = typer.Argument(..., help="a deployment with a workload, e.g. "
                                  "experiments/validation/pd_1p1d_low.yaml"),
    calibration: Optional[Path] = typer.Option(
        None, help="a `pdsim calibrate` file laid over the config before simulating"),
    tolerance: float = typer.Option(0.15, help="largest relative error of mean TTFT, mean ITL "
                                    "and output throughput"),
    tolerance_p90: float = typer.Option(0.25, help="largest relative error of P90 TTFT and ITL"),
    out: Optional[Path] = typer.Option(None, help="output directory (default "
                                       "results/validate_<name>)"),
) -> None:
    """Serve the deployment for real, replay its workload (exact arrivals and lengths), simulate
    it, and write the side-by-side table and plots; exit 1 when an error exceeds the tolerance
    (docs/validation.md)."""
    from pdsim.validation.compare import Tolerance
    from pdsim.validation.deployment import ServeError
    from pdsim.validation.validate import validate as run_validate

    with _exits_on(ConfigError, ServeError):
        result = run_validate(config, calibration=calibration, out_dir=out,
                              tolerance=Tolerance(mean=tolerance, p90=tolerance_p90))
    print((result.out_dir / "validation.md").read_text())
    print(f"wrote {result.out_dir}/validation.csv, validation.md, validation.png")
    if not result.passed:
        over = ", ".join(result.table.loc[~result.table["within"], "metric"])
        print(f"outside the tolerance: {over}")
        raise typer.Exit(1)


@app.command()
def calibrate(
    config: Path = typer.Argument(..., help="the deployment to calibrate (its model, dtype, "
                                  "page size, transfer), e.g. experiments/real_pd.yaml"),
    out: Path = typer.Option(..., "-o", "--out", help="calibration YAML to write; the forward "
                             "timings go beside it (<name>_timings.csv)"),
    repeats: int = typer.Option(5, help="runs per batch shape (the fastest is kept)"),
) -> None:
    """Measure this machine's forwards over a grid of batch shapes, the KV transfer over
    message sizes and the HTTP/router front end, and write a calibration file for
    `pdsim validate --calibration` (docs/validation.md)."""
    from pdsim.validation.deployment import ServeError
    from runtime.calibration import calibrate as run_calibrate

    with _exits_on(ConfigError, ServeError):
        from runtime.serve_config import load_serve_config
        from runtime.transfer.bindshim import reexec_with_preload

        # Mooncake's ports on transfer.host, as a worker's (its transfers are measured here).
        reexec_with_preload(load_serve_config(config).transfer.host)
        path = run_calibrate(config, out, repeats=repeats)
    print(f"wrote {path}")


@app.command()
def plan(
    plan_file: Path = typer.Argument(..., help="plan YAML, e.g. experiments/plan_qwen3_32b.yaml"),
    out: Optional[Path] = typer.Option(None, help="output directory (default results/<name>)"),
    jobs: Optional[int] = typer.Option(None, help="simulations run in parallel (default: CPUs, "
                                       "or the Ray cluster's)"),
    no_prefilter: bool = typer.Option(False, "--no-prefilter",
                                      help="simulate every candidate (slow)"),
    quiet: bool = typer.Option(False, help="no progress bar or tables"),
    executor: str = EXECUTOR_OPTION,
    ray_address: Optional[str] = RAY_ADDRESS_OPTION,
) -> None:
    """Find the cheapest deployment meeting a plan's SLO: pre-filter, simulate, recommend,
    and write the frontier, plots, report.md and launch commands (docs/planning.md)."""
    from pdsim.planning import plan as run_plan
    from pdsim.planning.report import summary_frame

    with _exits_on(ConfigError):
        result = run_plan(plan_file, out_dir=out, jobs=jobs, progress=not quiet,
                          prefilter=False if no_prefilter else None, executor=executor,
                          ray_address=ray_address)
    if not quiet:
        frame = summary_frame(result)
        table = Table(title=f"{result.plan.name}: Pareto frontier of {int(result.candidates['simulated'].sum())} "
                      f"simulated of {len(result.candidates)} candidates",
                      caption="latencies in ms")
        for column in frame.columns:
            table.add_column(column.removesuffix("_s"), justify="right")
        for _, row in frame.iterrows():
            table.add_row(*(f"{v * 1e3:,.1f}" if c.endswith("_s") else
                            f"{v:,.2f}" if isinstance(v, float) else str(v)
                            for c, v in row.items()))
        table_console.print(table)
    for title, choice in (("recommended", result.recommended), ("runner-up", result.runner_up)):
        if choice is not None:
            console.print(f"{title}: [bold]{choice.deployment.label}[/bold], "
                          f"{choice.deployment.num_gpus} GPUs, ${choice.summary['usd_per_hour']:,.2f}/h"
                          f", ${choice.summary['usd_per_mtok']:,.3f}/Mtok; bottleneck: "
                          f"{choice.bottleneck.name} ({choice.bottleneck.words})", highlight=False,
                          soft_wrap=True)
    if result.recommended is None:
        console.print("[red]no simulated deployment meets the SLO[/red]")
    else:
        console.print(result.recommended.launch.script(), highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"wrote {result.out_dir}/report.md, frontier.csv, candidates.csv, frontier.png, "
                  "recommended.yaml, launch.sh", soft_wrap=True)
    if result.recommended is None:
        raise typer.Exit(1)


@app.command()
def serve(
    config: Optional[Path] = typer.Argument(
        None, help="serve config YAML, e.g. experiments/real_colocated.yaml or "
        "experiments/real_pd.yaml (default: built-in colocated)"),
    model: Optional[str] = typer.Option(
        None, help="model preset (tiny-llama, tiny-mla) or local checkpoint directory"),
    host: Optional[str] = typer.Option(None, help="address to bind (default 127.0.0.1); "
                                       "disaggregated: the router's, or --role's"),
    port: Optional[int] = typer.Option(None, help="port to bind; 0 picks a free one; "
                                       "disaggregated: the router's, or --role's instance's"),
    role: Optional[str] = typer.Option(
        None, help="disaggregated only: run one role alone (prefill, decode or router); "
        "default: the whole deployment"),
    instance: int = typer.Option(0, help="--role prefill/decode: which instance"),
    bootstrap_port: Optional[int] = typer.Option(
        None, help="--role prefill: the instance's bootstrap server port"),
    prefill_url: list[str] = typer.Option(
        [], help="--role router: a prefill worker's URL (repeat for several)"),
    decode_url: list[str] = typer.Option(
        [], help="--role router: a decode worker's URL (repeat for several)"),
    api_key: Optional[str] = typer.Option(
        None, help="clients must send `Authorization: Bearer KEY` (also PDSIM_API_KEY)"),
    insecure: bool = typer.Option(
        False, help="--role: run without a cluster secret (PDSIM_CLUSTER_SECRET); only on a "
        "machine no one else can reach"),
) -> None:
    """Serve a real model with an OpenAI-compatible HTTP API until Ctrl-C or SIGTERM:
    colocated, or disaggregated (prefill and decode workers behind a router)."""
    from runtime.serve_config import ServeConfig, load_serve_config

    security = {k: v for k, v in (("api_key", api_key), ("insecure", insecure or None))
                if v is not None} or None
    with _exits_on(ConfigError):
        cfg = load_serve_config(config, model=model, security=security)
        if isinstance(cfg, ServeConfig):
            if role is not None:
                raise ConfigError(f"--role {role}: only a disaggregated config has roles")
            cfg = load_serve_config(config, model=model, host=host, port=port,
                                    security=security)
        elif role not in (None, "prefill", "decode", "router"):
            raise ConfigError(f"--role {role!r}; allowed: prefill, decode, router")
        elif host is not None or (port is not None and role in (None, "router")):
            section = role if role in ("prefill", "decode") else "router"
            moved = {"host": host} if section != "router" else {"host": host, "port": port}
            cfg = load_serve_config(config, model=model, security=security,
                                    **{section: {k: v for k, v in moved.items() if v is not None}})
    if isinstance(cfg, ServeConfig):
        _serve_colocated(cfg)
    else:
        _serve_disaggregated(cfg, role, instance, port, bootstrap_port, prefill_url, decode_url)


def _serve_colocated(cfg) -> None:
    from runtime.colocated import serve as run_server

    def ready(server) -> None:
        print(f"pdsim serve: {cfg.model_name} ({cfg.mode}) at {server.url}/v1", flush=True)

    try:
        run_server(cfg, on_ready=ready)
    except OSError as exc:  # cannot bind
        console.print(f"[red]error:[/red] cannot serve on {cfg.host}:{cfg.port}: {exc}",
                      highlight=False)
        raise typer.Exit(1) from None
    print("pdsim serve: stopped", flush=True)


def _serve_disaggregated(cfg, role, instance, port, bootstrap_port, prefill_url,
                         decode_url) -> None:
    from runtime.launcher import LaunchError, launch, serve_router

    name = cfg.model_name
    with _exits_on(LaunchError, ValueError, OSError, status=1):
        if role in ("prefill", "decode"):
            from runtime.pd.worker import ready_line, serve_instance
            from runtime.transfer.bindshim import reexec_with_preload

            reexec_with_preload(cfg.transfer.host)  # keeps Mooncake's ports on transfer.host

            status = serve_instance(
                cfg, role, instance, port=port, bootstrap_port=bootstrap_port,
                on_ready=lambda a: print(ready_line(cfg, role, instance, a), flush=True))
        elif role == "router":
            status = serve_router(cfg, prefill_url, decode_url, on_ready=lambda url: print(
                f"pdsim serve: router for {name} at {url}/v1", flush=True))
        else:
            shape = (f"{cfg.prefill.instances} prefill x tp {cfg.prefill.tp}, "
                     f"{cfg.decode.instances} decode x tp {cfg.decode.tp}")
            status = launch(cfg, on_ready=lambda url: print(
                f"pdsim serve: {name} (disaggregated: {shape}) at {url}/v1", flush=True))
    print("pdsim serve: stopped", flush=True)
    if status:
        raise typer.Exit(status)


@app.command()
def explain(
    config: Path = typer.Argument(..., help="experiment YAML (its base config; sweeps ignored)"),
    role: Optional[str] = typer.Option(None, help="prefill, decode or colocated (default: "
                                       "decode, or colocated for a colocated cluster)"),
    batch: int = typer.Option(64, help="decode: requests in the step, per attention-DP rank"),
    context: int = typer.Option(2048, help="decode: context tokens of each request"),
    prompt: int = typer.Option(4096, help="prefill: prompt tokens, chunked as the role's "
                               "scheduler chunks them"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Price one step of a role op by op: calls, time, share and how each op was priced."""
    import json

    from pdsim.config import load_experiment
    from pdsim.explain import explain_step

    with _exits_on(ConfigError, ValueError):
        cfg, _ = load_experiment(config)
        e = explain_step(cfg, role, batch, context, prompt, str(config.parent.resolve()))
    if json_out:
        print(json.dumps(e.to_json(), indent=2))
        return
    out = Console(width=min(console.width, 80))  # 80 columns at most, piped or not
    out.print(f"{e.model} on {e.hardware}, {e.role}, {e.cost_model} cost model:\n{e.step}",
              highlight=False)
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold")
    for name, justify in (("op", "left"), ("n", "right"), ("each µs", "right"),
                          ("total ms", "right"), ("share", "right"), ("table", "left"),
                          ("how", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for r in e.rows:
        table.add_row(r.name, str(r.count), f"{r.each_s * 1e6:.1f}", f"{r.total_s * 1e3:.2f}",
                      f"{e.share(r):.1%}", r.table, r.how)
    out.print(table)
    groups = ", ".join(f"{g} {v:.1%}" for g, v in e.group_shares().items())
    out.print(f"step {e.total_s * 1e3:.3f} ms (step_time_s {e.step_s * 1e3:.3f} ms); {groups}",
              highlight=False)


@app.command()
def presets() -> None:
    """List the model and hardware presets and their main figures (sources: docs/cost_model.md)."""
    from pdsim.specs.hardware import hardware_preset_names, load_hardware_spec
    from pdsim.deployment import model_presets
    from pdsim.specs.models import model_preset, model_preset_names

    models = Table(title="models (pdsim/specs/models.py)")
    backends = model_presets()
    for column in ("name", "params", "active/token", "attention", "MLP", "weight formats",
                   "backends"):
        models.add_column(column)
    for name in model_preset_names():
        m = model_preset(name)
        mlp = f"MoE {m.num_experts} top-{m.experts_per_token}" if m.is_moe else "dense"
        blocks = {"attn": m.precision.attention}
        if m.num_dense_layers:
            blocks["mlp"] = m.precision.dense_mlp
        if m.is_moe:
            blocks["experts"] = m.precision.moe_experts
        blocks["head"] = m.precision.lm_head
        formats = ", ".join(f"{block} {dtype}" for block, dtype in blocks.items())
        params, active = m.num_params / 1e9, m.active_params_per_token / 1e9
        models.add_row(name, f"{params:.4g}B", f"{active:.4g}B", m.attention, mlp, formats,
                       " + ".join(backends[name]))
    hardware = Table(title="hardware, per GPU, dense peaks (pdsim/specs/hardware.py)")
    for column in ("name", "BF16 TF", "FP8 TF", "FP4 TF", "HBM GB", "HBM GB/s", "NVLink GB/s",
                   "NIC GB/s", "NVLink domain", "$/GPU-h"):
        hardware.add_column(column)
    for name in hardware_preset_names():
        h = load_hardware_spec(name)
        hardware.add_row(*(f"{v:g}" if isinstance(v, (int, float)) else "-" if v is None else v
                           for v in (name, h.bf16_tflops, h.fp8_tflops, h.fp4_tflops, h.hbm_gib,
                                     h.hbm_gb_per_s, h.nvlink_gb_per_s, h.rdma_gb_per_s, h.gpus_per_node,
                                     h.usd_per_gpu_hour)))
    console.print(models)
    console.print(hardware)


if __name__ == "__main__":
    app()
