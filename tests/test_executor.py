"""The real executor behind the shared core scheduler, and the threaded engine (CPU, torch kernels).

Reference outputs come from the model run directly: every token recomputed from scratch without
a KV cache, argmax over the byte tokenizer's ids.
"""

from __future__ import annotations

import math
import threading

import pandas as pd
import pytest
import torch
from configs import scheduler_config
from core_harness import StubKV
from core_loop import drive

from pdsim.core.batch import (
    BatchResult, BatchShape, ExtendBatch, ExtendSegment, extend_attn_pairs,
)
from pdsim.core.decode import DecodeScheduler
from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from runtime.driver import Engine
from runtime.executor import TIMING_COLUMNS, ModelExecutor
from runtime.model import AttentionMetadata, ModelConfig, build_model
from runtime.sampling import SamplingParams
from runtime.protocol.stream import StreamEvent
from runtime.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.real, pytest.mark.slow]

VOCAB = ByteTokenizer.vocab_size
PRESETS = ["tiny-llama", "tiny-mla"]


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return build_model(ModelConfig.preset(request.param), seed=3)


def reference_greedy(model, prompt, max_new, stop=()):
    tokens, out = list(prompt), []
    for _ in range(max_new):
        meta = AttentionMetadata.without_cache([len(tokens)])
        hidden = model.hidden_states(torch.tensor(tokens), meta.positions(), meta, None)
        token = int(model.compute_logits(hidden[-1:])[0, :VOCAB].argmax())
        out.append(token)
        tokens.append(token)
        if token in stop:
            break
    return out


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sched_config(**kw):
    base = dict(num_pages=24, page_size=4, max_running_requests=8, max_prefill_tokens=48,
                chunked_prefill_size=8, num_reserved_decode_tokens=2)
    base.update(kw)
    return scheduler_config(**base)


def executor_for(model, cfg, **kw):
    return ModelExecutor(model, num_pages=cfg.num_pages, page_size=cfg.page_size,
                         vocab_limit=VOCAB, **kw)


def test_greedy_through_the_scheduler_equals_direct_generation(model):
    """Chunked prefill, batching and retraction (recompute of prompt + generated tokens) under a
    small pool leave greedy outputs exactly those of the model run directly."""
    cfg = sched_config()
    sched = ColocatedScheduler(cfg)
    retractions = []
    retract = sched._retract_one
    sched._retract_one = lambda *a: retractions.append(1) or retract(*a)
    reqs = [Request(f"r{i}", 5 + 3 * i, 10, arrival_s=0.0, prompt_ids=prompt(5 + 3 * i, i))
            for i in range(6)]
    drive(sched, executor_for(model, cfg), reqs)
    sched.check_pools_full()
    assert retractions, "the pool was meant to be too small for all six at once"
    for r in reqs:
        assert not r.error
        assert r.output_ids == reference_greedy(model, r.prompt_ids, 10), r.rid
        assert r.num_output == 10 and len(r.output_logprobs) == 10
        assert all(lp <= 0 for lp in r.output_logprobs)


def test_a_pd_decode_retraction_copies_the_kv_out_and_back_exactly(model):
    """A decode instance under a small pool retracts by copying requests' KV pages to the host
    and back into other pages (KVMove): greedy outputs stay exactly the model's, with no
    forward recomputing anything."""
    cfg = sched_config(max_prefill_tokens=64, chunked_prefill_size=0)
    kv = StubKV(initial=KVPoll.WaitingForInput)
    sched = DecodeScheduler(cfg, kv)
    executor = executor_for(model, cfg)
    reqs = [Request(f"r{i}", 5 + 3 * i, 10, arrival_s=0.0, prompt_ids=prompt(5 + 3 * i, i))
            for i in range(6)]
    for r in reqs:
        sched.add_request(r, 0.0)
    now, delivered, kinds = 0.0, set(), []
    while not sched.is_idle:
        for r in sched.transfer:  # the prefill side: the prompt's KV into its pages
            if r.rid not in delivered:
                segment = ExtendSegment(r, 0, r.input_len)
                shape = BatchShape(prefill_tokens=r.input_len,
                                   prefill_attn_pairs=extend_attn_pairs(r.input_len, 0))
                first = executor.forward(ExtendBatch(shape, now, [segment]))
                kv.deliver(r, first_token=first.token_ids[0], logprob=first.logprobs[0])
                delivered.add(r.rid)
        batch = sched.step(now)
        if batch is None:
            continue
        kinds.append((batch.kind, [m.to_host for m in batch.kv_moves]))
        now += 1.0
        sched.on_batch_done(batch, executor.forward(batch), now)
    sched.check_pools_full()
    assert sched.retractions > 0, "the pool was meant to be too small for all six at once"
    assert {kind for kind, _ in kinds} == {"decode"}
    moves = [to_host for _, m in kinds for to_host in m]
    assert moves.count(True) == moves.count(False) == sched.retractions
    assert not executor._host_kv  # every host copy went back
    for r in reqs:
        assert not r.error
        assert r.output_ids == reference_greedy(model, r.prompt_ids, 10), r.rid


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    cfg = sched_config(num_pages=64)

    def run(extra, seed=11):
        sched = ColocatedScheduler(cfg)
        target = Request("t", 9, 12, prompt_ids=prompt(9, 0),
                         sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        others = [Request(f"o{i}", 4 + i, 12, prompt_ids=prompt(4 + i, 10 + i),
                          sampling=SamplingParams(temperature=0.7, seed=i)) for i in range(extra)]
        drive(sched, executor_for(model, cfg), [*others[:1], target, *others[1:]])
        return target.output_ids

    alone = run(0)
    assert run(4) == alone
    assert run(0, seed=12) != alone


def test_every_forward_is_timed_with_its_shape(model, tmp_path):
    cfg = sched_config(num_pages=64)
    executor = executor_for(model, cfg)
    reqs = [Request(f"r{i}", 11, 4, prompt_ids=prompt(11, i)) for i in range(3)]
    batches = drive(ColocatedScheduler(cfg), executor, reqs)
    assert len(executor.timings) == len(batches)
    for batch, t in zip(batches, executor.timings):
        s = batch.shape
        assert (t.kind, t.prefill_tokens, t.prefill_attn_pairs, t.decode_reqs,
                t.decode_context_tokens) == (batch.kind, s.prefill_tokens, s.prefill_attn_pairs,
                                             s.decode_reqs, s.decode_context_tokens)
        assert t.duration_s > 0
    kinds = [t.kind for t in executor.timings]
    assert "extend" in kinds and "decode" in kinds
    for suffix in (".csv", ".parquet"):
        path = executor.save_timings(tmp_path / f"timings{suffix}")
        frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        assert list(frame.columns) == list(TIMING_COLUMNS) and len(frame) == len(batches)
    with pytest.raises(ValueError, match="allowed: .csv, .parquet"):
        executor.save_timings(tmp_path / "timings.json")


def test_core_abort_frees_a_waiting_a_chunked_and_a_running_request():
    cfg = sched_config(num_pages=64, chunked_prefill_size=4, max_prefill_tokens=4)
    sched = ColocatedScheduler(cfg)
    running, chunked, waiting = Request("run", 3, 5), Request("chunk", 10, 5), Request("wait", 6, 5)
    for r in (running, chunked, waiting):
        sched.add_request(r, 0.0)
    for now in (1.0, 2.0):  # "run" prefills with the first token of "chunk", then a chunk of 4
        batch = sched.step(now)
        sched.on_batch_done(batch, BatchResult(0.1), now + 0.5)
    assert running in sched.running.reqs and running.num_output == 1
    assert chunked.computed_tokens == 5 and chunked.pages and chunked.req_slot >= 0
    assert list(sched.waiting) == [chunked, waiting]
    assert sched.abort("nope", "x", 4.0) is False
    for r in (running, chunked, waiting):
        assert sched.abort(r.rid, "client disconnected", 4.0) is True
        assert r.finished and r.error == "client disconnected" and r.finish_s == 4.0
    assert sched.abort("run", "again", 5.0) is False
    assert sched.is_idle and not sched.waiting and not sched.running.reqs
    assert [r.rid for r in sched.done] == ["run", "chunk", "wait"]
    sched.check_pools_full()
    record = running.to_record("failed")
    assert record.output_tokens == 1 and record.error == "client disconnected"


# ---- the engine thread --------------------------------------------------------------------


class Collector:
    def __init__(self):
        self.events: dict[str, list[StreamEvent]] = {}
        self.cond = threading.Condition()

    def sink(self, key):
        def put(event):
            with self.cond:
                self.events.setdefault(key, []).append(event)
                self.cond.notify_all()
        return put

    def wait(self, keys, timeout=30.0):
        with self.cond:
            ok = self.cond.wait_for(
                lambda: all(self.events.get(k) and self.events[k][-1].finished for k in keys),
                timeout)
        assert ok, f"not finished: {[k for k in keys if not self.events.get(k)]}"
        return {k: self.events[k] for k in keys}


@pytest.fixture
def engine(model):
    cfg = sched_config(num_pages=48)
    eng = Engine(executor_for(model, cfg), cfg).start()
    yield eng
    eng.stop()


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


def test_engine_streams_tokens_and_keeps_records(model, engine):
    col = Collector()
    prompts = {f"q{i}": prompt(6 + 2 * i, 20 + i) for i in range(5)}
    refs = {k: reference_greedy(model, p, 8) for k, p in prompts.items()}
    # q0 stops at a stop token: the first one its greedy output has not produced before.
    stop_at = next(i for i in range(2, 8) if refs["q0"][i] not in refs["q0"][:i])
    for k, p in prompts.items():
        stop = [refs[k][stop_at]] if k == "q0" else []
        engine.submit(p, 8, col.sink(k), rid=k, stop_token_ids=stop)
    got = col.wait(list(prompts))
    for k, events in got.items():
        last = events[-1]
        assert last.error is None and last.prompt_tokens == len(prompts[k])
        if k == "q0":
            assert tokens_of(events) == refs[k][: stop_at + 1]
            assert last.finish_reason == "stop" and last.completion_tokens == stop_at + 1
        else:
            assert tokens_of(events) == refs[k] and last.finish_reason == "length"
            assert last.completion_tokens == 8
        assert len(events) >= 2  # tokens stream as they come, not all at the end
    engine.check_pools_full()
    records = {r.rid: r for r in engine.records}
    assert set(records) == set(prompts)
    for r in records.values():
        assert r.ok and r.decode_instance == 0
        chain = [r.arrival_s, r.prefill_start_s, r.prefill_end_s, r.first_token_s, r.finish_s]
        assert all(not math.isnan(t) for t in chain) and chain == sorted(chain)
        assert len(r.token_times_s) == r.output_tokens and r.token_times_s[-1] == r.finish_s
    frame = engine.records_frame()
    assert len(frame) == 5 and (frame["ttft_s"] > 0).all()


def test_engine_abort_and_stop_release_everything(model):
    cfg = sched_config(num_pages=48)
    eng = Engine(executor_for(model, cfg), cfg).start()
    col = Collector()
    eng.submit(prompt(5, 1), 150, col.sink("long"), rid="long")
    eng.submit(prompt(5, 2), 150, col.sink("other"), rid="other")
    eng.abort("long", "client disconnected")
    eng.abort("never-submitted")
    got = col.wait(["long"])
    assert got["long"][-1].error == "client disconnected"
    eng.stop()
    got = col.wait(["other"])
    assert got["other"][-1].error == "server shutting down"
    eng.sched.check_pools_full()
    assert {r.rid: r.status for r in eng.records} == {"long": "failed", "other": "failed"}
    with pytest.raises(RuntimeError, match="not running"):
        eng.submit([1, 2], 2, col.sink("late"))


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on(model, engine):
    col = Collector()
    engine.submit(prompt(5, 3), 4, col.sink("bad"), rid="bad", sampling="not params")
    got = col.wait(["bad"])
    assert "forward failed" in got["bad"][-1].error
    engine.submit(prompt(5, 3), 4, col.sink("good"), rid="good")
    assert tokens_of(col.wait(["good"])["good"]) == reference_greedy(model, prompt(5, 3), 4)
    engine.check_pools_full()


def test_engine_rejects_a_cache_that_does_not_match_the_pool(model):
    cfg = sched_config()
    with pytest.raises(ValueError, match="differs from the executor's KV cache"):
        Engine(executor_for(model, sched_config(num_pages=12)), cfg)
