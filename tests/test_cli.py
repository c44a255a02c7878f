"""`pdsim run` end to end, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import yaml

SUMMARY_COLUMNS = (
    "prefill_instances decode_instances prefill_tp decode_tp request_rate num_requests completed "
    "failed ttft_mean_s ttft_p50_s ttft_p90_s ttft_p99_s itl_mean_s itl_p50_s itl_p90_s itl_p99_s "
    "e2e_mean_s input_tok_s output_tok_s output_tok_s_per_gpu goodput_req_s slo_attainment"
).split()
REQUEST_COLUMNS = (
    "rid arrival_s bootstrap_done_s prefill_start_s prefill_end_s transfer_done_s first_token_s "
    "finish_s prefill_instance decode_instance status"
).split()

TINY = {
    "name": "tiny",
    "model": "llama-3.1-8b",
    "hardware": "h100",
    "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
    "workload": {"num_requests": 60, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 5},
                 "input_len": {"dist": "uniform", "low": 100, "high": 2000},
                 "output_len": {"dist": "uniform", "low": 10, "high": 100}},
    "sweep": {"cluster.prefill.instances,cluster.decode.instances": [[1, 2], [2, 1]],
              "workload.arrival.rate_rps": [5, 10]},
}


def pdsim(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pdsim.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_run_writes_summary_requests_plots_and_report(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    proc = pdsim("run", "tiny.yaml", "--jobs", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = tmp_path / "results" / "tiny"
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 4
    assert set(SUMMARY_COLUMNS) <= set(summary.columns)
    assert (summary["completed"] + summary["failed"] == 60).all()
    assert summary["output_tok_s_per_gpu"].gt(0).all()
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 4 * 60
    assert set(REQUEST_COLUMNS) <= set(requests.columns)
    for png in ("ttft.png", "itl.png", "output_throughput_per_gpu.png", "goodput_per_gpu.png",
                "ttft_cdf.png"):
        assert (out / png).stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "1P:2D" in report and "2P:1D" in report and "](ttft.png)" in report
    assert "1P:2D" in proc.stdout  # the table at the end


@pytest.mark.slow
def test_same_experiment_twice_gives_identical_summary(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    a = pdsim("run", "tiny.yaml", "--quiet", "--out", "a", cwd=tmp_path)
    b = pdsim("run", "tiny.yaml", "--quiet", "--out", "b", "--jobs", "1", cwd=tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert (tmp_path / "a" / "summary.csv").read_text() == (tmp_path / "b" / "summary.csv").read_text()


@pytest.mark.slow
def test_bad_config_exits_2_with_a_clear_message(tmp_path):
    bad = dict(TINY, router={"policy": "telepathy"})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    proc = pdsim("run", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "router.policy" in proc.stderr and "round_robin" in proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_check_lists_points(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    proc = pdsim("check", "tiny.yaml", cwd=tmp_path)
    assert proc.returncode == 0
    assert "4 point(s)" in proc.stdout
