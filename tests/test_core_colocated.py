"""The colocated scheduler (prefill and decode on one instance), driven on a manual clock."""

from __future__ import annotations

import random

import pytest
from configs import scheduler_config
from core_harness import Driver, FixedExecutor

from pdsim.core.batch import BatchResult
from pdsim.core.config import SchedulerConfig
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.deployment import SchedulerKnobs


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=4, max_running_requests=16, max_prefill_tokens=64,
                chunked_prefill_size=32, num_reserved_decode_tokens=4)
    base.update(kw)
    return scheduler_config(**base)


def driver(sched, executor=None, log=False) -> Driver:
    d = Driver(executor or FixedExecutor(extend_s=1.0, decode_s=0.25), log=log)
    d.add_instance("C", sched)
    return d


def test_prefill_first():
    s = ColocatedScheduler(cfg())
    r0, r1 = Request("r0", 8, 10), Request("r1", 8, 10)
    s.add_request(r0, 0.0)
    b = s.step(0.0)
    s.on_batch_done(b, BatchResult(1.0), 1.0)
    assert list(s.running.reqs) == [r0]
    s.add_request(r1, 1.0)
    b = s.step(1.0)
    assert b.kind == "extend" and [g.req for g in b.segments] == [r1]  # r0 waits for its decode
    s.on_batch_done(b, BatchResult(1.0), 2.0)
    b = s.step(2.0)
    assert b.kind == "decode" and b.reqs == [r0, r1] and b.step == 1
    assert r0.token_times_s == [1.0] and r1.token_times_s == [2.0]


def test_chunked_prefill_runs_chunk_after_chunk_then_decodes():
    s = ColocatedScheduler(cfg(chunked_prefill_size=8))
    ex = FixedExecutor(extend_s=1.0, decode_s=0.25)
    d = driver(s, ex, log=True)
    r = Request("r0", 20, 3)
    d.submit(0.0, "C", r)
    d.run()
    assert [(b.kind, b.shape.prefill_tokens, b.shape.decode_reqs) for b in ex.batches] == [
        ("extend", 8, 0), ("extend", 8, 0), ("extend", 4, 0), ("decode", 0, 1), ("decode", 0, 1),
    ]
    assert [(g.start, g.end) for b in ex.batches[:3] for g in b.segments] == [(0, 8), (8, 16), (16, 20)]
    assert d.log == [
        ("r0 C:waiting", 0.0), ("r0 C:extend", 0.0),
        ("r0 C:waiting", 1.0), ("r0 C:extend", 1.0),
        ("r0 C:waiting", 2.0), ("r0 C:extend", 2.0),
        ("r0 C:running", 3.0),
        ("r0 C:done", 3.5),
    ]
    assert (r.prefill_start_s, r.prefill_end_s, r.token_times_s) == (0.0, 3.0, [3.0, 3.25, 3.5])
    s.check_pools_full()


def test_a_request_too_long_for_the_pool_fails_and_the_others_go_on():
    s = ColocatedScheduler(cfg(num_pages=8, page_size=4))  # 32 tokens
    d = driver(s)
    ok0, big, ok1 = Request("ok0", 10, 5), Request("big", 30, 3), Request("ok1", 20, 12)
    for r in (ok0, big, ok1):
        d.submit(0.0, "C", r)
    d.run()
    assert big.finished and big.error == (
        "request needs 33 KV tokens but the instance's pool holds 32 (8 pages of 4)"
    )
    assert big.finish_s == 0.0 and big.num_output == 0 and big.token_times_s == []
    assert big.to_record("failed").status == "failed"
    for r in (ok0, ok1):
        assert r.error == "" and r.num_output == r.max_new_tokens
    assert [r.rid for r in d.done("C")] == ["big", "ok0", "ok1"]
    s.check_pools_full()


def test_token_times_one_per_output_token_and_ordered():
    s = ColocatedScheduler(cfg())
    d = driver(s)
    rng = random.Random(5)
    reqs = [Request(f"r{i}", rng.randint(1, 40), rng.randint(1, 20), arrival_s=0.3 * i) for i in range(30)]
    for r in reqs:
        d.submit(r.arrival_s, "C", r)
    d.run()
    for r in reqs:
        assert r.error == ""
        assert r.num_output == r.max_new_tokens == len(r.token_times_s)
        assert r.token_times_s == sorted(r.token_times_s)
        assert r.arrival_s <= r.prefill_start_s < r.prefill_end_s == r.token_times_s[0]
        assert r.finish_s == r.token_times_s[-1]
        rec = r.to_record("ok")
        assert rec.ttft_s == r.token_times_s[0] - r.arrival_s and rec.output_tokens == r.max_new_tokens
    s.check_pools_full()


class CountingExecutor(FixedExecutor):
    """Counts recomputes: extend segments of requests that had already generated tokens."""

    def __init__(self):
        super().__init__(extend_s=0.02, decode_s=0.01)
        self.recomputes = 0
        self.max_running = 0

    def forward(self, batch):
        if batch.kind == "extend":
            self.recomputes += sum(g.req.num_output > 0 for g in batch.segments if g.start == 0)
        else:
            self.max_running = max(self.max_running, len(batch.reqs))
        return super().forward(batch)


def test_random_workload_under_a_small_pool_leaks_nothing():
    rng = random.Random(2024)
    # 24 pages of 8 = 192 tokens; prompts up to 150, outputs up to 60: retraction is routine and
    # some requests cannot fit at all.
    s = ColocatedScheduler(cfg(num_pages=24, page_size=8, max_running_requests=12, max_prefill_tokens=96,
                               chunked_prefill_size=40, num_reserved_decode_tokens=8))
    ex = CountingExecutor()
    d = driver(s, ex)
    reqs = []
    t = 0.0
    for i in range(200):
        t += rng.expovariate(40.0)
        r = Request(f"r{i}", rng.randint(1, 150), rng.randint(1, 60), arrival_s=t)
        reqs.append(r)
        d.submit(t, "C", r)
    d.run()
    assert s.is_idle
    s.check_pools_full()
    assert ex.recomputes > 0, "the workload should have forced retractions"
    assert ex.max_running <= 12
    failed = [r for r in reqs if r.error]
    assert failed and all("pool holds 192" in r.error for r in failed)
    assert all(r.input_len + r.max_new_tokens > 192 for r in failed)
    for r in reqs:
        assert r.finished
        if not r.error:
            assert r.num_output == r.max_new_tokens == len(r.token_times_s)
            assert r.token_times_s == sorted(r.token_times_s)
    assert {r.rid for r in d.done("C")} == {r.rid for r in reqs}


def test_many_seeds_with_long_chunked_prompts_never_stall():
    # Several half-prefilled requests at once, retraction and a tiny pool: the driver raises if
    # the scheduler ever has work it cannot plan.
    for seed in range(25):
        rng = random.Random(seed)
        s = ColocatedScheduler(cfg(num_pages=16, page_size=4, max_running_requests=8,
                                   max_prefill_tokens=32, chunked_prefill_size=16,
                                   num_reserved_decode_tokens=2))
        d = driver(s)
        reqs = [Request(f"r{i}", rng.randint(1, 40), rng.randint(1, 30)) for i in range(40)]
        for i, r in enumerate(reqs):
            d.submit(0.1 * i, "C", r)
        d.run()
        s.check_pools_full()
        assert all(r.error or r.num_output == r.max_new_tokens for r in reqs)


def test_a_prompt_waits_for_room_for_what_running_requests_may_still_generate():
    """SGLang's PrefillAdder: a prompt goes in when the pool holds it and the tokens it may
    generate beside new_token_ratio of what the running requests may still generate; the
    ratio starts at 0.7 and loses (0.7 - 0.098) / 600 a decode step."""
    s = ColocatedScheduler(cfg(num_pages=256, page_size=4))  # 1,024 tokens
    a, b = Request("a", 16, 1000), Request("b", 300, 40)
    s.add_request(a, 0.0)
    batch = s.step(0.0)
    s.on_batch_done(batch, BatchResult(1.0), 1.0)  # a decodes, its first token out
    assert s._reserved_tokens() == int(999 * 0.7)
    s.add_request(b, 1.0)
    decay = (0.7 - 0.7 * 0.14) / 600

    def admits(k: int) -> bool:  # after k decode steps of a
        free = 1024 - 4 * -(-(16 + k) // 4)  # the pages a's KV fills
        return 300 + 40 < free - int((1000 - (1 + k)) * (0.7 - k * decay))

    want = next(k for k in range(1000) if admits(k))
    assert want > 0  # held back at first
    t, k = 1.0, 0
    while True:
        batch = s.step(t)
        if batch.kind == "extend":
            break
        t += 1.0
        s.on_batch_done(batch, BatchResult(1.0), t)
        k += 1
    assert k == want and [g.req.rid for g in batch.segments] == ["b"]
    assert s.new_token_ratio == pytest.approx(0.7 - k * decay)


def test_the_ratio_resets_when_idle_and_follows_a_retraction():
    s = ColocatedScheduler(cfg(num_pages=64, page_size=4))
    s.new_token_ratio = 0.2
    assert s.step(0.0) is None and s.new_token_ratio == 0.7  # an idle step resets it
    ratios = []
    done = s.on_batch_done
    s.on_batch_done = lambda *a: done(*a) or ratios.append(s.new_token_ratio)
    d = driver(s)
    d.submit(0.0, "C", Request("a", 8, 4))
    d.run()
    decay = (0.7 - 0.098) / 600
    assert ratios == pytest.approx([0.7, 0.7 - decay, 0.7 - 2 * decay, 0.7 - 3 * decay])
    # a retraction: what the batch has decoded, plus 20 steps a request, over its max_new_tokens
    s = ColocatedScheduler(cfg(num_pages=12, page_size=4))
    s._reserved_tokens = lambda: 0  # admit as if nothing would be generated: retract later
    d = driver(s)
    seen = []
    retract = s._retract_one

    def watched():
        done = retract()
        reqs = list(s.running.reqs)
        decoded = sum(s.running.kv_len(r) - r.input_len + 1 for r in reqs)
        seen.append((s.new_token_ratio, min(1.0, (decoded + 20 * len(reqs))
                                            / (sum(r.max_new_tokens for r in reqs) + 1))))
        return done

    s._retract_one = watched
    for i in range(3):
        d.submit(0.0, "C", Request(f"r{i}", 8, 12))
    d.run()
    assert seen and all(got == pytest.approx(want) for got, want in seen)
    s.check_pools_full()


def test_schedule_conservativeness_scales_the_ratio_and_dp_attention_lowers_it():
    """SGLang's --schedule-conservativeness multiplies the starting ratio (capped at 1), and DP
    attention multiplies the conservativeness by 0.3 (`_handle_data_parallelism`)."""
    knobs = SchedulerKnobs(disable_radix_cache=True, max_running_requests=8)
    plain = ColocatedScheduler(knobs.build(64))
    dp = ColocatedScheduler(knobs.build(64, dp_attention=2))
    assert (plain.init_ratio, plain.min_ratio) == pytest.approx((0.7, 0.098))
    assert (dp.init_ratio, dp.min_ratio) == pytest.approx((0.21, 0.21 * 0.14))
    assert dp.new_token_ratio == dp.init_ratio
    bold = ColocatedScheduler(knobs.model_copy(update={"schedule_conservativeness": 2.0}).build(64))
    assert bold.init_ratio == 1.0
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        SchedulerKnobs(schedule_conservativeness=-1)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_schedule_a_request_that_comes_during_a_step_is_prefilled_a_step_later(overlap):
    """SGLang's event_loop_overlap plans step k+1 while step k runs: r1, which comes during
    r0's first decode step, finds the next step (r0's second decode) already planned, and is
    prefilled only after it; TTFT one step longer. r2 comes while the instance idles and is
    prefilled at once."""
    from dataclasses import replace

    from pdsim.core.instance import Add, Instance
    config = replace(cfg(), overlap_schedule="plans_ahead" if overlap else "off")
    inst = Instance([ColocatedScheduler(config)], lambda r: None)
    r0, r1, r2 = Request("r0", 8, 4), Request("r1", 8, 2), Request("r2", 8, 2)
    step = inst.begin(0.0, [Add(r0)])
    kinds, t = [], 0.0
    while step is not None:
        t += 1.0
        inst.finish(step, BatchResult(1.0), t)
        step = inst.begin(t, [Add(r1)] if t == 2.0 else [])
        kinds.append(None if step is None else
                     (step[0].kind, sorted(r.rid for r in (step[0].reqs if step[0].kind == "decode"
                                                          else [g.req for g in step[0].segments]))))
    if overlap:
        assert kinds[:3] == [("decode", ["r0"]), ("decode", ["r0"]), ("extend", ["r1"])]
        assert r1.token_times_s[0] == 4.0
    else:
        assert kinds[:2] == [("decode", ["r0"]), ("extend", ["r1"])]
        assert r1.token_times_s[0] == 3.0
    step = inst.begin(t + 5.0, [Add(r2)])  # idle: planned at once
    assert step[0].kind == "extend" and r2.prefill_start_s == t + 5.0
