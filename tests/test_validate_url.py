"""`pdsim validate CONFIG --url URL` against an endpoint started apart from it: `pdsim serve` in
its own process, reached over HTTP on loopback like any OpenAI-compatible server.

The PD run sends token-id prompts behind an API key; the colocated one sends text prompts of
exact lengths built with a byte-level tokenizer.json the server loads too. SGLang's native
`/generate` stream (`--api generate`) has no server here (SGLang is not installable on this
machine): its chunk parsing is checked on chunks of the documented shape.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from byte_tokenizer import byte_tokenizer
from configs import tiny_pd_yaml
from pdsim.validation.compare import METRICS

WORKLOAD = ("slo: {ttft_s: 2.0, itl_s: 0.5}\n"
            "workload: {num_requests: 10, seed: 3, arrival: {process: poisson, rate_rps: 4},\n"
            "  input_len: {dist: uniform, low: 16, high: 96},\n"
            "  output_len: {dist: uniform, low: 4, high: 16}}\n")


def pdsim(*args, cwd, timeout=300):
    env = {**os.environ, "GLOG_minloglevel": "2"}
    return subprocess.run([sys.executable, "-m", "pdsim.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _check_run(proc, out: Path, n: int) -> pd.DataFrame:
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_csv(out / "validation.csv").set_index("metric")
    assert list(table.index) == [label for label, _ in METRICS]
    assert proc.returncode == (0 if table["within"].all() else 1)  # the table's verdict
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == n
    # The endpoint reported every request's counts, and they are the workload's.
    lengths = pd.read_csv(out / "lengths.csv").set_index("tokens")
    assert list(lengths["reported"]) == list(lengths["exact"]) == [n, n]
    assert list(lengths["off"]) == [0, 0] and list(lengths["not_reported"]) == [0, 0]
    real = pd.read_csv(out / "real_requests.csv")
    sim = pd.read_csv(out / "sim_requests.csv")
    # Request for request: the same lengths, the simulated one named after the measured one.
    assert list(real["rid"]) == list(sim["rid"]) and real["rid"].is_unique
    assert list(real["input_tokens"]) == list(sim["input_tokens"])
    assert list(real["output_tokens"]) == list(sim["output_tokens"])
    assert (real["ttft_s"] > 0).all() and (real["status"] == "ok").all()
    return table


@pytest.mark.real
@pytest.mark.slow
def test_validate_url_against_a_separately_started_pd_deployment(tmp_path, monkeypatch):
    from pdsim.config import load_experiment
    from pdsim.validation.deployment import RealDeployment
    from pdsim.workload import generate
    from runtime.security import new_secret

    config = tmp_path / "pd.yaml"
    config.write_text("name: url_pd\n" + tiny_pd_yaml() + WORKLOAD)
    monkeypatch.setenv("PDSIM_API_KEY", "test-key-123")
    with RealDeployment(config, secret=new_secret()) as served:
        proc = pdsim("validate", str(config), "--url", served.url, "--api-key", "test-key-123",
                     "--out", "out", cwd=tmp_path)
        _check_run(proc, tmp_path / "out", 10)
        # Without the key the endpoint refuses, and validate says so.
        denied = pdsim("validate", str(config), "--url", served.url, "--model", "tiny-llama",
                       "--out", "denied", cwd=tmp_path)
    assert denied.returncode == 2 and "HTTP 401" in " ".join(denied.stderr.split())
    real = pd.read_csv(tmp_path / "out" / "real_requests.csv")
    work = generate(load_experiment(config)[0].workload)
    # Open loop at the workload's times: each request left within 50 ms of its arrival time.
    assert (abs(real["arrival_s"].to_numpy() - work.arrival_s) < 0.05).all()
    assert list(real["input_tokens"]) == list(work.input_tokens)
    assert "| input | 10 | 10 | 0 |" in (tmp_path / "out" / "validation.md").read_text()


@pytest.mark.real
@pytest.mark.slow
def test_validate_url_with_text_prompts_of_exact_length(tmp_path):
    from pdsim.validation.deployment import RealDeployment
    from runtime.security import new_secret

    tok = byte_tokenizer(tmp_path / "tok")
    raw = {"name": "url_text", "seed": 0, "model": "tiny-llama", "device": "cpu",
           "tokenizer": str(tok), "router": {"port": 0},
           "cluster": {"mode": "colocated", "colocated": {"instances": 1, "scheduler": {
               "page_size": 8, "num_pages": 256, "max_running_requests": 8}}}}
    config = tmp_path / "colocated.yaml"
    config.write_text(yaml.safe_dump(raw) + WORKLOAD)
    with RealDeployment(config, secret=new_secret()) as served:
        proc = pdsim("validate", str(config), "--url", served.url, "--tokenizer", str(tok),
                     "--out", "out", cwd=tmp_path)
    _check_run(proc, tmp_path / "out", 10)
    assert "text prompts" in proc.stdout


def test_sglang_generate_chunks_give_token_times_and_counts():
    from pdsim.validation.replay import _Stream

    stream = _Stream("replay-0")
    # SGLang's /generate stream: cumulative text and completion_tokens in meta_info.
    for now, done in ((0.10, 1), (0.12, 3), (0.13, 4)):
        stream.chunk("generate", {"text": "x" * done, "meta_info": {
            "id": "abc", "prompt_tokens": 7, "completion_tokens": done, "cached_tokens": 0,
            "finish_reason": None}}, now)
    assert stream.rid == "abc" and (stream.prompt_tokens, stream.completion_tokens) == (7, 4)
    assert stream.token_times() == [0.10, 0.12, 0.12, 0.13]
    failed = _Stream("replay-1")
    failed.chunk("generate", {"error": {"message": "boom"}}, 0.1)
    assert "boom" in failed.error


def test_text_only_chunks_are_spread_to_the_reported_count():
    from pdsim.validation.replay import _Stream

    stream = _Stream("r")
    for now in (1.0, 1.5, 2.0):  # three chunks of text, no token ids (an endpoint like SGLang's)
        stream.chunk("completions", {"id": "c", "choices": [{"text": "ab"}]}, now)
    stream.chunk("completions", {"id": "c", "choices": [],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 5}}, 2.0)
    assert stream.token_times() == [1.0, 1.25, 1.5, 1.75, 2.0]


@pytest.mark.slow
def test_url_only_options_need_url(tmp_path):
    config = tmp_path / "pd.yaml"
    config.write_text("name: x\n" + tiny_pd_yaml() + WORKLOAD)
    proc = pdsim("validate", str(config), "--api-key", "k", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--url" in proc.stderr
    proc = pdsim("validate", str(config), "--url", "http://127.0.0.1:9", "--api", "generate",
                 "--tokenizer", str(tmp_path), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "input_ids" in proc.stderr
