"""What a new user hits first: sweeps of any field plot and report, tables fit an 80-column
terminal, mistakes are reported early and in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow
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


def test_command_list_gives_each_summary_unbroken():
    """A docstring's line breaks are not the terminal's: a wide terminal shows each command's
    summary on one line, an 80-column one wraps it within the panel."""
    wide = cli("--help", columns=240)
    assert ("Check a config without simulating: an experiment (its sweep points listed), a plan "
            "or a serve config, told apart by their keys, and every file it names." in wide)
    assert_fits(cli("--help"))


@pytest.mark.slow
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


def test_a_closed_loop_table_shows_the_requests_served_per_second(tmp_path):
    """Closed loops offer no rate; their table shows what was served instead of a dash, and a
    sweep of both kinds shows both. Throughputs read as rates, not as seconds in ms."""
    closed = {"process": "closed", "concurrency": 4, "think_time_s": 0}
    config = tiny(sweep={"workload.arrival": [closed, {"process": "poisson", "rate_rps": 4}]})
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump(config))
    output = cli("run", str(tmp_path / "mixed.yaml"), "--out", str(tmp_path / "out"),
                 "--jobs", "1", columns=200)
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    header = next(line for line in output.splitlines() if "TTFT" in line)
    assert "req/s" in header and "served req/s" in header
    rows = [line.split("│") for line in output.splitlines() if line.startswith("│")]
    served = [float(cells[3]) for cells in rows]
    assert served == pytest.approx(list(summary["request_throughput_req_s"]), rel=0.01)
    assert 1 < min(served) and max(served) < 100  # requests per second, not ms
    config = tiny(workload={**tiny()["workload"], "arrival": closed})
    (tmp_path / "closed.yaml").write_text(yaml.safe_dump(config))
    output = cli("run", str(tmp_path / "closed.yaml"), "--out", str(tmp_path / "out2"),
                 "--jobs", "1", columns=200)
    header = next(line for line in output.splitlines() if "TTFT" in line)
    assert "served req/s" in header and "req/s" not in header.replace("served req/s", "")


@pytest.mark.slow
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


# ---- errors early and in one line ----------------------------------------------------------


def invoke(*args: str):
    from typer.testing import CliRunner

    from pdsim.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def write_trace(path, rows: int) -> None:
    path.write_text("".join(json.dumps({"timestamp": 250 * i, "input_length": 300,
                                        "output_length": 6, "hash_ids": [i]}) + "\n"
                            for i in range(rows)))


def test_check_and_run_name_a_missing_trace_before_simulating(tmp_path):
    config = tiny(sweep={"workload.num_requests": [4, 8]})
    config["workload"] = {"trace": "traces/gone.jsonl", "seed": 0}
    (tmp_path / "gone.yaml").write_text(yaml.safe_dump(config))
    for command in ("check", "run"):
        options = ["--out", str(tmp_path / "out"), "--jobs", "2"] if command == "run" else []
        result = invoke(command, str(tmp_path / "gone.yaml"), *options)
        assert result.exit_code == 2, result.output
        assert "workload.trace" in result.output and "gone.jsonl" in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()  # nothing simulated


@pytest.mark.slow
def test_a_point_whose_trace_cannot_serve_it_is_named_in_one_line_before_any_runs(tmp_path):
    write_trace(tmp_path / "t12.jsonl", 12)
    config = tiny(sweep={"workload.num_requests": [10, 50]})
    config["workload"] = {"trace": "t12.jsonl", "seed": 0}
    (tmp_path / "few.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "pdsim.cli", "run", "few.yaml", "--jobs", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr  # checked up front, as by `check`
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "sweep point 1 (workload.num_requests=50)" in error[0]
    assert "50 requested" in error[0] and "holds 12" in error[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_check_accepts_experiments_plans_and_serve_configs(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    plan_block = next(block for block in re.findall(r"```yaml\n(.*?)```", readme, re.S)
                      if "max_gpus" in block)
    (tmp_path / "plan.yaml").write_text(plan_block)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(
        {"model": "tiny-llama", "cluster": {
            "mode": "disaggregated",
            "prefill": {"instances": 1, "scheduler": {"num_pages": 64}},
            "decode": {"instances": 1, "scheduler": {"num_pages": 64}}}}))
    (tmp_path / "experiment.yaml").write_text(yaml.safe_dump(tiny()))
    for name, said in (("plan", "valid plan"), ("serve", "valid serve config"),
                       ("experiment", "valid experiment, 1 point(s)")):
        result = invoke("check", str(tmp_path / f"{name}.yaml"))
        assert result.exit_code == 0 and said in result.output, result.output
    (tmp_path / "bad_plan.yaml").write_text(plan_block.replace("max_gpus", "max_gpu"))
    result = invoke("check", str(tmp_path / "bad_plan.yaml"))  # an experiment now: no cluster
    assert result.exit_code == 2 and "max_gpu" in result.output


def test_plan_keys_are_the_fields_only_a_plan_has():
    from pdsim.config import _PLAN_KEYS, ExperimentConfig
    from pdsim.planning.config import PlanConfig

    assert set(_PLAN_KEYS) == set(PlanConfig.model_fields) - set(ExperimentConfig.model_fields)


@pytest.mark.parametrize("kind", ["experiment", "plan"])
def test_trace_with_arrival_says_they_are_exclusive(tmp_path, kind):
    from pdsim.config import ConfigError, parse_experiment
    from pdsim.planning import parse_plan

    config = tiny()
    config["workload"] = {**config["workload"], "trace": "t.jsonl"}
    if kind == "plan":
        config = {"name": "p", "model": config["model"], "hardware": config["hardware"],
                  "max_gpus": 2, "slo": {"ttft_p90_s": 1.0}, "workload": config["workload"]}
    with pytest.raises(ConfigError) as err:
        (parse_experiment if kind == "experiment" else parse_plan)(config, "mixed.yaml")
    assert "`trace` and arrival, input_len, output_len are exclusive" in str(err.value)
    assert "unknown key" not in str(err.value)


def test_auto_cost_model_names_the_missing_table_not_the_roofline_params(tmp_path):
    config = tiny(model="deepseek-v3", hardware="gb200",
                  cost_model={"name": "auto", "params": {"framework": "vllm"}})
    config["cluster"] = {"prefill": {"instances": 1, "tp": 8}, "decode": {"instances": 1, "tp": 8}}
    (tmp_path / "vllm.yaml").write_text(yaml.safe_dump(config))
    result = invoke("check", str(tmp_path / "vllm.yaml"))
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "context_mla_perf.parquet" in text and "takes no framework" in text
    assert "Extra inputs are not permitted" not in text


# ---- Mooncake's start-up chatter ---------------------------------------------------------------

GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.M)


@pytest.mark.real
@pytest.mark.slow
def test_a_clean_pd_start_prints_no_mooncake_glog_lines(tmp_path):
    from pd_harness import (
        Worker, body, child_env, generate, pd_config, python_command, stop_workers, wait_healthy,
    )

    from runtime.distributed import free_port

    config = pd_config("tiny-llama")
    env = {**child_env(), "PDSIM_KERNEL_BACKEND": "torch", "PDSIM_MOONCAKE_LOG_DIR": str(tmp_path)}
    env.pop("GLOG_minloglevel", None)  # as a user starts it: glog's defaults
    workers = []
    try:
        for role in ("prefill", "decode"):
            port, bport = free_port(), free_port() if role == "prefill" else None
            payload = {"parent_pid": os.getpid(), "config": config.model_dump(mode="json"),
                       "role": role, "instance": 0, "port": port, "bootstrap_port": bport}
            with open(tmp_path / f"{role}.stderr", "w") as err:
                proc = subprocess.Popen(python_command("instance", payload), env=env,
                                        stdout=subprocess.DEVNULL, stderr=err)
            workers.append(Worker(role, 1, f"http://127.0.0.1:{port}", proc, bport or 0))
        wait_healthy(workers)
        prefill, decode = workers
        (outcome,) = generate(prefill, decode, [body("r0", [5, 6, 7, 8, 9], 4, prefill)])
        assert outcome.decode_status == 200
    finally:
        stop_workers(workers)
    for role in ("prefill", "decode"):
        stderr = (tmp_path / f"{role}.stderr").read_text()
        assert "INSECURE" in stderr  # the worker's own warnings were captured
        assert not GLOG_LINE.search(stderr), stderr
    logs = " ".join(p.read_text() for p in tmp_path.glob("mooncake-*.log"))
    assert "Local segment descriptor not found" in logs  # kept in the log file, not lost


def test_planning_docs_list_every_slo_key():
    from pdsim.planning.config import PlanSLO

    docs = (Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `slo` |"))
    assert [key for key in PlanSLO.model_fields if f"`{key}`" not in row] == []


def test_experiments_docs_describe_every_scheduler_knob():
    """Every `cluster.<role>.scheduler` field is in docs/experiments.md's paragraph of scheduler
    flags (disable_overlap_schedule was documented only in cost_model.md's prose)."""
    from pdsim.deployment import SchedulerKnobs

    docs = (Path(__file__).parents[1] / "docs" / "experiments.md").read_text()
    start = docs.index("Scheduler flags (`cluster.<role>.scheduler`")
    section = docs[start:docs.index("## One deployment, two backends")]
    assert [key for key in SchedulerKnobs.model_fields if f"`{key}`" not in section] == []


def test_layout_drops_the_least_important_columns_first_and_never_cuts_a_cell():
    from pdsim.tables import Column, layout

    columns = [Column("point", 0), Column("TTFT p50", 1), Column("P busy", 3), Column("ok", 2)]
    rows = [["2P:6D @ 40 req/s", "1204.9", "84%", "3000"]]
    shown, widths = layout(columns, rows, 40)
    assert shown == [0, 1, 3]  # P busy (priority 3) went first
    assert sum(widths) + 3 * len(widths) + 1 <= 40
    assert all(w >= len(rows[0][i]) for i, w in zip(shown, widths))
    assert layout(columns, rows, None)[0] == [0, 1, 2, 3]  # --wide: every column
    assert layout(columns, rows, 10)[0] == [0]  # the label stays, however narrow


def test_errors_go_to_standard_error(tmp_path):
    """An error is on standard error, so a command whose output is a file's text (import-sglang
    > exp.yaml) writes none of it there."""
    from typer.testing import CliRunner

    from pdsim.cli import app

    config = tiny(cluster={"prefill": {"tp": 3}, "decode": {}})
    (tmp_path / "tp3.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["check", str(tmp_path / "tp3.yaml")])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: cluster.prefill: attention tp=3")


def test_version_and_the_short_help_flag():
    from pdsim import __version__

    assert cli("--version").strip() == f"pdsim {__version__}"
    assert "run [OPTIONS] {experiment}" in cli("run", "-h") and "Commands" in cli("-h")
