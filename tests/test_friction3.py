"""What a sweep user hits next: a point that cannot run is skipped, not the sweep aborted, while
a typo still stops everything; `pdsim check` finds an empty trace window and MTP on a model
without MTP layers before `pdsim run` would."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import ConfigError, parse_experiment
from pdsim.runner import mtp_error, run_experiment
from pdsim.workload import SyntheticWorkload

WORKLOAD = {"num_requests": 6, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 2},
            "input_len": {"dist": "fixed", "value": 128},
            "output_len": {"dist": "fixed", "value": 4}}
# Llama-3.1-70B colocated: its 131 GiB of BF16 weights fit no single GPU; at tp 2 they fit an
# A100 (80 GB) but not an L40S (48 GB).
SEVENTY_B = {"name": "fit", "model": "llama-3.1-70b", "cost_model": {"name": "roofline"},
             "cluster": {"mode": "colocated", "colocated": {"instances": 1, "tp": 1}},
             "workload": WORKLOAD}
MTP = {"method": "mtp", "num_draft_tokens": 2, "acceptance": {"mean_accept_len": 2.0}}


def write(tmp_path, data: dict, name: str = "e.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.slow
def test_points_that_do_not_fit_are_skipped_and_the_others_simulated(tmp_path):
    path = write(tmp_path, {**SEVENTY_B, "sweep": {"hardware": ["l40s", "a100"],
                                                    "cluster.colocated.tp": [1, 2]}})
    code, out = cli("run", str(path), "--out", str(tmp_path / "out"))
    assert code == 0, out
    # the table names the skipped points, and the reasons follow it
    assert "4 points, 3 skipped" in out and out.count("(skipped)") == 3
    assert ("sweep point 2 (hardware=a100, cluster.colocated.tp=1) cannot run, skipped: "
            "cluster.colocated: llama-3.1-70b does not fit on a100 at tp=1") in out
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert list(summary["point"]) == [0, 1, 2, 3]
    ran = summary["skipped"].isna()
    assert list(ran) == [False, False, False, True]
    assert summary.loc[~ran, "skipped"].str.contains("does not fit").all()
    assert summary.loc[~ran, ["completed", "ttft_p50_s", "output_tok_s_per_gpu"]].isna().all().all()
    assert list(summary["num_gpus"]) == [1, 2, 1, 2] and (summary["request_rate"] == 2).all()
    assert summary.loc[ran, "completed"].item() == WORKLOAD["num_requests"]
    requests = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    assert set(requests["point"]) == {3}
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.count("hardware=l40s") >= 2  # the skipped rows are in its table
    assert report.count(": skipped, cluster.colocated: llama-3.1-70b does not fit") == 3
    assert "nan" not in out  # a skipped row's metrics read "–"
    assert all((tmp_path / "out" / png).is_file() for png in ("ttft.png", "ttft_cdf.png"))


def test_mtp_on_a_model_without_mtp_layers_skips_that_point_only(tmp_path):
    data = {**SEVENTY_B, "model": "llama-3.1-8b", "speculative": MTP,
            "sweep": {"speculative.method": ["none", "mtp"]}}
    summary, _ = run_experiment(write(tmp_path, data), tmp_path / "out", jobs=1, progress=False)
    assert summary["skipped"].isna().tolist() == [True, False]
    assert "no MTP layers" in summary["skipped"][1] and "eagle" in summary["skipped"][1]
    assert any("sweep point 1 (speculative.method=mtp) cannot run" in n
               for n in summary.attrs["notes"])


def test_check_lists_the_points_it_will_skip(tmp_path):
    path = write(tmp_path, {**SEVENTY_B, "sweep": {"cluster.colocated.tp": [1, 2]}})
    code, out = cli("check", str(path))
    assert code == 0 and "valid experiment, 2 point(s)" in out
    assert "sweep point 0 (cluster.colocated.tp=1) cannot run, skipped:" in out
    assert "sweep point 1" not in out


@pytest.mark.parametrize("sweep, message", [
    ({"hardware": ["a100", "a10O"]}, "hardware: unknown hardware 'a10O': not a preset"),
    ({"model": ["llama-3.1-70b", "llama-3.1-7b"]}, "model: unknown model 'llama-3.1-7b'"),
    ({"cluster.colocated.tpp": [1, 2]}, "cluster.colocated.tpp: unknown key"),
    ({"cluster.colocated.tp": [0, 4]}, "cluster.colocated.tp: Input should be greater than"),
])
def test_a_mistake_at_one_point_still_stops_the_run_before_anything_is_simulated(
        tmp_path, sweep, message):
    """Typos and invalid values are not points that cannot run: nothing is simulated."""
    path = write(tmp_path, {**SEVENTY_B, "hardware": "a100", "sweep": sweep,
                            "cluster": {"mode": "colocated", "colocated": {"tp": 2}}})
    for command in ("check", "run"):
        code, out = cli(command, str(path), *["--out", str(tmp_path / "out")] * (command == "run"))
        assert code == 2 and message in out, (command, out)
    assert not (tmp_path / "out").exists()


def test_no_point_that_can_run_is_an_error_with_every_reason(tmp_path):
    one = write(tmp_path, SEVENTY_B, "one.yaml")
    code, out = cli("run", str(one), "--out", str(tmp_path / "out"))
    assert code == 2 and out.startswith("error: cluster.colocated: llama-3.1-70b does not fit on "
                                        "h100 at tp=1")  # one point: its error as before
    both = write(tmp_path, {**SEVENTY_B, "sweep": {"hardware": ["l40s", "a100"]}}, "both.yaml")
    code, out = cli("check", str(both))
    assert code == 2 and "no sweep point can run" in out
    for i, gpu in enumerate(("l40s", "a100")):
        assert (f"sweep point {i} (hardware={gpu}): cluster.colocated: llama-3.1-70b does not "
                f"fit on {gpu}") in out
    assert not (tmp_path / "out").exists()


def test_check_finds_a_trace_window_without_the_requests_asked_for(tmp_path, traces):
    data = {**SEVENTY_B, "model": "llama-3.1-8b", "workload": {
        "trace": str(traces / "AzureLLMInferenceTrace_code.csv"), "start_s": 99999,
        "num_requests": 200}}
    code, out = cli("check", str(write(tmp_path, data)))
    assert code == 2
    assert "workload.num_requests: 200 requested" in out and "holds 0 at or after start_s" in out
    data["workload"]["start_s"] = 0
    assert cli("check", str(write(tmp_path, data)))[0] == 0


def test_check_reads_an_empirical_lengths_trace_without_drawing_the_workload(
        tmp_path, monkeypatch):
    (tmp_path / "empty.jsonl").write_text("")
    data = {**SEVENTY_B, "model": "llama-3.1-8b", "workload": {
        **WORKLOAD, "input_len": {"dist": "empirical", "path": "empty.jsonl", "column": "input"},
        "prefix": {"system_prompts": 2, "system_prompt_len": 64, "share": 0.5}}}
    path = write(tmp_path, data)

    def no_drawing(self, base_dir=None):
        raise AssertionError("check drew the whole workload")

    monkeypatch.setattr(SyntheticWorkload, "build", no_drawing)
    code, out = cli("check", str(path))
    assert code == 2 and "has no rows to sample from" in out
    data["workload"]["input_len"] = WORKLOAD["input_len"]
    assert cli("check", str(write(tmp_path, data)))[0] == 0


@pytest.mark.parametrize("model, refused", [
    ("llama-3.1-8b", True), ("qwen3-235b-a22b", True), ("kimi-k2", True),
    ("deepseek-v3", False), ("deepseek-r1", False), ("qwen3-next-80b-a3b", False),
    ("tiny-llama", False),  # the real backend gives it an MTP head of its own
    ({"base": "llama-3.1-8b"}, False),  # a ModelSpec cannot say: taken as configured
])
def test_mtp_is_refused_on_presets_whose_checkpoint_has_no_mtp_layers(model, refused):
    cfg = parse_experiment({**SEVENTY_B, "model": model, "speculative": MTP})
    assert (mtp_error(cfg) is not None) == refused
    eagle = parse_experiment({**SEVENTY_B, "model": model,
                              "speculative": {**MTP, "method": "eagle"}})
    assert mtp_error(eagle) is None


def test_check_refuses_mtp_on_llama_and_names_eagle(tmp_path):
    data = {**SEVENTY_B, "model": "llama-3.1-8b", "hardware": "h100", "speculative": MTP}
    code, out = cli("check", str(write(tmp_path, data)))
    assert code == 2
    assert out.startswith("error: speculative.method mtp: llama-3.1-8b's checkpoint has no MTP "
                          "layers") and "Use method eagle" in out and "deepseek-v3" in out
    data["speculative"] = {**MTP, "method": "eagle"}
    assert cli("check", str(write(tmp_path, data)))[0] == 0


def test_summary_rows_of_skipped_points_keep_metrics_nan(tmp_path):
    """A skipped point's rate is the one a simulated point reports: a trace's mean rate too."""
    from pdsim.runner import skipped_row

    cfg = parse_experiment({**SEVENTY_B, "workload": {"num_requests": 4, "arrival": {
        "process": "steps", "steps": [{"at_s": 0, "rate_rps": 4}]},
        "input_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 2}}})
    row = skipped_row(3, cfg, {"cluster.colocated.tp": 1}, "why", None)
    assert row["point"] == 3 and row["skipped"] == "why" and row["num_gpus"] == 1
    assert row["sweep.cluster.colocated.tp"] == 1 and row["concurrency"] == 0
    assert 0 < row["request_rate"] and not math.isnan(row["request_rate"])
    with pytest.raises(ConfigError):
        run_experiment(write(tmp_path, SEVENTY_B), tmp_path / "out", jobs=1, progress=False)
