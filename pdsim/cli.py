"""The `pdsim` command."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from pdsim.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})
console = Console()


def _print_version(asked: bool) -> None:
    if asked:
        from pdsim import __version__

        print(f"pdsim {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version,
                                       is_eager=True, help="print the version and exit")) -> None:
    """Simulate and run prefill/decode disaggregated LLM serving."""


def _error(message: str) -> None:
    """`error: message` on standard error (standard output may be a file's text), as click
    echoes it: ending in a newline whatever came before, never folded at the console's width
    (a log keeps it whole), red on a terminal only."""
    typer.echo(f"{typer.style('error:', fg='red')} {message.rstrip()}", err=True)


@contextmanager
def _exits_on(*errors: type[Exception], status: int = 2) -> Iterator[None]:
    """A mistake the user can fix (`errors`): its message (`_error`), exit `status`, no
    traceback."""
    try:
        yield
    except errors as exc:
        _error(str(exc))
        raise typer.Exit(status) from None


# (header, summary column, priority: the largest numbers are dropped first on a narrow terminal)
TABLE_COLUMNS = (
    ("point", None, 0), ("req/s", "request_rate", 1), ("GPUs", "num_gpus", 3),
    ("ok", "completed", 3), ("failed", "failed", 2), ("TTFT p50", "ttft_p50_s", 1),
    ("TTFT p99", "ttft_p99_s", 2), ("ITL p50", "itl_p50_s", 1), ("ITL p99", "itl_p99_s", 2),
    ("tok/s/GPU", "output_tok_s_per_gpu", 1), ("goodput/GPU", "goodput_req_s_per_gpu", 1),
    ("SLO met", "slo_attainment", 1), ("P busy", "prefill_busy_frac", 4),
    ("D batch", "decode_mean_batch", 4), ("$/Mtok", "usd_per_mtok", 3),
    ("goodput/$", "goodput_req_per_usd", 3),
)
# The caption's note on a column, when it is shown.
_TABLE_NOTES = (("goodput/GPU", "goodput: requests/s meeting the SLO"),
                ("$/Mtok", "$/Mtok: per million output tokens"))
WIDE_OPTION = typer.Option(False, "--wide", help="every table column, however wide the table")

EXECUTOR_OPTION = typer.Option(
    "local", help="where simulations run: local (a process pool) or ray (one Ray task each)")
RAY_ADDRESS_OPTION = typer.Option(
    None, help="--executor ray: the cluster to join (auto, ray://HEAD:10001); default: start a "
    "local Ray instance")


def _fmt(col: str, row) -> str:
    v = row[col]
    if v != v:  # NaN: the column does not apply (no prefill instances, a skipped point)
        return "–"
    if col.startswith(("ttft_", "itl_", "e2e_", "tpot_")):  # latencies, in seconds
        return f"{v * 1e3:.1f}"
    if col in ("slo_attainment", "prefix_hit_rate"):
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
    wide: bool = WIDE_OPTION,
    executor: str = EXECUTOR_OPTION,
    ray_address: Optional[str] = RAY_ADDRESS_OPTION,
) -> None:
    """Simulate every point of an experiment and write tables, plots and a report."""
    from pdsim.runner import PointError, run_experiment
    from pdsim.sim.silicon import roofline_reliance_warning

    with _exits_on(ConfigError), _exits_on(PointError, status=1):
        summary, out_dir = run_experiment(experiment, out, jobs, progress=not quiet,
                                          executor=executor, ray_address=ray_address)
    if not quiet:
        from pdsim.tables import counted

        title, table = f"{experiment.stem}: {counted(len(summary), 'point')}", summary
        if "skipped" in summary:  # points that cannot run: named so in the table (why: below)
            skipped = summary["skipped"].notna()
            title += f", {skipped.sum()} skipped"
            table = summary.assign(label=summary["label"].where(~skipped,
                                                                summary["label"] + " (skipped)"))
        _print_points(table, title, wide)
        console.print(summary.attrs.get("measurement", ""), style="dim", markup=False,
                      highlight=False, soft_wrap=True)
    warning = roofline_reliance_warning(summary.to_dict("records"))
    for note in [warning] * bool(warning) + summary.attrs.get("notes", []):
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out_dir}/summary.csv, requests.parquet, report.md and plots")


def _print_points(summary, title: str, wide: bool) -> None:
    """The run table: one row per sweep point, named after what the sweep varies there
    (pdsim.plots.sweep_labels), or p0, p1... with a legend when those names are long."""
    from pdsim.tables import (Column, layout, print_table, short_labels, shows_prefix_hits,
                              target_width)

    names, legend = short_labels(summary["label"], "p")
    table = TABLE_COLUMNS + ((("prefix hit", "prefix_hit_rate", 1),)
                             if shows_prefix_hits(summary) else ())
    closed = summary["request_rate"].isna()  # closed loops offer no rate: show the served one
    if closed.any():
        served = ("served req/s", "request_throughput_req_s", 1)
        table = (table[0], *table[1:2] * (not closed.all()), served, *table[2:])
    failures = summary["failed"].any()  # then never dropped at a narrow width
    columns = [Column(name, 0 if col == "failed" and failures else priority,
                      justify="left" if col is None else "right")
               for name, col, priority in table]
    rows = [[name] + [_fmt(col, row) for _, col, _ in table[1:]]
            for name, (_, row) in zip(names, summary.iterrows())]
    shown = {columns[i].header for i in layout(columns, rows, target_width(console, wide))[0]}
    caption = "; ".join(["latencies in ms"] + [note for header, note in _TABLE_NOTES
                                                if header in shown])
    print_table(console, columns, rows, title=title, wide=wide, legend=legend, caption=caption)


@app.command()
def check(config: Path = typer.Argument(..., help="an experiment, plan or serve config YAML")) -> None:
    """Check a config without simulating: an experiment (its sweep points listed), a plan or a
    serve config, told apart by their keys, and every file it names."""
    from pdsim.config import config_kind, read_config_file

    with _exits_on(ConfigError):
        kind = config_kind(read_config_file(config, "config"))
        {"experiment": _check_experiment, "plan": _check_plan, "serve": _check_serve}[kind](config)


def _check_experiment(path: Path) -> None:
    from pdsim.config import expand_sweep, load_experiment
    from pdsim.runner import check_points

    cfg, raw = load_experiment(path)
    points = expand_sweep(cfg, raw, str(path))
    notes = check_points(points, str(path.parent.resolve()), str(path))
    console.print(f"{path}: valid experiment, {len(points)} point(s)")
    for swept, _ in points:
        console.print("  " + (", ".join(f"{k}={v}" for k, v in swept.items()) or "(no sweep)"))
    if "transfer" in raw:  # served too (real_pd.yaml): what `pdsim serve` would say of it
        from runtime.serve_config import load_serve_config

        try:
            notes = [*notes, *load_serve_config(path).notes()]
        except ConfigError:  # not servable as it stands: `pdsim serve` says why
            pass
    for note in notes:
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)


def _check_plan(path: Path) -> None:
    from pdsim.config import check_files
    from pdsim.planning import load_plan
    from pdsim.specs.hardware import load_hardware_spec
    from pdsim.specs.models import load_model_spec

    plan_cfg = load_plan(path)
    base_dir = str(path.parent.resolve())
    check_files(plan_cfg.workload, base_dir, str(path))
    try:
        model = load_model_spec(plan_cfg.model, base_dir)
        hardware = load_hardware_spec(plan_cfg.hardware, base_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    names = hardware.name
    if plan_cfg.gpu_types:  # each type loads and has a price
        from pdsim.planning.hardware_mix import gpu_options

        try:
            names = ", ".join(o.name for o in gpu_options(plan_cfg, base_dir))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    console.print(f"{path}: valid plan, {model.name} on {names}", highlight=False)


def _check_serve(path: Path) -> None:
    from runtime.serve_config import load_serve_config

    cfg = load_serve_config(path)
    console.print(f"{path}: valid serve config, {cfg.model_name} ({cfg.mode})", highlight=False)
    for note in cfg.notes():
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)


TOLERANCE_OPTION = typer.Option(0.15, help="largest relative error of mean TTFT, mean ITL and "
                                "output throughput")
TOLERANCE_P90_OPTION = typer.Option(0.25, help="largest relative error of P90 TTFT and ITL")
CALIBRATION_OPTION = typer.Option(
    None, help="a `pdsim calibrate` file laid over the config before simulating")


@app.command()
def validate(
    config: Path = typer.Argument(..., help="a deployment with a workload, e.g. "
                                  "experiments/validation/pd_1p1d_low.yaml"),
    calibration: Optional[Path] = CALIBRATION_OPTION,
    tolerance: float = TOLERANCE_OPTION,
    tolerance_p90: float = TOLERANCE_P90_OPTION,
    out: Optional[Path] = typer.Option(None, help="output directory (default "
                                       "results/validate_<name>)"),
    url: Optional[str] = typer.Option(
        None, help="replay against this running endpoint (its API root, e.g. "
        "http://host:30000) instead of serving the config here: SGLang, vLLM, Dynamo, pdsim serve"),
    api: str = typer.Option("completions", help="--url: completions (POST /v1/completions) or "
                            "generate (SGLang's native POST /generate, input_ids)"),
    tokenizer: Optional[Path] = typer.Option(
        None, help="--url: the model's tokenizer.json (or its directory): send text prompts of "
        "exact token lengths instead of token ids"),
    api_key: Optional[str] = typer.Option(None, help="--url: sent as `Authorization: Bearer KEY`"),
    model: Optional[str] = typer.Option(None, help="--url: the model name to ask for (default: "
                                        "the first the endpoint lists)"),
) -> None:
    """Replay the config's workload (exact arrivals and lengths) on the deployment served here,
    or on a running endpoint (--url), simulate it, and write the side-by-side table and plots;
    exit 1 when an error exceeds the tolerance (docs/validation.md)."""
    from pdsim.validation.compare import Tolerance
    from pdsim.validation.deployment import ServeError
    from pdsim.validation.validate import validate as run_validate

    with _exits_on(ConfigError, ServeError):
        result = run_validate(config, calibration=calibration, out_dir=out,
                              tolerance=Tolerance(mean=tolerance, p90=tolerance_p90), url=url,
                              api=api, tokenizer=tokenizer, api_key=api_key, model=model)
    _report_validation(result)


def _report_validation(result) -> None:
    """The written table, the files, a warning on token counts off, exit 1 when out of
    tolerance."""
    from pdsim.validation.lengths import mismatched

    print((result.out_dir / "validation.md").read_text())
    print(f"wrote {result.out_dir}/validation.csv, validation.md, validation.png")
    if result.lengths is not None and mismatched(result.lengths):
        console.print("[yellow]the endpoint's token counts differ from the workload's for some "
                      "requests (see the table above, lengths.csv)[/yellow]")
    if not result.passed:
        over = ", ".join(result.table.loc[~result.table["within"], "metric"])
        print(f"outside the tolerance: {over}")
        raise typer.Exit(1)


@app.command()
def compare(
    config: Path = typer.Argument(..., help="the deployment the results were measured on"),
    measured: Path = typer.Option(..., help="per-request results: SGLang bench_serving "
                                  "--output-details JSONL, aiperf profile_export.jsonl or CSV"),
    fmt: str = typer.Option("auto", "--format", help="auto, bench_serving, aiperf or csv"),
    run_line: Optional[int] = typer.Option(None, "--run", help="bench_serving: the line of the "
                                           "run to compare (default: the file's only one)"),
    calibration: Optional[Path] = CALIBRATION_OPTION,
    tolerance: float = TOLERANCE_OPTION,
    tolerance_p90: float = TOLERANCE_P90_OPTION,
    out: Optional[Path] = typer.Option(None, help="output directory (default "
                                       "results/compare_<name>)"),
) -> None:
    """Compare a benchmark's per-request results with the deployment simulated on the same
    send times and lengths: the side-by-side table and plots of `validate`, no network needed;
    exit 1 when an error exceeds the tolerance (docs/validation.md)."""
    from pdsim.validation.compare import Tolerance
    from pdsim.validation.validate import compare_measured

    with _exits_on(ConfigError):
        result = compare_measured(config, measured, fmt=fmt, run=run_line, calibration=calibration,
                                  out_dir=out,
                                  tolerance=Tolerance(mean=tolerance, p90=tolerance_p90))
    _report_validation(result)


@app.command()
def calibrate(
    config: Path = typer.Argument(..., help="the deployment to calibrate (its model, dtype, "
                                  "page size, transfer), e.g. experiments/real_pd.yaml"),
    out: Path = typer.Option(..., "-o", "--out", help="calibration YAML to write; the forward "
                             "timings go beside it (<name>_timings.csv)"),
    repeats: int = typer.Option(5, help="runs per batch shape (the fastest is kept)"),
    measured: Optional[Path] = typer.Option(
        None, help="fit to these per-request results of the deployment instead of measuring "
        "this machine (the formats of `pdsim compare`)"),
    fmt: str = typer.Option("auto", "--format", help="--measured: auto, bench_serving, aiperf "
                            "or csv"),
    run_line: Optional[int] = typer.Option(None, "--run", help="--measured bench_serving: the "
                                           "line of the run"),
) -> None:
    """Measure this machine's forwards over a grid of batch shapes, the KV transfer over
    message sizes and the HTTP/router front end, or fit a deployment's measured results
    (--measured: a steady decode step and a concurrency-1 TTFT), and write a calibration file
    for `pdsim validate --calibration` (docs/validation.md)."""
    from pdsim.validation.deployment import ServeError

    if measured is not None:
        from pdsim.validation.fit import calibrate_measured

        with _exits_on(ConfigError):
            path = calibrate_measured(config, measured, out, fmt=fmt, run=run_line)
        print(f"wrote {path}")
        return
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
    wide: bool = WIDE_OPTION,
    executor: str = EXECUTOR_OPTION,
    ray_address: Optional[str] = RAY_ADDRESS_OPTION,
) -> None:
    """Find the cheapest deployment meeting a plan's SLO: pre-filter, simulate, recommend,
    and write the frontier, plots, report.md and launch commands (docs/planning.md)."""
    from pdsim.planning import plan as run_plan
    from pdsim.planning.result import choice_line

    with _exits_on(ConfigError):
        result = run_plan(plan_file, out_dir=out, jobs=jobs, progress=not quiet,
                          prefilter=False if no_prefilter else None, executor=executor,
                          ray_address=ray_address)
    if not quiet:
        _print_frontier(result, wide)
    for title, choice in (("recommended", result.recommended), ("runner-up", result.runner_up)):
        if choice is not None:
            console.print(textwrap.fill(choice_line(title, choice), console.width,
                                        subsequent_indent="  ", break_on_hyphens=False),
                          highlight=False, markup=False, soft_wrap=True)
    if result.recommended is None:
        console.print("[red]no simulated deployment meets the SLO[/red]")
    else:
        console.print(result.recommended.launch.script(), highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"wrote {result.out_dir}/report.md, frontier.csv, candidates.csv, frontier.png, "
                  "throughput_vs_interactivity.png, "
                  "recommended.yaml, launch.sh", soft_wrap=True)
    if result.recommended is None:
        raise typer.Exit(1)


# Frontier columns (pdsim.planning.report.summary_frame): header and priority.
_FRONTIER = {"label": ("deployment", 0), "num_gpus": ("GPUs", 1),
             "output_tok_s_per_gpu": ("tok/s/GPU", 1), "usd_per_mtok": ("$/Mtok", 1),
             "feasible": ("meets SLO", 2), "bottleneck": ("bottleneck", 3)}


def _print_frontier(result, wide: bool) -> None:
    """The plan's Pareto frontier; deployments named d0, d1... with a legend when long."""
    from pdsim.planning.report import stopped_frame, summary_frame
    from pdsim.tables import Column, print_table, short_labels

    frame = summary_frame(result)
    names, legend = short_labels(frame["label"], "d")
    columns = []
    for c in frame.columns:
        metric, _, stat = c.removesuffix("_s").partition("_")  # a latency: "TTFT p90" (ms)
        header, priority = _FRONTIER.get(c, (f"{metric.upper()} {stat}", 1))
        columns.append(Column(header, priority, justify="left" if c in ("label", "bottleneck")
                              else "right", wrap=c == "bottleneck"))
    rows = [[name] + [f"{v * 1e3:,.1f}" if c.endswith("_s") else
                      f"{v:,.2f}" if isinstance(v, float) else str(v)
                      for c, v in row.items() if c != "label"]
            for name, (_, row) in zip(names, frame.iterrows())]
    simulated = int(result.candidates["simulated"].sum())
    stopped = stopped_frame(result)
    if frame.empty and not stopped.empty:  # every run stopped early: say where and why
        print_table(console, [Column("deployment", 0, justify="left"), Column("GPUs", 0),
                              Column("stopped once out of reach", 0, justify="left", wrap=True)],
                    [[r.label, str(r.num_gpus), r.stopped] for r in stopped.itertuples()],
                    wide=wide, title=f"{result.plan.name}: all {simulated} simulated of "
                    f"{len(result.candidates)} candidates stopped early")
        return
    print_table(console, columns, rows, wide=wide, legend=legend, caption="latencies in ms",
                title=f"{result.plan.name}: the Pareto frontier, {len(rows)} of the {simulated} "
                f"simulated of {len(result.candidates)} candidates (the rest are dominated)")


@app.command()
def serve(
    config: Optional[Path] = typer.Argument(
        None, help="serve config YAML, e.g. experiments/real_colocated.yaml or "
        "experiments/real_pd.yaml (default: built-in colocated)"),
    model: Optional[str] = typer.Option(
        None, help="a servable model preset (`pdsim presets` marks them) or a local checkpoint "
        "directory"),
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
    model_path: Optional[str] = typer.Option(None, help="SGLang's spelling of --model"),
    disaggregation_mode: Optional[str] = typer.Option(
        None, help="SGLang's spelling of --role prefill|decode (null: the whole deployment)"),
    disaggregation_bootstrap_port: Optional[int] = typer.Option(
        None, help="SGLang's spelling of --bootstrap-port"),
    tp_size: Optional[int] = typer.Option(
        None, min=1, help="the role's (or a colocated config's) tensor-parallel size"),
) -> None:
    """Serve a real model with an OpenAI-compatible HTTP API until Ctrl-C or SIGTERM:
    colocated, or disaggregated (prefill and decode workers behind a router). SGLang's
    launch_server flags --model-path, --tp-size, --disaggregation-mode,
    --disaggregation-bootstrap-port, --host and --port are understood too."""
    from runtime.serve_config import ServeConfig, load_serve_config

    security = {k: v for k, v in (("api_key", api_key), ("insecure", insecure or None))
                if v is not None} or None
    with _exits_on(ConfigError):
        model, role, bootstrap_port = _sglang_spellings(
            model, model_path, role, disaggregation_mode, bootstrap_port,
            disaggregation_bootstrap_port)
        cfg = load_serve_config(config, model=model, security=security)
        top, sections = {}, {}
        if isinstance(cfg, ServeConfig):
            if role is not None:
                raise ConfigError(f"--role {role}: only a disaggregated config has roles")
            top = {"host": host, "port": port}
            if tp_size is not None:
                sections["colocated"] = {"tp": tp_size}
        elif role not in (None, "prefill", "decode", "router"):
            raise ConfigError(f"--role {role!r}; allowed: prefill, decode, router")
        else:
            section = role if role in ("prefill", "decode") else "router"
            moved = {"host": host} if section != "router" else {"host": host, "port": port}
            moved = {k: v for k, v in moved.items() if v is not None}
            if moved:
                sections[section] = moved
            if tp_size is not None:
                if role not in ("prefill", "decode"):
                    raise ConfigError("--tp-size: a disaggregated deployment has one per role; "
                                      "give --disaggregation-mode prefill|decode (or --role), "
                                      "or set cluster.prefill.tp / cluster.decode.tp")
                sections[role] = {**sections.get(role, {}), "tp": tp_size}
        if top or sections:
            cfg = load_serve_config(config, model=model, security=security, **top, **sections)
    if isinstance(cfg, ServeConfig):
        _serve_colocated(cfg)
    else:
        _serve_disaggregated(cfg, role, instance, port, bootstrap_port, prefill_url, decode_url)


def _sglang_spellings(model, model_path, role, mode, bootstrap_port, sglang_bootstrap_port):
    """`pdsim serve`'s options from SGLang's launch_server spellings; each may be given one
    way only, or both ways alike."""
    def one(name: str, ours, theirs_name: str, theirs):
        if ours is not None and theirs is not None and ours != theirs:
            raise ConfigError(f"--{name} {ours} and --{theirs_name} {theirs} disagree; give one")
        return ours if ours is not None else theirs

    if mode is not None and mode not in ("prefill", "decode", "null"):
        raise ConfigError(f"--disaggregation-mode {mode!r}; allowed: prefill, decode, null")
    return (one("model", model, "model-path", model_path),
            one("role", role, "disaggregation-mode", None if mode == "null" else mode),
            one("bootstrap-port", bootstrap_port, "disaggregation-bootstrap-port",
                sglang_bootstrap_port))


def _serve_colocated(cfg) -> None:
    from runtime.colocated import serve as run_server

    def ready(server) -> None:
        print(f"pdsim serve: {cfg.model_name} ({cfg.mode}) at {server.url}/v1", flush=True)

    try:
        run_server(cfg, on_ready=ready)
    except OSError as exc:  # cannot bind
        _error(f"cannot serve on {cfg.host}:{cfg.port}: {exc}")
        raise typer.Exit(1) from None
    print("pdsim serve: stopped", flush=True)


def _serve_disaggregated(cfg, role, instance, port, bootstrap_port, prefill_url,
                         decode_url) -> None:
    from runtime.launcher import LaunchError, launch, serve_router

    name = cfg.model_name
    for note in cfg.notes():
        typer.echo(f"warning: {note}", err=True)
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
    role: Optional[str] = typer.Option(
        None, help="prefill, decode or colocated (default: colocated for a colocated cluster, "
        "else prefill given --prompt or --prompts, else decode); on a colocated cluster prefill "
        "and decode explain its instance's extend and decode steps"),
    batch: Optional[int] = typer.Option(
        None, help="decode step: requests in the step, per attention-DP rank (default 64)"),
    context: Optional[int] = typer.Option(
        None, help="decode step: context tokens of each request (default 2048)"),
    prompt: Optional[int] = typer.Option(
        None, help="extend step (prefill, or colocated): tokens of each prompt (default 4096)"),
    prompts: Optional[int] = typer.Option(
        None, help="extend step: prompts waiting together, per attention-DP rank, cut into "
        "steps at the role's chunk as its scheduler cuts them (default 1)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    wide: bool = WIDE_OPTION,
) -> None:
    """Price one step of a role op by op: calls, time, share and how each op was priced."""
    import json

    from pdsim.config import load_experiment
    from pdsim.explain import explain_step

    with _exits_on(ConfigError, ValueError):
        cfg, _ = load_experiment(config)
        e = explain_step(cfg, role, batch, context, prompt, prompts,
                         str(config.parent.resolve()))
    if json_out:
        print(json.dumps(e.to_json(), indent=2))
        return
    from rich.table import Table

    from pdsim.tables import target_width

    # The prose folds at the terminal's width (COLUMNS when piped, else 80); the table's rows
    # never do: where they would, its least needed columns go, as `pdsim run`'s do.
    console.print(f"{e.model} on {e.hardware}, {e.role}, {e.cost_model} cost model:\n{e.step}",
                  highlight=False)
    rows = [[r.name, str(r.count), f"{r.each_s * 1e6:.1f}", f"{r.total_s * 1e3:.2f}",
             f"{e.share(r):.1%}", r.table, r.how] for r in e.rows]
    width = target_width(console, wide)
    shown = _explain_columns(rows, width)
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold")
    for i in shown:
        name, justify, _ = _EXPLAIN_COLUMNS[i]
        table.add_column(name, justify=justify, overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    fits = _explain_width(rows, shown)
    Console(width=fits if width is None else min(fits, width), file=console.file,
            force_terminal=console.is_terminal).print(table)
    hidden = [name for i, (name, _, _) in enumerate(_EXPLAIN_COLUMNS) if i not in shown]
    if hidden:
        console.print(f"not shown at {width} columns: {', '.join(hidden)} (--wide shows them)",
                      highlight=False, markup=False)
    groups = ", ".join(f"{g} {v:.1%}" for g, v in e.group_shares().items())
    console.print(f"step {e.total_s * 1e3:.3f} ms (step_time_s {e.step_s * 1e3:.3f} ms); "
                  f"{groups}", highlight=False)


# `pdsim explain`'s table: (header, justify, priority: the largest dropped first when the rows
# would fold; each µs is total ms / n, a silicon table's name is the widest cell)
_EXPLAIN_COLUMNS = (("op", "left", 0), ("n", "right", 1), ("each µs", "right", 3),
                    ("total ms", "right", 0), ("share", "right", 0), ("table", "left", 2),
                    ("how", "left", 1))


def _explain_width(rows: list[list[str]], shown: list[int]) -> int:
    """The width of explain's table of the `shown` columns, unfolded: one space between them."""
    return sum(max([len(_EXPLAIN_COLUMNS[i][0])] + [len(row[i]) for row in rows])
               for i in shown) + len(shown) - 1


def _explain_columns(rows: list[list[str]], width: int | None) -> list[int]:
    """The columns of explain's table that fit `width` (None: all)."""
    shown = list(range(len(_EXPLAIN_COLUMNS)))
    while width is not None and _explain_width(rows, shown) > width:
        droppable = [i for i in shown if _EXPLAIN_COLUMNS[i][2]]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (_EXPLAIN_COLUMNS[i][2], i)))
    return shown


def _count(n: float) -> str:
    """A parameter count: "8.03B", "419.4M"."""
    return f"{n / 1e9:.4g}B" if n >= 1e9 else f"{n / 1e6:.4g}M"


@app.command()
def presets(wide: bool = WIDE_OPTION) -> None:
    """List the model and hardware presets and their main figures (sources: docs/cost_model.md)."""
    from pdsim.deployment import model_presets
    from pdsim.specs.hardware import hardware_preset_names, load_hardware_spec
    from pdsim.specs.models import model_preset, model_preset_names
    from pdsim.tables import Column, print_table

    backends = model_presets()
    rows = []
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
        rows.append([name, _count(m.num_params), _count(m.active_params_per_token),
                     m.attention_summary,
                     mlp, formats, " + ".join(backends[name])])
    columns = [Column("name", 0, "left"), Column("params", 1), Column("active/token", 1),
               Column("attention", 2, "left", wrap=True), Column("MLP", 1, "left", wrap=True),
               Column("weight formats", 3, "left", wrap=True),
               Column("backends", 2, "left", wrap=True)]
    print_table(console, columns, rows, title="models (pdsim/specs/models.py)", wide=wide)
    rows = []
    for name in hardware_preset_names():
        h = load_hardware_spec(name)
        rows.append([f"{v:g}" if isinstance(v, (int, float)) else "-" if v is None else v
                     for v in (name, h.bf16_tflops, h.fp8_tflops, h.fp4_tflops, h.hbm_gib,
                               h.hbm_gb_per_s, h.nvlink_gb_per_s, h.rdma_gb_per_s,
                               h.gpus_per_node, h.usd_per_gpu_hour)])
    headers = (("BF16 TF", 1), ("FP8 TF", 1), ("FP4 TF", 2), ("HBM GiB", 1), ("HBM GB/s", 1),
               ("NVLink GB/s", 2), ("NIC GB/s", 2), ("NVLink domain", 3), ("$/GPU-h", 1))
    columns = [Column("name", 0, "left")] + [Column(h, p) for h, p in headers]
    print_table(console, columns, rows, wide=wide,
                title="hardware, per GPU, dense peaks (pdsim/specs/hardware.py)")



@app.command("import-sglang")
def import_sglang(
    commands: str = typer.Argument(..., help="SGLang launch commands (a launch.sh), or - for "
                                   "standard input"),
    base: Path = typer.Option(..., help="experiment whose workload, hardware, SLO... the "
                              "deployment is simulated with (`pdsim plan` writes one beside "
                              "launch.sh); its model, cluster and router are replaced"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write the YAML here "
                                       "(default: standard output)"),
    name: Optional[str] = typer.Option(None, help="the experiment's name (default: the base's)"),
    model: Optional[str] = typer.Option(
        None, help="the simulator's model when --model-path is none it knows (a preset or a "
        "file)"),
) -> None:
    """Read SGLang's launch commands (a server per role instance and the router, as `pdsim plan`
    writes them in launch.sh) into an experiment YAML that `pdsim run` simulates; warn of the
    flags read past that may change performance but are not modelled."""
    import sys

    import yaml

    from pdsim.config import parse_experiment, read_config_file
    from pdsim.planning.import_sglang import import_sglang as read_commands

    with _exits_on(ConfigError, OSError):
        text = sys.stdin.read() if commands == "-" else Path(commands).read_text()
        data, notes = read_commands(text, read_config_file(base, "experiment") or {},
                                    name=name, model=model, base_dir=base.parent)
        parse_experiment(data, f"{commands} over {base}")  # what `pdsim run` will check
        for note in notes:  # on standard error: standard output may be the YAML
            typer.echo(f"warning: {note}", err=True)
        doc = yaml.safe_dump(data, sort_keys=False)
        if out is None:
            print(doc, end="")
        else:
            out.write_text(doc)
            console.print(f"wrote {out}", highlight=False)


def _summaries_on_one_line(typer_app: typer.Typer) -> None:
    """Typer's list of commands keeps the line breaks of a docstring's first paragraph (a
    command's own page joins them): give every command that paragraph on one line."""
    for info in typer_app.registered_commands:
        if info.short_help is None and info.callback.__doc__:
            info.short_help = " ".join(info.callback.__doc__.split("\n\n")[0].split())


_summaries_on_one_line(app)

if __name__ == "__main__":
    app()
