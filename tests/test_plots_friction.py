"""What new users missed in the plots, tables and progress output (issue 20): SLO bounds on the
latency panels, GPUs and parallelism on the P:D axis, legends outside the data in words,
whole-number ticks on whole-number axes, the throughput-per-GPU against tokens-per-user chart
for runs and plans, the prefix hit rate of the prefix-cache experiment, and progress lines."""

from __future__ import annotations

import asyncio
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from pdsim import plots, progress
from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, summarize

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP_PNGS = ["ttft.png", "itl.png", "output_throughput_per_gpu.png", "goodput_per_gpu.png",
              plots.INTERACTIVITY_PNG]


@pytest.fixture
def captured(monkeypatch):
    """Figures as saved, by file name (pdsim.plots and the plan's frontier alike)."""
    figures = {}
    save = Figure.savefig

    def keep(fig, path, *args, **kwargs):
        figures[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _records(seed: int, ttft_s: float, gap_s: float, n: int = 30) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i, arrival in enumerate(np.cumsum(rng.exponential(0.5, n))):
        first = arrival + rng.exponential(ttft_s)
        times = list(first + gap_s * np.arange(int(rng.integers(4, 12))))
        out.append(RequestRecord(rid=str(i), input_tokens=200, output_tokens=len(times),
                                 status="ok", arrival_s=float(arrival), first_token_s=times[0],
                                 finish_s=times[-1], token_times_s=times))
    return out


def _summary(points: list[dict], **columns) -> pd.DataFrame:
    """One summary row per point of `sweep.` fields: the toy runs get slower with each point."""
    rows = []
    for i, fields in enumerate(points):
        s = summarize(_records(i, 0.1 * (1 + i), 0.01 * (1 + i % 3)), num_gpus=2,
                      slo=SLO(ttft_s=0.5, itl_s=0.02))
        rows.append({"point": i, "mode": "disaggregated", "prefill_instances": 1,
                     "decode_instances": 1, "request_rate": 2.0, "concurrency": 0, **s,
                     **{k: v[i] for k, v in columns.items()},
                     **{f"sweep.{k}": v for k, v in fields.items()}})
    return pd.DataFrame(rows)


def _dashed_at(ax, y: float) -> bool:
    return any(line.get_linestyle() == "--" and np.allclose(line.get_ydata(), y)
               for line in ax.get_lines())


def _legend_outside(fig, ax) -> bool:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out as saved
    renderer = canvas.get_renderer()
    return ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


@pytest.mark.slow
def test_sweep_of_a_number_and_a_category_draws_slo_lines_integer_ticks_and_legends_outside(
        tmp_path, captured):
    summary = _summary([{"cluster.prefill.instances": n,
                         "cluster.prefill.scheduler.disable_radix_cache": off}
                        for off in (False, True) for n in (1, 2, 3, 4)])
    slo = SLO(ttft_s=0.5, itl_s=0.02)
    paths = plots.plot_experiment(summary, tmp_path, slo=slo)
    assert [p.name for p in paths] == SWEEP_PNGS
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    ttft, itl = captured["ttft.png"].axes[0], captured["itl.png"].axes[0]
    assert _dashed_at(ttft, 500.0) and _dashed_at(itl, 20.0)  # the bounds, in ms
    assert "SLO: TTFT ≤ 500 ms" in [t.get_text() for t in ttft.get_legend().get_texts()]
    for name in ("ttft.png", "output_throughput_per_gpu.png"):
        ax = captured[name].axes[0]
        assert ax.get_xlabel() == "prefill instances"
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        legend = ax.get_legend()
        assert legend.get_title().get_text() == "prefill radix cache disabled"
        assert [t.get_text() for t in legend.get_texts()][:2] == ["False", "True"]
        assert _legend_outside(captured[name], ax)
    # the throughput panel has no SLO line: it is not a latency
    assert not any(line.get_linestyle() == "--"
                   for line in captured["output_throughput_per_gpu.png"].axes[0].get_lines())


@pytest.mark.slow
def test_a_sweep_of_categories_alone_still_plots_them_as_categories(tmp_path, captured):
    policies = ["round_robin", "least_loaded", "cache_aware"]
    summary = _summary([{"router.policy": p} for p in policies])
    paths = plots.plot_experiment(summary, tmp_path, slo=SLO(ttft_s=0.5, itl_s=1.0))
    assert [p.name for p in paths] == SWEEP_PNGS
    ax = captured["ttft.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == policies
    assert ax.get_xlabel() == "router policy"
    assert all(line.get_linestyle() in ("None", "--") for line in ax.get_lines())  # points
    # an ITL bound of 1 s over gaps of 10-30 ms stays off the top rather than flatten the data
    itl = captured["itl.png"].axes[0]
    assert itl.get_ylim()[1] < 100
    assert "SLO: mean ITL per request ≤ 1000 ms (above the plot)" in [
        t.get_text() for t in itl.get_legend().get_texts()]


@pytest.mark.slow
def test_pd_axis_names_gpus_and_parallelism(tmp_path, captured):
    pairs = [(1, 3), (2, 2), (2, 6)]
    summary = _summary(
        [{"cluster.prefill.instances": p, "cluster.decode.instances": d} for p, d in pairs],
        prefill_instances=[p for p, _ in pairs], decode_instances=[d for _, d in pairs],
        prefill_tp=[4, 4, 8], decode_tp=[4, 4, 4], prefill_dp_attention=[1, 1, 1],
        decode_dp_attention=[1, 1, 4])
    summary["num_gpus"] = [16, 16, 40]
    plots.plot_experiment(summary, tmp_path)
    ticks = [t.get_text() for t in captured["ttft.png"].axes[0].get_xticklabels()]
    # ordered by prefill share (2P:6D's equals 1P:3D's)
    assert ticks == ["1P:3D\n16 GPU, tp4", "2P:6D\n40 GPU, tp8 / tp4 dp4", "2P:2D\n16 GPU, tp4"]


@pytest.mark.slow
def test_interactivity_chart_plots_every_point_and_rings_the_frontier(tmp_path, captured):
    summary = _summary([{"cluster.decode.tp": tp} for tp in (1, 2, 4, 8, 16)])
    assert plots.plot_experiment(summary, tmp_path)[-1].name == plots.INTERACTIVITY_PNG
    ax = captured[plots.INTERACTIVITY_PNG].axes[0]
    user = 1.0 / summary["tpot_mean_s"].to_numpy()
    gpu = summary["output_tok_s_per_gpu"].to_numpy()
    drawn = np.concatenate([c.get_offsets() for c in ax.collections if len(c.get_offsets())
                            and c.get_facecolors().size])  # filled: the points themselves
    assert sorted(map(tuple, drawn.round(6))) == sorted(zip(user.round(6), gpu.round(6)))
    front = plots.pareto_upper_right(user, gpu)
    assert front.any() and not front.all()  # the toy runs trade one for the other
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "Pareto frontier"]
    order = np.argsort(user[front])
    np.testing.assert_allclose(line.get_xdata(), user[front][order])
    np.testing.assert_allclose(line.get_ydata(), gpu[front][order])
    assert "per user" in ax.get_xlabel() and "per GPU" in ax.get_ylabel()


def test_pareto_upper_right():
    x = np.array([1.0, 2.0, 3.0, 2.0, np.nan])
    y = np.array([3.0, 2.0, 1.0, 1.0, 9.0])
    assert plots.pareto_upper_right(x, y).tolist() == [True, True, True, False, False]


def test_log_axes_read_as_plain_numbers(tmp_path):
    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([4.5, 6.5], [1, 2])
    plots.log_axis(ax.xaxis)
    fig.savefig(tmp_path / "x.png")
    lo, hi = ax.get_xlim()
    labels = [t.get_text() for t in ax.get_xticklabels(minor=True)
              if t.get_text() and lo <= t.get_position()[0] <= hi]
    assert labels == ["5", "6"]  # not 5×10^0


# --------------------------------------------------------------------------------------------
# Whole runs: the prefix-cache experiment, tiny, and a tiny plan


@pytest.fixture(scope="module")
def prefix_run(tmp_path_factory, traces):
    from pdsim.runner import run_experiment

    raw = yaml.safe_load((REPO / "experiments" / "prefix_cache.yaml").read_text())
    raw["workload"].update(trace=str(traces / "conversation_trace.jsonl"), num_requests=24)
    raw["sweep"] = {"cluster.prefill.scheduler.disable_radix_cache": [False, True],
                    "cluster.prefill.instances": [1, 2]}
    out = tmp_path_factory.mktemp("prefix")
    path = out / "prefix_cache.yaml"
    path.write_text(yaml.safe_dump(raw))
    summary, out_dir = run_experiment(path, out / "results", jobs=2, progress=False)
    return summary, out_dir


@pytest.mark.slow
def test_prefix_experiment_shows_its_hit_rate_in_the_report_and_the_table(prefix_run,
                                                                         monkeypatch):
    from pdsim import cli

    summary, out = prefix_run
    cached = ~summary["sweep.cluster.prefill.scheduler.disable_radix_cache"]
    assert (summary.loc[cached, "prefix_hit_rate"] > 0).all()
    assert (summary.loc[~cached, "prefix_hit_rate"] == 0).all()
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if "TTFT p50 (ms)" in line)
    column = [c.strip() for c in header.split("|")].index("prefix hit")
    rows = [[c.strip() for c in line.split("|")] for line in report.splitlines()
            if line.startswith("| prefill.instances=")]
    assert len(rows) == 4
    hits = {f"{float(r) * 100:.1f}%" for r in summary["prefix_hit_rate"]}
    assert {r[column] for r in rows} == hits
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=300))
    cli._print_points(summary, "t", wide=True)
    table = cli.console.file.getvalue()
    assert "prefix hit" in table and all(h in table for h in hits)


@pytest.mark.slow
def test_prefix_experiment_writes_every_plot(prefix_run):
    _, out = prefix_run
    for name in SWEEP_PNGS + ["ttft_cdf.png", "itl_cdf.png"]:
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    assert f"]({plots.INTERACTIVITY_PNG})" in (out / "report.md").read_text()


def test_a_run_without_a_prefix_cache_has_no_prefix_column():
    from pdsim.tables import shows_prefix_hits

    summary = _summary([{"router.policy": p} for p in ("round_robin", "cache_aware")])
    assert (summary["prefix_hit_rate"] == 0).all() and not shows_prefix_hits(summary)
    assert shows_prefix_hits(summary.assign(prefix_hit_rate=[0.0, 0.3]))


@pytest.mark.slow
def test_plan_writes_frontier_with_tpot_panels_and_the_interactivity_chart(tmp_path, captured,
                                                                           capsys):
    from pdsim.planning import parse_plan, plan

    cfg = parse_plan({
        "name": "tiny_plan", "model": "llama-3.1-8b", "hardware": "h100",
        "workload": {"num_requests": 40, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 60},
                     "input_len": {"dist": "lognormal", "mean": 1024, "cv": 0.5, "min": 64,
                                   "max": 4096},
                     "output_len": {"dist": "lognormal", "mean": 64, "cv": 0.5, "min": 8,
                                    "max": 256}},
        "slo": {"ttft_p90_s": 0.4, "tpot_p90_s": 0.012},
        "max_gpus": 2, "search": {"tp": [1, 2]}})
    result = plan(cfg, out_dir=tmp_path, jobs=2, progress=True)
    err = capsys.readouterr().err  # not a terminal: one line per phase
    assert f"pre-filtering {len(result.candidates)} deployments..." in err
    assert "simulating tiny_plan (" in err
    for name in ("frontier.png", plots.INTERACTIVITY_PNG):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
        assert f"]({name})" in (tmp_path / "report.md").read_text()
    frontier = captured["frontier.png"]
    xlabels = [ax.get_xlabel() for ax in frontier.axes if ax.get_xlabel()]
    assert {"TTFT p90 (ms)", "TPOT p90 (ms)"} <= set(xlabels)
    tpot = [ax for ax in frontier.axes if ax.get_xlabel() == "TPOT p90 (ms)"]
    assert all(any(line.get_linestyle() == "--" and np.allclose(line.get_xdata(), 12.0)
                   for line in ax.get_lines()) for ax in tpot)  # the TPOT target, dashed
    chart = captured[plots.INTERACTIVITY_PNG].axes[0]
    sims = result.candidates[result.candidates["simulated"]]
    points = sum(len(c.get_offsets()) for c in chart.collections
                 if c.get_label() in ("meets the SLO", "misses the SLO"))
    assert points == len(sims)
    if result.recommended is not None:
        assert any(c.get_label() == "recommended" for c in chart.collections)


# --------------------------------------------------------------------------------------------
# Progress


def _console(monkeypatch, terminal: bool) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(progress, "_stderr",
                        lambda: Console(file=out, force_terminal=terminal, width=120))
    return out


def test_phases_print_one_line_each_when_not_on_a_terminal(monkeypatch):
    out = _console(monkeypatch, terminal=False)
    with progress.phase("pre-filtering 12 deployments") as show:
        show("still going")  # dropped: no redraws in a log
    with progress.progress_bar("simulating x", 3) as bar:
        bar.advance()
    with progress.phase("hidden", show=False):
        pass
    assert out.getvalue() == "pre-filtering 12 deployments...\nsimulating x (3)...\n"


def test_on_a_terminal_bars_show_the_time_left(monkeypatch):
    out = _console(monkeypatch, terminal=True)
    with progress.progress_bar("simulating x", 4) as bar:
        for _ in range(4):
            bar.advance()
    text = out.getvalue()
    assert "simulating x" in text and "4/4" in text and "eta" in text
    assert "0:00:00" in text  # elapsed and remaining columns


class _SlowHealth(BaseHTTPRequestHandler):
    """/health answers 503 until `ready` is set."""

    ready = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        code = 200 if self.ready.is_set() else 503
        body = b'{"role": "decode"}' if code == 200 else b"{}"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.real
@pytest.mark.slow
def test_serve_start_up_names_the_workers_it_waits_for(monkeypatch):
    from runtime.launcher import WorkerProcess, wait_healthy

    out = _console(monkeypatch, terminal=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Timer(0.5, _SlowHealth.ready.set).start()
    try:
        health = asyncio.run(wait_healthy([WorkerProcess("decode", 0, url, None)],
                                          asyncio.Event(), timeout_s=20))
    finally:
        server.shutdown()
    assert health == {url: {"role": "decode"}}
    assert out.getvalue() == "waiting for decode worker 0 to be healthy...\n"
