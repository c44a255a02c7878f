"""What users tripped over in the run table, the report's text and the CLI's errors: a narrow
table hid the failures and explained a column it did not show, the report said goodput
counted other requests than SLO attainment, and errors were folded over several lines."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from pdsim import cli
from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, summarize
from pdsim.report import write_report


def point(label: str, failed: int) -> dict:
    """A summary row of 20 requests, `failed` of them failed, priced."""
    records = []
    for i in range(20):
        times = list(0.5 * i + 0.2 + 0.01 * np.arange(8))
        records.append(RequestRecord(rid=str(i), input_tokens=100, output_tokens=8,
                                     status="failed" if i < failed else "ok",
                                     arrival_s=0.5 * i, first_token_s=times[0],
                                     finish_s=times[-1], token_times_s=times))
    s = summarize(records, num_gpus=2, slo=SLO())
    return {"label": label, "request_rate": 2.0, **s, "prefill_busy_frac": 0.3,
            "decode_mean_batch": 1.2, "usd_per_mtok": 4.5, "goodput_req_per_usd": 900.0}


def table(summary: pd.DataFrame, monkeypatch, columns: int) -> str:
    out = io.StringIO()
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(cli, "console", Console(file=out, width=columns))
    cli._print_points(summary, "t", wide=False)
    return out.getvalue()


def headers(text: str) -> str:
    return " ".join(line for line in text.splitlines() if line.startswith("┃"))


def test_a_narrow_table_keeps_the_failures_and_explains_only_what_it_shows(monkeypatch):
    failing = pd.DataFrame([point("1P:1D @ 2 req/s", 0), point("1P:3D @ 2 req/s", 3)])
    narrow = table(failing, monkeypatch, 80)
    assert "failed" in headers(narrow) and "not shown at 80 columns" in narrow
    assert "$/Mtok" not in headers(narrow) and "per million output tokens" not in narrow
    clean = table(failing.assign(failed=0), monkeypatch, 80)
    assert "failed" not in headers(clean)  # without failures it may go, the widest first
    wide = table(failing, monkeypatch, 240)
    assert "$/Mtok" in headers(wide) and "$/Mtok: per million output tokens" in wide


def test_the_report_says_goodput_and_slo_met_count_the_same_requests(tmp_path):
    summary = pd.DataFrame([{**point("a", 0), "prefill_instances": 1, "decode_instances": 1}])
    text = write_report(summary, tmp_path, title="t", config_text=None, plots=[],
                        slo=SLO(ttft_s=0.5, itl_s=0.05)).read_text()
    header = text.split("## ")[0]
    assert "requests that arrived in the measurement window" in header
    assert "goodput: those requests meeting both per second" in header
    assert "completed requests meeting both" not in header


@pytest.mark.parametrize("args", [["check"], ["run", "--quiet"]])
def test_an_error_is_one_line_ending_in_a_newline(tmp_path, args):
    """Two failing commands in a row: each error is a whole line of its own, however long
    (not folded at 80 columns), so the next output never joins it."""
    config = {"name": "t", "model": "llama-3.1-8b", "hardware": "h100",
              "cluster": {"prefill": {"tp": 3}, "decode": {}},
              "workload": {"num_requests": 10, "seed": 0,
                           "arrival": {"process": "poisson", "rate_rps": 5},
                           "input_len": {"dist": "fixed", "value": 100},
                           "output_len": {"dist": "fixed", "value": 10}}}
    (tmp_path / "tp3.yaml").write_text(yaml.safe_dump(config))
    errors = ""
    for _ in range(2):
        result = CliRunner().invoke(cli.app, [*args, str(tmp_path / "tp3.yaml")],
                                    env={"COLUMNS": "80"})
        assert result.exit_code == 2
        errors += result.stderr
    lines = errors.splitlines(keepends=True)
    assert len(lines) == 2 and lines[0] == lines[1]
    assert lines[0].startswith("error: cluster.prefill: attention tp=3")
    assert lines[0].endswith("allowed: 1, 2, 4, 8, 16, 32\n") and len(lines[0]) > 80


def test_the_report_says_what_span_and_which_tool_definition_each_figure_uses(tmp_path):
    """A user comparing against a bench_serving or aiperf table must see whether the figures
    cover the whole run (the tools' span) or a steady-state window, and which of the tools'
    latencies each column is."""
    from pdsim.metrics import MeasurementWindow

    summary = pd.DataFrame([{**point("a", 0), "prefill_instances": 1, "decode_instances": 1}])
    whole = write_report(summary, tmp_path, title="t", config_text=None, plots=[]).read_text()
    header = whole.split("## ")[0]
    assert "whole run, first request sent to last response" in header
    assert "bench_serving's ITL, aiperf's inter-chunk latency" in header
    assert "bench_serving's TPOT, aiperf's inter-token latency" in header
    assert "TPOT p50 (ms)" in whole
    window = MeasurementWindow(warmup_requests=16, cooldown_requests=16)
    steady = write_report(summary, tmp_path, title="t", config_text=None, plots=[],
                          window=window).read_text().split("## ")[0]
    assert "steady-state window (metrics: warmup_requests=16, cooldown_requests=16)" in steady
    assert "leave `metrics:` out to match" in steady
