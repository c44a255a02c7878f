"""`ServeMetrics` alone, on hand-made records and batches whose numbers are worked out here:
which families each kind of server exports, and the two gauges it derives from forwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdsim.core.batch import BatchShape
from pdsim.core.records import RequestRecord
from prom import Scrape
from runtime import serve_metrics
from runtime.serve_metrics import GEN_THROUGHPUT_STEPS, ServeMetrics


def record(**times) -> RequestRecord:
    return RequestRecord(rid="r", input_tokens=10, output_tokens=3, status="ok",
                         token_times_s=[1.0, 1.5, 2.5], **times)


def scrape(metrics: ServeMetrics) -> Scrape:
    return Scrape(metrics.render().decode())


def test_bad_engine_type_and_unknown_gauges_are_refused():
    with pytest.raises(ValueError, match="engine_type 'router'; allowed: unified, prefill"):
        ServeMetrics("router")
    with pytest.raises(ValueError, match=r"unknown gauges \['sglang:made_up'\]"):
        ServeMetrics().set_gauges({"sglang:made_up": 1})


def test_the_front_reports_requests_under_sglang_names():
    metrics = ServeMetrics(engine_type=None)  # the PD router
    metrics.name_model("m")
    metrics.observe_request(record(arrival_s=0.5, first_token_s=1.0, finish_s=2.5))
    got = scrape(metrics)
    assert got.value("sglang:time_to_first_token_seconds_sum", model_name="m") == 0.5
    assert got.value("sglang:e2e_request_latency_seconds_sum", model_name="m") == 2.0
    assert got.value("sglang:inter_token_latency_seconds_count", model_name="m") == 2
    assert got.value("sglang:inter_token_latency_seconds_sum", model_name="m") == 1.5
    assert got.value("sglang:prompt_tokens_total", model_name="m") == 10
    assert got.value("sglang:generation_tokens_total", model_name="m") == 3
    assert not got.samples("sglang:queue_time_seconds_count")
    assert not got.samples("sglang:num_running_reqs")


def test_a_workers_request_times_are_pdsim_and_its_queue_time_its_own():
    metrics = ServeMetrics("decode")
    metrics.name_model("m")
    metrics.observe_request(record(arrival_s=0.0, transfer_done_s=0.75, decode_join_s=1.0,
                                   first_token_s=1.0, finish_s=2.5))
    got = scrape(metrics)
    assert not got.samples("sglang:time_to_first_token_seconds_count")
    assert got.value("pdsim_time_to_first_token_seconds_sum", model_name="m") == 1.0
    engine = {"model_name": "m", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0"}
    assert got.value("sglang:queue_time_seconds_sum", **engine) == 0.25
    assert got.value("sglang:gen_throughput", **engine) == 0  # no decode step yet
    assert not got.samples("sglang:cache_hit_rate")  # a decode worker prefills nothing


def test_gen_throughput_is_tokens_over_the_windows_wall_time(monkeypatch):
    clock = iter(0.1 * (i + 1) for i in range(2 * GEN_THROUGHPUT_STEPS))
    monkeypatch.setattr(serve_metrics.time, "monotonic", lambda: next(clock))
    metrics = ServeMetrics()
    step = SimpleNamespace(kind="decode", shape=BatchShape(decode_reqs=2))
    for _ in range(GEN_THROUGHPUT_STEPS - 1):
        metrics.observe_forward(step, 0.1, ())
    assert scrape(metrics).value("sglang:gen_throughput") == 0  # the window is not complete
    metrics.observe_forward(step, 0.1, ())
    # 40 steps of 2 tokens, from the first step's start (0.0) to the last one's end (4.0)
    assert scrape(metrics).value("sglang:gen_throughput") == pytest.approx(20.0)
    assert scrape(metrics).value("pdsim_forwards_total", kind="decode") == GEN_THROUGHPUT_STEPS


def test_cache_hit_rate_is_of_the_prompts_an_extend_completed():
    metrics = ServeMetrics("prefill")
    done = SimpleNamespace(input_len=40, cached_tokens=32)
    other = SimpleNamespace(input_len=100, cached_tokens=64)
    batch = SimpleNamespace(kind="extend", segments=[
        SimpleNamespace(req=done, end=40),  # its prompt's last chunk
        SimpleNamespace(req=other, end=80),  # a chunk in the middle: not counted yet
    ])
    metrics.observe_forward(batch, 0.01, [done])
    assert scrape(metrics).value("sglang:cache_hit_rate", engine_type="prefill") == 0.8
