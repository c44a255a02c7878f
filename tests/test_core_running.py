"""The continuous-batching running batch, and the real-executor path where forwards return ids."""

from __future__ import annotations

import random

import pytest

from configs import scheduler_config
from core_harness import Driver, FixedExecutor

from pdsim.core.batch import BatchResult
from pdsim.core.pool import PagePool
from pdsim.core.request import Request
from pdsim.core.running import RunningBatch
from pdsim.core.scheduler import ColocatedScheduler


def prefilled(rid, n_in, n_out, pool, **kw) -> Request:
    """A request just out of its prefill: prompt KV computed, first token emitted at t=0."""
    r = Request(rid, n_in, n_out, **kw)
    r.pages = pool.alloc_many(-(-n_in // pool.page_size))
    r.computed_tokens = n_in
    r.num_output = 1
    r.token_times_s = [0.0]
    return r


def test_lengths_follow_from_the_join_step():
    pool = PagePool(32, page_size=4)
    rb = RunningBatch(pool)
    a = prefilled("a", 6, 5, pool)
    rb.join(a)
    for t in (1.0, 2.0):
        rb.complete(rb.plan(t - 1.0), BatchResult(1.0), t)
    b = prefilled("b", 3, 2, pool)
    rb.join(b)
    assert (rb.kv_len(a), rb.kv_len(b)) == (8, 3)
    assert rb.context_tokens == 11
    batch = rb.plan(2.0)
    assert batch.kind == "decode" and batch.step == 3 and batch.reqs == [a, b]
    assert (batch.shape.decode_reqs, batch.shape.decode_context_tokens) == (2, 13)
    done = rb.complete(batch, BatchResult(1.0), 3.0)
    assert done == [b]  # b had 1 token of 2
    rb.leave(b)
    assert (b.num_output, b.computed_tokens, b.token_times_s) == (2, 4, [0.0, 3.0])
    assert rb.context_tokens == 9
    done = rb.complete(rb.plan(3.0), BatchResult(1.0), 4.0)
    assert done == [a]
    rb.leave(a)
    assert (a.num_output, a.computed_tokens, a.token_times_s) == (5, 10, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert len(rb) == 0 and rb.context_tokens == 0


def test_token_ids_are_appended_per_step_and_a_stop_token_ends_early():
    pool = PagePool(32, page_size=4)
    rb = RunningBatch(pool)
    a = prefilled("a", 4, 6, pool, prompt_ids=[1, 2, 3, 4], stop_token_ids=frozenset({0}))
    b = prefilled("b", 4, 3, pool, prompt_ids=[5, 6, 7, 8])
    a.output_ids, b.output_ids = [11], [21]
    rb.join(a)
    rb.join(b)
    steps = [([12, 22], [-0.1, -0.2]), ([0, 23], [-0.3, -0.4])]
    finished = []
    for k, (ids, lps) in enumerate(steps, start=1):
        batch = rb.plan(float(k - 1))
        done = rb.complete(batch, BatchResult(1.0, token_ids=ids, logprobs=lps), float(k))
        for r in done:
            rb.leave(r)
        finished.append([r.rid for r in done])
    assert finished == [[], ["b", "a"]]  # b by length, a by its stop token 0
    assert a.output_ids == [11, 12, 0] and a.output_logprobs == [-0.1, -0.3]
    assert b.output_ids == [21, 22, 23] and b.output_logprobs == [-0.2, -0.4]
    assert a.num_output == 3 < a.max_new_tokens and len(a.token_times_s) == 3
    assert b.num_output == 3


def test_a_stop_token_on_the_last_allowed_step_is_counted_once():
    pool = PagePool(8, page_size=4)
    rb = RunningBatch(pool)
    a = prefilled("a", 4, 2, pool, prompt_ids=[1, 2, 3, 4], stop_token_ids=frozenset({0}))
    rb.join(a)
    done = rb.complete(rb.plan(0.0), BatchResult(1.0, token_ids=[0]), 1.0)
    assert done == [a]


def test_growth_buckets_ask_for_a_page_exactly_when_one_fills():
    pool = PagePool(8, page_size=4)
    rb = RunningBatch(pool)
    a = prefilled("a", 4, 9, pool)  # 4 tokens in 1 full page: needs a page before step 1
    rb.join(a)
    asked = []
    for k in range(8):
        due = rb.pages_due()
        asked.append([r.rid for r in due])
        for r in due:
            rb.add_page(r, pool.alloc())
        rb.complete(rb.plan(float(k)), BatchResult(1.0), float(k + 1))
    assert asked == [["a"], [], [], [], ["a"], [], [], []]


# ----- through the colocated scheduler, with a "real" executor -------------------------------

STOP = 0


def counting_tokens(batch, i):
    """Token ids that count: an extend yields 100 + fill length, a decode step 100 + KV length + 1.
    So a request's k-th output token (k = 1, 2, ...) is always 100 + input_len + k - 1."""
    if batch.kind == "extend":
        return 100 + batch.segments[i].end
    req = batch.reqs[i]
    return 100 + req.kv_at_join + batch.step - req.join_step


def test_colocated_appends_executor_tokens_and_stops_on_a_stop_token():
    stop_at = {"s": 3, "first": 1}  # output index (1-based) at which each emits the stop token

    def tokens(batch, i):
        req = batch.segments[i].req if batch.kind == "extend" else batch.reqs[i]
        k = len(req.output_ids) + 1
        return STOP if stop_at.get(req.rid) == k else 1000 + k

    s = ColocatedScheduler(scheduler_config(32, page_size=4))
    d = Driver(FixedExecutor(token_fn=tokens), log=False)
    d.add_instance("C", s)
    stop = frozenset({STOP})
    reqs = {
        "s": Request("s", 4, 10, prompt_ids=[1] * 4, stop_token_ids=stop),
        "first": Request("first", 4, 10, prompt_ids=[1] * 4, stop_token_ids=stop),
        "full": Request("full", 4, 5, prompt_ids=[1] * 4, stop_token_ids=stop),
    }
    for r in reqs.values():
        d.submit(0.0, "C", r)
    d.run()
    assert reqs["s"].output_ids == [1001, 1002, STOP] and reqs["s"].num_output == 3
    assert reqs["first"].output_ids == [STOP] and reqs["first"].num_output == 1
    assert reqs["full"].output_ids == [1001, 1002, 1003, 1004, 1005]
    for r in reqs.values():
        assert r.finished and r.error == ""
        assert len(r.token_times_s) == r.num_output == len(r.output_ids) == len(r.output_logprobs)
    s.check_pools_full()


def test_retracted_requests_recompute_from_prompt_and_output_ids():
    s = ColocatedScheduler(scheduler_config(12, page_size=4, max_prefill_tokens=64,
                                            chunked_prefill_size=16, num_reserved_decode_tokens=0))
    ex = FixedExecutor(token_fn=counting_tokens)
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    rng = random.Random(3)
    reqs = []
    for i in range(12):
        n_in = rng.randint(2, 20)
        reqs.append(Request(f"r{i}", n_in, rng.randint(5, 25), prompt_ids=list(range(n_in))))
        d.submit(0.1 * i, "C", reqs[-1])
    recomputed = []
    orig = ex.forward

    def forward(batch):
        if batch.kind == "extend":
            for g in batch.segments:
                if g.req.num_output:
                    ids = g.req.fill_ids()
                    assert len(ids) == g.req.fill_len and ids[g.req.input_len:] == g.req.output_ids
                    recomputed.append(g.req.rid)
        return orig(batch)

    ex.forward = forward
    d.run()
    assert recomputed, "the pool should have forced retractions"
    for r in reqs:
        if r.input_len + r.max_new_tokens > 48:
            assert "pool holds 48" in r.error
            continue
        assert r.error == ""
        assert r.output_ids == [100 + r.input_len + k for k in range(r.max_new_tokens)]
        assert len(r.output_logprobs) == r.num_output == len(r.token_times_s) == r.max_new_tokens
    s.check_pools_full()


def test_a_long_running_batch_keeps_no_history_of_departed_requests():
    """A server runs for days: step end times and bucket entries of requests that left (here by
    a stop token long before their max_new_tokens) must not pile up."""
    from pdsim.core.running import TRIM_EVERY_STEPS, StepTimes

    pool = PagePool(4096, page_size=4)
    rb = RunningBatch(pool)
    rng = random.Random(0)
    live: list[Request] = []
    for step in range(3 * TRIM_EVERY_STEPS):
        while len(live) < 8:
            r = prefilled(f"r{step}-{len(live)}", 4, 100_000, pool, stop_token_ids=frozenset({7}))
            rb.join(r)
            live.append(r)
        for r in rb.pages_due():
            rb.add_page(r, pool.alloc())
        batch = rb.plan(float(step))
        ids = [7 if rng.random() < 0.05 else 1 for _ in batch.reqs]
        done = rb.complete(batch, BatchResult(1.0, token_ids=ids), float(step + 1))
        for r in done:
            rb.leave(r)
            pool.free_many(r.pages)
            live.remove(r)
            assert len(r.token_times_s) == r.num_output  # its times survived the trimming
    # Step times are dropped in whole chunks: at most one partly stale chunk beyond the bound.
    kept_bound = TRIM_EVERY_STEPS + max(rb.step - r.join_step for r in live) + StepTimes.CHUNK
    assert rb.step_end_s.kept <= kept_bound
    waiting = [r for bucket in rb._finish_at.values() for r in bucket]
    assert sorted(r.rid for r in waiting) == sorted(r.rid for r in live)
    growing = [r for bucket in rb._grow_at.values() for r in bucket]
    assert sorted(r.rid for r in growing) == sorted(r.rid for r in live)


def test_token_times_read_as_a_list_of_floats():
    import numpy as np

    from pdsim.core.token_times import TokenTimes, flatten_times

    steps = np.array([1.0, 1.5, 2.25, 3.0])
    t = TokenTimes([0.5])
    t.extend(steps[1:3])  # a view: kept, not copied
    t.append(4.0)
    assert len(t) == 4 and t == [0.5, 1.5, 2.25, 4.0] and t != [0.5, 1.5, 2.25]
    assert (t[0], t[1], t[-1], t[-2], t[1:3]) == (0.5, 1.5, 4.0, 2.25, [1.5, 2.25])
    assert list(t) == sorted(t) and all(type(x) is float for x in t)
    with pytest.raises(IndexError):
        t[4]
    flat = flatten_times([t, [7.0, 8.0], TokenTimes()], 6)
    assert flat.tolist() == [0.5, 1.5, 2.25, 4.0, 7.0, 8.0]


def test_a_leaving_request_keeps_views_of_the_step_times():
    from pdsim.core.token_times import TokenTimes

    pool = PagePool(32, page_size=4)
    rb = RunningBatch(pool)
    a = prefilled("a", 4, 4, pool)
    a.token_times_s = TokenTimes([0.0])
    rb.join(a)
    for t in (1.0, 2.0, 3.0):
        for r in rb.pages_due():
            rb.add_page(r, pool.alloc())
        done = rb.complete(rb.plan(t - 1.0), BatchResult(1.0), t)
    assert done == [a]
    rb.leave(a)
    assert a.token_times_s == [0.0, 1.0, 2.0, 3.0]
    assert [type(p).__name__ for p in a.token_times_s.parts()] == ["float", "ndarray"]
