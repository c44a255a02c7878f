"""What a new user hits first: sweeps of any field plot and report, tables fit an 80-column
terminal, mistakes are reported early and in one line."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from pdsim.runner import run_experiment

SWEEP_PNGS = ("ttft.png", "itl.png", "output_throughput_per_gpu.png", "goodput_per_gpu.png",
              "ttft_cdf.png", "itl_cdf.png")


def tiny(**extra) -> dict:
    """A 1P:1D deployment and a dozen short requests: seconds to simulate."""
    return {
        "name": "tiny", "seed": 0, "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {"num_requests": 12, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 4},
                     "input_len": {"dist": "fixed", "value": 256},
                     "output_len": {"dist": "fixed", "value": 8}},
        **extra,
    }


# One field of each kind: numeric, categorical string, boolean, a hardware preset, a combined
# `a,b` field, and two categorical fields crossed.
SWEEPS = {
    "numeric": {"workload.arrival.rate_rps": [2, 4]},
    "string": {"router.policy": ["round_robin", "least_loaded"]},
    "boolean": {"cluster.prefill.scheduler.disable_radix_cache": [False, True]},
    "hardware": {"hardware": ["h100", "h200"]},
    "combined": {"cluster.prefill.tp,cluster.decode.tp": [[1, 1], [2, 2]]},
    "crossed": {"router.policy": ["round_robin", "least_loaded"],
                "cluster.prefill.scheduler.disable_radix_cache": [False, True]},
}


@pytest.mark.parametrize("kind", SWEEPS)
def test_every_kind_of_sweep_plots_and_reports(kind, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny(sweep=SWEEPS[kind])))
    summary, out = run_experiment(path, tmp_path / "out", jobs=1, progress=False)
    points = 4 if kind == "crossed" else 2
    assert len(summary) == points
    for png in SWEEP_PNGS:
        assert (out / png).read_bytes().startswith(b"\x89PNG"), png
    report = (out / "report.md").read_text()
    results = report.split("## Results")[1].split("##")[0]
    rows = [line for line in results.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) == points
    if kind != "numeric":  # a P:D sweep's rows are named by P:D and rate, others by the values
        assert [row.split(" | ")[0][2:] for row in rows] == summary["label"].tolist()
    for png in SWEEP_PNGS:
        assert f"]({png})" in report


# ---- tables at 80 columns -------------------------------------------------------------------

TABLE_CHARS = "│┃┏┗┡└┌"


def assert_fits(output: str, width: int = 80) -> list[str]:
    """No cell cut to `…`, every table line within `width`; returns the table lines."""
    from rich.cells import cell_len

    assert "…" not in output, output
    lines = [line for line in output.splitlines() if line[:1] in TABLE_CHARS]
    assert lines, output
    for line in lines:
        assert cell_len(line) <= width, line
    return lines


def cli(*args: str, columns: int = 80):
    from typer.testing import CliRunner

    from pdsim.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_presets_never_cut_a_name_at_80_columns():
    from pdsim.specs.hardware import hardware_preset_names
    from pdsim.specs.models import model_preset_names

    lines = assert_fits(cli("presets"))
    first_cells = {line.split("│")[1].strip() for line in lines if line.startswith("│")}
    assert set(model_preset_names()) | set(hardware_preset_names()) <= first_cells


def test_trace_sweep_table_fits_80_columns_with_a_legend(tmp_path):
    traces = tmp_path / "a_rather_long_directory_name_for_the_traces_of_this_experiment"
    traces.mkdir()
    for name in ("conversation_sample.jsonl", "tool_calls_sample.jsonl"):
        rows = [{"timestamp": 250 * i, "input_length": 300, "output_length": 6,
                 "hash_ids": [i, i + 1]} for i in range(12)]
        (traces / name).write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    config = tiny(sweep={"workload.trace": [f"{traces.name}/conversation_sample.jsonl",
                                            f"{traces.name}/tool_calls_sample.jsonl"],
                         "workload.target_rate_rps": [2, 4]})
    config["workload"] = {"trace": f"{traces.name}/conversation_sample.jsonl", "seed": 0}
    (tmp_path / "trace.yaml").write_text(yaml.safe_dump(config))
    output = cli("run", str(tmp_path / "trace.yaml"), "--out", str(tmp_path / "out"),
                 "--jobs", "1")
    lines = assert_fits(output)
    names = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert names == ["p0", "p1", "p2", "p3"]
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    for name, label in zip(names, summary["label"]):  # the legend under the table
        assert f"{name}: {label}" in " ".join(output.split())
    header = " ".join(lines[:3])  # metrics shown, not only labels
    assert all(word in header for word in ("TTFT", "ITL", "tok/s/GPU", "SLO"))
    wide = cli("run", str(tmp_path / "trace.yaml"), "--out", str(tmp_path / "out"),
               "--jobs", "1", "--wide")
    assert "P busy" in wide and "D batch" in wide and "…" not in wide


def test_plan_frontier_fits_80_columns(tmp_path):
    plan = {
        "name": "tiny_plan", "model": "llama-3.1-8b", "hardware": "h100", "max_gpus": 2,
        "workload": {"num_requests": 30, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 10},
                     "input_len": {"dist": "fixed", "value": 512},
                     "output_len": {"dist": "fixed", "value": 16}},
        "slo": {"ttft_p90_s": 1.0, "itl_p90_s": 0.05, "tpot_p90_s": 0.05},
        "search": {"tp": [1], "modes": ["colocated", "disaggregated"]},
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    output = cli("plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "out"),
                 "--jobs", "1")
    lines = assert_fits(output)
    frontier = pd.read_csv(tmp_path / "out" / "frontier.csv")
    names = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert names == frontier["label"].tolist()  # short labels stay whole, on one line
    header = " ".join(lines[:3])
    assert all(word in header for word in ("TTFT", "ITL", "TPOT", "tok/s/GPU"))
