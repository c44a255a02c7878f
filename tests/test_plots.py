"""Plots and the markdown report, drawn from small summaries and request tables built here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pdsim import plots
from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, records_frame, summarize
from pdsim.plots import plot_latency_cdfs, plot_sweep, with_pd_ratio
from pdsim.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP_FILES = ["ttft.png", "itl.png", "output_throughput_per_gpu.png", "goodput_per_gpu.png"]


def run(prefill, decode, rate, n=40):
    """Records of a toy run: TTFT shrinks with prefill instances, ITL with decode instances."""
    rng = np.random.default_rng(prefill * 100 + decode * 10 + rate)
    records = []
    for i, arrival in enumerate(np.cumsum(rng.exponential(1.0 / rate, n))):
        ttft = rng.exponential(0.3 * rate / prefill)
        tpot = 0.02 * (1.0 + rate / (2.0 * decode))
        times = list(arrival + ttft + tpot * np.arange(int(rng.integers(4, 20))))
        records.append(RequestRecord(
            rid=f"{i}", input_tokens=int(rng.integers(50, 500)), output_tokens=len(times), status="ok",
            arrival_s=float(arrival), first_token_s=times[0], finish_s=times[-1], token_times_s=times))
    return records


CONFIGS = [(3, 1), (1, 3), (1, 1), (2, 2)]
RATES = [1, 4]


@pytest.fixture(scope="module")
def sweep():
    rows, frames = [], []
    for p, d in CONFIGS:
        for rate in RATES:
            records = run(p, d, rate)
            summary = summarize(records, num_gpus=2 * (p + d), slo=SLO(ttft_s=0.5, itl_s=0.05))
            rows.append({"prefill_instances": p, "decode_instances": d, "request_rate": rate, **summary})
            frame = records_frame(records)
            frames.append(frame.assign(point=f"{p}P:{d}D @ {rate} req/s", request_rate=rate))
    return pd.DataFrame(rows), pd.concat(frames, ignore_index=True)


@pytest.fixture
def captured(monkeypatch):
    """Figures as saved, keyed by file name, to check what was drawn."""
    figures = {}
    save = plots._save

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def assert_pngs(paths, names):
    assert [p.name for p in paths] == names
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_pd_ratio_labels_and_prefill_share():
    frame = with_pd_ratio(pd.DataFrame({"prefill_instances": [1, 3, 0],
                                        "decode_instances": [3, 1, 4]}))
    assert frame["pd_ratio"].tolist() == ["1P:3D", "3P:1D", "colocated ×4"]  # not "0P:4D"
    assert frame["prefill_share"].tolist() == [0.25, 0.75, 0.0]


def colocated_vs_pd(clients=(4, 16)) -> pd.DataFrame:
    """A summary of colocated x4 (TP 2) against 1P:3D and 2P:2D (TP 1), at each client count."""
    rows = []
    for mode, p, d, tp in (("colocated", 0, 4, 2), ("disaggregated", 1, 3, 1),
                           ("disaggregated", 2, 2, 1)):
        for i, n in enumerate(clients):
            s = summarize(run(max(p, 1), d, 1 + i), num_gpus=(p + d) * tp,
                          slo=SLO(ttft_s=0.5, itl_s=0.05))
            rows.append({"mode": mode, "prefill_instances": p, "decode_instances": d,
                         "prefill_tp": tp * (p > 0), "decode_tp": tp, "prefill_dp_attention": 1,
                         "decode_dp_attention": 1, "request_rate": float("nan"),
                         "concurrency": n, **s, "sweep.cluster.mode": mode,
                         "sweep.cluster.prefill.instances": max(p, 1),
                         "sweep.cluster.decode.instances": d,
                         "sweep.workload.arrival.concurrency": n})
    return pd.DataFrame(rows)


@pytest.mark.slow
def test_legends_name_colocated_runs_and_the_gpus_of_each_configuration(tmp_path, captured):
    summary = colocated_vs_pd()
    assert plots.sweep_labels(summary)[:2] == ["colocated ×4 @ 4 clients",
                                               "colocated ×4 @ 16 clients"]
    plots.plot_experiment(summary, tmp_path)
    ticks = [t.get_text() for t in captured["ttft.png"].axes[0].get_xticklabels()]
    assert ticks[0] == "colocated ×4\n8 GPU, tp2"
    names = ["colocated ×4, 8 GPU, tp2", "1P:3D, 4 GPU, tp1", "2P:2D, 4 GPU, tp1"]
    for png in ("throughput_vs_ttft.png", plots.INTERACTIVITY_PNG):
        legend = captured[png].axes[0].get_legend()
        assert set(names) <= {t.get_text() for t in legend.get_texts()}, png
    # One configuration: its one line or curve still says what it is.
    one = summary[summary["mode"] == "colocated"]
    plots.plot_experiment(one, tmp_path / "one")
    for png in ("ttft.png", "throughput_vs_itl.png"):
        texts = [t.get_text() for t in captured[png].axes[0].get_legend().get_texts()]
        assert texts[0] == "colocated ×4, 8 GPU, tp2", png


@pytest.mark.slow
def test_plot_sweep_multi_point(sweep, tmp_path, captured):
    summary, _ = sweep
    paths = plot_sweep(summary, tmp_path / "sweep")
    assert_pngs(paths, SWEEP_FILES)
    ax = captured["ttft.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "1P:3D\n8 GPU", "1P:1D\n4 GPU", "2P:2D\n8 GPU", "3P:1D\n8 GPU"]  # no TP columns here
    assert "ms" in ax.get_ylabel() and ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["1 req/s", "4 req/s", "p50", "p99"]
    assert len(ax.get_lines()) == len(RATES) * 2
    # Values are plotted in ms, in prefill-share order.
    p50_rate1 = ax.get_lines()[0].get_ydata()
    expected = [summary.set_index(["prefill_instances", "decode_instances", "request_rate"])
                .loc[(p, d, 1), "ttft_p50_s"] * 1e3 for p, d in [(1, 3), (1, 1), (2, 2), (3, 1)]]
    np.testing.assert_allclose(p50_rate1, expected)
    goodput = captured["goodput_per_gpu.png"].axes[0]
    assert "per GPU" in goodput.get_ylabel() and len(goodput.get_lines()) == len(RATES)


@pytest.mark.slow
def test_plot_sweep_single_configuration_uses_request_rate(sweep, tmp_path, captured):
    summary, _ = sweep
    one = summary[(summary.prefill_instances == 1) & (summary.decode_instances == 3)]
    paths = plot_sweep(one, tmp_path / "single")
    assert_pngs(paths, SWEEP_FILES)
    ax = captured["itl.png"].axes[0]
    assert ax.get_xlabel() == "request rate (req/s)"
    np.testing.assert_allclose(ax.get_lines()[0].get_xdata(), RATES)
    assert [t.get_text() for t in ax.get_legend().get_texts()][0] == "1P:3D, 8 GPU"


@pytest.mark.slow
def test_plot_sweep_single_row_and_empty(sweep, tmp_path):
    summary, _ = sweep
    assert_pngs(plot_sweep(summary.iloc[:1], tmp_path / "row"), SWEEP_FILES)
    assert plot_sweep(summary.iloc[:0], tmp_path / "none") == []


@pytest.mark.slow
def test_plot_sweep_averages_repeated_points(sweep, tmp_path, captured):
    summary, _ = sweep
    twice = pd.concat([summary, summary.assign(ttft_p50_s=summary["ttft_p50_s"] + 1.0)])
    plot_sweep(twice, tmp_path)
    ax = captured["ttft.png"].axes[0]
    assert len(ax.get_lines()) == len(RATES) * 2
    assert len(ax.get_lines()[0].get_xdata()) == len(CONFIGS)


def test_plot_sweep_names_missing_columns(sweep, tmp_path):
    summary, _ = sweep
    with pytest.raises(ValueError, match="prefill_instances"):
        plot_sweep(summary.drop(columns=["prefill_instances"]), tmp_path)


@pytest.mark.slow
def test_plot_latency_cdfs(sweep, tmp_path, captured):
    _, requests = sweep
    paths = plot_latency_cdfs(requests, tmp_path, max_curves=3)
    assert_pngs(paths, ["ttft_cdf.png", "itl_cdf.png"])
    ax = captured["ttft_cdf.png"].axes[0]
    assert len(ax.get_legend().get_texts()) == 3
    assert "3 of 8 points" in ax.get_title()
    line = ax.get_lines()[0]
    assert line.get_ydata()[-1] == 1.0 and np.all(np.diff(line.get_xdata()) >= 0)


@pytest.mark.slow
def test_plot_latency_cdfs_split_by_rate(sweep, tmp_path):
    _, requests = sweep
    paths = plot_latency_cdfs(requests, tmp_path, split="request_rate")
    assert_pngs(paths, ["ttft_cdf_request_rate-1.png", "itl_cdf_request_rate-1.png",
                        "ttft_cdf_request_rate-4.png", "itl_cdf_request_rate-4.png"])


def test_cdf_curves_kept_are_the_most_distinct():
    # Four near-copies at 10 ms, one at 100 ms, one at 1 s: three curves keep 10 ms, 100 ms, 1 s.
    medians = {"a": 0.010, "b": 0.0101, "c": 0.0102, "d": 0.0103, "e": 0.1, "f": 1.0}
    frame = pd.DataFrame([{"point": k, "ttft_s": v * f, "itl_mean_s": 0.02}
                          for k, v in medians.items() for f in (0.5, 1.0, 1.5)])
    names, total = plots._pick_curves(frame, "point", 3)
    assert total == 6 and names[1:] == ["e", "f"] and names[0] in "abcd"


@pytest.mark.slow
def test_write_report(sweep, tmp_path):
    summary, _ = sweep
    summary = summary.copy()
    # Rate 1: 1P:1D has the best goodput per GPU, 3P:1D the best SLO attainment.
    at = {(p, d): (summary.prefill_instances == p) & (summary.decode_instances == d)
          & (summary.request_rate == 1) for p, d in CONFIGS}
    summary.loc[at[1, 1], ["goodput_req_s_per_gpu", "slo_attainment"]] = [0.9, 0.80]
    summary.loc[at[3, 1], ["goodput_req_s_per_gpu", "slo_attainment"]] = [0.5, 0.99]
    summary.loc[at[1, 3], ["goodput_req_s_per_gpu", "slo_attainment"]] = [0.1, 0.50]
    summary.loc[at[2, 2], ["goodput_req_s_per_gpu", "slo_attainment", "ttft_p50_s"]] = [0.2, 0.60, 0.25]
    figures = plot_sweep(summary, tmp_path / "plots")

    path = write_report(summary, tmp_path, title="Ratio sweep", config_text="seed: 1\nrates: [1, 4]\n",
                        plots=figures, slo=SLO(ttft_s=0.5, itl_s=0.05))
    assert path == tmp_path / "report.md"
    text = path.read_text()
    assert text.startswith("# Ratio sweep\n")
    assert "| 1 | 1P:1D | 0.900 | 3P:1D | 99.0% |" in text
    header = next(line for line in text.splitlines() if line.startswith("| P:D |"))
    assert "TTFT p50 (ms)" in header and "goodput/GPU (req/s)" in header
    row = next(line for line in text.splitlines() if line.startswith("| 2P:2D | 1 |"))
    assert "| 250 |" in row  # 0.25 s shown in ms
    assert len([line for line in text.splitlines() if re.match(r"\| \dP:\dD \|", line)]) == len(summary)
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == [f"plots/{name}" for name in SWEEP_FILES]
    assert all((tmp_path / link).is_file() for link in links)
    assert "```yaml\nseed: 1\nrates: [1, 4]\n```" in text
    assert "TTFT ≤ 500 ms" in text
    # Same input, same bytes.
    assert write_report(summary, tmp_path, title="Ratio sweep", config_text="seed: 1\nrates: [1, 4]\n",
                        plots=figures, slo=SLO(ttft_s=0.5, itl_s=0.05)).read_text() == text


def test_write_report_without_winners_or_plots(sweep, tmp_path):
    summary, _ = sweep
    hopeless = summary.assign(goodput_req_s=0.0, goodput_req_s_per_gpu=0.0, slo_attainment=0.0)
    text = write_report(hopeless, tmp_path, title="t", config_text=None, plots=[]).read_text()
    assert "| 1 | – | – | – | – |" in text and "## Plots" not in text and "## Configuration" not in text


def swept(rows):
    """A summary of runs that vary the given `sweep.` fields."""
    out = []
    for i, fields in enumerate(rows):
        records = run(1, 1 + i % 3, 2)
        summary = summarize(records, num_gpus=2, slo=SLO(ttft_s=0.5, itl_s=0.05))
        out.append({"point": i, "mode": "disaggregated", "prefill_instances": 1, "decode_instances": 1,
                    "request_rate": 2.0, "concurrency": 0, **summary,
                    **{f"sweep.{k}": v for k, v in fields.items()}})
    return pd.DataFrame(out)


def test_sweep_labels_name_what_varies(sweep):
    summary, _ = sweep
    pd_sweep = summary.assign(**{"sweep.cluster.prefill.instances": summary["prefill_instances"],
                                 "sweep.workload.arrival.rate_rps": summary["request_rate"]})
    assert plots.sweep_labels(pd_sweep)[:2] == ["3P:1D @ 1 req/s", "3P:1D @ 4 req/s"]
    ep = swept([{"cluster.decode.tp": tp, "cluster.decode.ep": tp, "cluster.decode.two_batch_overlap": tbo}
                for tp in (8, 16) for tbo in (False, True)])
    assert plots.sweep_labels(ep)[1] == "decode.tp=8, decode.two_batch_overlap=True"  # ep moves with tp
    clients = swept([{"workload.arrival.concurrency": n} for n in (1, 4)])
    clients["concurrency"] = clients["sweep.workload.arrival.concurrency"]
    assert plots.sweep_labels(clients) == ["1P:1D @ 1 client", "1P:1D @ 4 clients"]
    # Fields that move with the x field (the first numeric one) are not repeated.
    scale = swept([{"cluster.decode.ep": n, "cluster.prefill.instances": n // 8,
                    "speculative.acceptance.rates": [0.8, 0.6], "workload.arrival.concurrency": 64 * n}
                   for n in (8, 16)])
    assert plots.sweep_labels(scale) == ["decode.ep=8", "decode.ep=16"]


@pytest.mark.slow
def test_generic_sweep_plots_against_its_field_one_line_per_other_field(tmp_path, captured):
    ep = swept([{"cluster.decode.tp": tp, "cluster.decode.ep": tp, "cluster.decode.two_batch_overlap": tbo}
                for tp in (8, 16, 32) for tbo in (False, True)])
    paths = plots.plot_experiment(ep, tmp_path)
    # no throughput-latency curve: clients do not vary
    assert_pngs(paths, SWEEP_FILES + ["throughput_vs_interactivity.png"])
    ax = captured["output_throughput_per_gpu.png"].axes[0]
    assert ax.get_xlabel() == "decode tp"
    legend = ax.get_legend()
    # tp and ep move together: one line per two-batch-overlap setting, three points each.
    assert legend.get_title().get_text() == "decode two batch overlap"
    assert [t.get_text() for t in legend.get_texts()] == ["False", "True"]
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[8, 16, 32]] * 2
    np.testing.assert_allclose(ax.get_lines()[1].get_ydata(),
                               ep[ep["sweep.cluster.decode.two_batch_overlap"]]["output_tok_s_per_gpu"])


@pytest.mark.slow
def test_concurrency_sweep_draws_throughput_against_latency(tmp_path, captured):
    clients = swept([{"workload.arrival.concurrency": n} for n in (1, 4, 16, 64, 256)])
    clients["concurrency"] = clients["sweep.workload.arrival.concurrency"]
    paths = plots.plot_experiment(clients, tmp_path)
    assert_pngs(paths, SWEEP_FILES + ["throughput_vs_ttft.png", "throughput_vs_itl.png",
                                      "throughput_vs_interactivity.png"])
    ax = captured["throughput_vs_ttft.png"].axes[0]
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_xdata(), clients["ttft_p50_s"] * 1e3)
    np.testing.assert_allclose(line.get_ydata(), clients["output_tok_s_per_gpu"])
    assert [t.get_text() for t in ax.texts] == ["1", "4", "16", "64", "256"]
    ttft = captured["ttft.png"].axes[0]
    assert ttft.get_xlabel() == "concurrent clients" and ttft.get_xscale() == "log"  # 1 ... 256
    best = clients.loc[clients["goodput_req_s_per_gpu"].idxmax(), "concurrency"]
    text = write_report(clients, tmp_path, title="t", config_text=None, plots=[]).read_text()
    assert f"| 2 | 1P:1D @ {best} clients |" in text  # the best point names its client count


@pytest.mark.slow
def test_a_sweep_with_clients_and_another_field_draws_one_curve_per_setting(tmp_path, captured):
    spec = swept([{"speculative.num_draft_tokens": k, "workload.arrival.concurrency": n}
                  for k in (1, 3) for n in (8, 32, 128)])
    spec["concurrency"] = spec["sweep.workload.arrival.concurrency"]
    plots.plot_experiment(spec, tmp_path)
    assert captured["ttft.png"].axes[0].get_xlabel() == "speculative num draft tokens"
    ax = captured["throughput_vs_itl.png"].axes[0]
    assert ax.get_legend().get_title().get_text() == "speculative num draft tokens"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["1", "3"]
    assert [len(line.get_xdata()) for line in ax.get_lines()] == [3, 3]


def test_report_of_a_generic_sweep_names_its_fields(tmp_path):
    spec = swept([{"speculative.num_draft_tokens": k, "speculative.method": m}
                  for m, k in (("mtp", 3), ("mtp", 1), ("none", 1))])
    text = write_report(spec, tmp_path, title="t", config_text=None, plots=[]).read_text()
    header = next(line for line in text.splitlines() if line.startswith("| speculative.num_draft_tokens, "))
    assert "speculative.method" in header and "clients" not in header  # open loop: no clients column
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| speculative.")]
    assert rows[1:] == ["speculative.num_draft_tokens=3, speculative.method=mtp",
                        "speculative.num_draft_tokens=1, speculative.method=mtp",
                        "speculative.num_draft_tokens=1, speculative.method=none"]  # sweep order
