"""`pdsim compare CONFIG --measured FILE`: results a benchmark client wrote, against the
deployment simulated on the same send times and lengths (docs/validation.md).

The aiperf file is real: aiperf (installed here) replays the config's workload, as a Mooncake
trace at its exact timestamps, against a started `pdsim serve`, and `pdsim compare` reads its
`profile_export.jsonl`. SGLang's bench_serving cannot run here (SGLang is not installable on
this machine), so its file is built in the test from the schema bench_serving writes with
`--output-details` (one JSON object per run: input_lens, output_lens, ttfts, itls, errors,
request_rate, max_concurrency).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from byte_tokenizer import byte_tokenizer
from pdsim.config import ConfigError
from pdsim.validation.measured import MeasuredFileError, read_measured

DEPLOYMENT = {"name": "measured", "seed": 0, "model": "tiny-llama", "device": "cpu",
              "router": {"port": 0}, "slo": {"ttft_s": 2.0, "itl_s": 0.5},
              "cluster": {"mode": "colocated", "colocated": {"instances": 1, "scheduler": {
                  "page_size": 8, "num_pages": 256, "max_running_requests": 8}}}}


def pdsim(*args, cwd, timeout=300):
    env = {**os.environ, "GLOG_minloglevel": "2"}
    return subprocess.run([sys.executable, "-m", "pdsim.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write_config(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump({**DEPLOYMENT, **extra}))
    return path


def verdict(proc, out: Path) -> pd.DataFrame:
    """The written table, after checking the exit code is its verdict."""
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_csv(out / "validation.csv").set_index("metric")
    assert proc.returncode == (0 if table["within"].all() else 1)
    assert (out / "validation.png").stat().st_size > 10_000
    return table


@pytest.mark.real
@pytest.mark.slow
def test_aiperf_profile_of_pdsim_serve_is_compared(tmp_path):
    from pdsim.config import load_experiment
    from pdsim.validation.deployment import RealDeployment
    from pdsim.workload import generate
    from runtime.security import new_secret

    aiperf = shutil.which("aiperf")
    assert aiperf, "aiperf is a test dependency (pyproject.toml)"
    tok = byte_tokenizer(tmp_path / "tok")
    workload = {"num_requests": 6, "seed": 1, "arrival": {"process": "poisson", "rate_rps": 5},
                "input_len": {"dist": "uniform", "low": 16, "high": 96},
                "output_len": {"dist": "uniform", "low": 4, "high": 16}}
    config = write_config(tmp_path, tokenizer=str(tok), workload=workload)
    work = generate(load_experiment(config)[0].workload)
    # The config's workload as a Mooncake trace: aiperf sends it at its timestamps (ms).
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": round(a * 1e3, 3), "input_length": int(i),
                                         "output_length": int(o)}) + "\n"
                             for a, i, o in zip(work.arrival_s, work.input_tokens,
                                                work.output_tokens)))
    with RealDeployment(config, secret=new_secret()) as served:
        run = subprocess.run(
            [aiperf, "profile", "--model", "tiny-llama", "--url", served.url,
             "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tok),
             "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
             "--fixed-schedule", "--extra-inputs", "ignore_eos:true",
             "--use-server-token-count", "--export-level", "records", "--ui-type", "none",
             "--artifact-dir", str(tmp_path / "artifacts")],
            cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    export = tmp_path / "artifacts" / "profile_export.jsonl"
    rows = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    assert len(rows) == 6 and all(r.get("error") is None for r in rows)

    proc = pdsim("compare", str(config), "--measured", str(export), "--out", "out",
                 cwd=tmp_path)
    table = verdict(proc, tmp_path / "out")
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == 6
    # The real column is aiperf's own figures, read back from its export.
    ttft_ms = [r["metrics"]["time_to_first_token"]["value"] for r in rows]
    assert table.loc["TTFT mean", "real"] == pytest.approx(np.mean(ttft_ms) / 1e3, rel=1e-9)
    e2e_ms = [r["metrics"]["request_latency"]["value"] for r in rows]
    assert table.loc["E2E mean", "real"] == pytest.approx(np.mean(e2e_ms) / 1e3, rel=1e-9)
    real = pd.read_csv(tmp_path / "out" / "real_requests.csv")
    # The trace's lengths, as the server counted them; the send times aiperf recorded, which
    # follow the trace's as closely as aiperf kept its schedule on this shared machine.
    assert list(real["input_tokens"]) == list(work.input_tokens)
    assert list(real["output_tokens"]) == list(work.output_tokens)
    start_ns = sorted(r["metadata"]["request_start_ns"] for r in rows)
    assert list(real["arrival_s"]) == pytest.approx([(t - start_ns[0]) / 1e9 for t in start_ns])
    assert (abs(real["arrival_s"] - work.arrival_s) < 0.25).all()
    sim = pd.read_csv(tmp_path / "out" / "sim_requests.csv")
    assert list(sim["rid"]) == list(real["rid"])
    assert list(sim["arrival_s"]) == pytest.approx(list(real["arrival_s"]))


def bench_serving_run(**overrides) -> dict:
    """One bench_serving run as `--output-details` writes it: four requests, one failed."""
    run = {"backend": "sglang", "dataset_name": "random", "request_rate": math.inf,
           "max_concurrency": None, "duration": 1.0, "completed": 3,
           "input_lens": [32, 48, 64, 40], "output_lens": [4, 3, 0, 5],
           "ttfts": [0.05, 0.07, 0.0, 0.06],
           # Request 1 streamed its 3 tokens in 2 chunks: one gap for two tokens.
           "itls": [[0.01, 0.01, 0.02], [0.03], [], [0.01, 0.01, 0.01, 0.01]],
           "generated_texts": ["abcd", "abc", "", "abcde"],
           "errors": ["", "", "HTTP 503: busy", ""]}
    return run | overrides


def test_bench_serving_all_at_once_and_held_back_by_max_concurrency(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(bench_serving_run()) + "\n")
    measured = read_measured(path)
    assert measured.source.startswith("SGLang bench_serving")
    ok = [r for r in measured.records if r.ok]
    assert [r.arrival_s for r in measured.records] == [0.0] * 4  # request_rate Infinity
    assert [r.ttft_s for r in ok] == pytest.approx([0.05, 0.07, 0.06])
    assert ok[0].token_times_s == pytest.approx([0.05, 0.06, 0.07, 0.09])
    assert ok[1].token_times_s == pytest.approx([0.07, 0.085, 0.10])  # spread over its gap
    assert any("1 of 4 requests give no time per token" in n for n in measured.notes)
    failed = [r for r in measured.records if not r.ok]
    assert [f.error for f in failed] == ["HTTP 503: busy"] and failed[0].input_tokens == 64
    assert any("1 requests failed" in n for n in measured.notes)

    # max_concurrency 2: requests 2 and 3 wait for the first two slots to free.
    path.write_text(json.dumps(bench_serving_run(max_concurrency=2)) + "\n")
    held = read_measured(path, "bench_serving").records
    latency = [0.05 + 0.04, 0.07 + 0.03]  # ttft + the gaps of requests 0 and 1
    by_rid = {r.rid: r.arrival_s for r in held}
    assert by_rid["2"] == pytest.approx(min(latency))
    # Request 2 failed at once, so request 3 takes its slot at the same moment.
    assert by_rid["3"] == pytest.approx(min(latency))
    assert [r.arrival_s for r in held] == sorted(r.arrival_s for r in held)

    # A finite rate: the send times were not recorded; a seeded Poisson process stands in.
    path.write_text(json.dumps(bench_serving_run(request_rate=4.0)) + "\n")
    first, again = read_measured(path, seed=7), read_measured(path, seed=7)
    assert [r.arrival_s for r in first.records] == [r.arrival_s for r in again.records]
    assert len({r.arrival_s for r in first.records}) == 4
    assert any("Poisson process at its request_rate 4 req/s" in n for n in first.notes)


@pytest.mark.slow
def test_compare_a_bench_serving_file_end_to_end(tmp_path):
    config = write_config(tmp_path)
    path = tmp_path / "bench.jsonl"
    # Two runs appended to one file: --run picks one by its line.
    path.write_text(json.dumps(bench_serving_run(request_rate=2.0)) + "\n"
                    + json.dumps(bench_serving_run(max_concurrency=1)) + "\n")
    proc = pdsim("compare", str(config), "--measured", str(path), "--out", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "--run LINE" in " ".join(proc.stderr.split())
    proc = pdsim("compare", str(config), "--measured", str(path), "--run", "2", "--out", "out",
                 cwd=tmp_path)
    table = verdict(proc, tmp_path / "out")
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == 3
    assert table.loc["TTFT mean", "real"] == pytest.approx(np.mean([0.05, 0.07, 0.06]))
    assert "max_concurrency 1" in proc.stdout
    assert "What the file left to assume" in (tmp_path / "out" / "validation.md").read_text()
    sim = pd.read_csv(tmp_path / "out" / "sim_requests.csv")
    assert sorted(sim["rid"].astype(str)) == ["0", "1", "3"]  # the failed request is not simulated


@pytest.mark.slow
def test_csv_with_itls_or_e2e(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("arrival_s,input_tokens,output_tokens,ttft_s,itls_s,e2e_s,error\n"
                    "0.5,32,3,0.1,0.02;0.04,,\n"
                    "0.0,16,4,0.2,,0.5,\n"
                    "0.7,8,,,,,timeout\n")
    measured = read_measured(path)
    rec = {r.rid: r for r in measured.records}
    assert [r.rid for r in measured.records] == ["1", "0", "2"]  # sorted by send time
    assert rec["0"].arrival_s == pytest.approx(0.5) and rec["1"].arrival_s == 0.0
    assert rec["0"].token_times_s == pytest.approx([0.6, 0.62, 0.66])
    assert rec["1"].token_times_s == pytest.approx([0.2, 0.3, 0.4, 0.5])  # e2e alone: spread
    assert rec["1"].e2e_s == pytest.approx(0.5)
    assert not rec["2"].ok and rec["2"].error == "timeout"

    config = write_config(tmp_path)
    proc = pdsim("compare", str(config), "--measured", str(path), "--format", "csv",
                 "--tolerance", "10", "--tolerance-p90", "10", "--out", "out", cwd=tmp_path)
    table = verdict(proc, tmp_path / "out")
    assert proc.returncode == 0  # every error within a 1000% tolerance
    assert table.loc["TTFT mean", "real"] == pytest.approx(0.15)
    assert table.loc["completed", "real"] == 2


@pytest.mark.parametrize("fmt, name, text, words", [
    ("aiperf", "a.jsonl",
     '{"metadata": {"request_start_ns": 1, "benchmark_phase": "profiling"}, "metrics": '
     '{"usage_prompt_tokens": {"value": 4, "unit": "tokens"}, "output_sequence_length": '
     '{"value": 3, "unit": "tokens"}, "time_to_first_token": {"value": 5, "unit": "ms"}, '
     '"request_latency": {"value": 9, "unit": "ms"}}, "error": null}\n'
     '{"metadata": {"request_start_ns": 2, "benchmark_phase": "profiling"}, "metrics": '
     '{"usage_prompt_tokens": {"value": 4, "unit": "tokens"}, "output_sequence_length": '
     '{"value": 3, "unit": "tokens"}, "request_latency": {"value": 9, "unit": "ms"}}, '
     '"error": null}\n',
     ["a.jsonl line 2", "time_to_first_token"]),
    ("aiperf", "a.jsonl",
     '{"metadata": {"request_start_ns": 1}, "metrics": {"input_sequence_length": {"value": 4, '
     '"unit": "tokens"}, "output_sequence_length": {"value": 3, "unit": "tokens"}, '
     '"time_to_first_token": {"value": 5, "unit": "fortnights"}}, "error": null}\n',
     ["line 1", "time_to_first_token.unit", "fortnights", "allowed"]),
    ("auto", "b.jsonl", '{"input_lens": [1], "output_lens": [1], "ttfts": [0.1]}\n',
     ["b.jsonl line 1", "itls", "--output-details"]),
    ("bench_serving", "b.jsonl", json.dumps(bench_serving_run(ttfts=[0.1, -1, 0, 0.1])) + "\n",
     ["line 1", "request 1", "ttfts[1]", "-1"]),
    ("csv", "c.csv", "arrival_s,input_tokens,output_tokens,ttft_s,e2e_s\n0,4,2,0.1,0.3\n"
     "0.2,4,2,fast,0.3\n", ["c.csv line 3", "column ttft_s", "'fast'"]),
    ("csv", "c.csv", "arrival_s,input_tokens,output_tokens,ttft_s\n0,4,2,0.1\n",
     ["line 1", "itls_s or e2e_s"]),
    ("auto", "d.jsonl", "{not json\n", ["d.jsonl line 1", "not JSON"]),
])
def test_a_malformed_file_names_its_line_and_field(tmp_path, fmt, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MeasuredFileError) as info:
        read_measured(path, fmt)
    for word in words:
        assert word in str(info.value)


@pytest.mark.slow
def test_malformed_file_exits_2_with_the_message(tmp_path):
    config = write_config(tmp_path)
    path = tmp_path / "c.csv"
    path.write_text("arrival_s,input_tokens,output_tokens,ttft_s,itls_s\n0,4,3,0.1,0.1;x\n")
    proc = pdsim("compare", str(config), "--measured", "c.csv", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "c.csv line 2: column itls_s: '0.1;x'" in " ".join(proc.stderr.split())


def test_text_prompts_encode_to_exact_lengths(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from pdsim.validation.prompts import TextPrompts

    prompts = TextPrompts(byte_tokenizer(tmp_path / "bytes"))
    texts = prompts.prompts([1, 7, 64, 300], seed=0)
    assert [prompts.count(t) for t in texts] == [1, 7, 64, 300]
    assert all(len(t.encode()) == n for t, n in zip(texts, [1, 7, 64, 300]))

    # A BPE with merges (neighbours can merge) and a BOS added to every prompt.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 3,
              "pack my box with five dozen liquor jugs", "sphinx of black quartz judge my vow"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    (tmp_path / "bpe").mkdir()
    tok.save(str(tmp_path / "bpe" / "tokenizer.json"))
    bpe = TextPrompts(tmp_path / "bpe")
    assert bpe.special == 1
    lengths = [2, 5, 33, 128]
    texts = bpe.prompts(lengths, seed=3)
    assert [len(tok.encode(t).ids) for t in texts] == lengths
    with pytest.raises(ConfigError) as info:
        bpe.prompt(1, np.random.default_rng(0))
    assert "at least 2" in str(info.value)


def test_steady_gaps_know_the_batch_and_skip_what_changed():
    from pdsim.core.records import RequestRecord
    from pdsim.validation.fit import lone_requests, steady_gaps

    def rec(rid, arrival, times):
        return RequestRecord(rid=rid, input_tokens=8, output_tokens=len(times), status="ok",
                             arrival_s=arrival, first_token_s=times[0], finish_s=times[-1],
                             token_times_s=times)

    a = rec("a", 0.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    b = rec("b", 2.5, [3.5, 4.5, 5.5])  # waits for its first token over a's gap 2 -> 3 and 3 -> 4
    gaps, batch = steady_gaps([a, b])
    # a: 1->2 alone (batch 1); 2->3 and 3->4 see b pending; 4->5 with b (batch 2); 5->6: b
    # leaves at 5.5. b: 3.5->4.5 with a (batch 2); 4.5->5.5 with a (batch 2).
    assert sorted(zip(gaps.tolist(), batch.tolist())) == [(1.0, 1), (1.0, 2), (1.0, 2), (1.0, 2)]
    assert [r.rid for r in lone_requests([a, b])] == ["a"]


@pytest.mark.slow
def test_calibrate_measured_makes_the_simulation_reproduce_lone_requests(tmp_path):
    # Requests far apart: every one alone, every gap a steady step at batch 1.
    rows = [f"{t},32,8,0.05,{';'.join(['0.004'] * 7)}" for t in (0, 10, 20, 30)]
    path = tmp_path / "lone.csv"
    path.write_text("arrival_s,input_tokens,output_tokens,ttft_s,itls_s\n" + "\n".join(rows))
    config = write_config(tmp_path)
    proc = pdsim("calibrate", str(config), "--measured", "lone.csv", "-o", "calib/fit.yaml",
                 cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert "from 28 steady gaps at batch 1-1" in text and "from 4 requests alone" in text
    overlay = yaml.safe_load((tmp_path / "calib" / "fit.yaml").read_text())
    assert set(overlay) == {"measured", "cost_model", "router"}
    assert overlay["measured"]["lone_requests"]["count"] == 4
    before = pdsim("compare", str(config), "--measured", "lone.csv", "--out", "before",
                   cwd=tmp_path, timeout=120)
    after = pdsim("compare", str(config), "--measured", "lone.csv", "--calibration",
                  "calib/fit.yaml", "--out", "after", cwd=tmp_path, timeout=120)
    assert before.returncode == 1 and after.returncode == 0, after.stdout
    table = pd.read_csv(tmp_path / "after" / "validation.csv").set_index("metric")
    assert abs(table.loc["TTFT mean", "error"]) < 0.01
    assert abs(table.loc["ITL mean", "error"]) < 0.01
