"""What a driver reads from the core: the outbox (`emitted`: the requests the last step gave a
token outside a forward, a decode worker's first token from the KV metadata), `fail_batch` for a
forward that raised, each decode plan's KV lengths, and `load()`, the router's signal."""

from __future__ import annotations

from configs import scheduler_config
from core_harness import StubKV

from pdsim.core.batch import BatchResult, ExtendBatch
from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=4, max_running_requests=8, pre_alloc_size=2,
                metadata_slots=8, num_reserved_decode_tokens=0, waiting_timeout_s=10.0,
                max_prefill_tokens=64, chunked_prefill_size=0)
    base.update(kw)
    return scheduler_config(**base)


def test_decode_first_token_is_in_the_outbox_for_one_step_only():
    kv = StubKV()
    s = DecodeScheduler(cfg(), kv)
    r = Request("r1", 8, 4, arrival_s=0.0, bootstrap_room=1001, prompt_ids=list(range(8)))
    s.add_request(r, 0.0)
    kv["r1"].state = kv["r1"].state.WaitingForInput
    assert s.step(0.0) is None and r in s.transfer and s.emitted == []
    kv.deliver(r, first_token=42)
    batch = s.step(1.0)
    assert s.emitted == [r] and r.output_ids == [42]
    assert batch is not None and batch.kind == "decode" and batch.reqs == [r]
    s.step(2.0)
    assert s.emitted == []


def test_fail_batch_fails_an_extend_batch_and_frees_its_pages_and_slots():
    s = ColocatedScheduler(cfg())
    a = Request("a", 10, 3, arrival_s=0.0)
    b = Request("b", 6, 3, arrival_s=0.0)
    s.add_request(a, 0.0)
    s.add_request(b, 0.0)
    batch = s.step(0.0)
    assert batch.kind == "extend" and not s.waiting and s.pool.num_used > 0
    s.fail_batch(batch, "forward failed: boom", 0.5)
    assert [r.rid for r in s.done] == ["a", "b"]
    assert all(r.error == "forward failed: boom" and r.finished for r in (a, b))
    assert s.is_idle and not s.waiting
    s.check_pools_full()


def test_fail_batch_fails_a_decode_batch_only():
    s = ColocatedScheduler(cfg())
    a = Request("a", 4, 5, arrival_s=0.0)
    s.add_request(a, 0.0)
    s.on_batch_done(s.step(0.0), BatchResult(0.1), 1.0)
    c = Request("c", 4, 5, arrival_s=1.0)
    s.add_request(c, 1.0)
    s.done.clear()
    decode = s.running.plan(1.0)
    s.fail_batch(decode, "forward failed: boom", 1.5)
    assert [r.rid for r in s.done] == ["a"] and a.error.startswith("forward failed")
    assert list(s.waiting) == [c] and not c.finished



def test_a_decode_plan_carries_each_requests_kv_length():
    s = ColocatedScheduler(cfg())
    a = Request("a", 5, 9, arrival_s=0.0)
    s.add_request(a, 0.0)
    s.on_batch_done(s.step(0.0), BatchResult(0.1, [1], [0.0]), 1.0)  # prefill: KV 5
    for t in (2.0, 3.0):
        s.on_batch_done(s.step(t), BatchResult(0.1, [1], [0.0]), t + 0.5)  # KV 6, 7
    b = Request("b", 3, 9, arrival_s=3.0)
    s.add_request(b, 3.0)
    s.on_batch_done(s.step(3.5), BatchResult(0.1, [1], [0.0]), 4.0)  # b's prefill: KV 3
    batch = s.step(4.0)
    assert batch.kind == "decode" and [r.rid for r in batch.reqs] == ["a", "b"]
    assert batch.kv_lens() == [7, 3]
    assert not hasattr(ExtendBatch(batch.shape, 0.0, []), "kv_lens")  # segments say what is cached


def test_load_is_pending_prompt_tokens_on_prefill_and_active_requests_elsewhere():
    kv = StubKV()
    p = PrefillScheduler(cfg(), kv)
    p.add_request(Request("p1", 10, 1, arrival_s=0.0, bootstrap_room=1), 0.0)
    p.add_request(Request("p2", 7, 1, arrival_s=0.0, bootstrap_room=2), 0.0)
    assert p.load() == 17
    d = DecodeScheduler(cfg(), kv)
    d.add_request(Request("d1", 10, 4, arrival_s=0.0, bootstrap_room=3), 0.0)
    c = ColocatedScheduler(cfg())
    for i in range(3):
        c.add_request(Request(f"c{i}", 4, 4, arrival_s=0.0), 0.0)
    assert (d.load(), c.load()) == (1, 3)
