"""The prefill scheduler's queues, stepped by hand with scripted senders and a manual clock."""

from __future__ import annotations

from dataclasses import replace

import pytest
from configs import scheduler_config
from core_harness import StubKV

from pdsim.core.batch import BatchResult
from pdsim.core.config import SchedulerConfig
from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.kvpoll import KVPoll
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request

ROOM = 1234567890123


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=4, max_running_requests=8, metadata_slots=8,
                bootstrap_timeout_s=5.0)
    base.update(kw)
    return scheduler_config(**base)


def req(rid: str, n_in: int, n_out: int = 8) -> Request:
    return Request(rid, n_in, n_out, arrival_s=0.0, bootstrap_room=ROOM + int(rid[1:]))


def used(s: PrefillScheduler) -> tuple[int, int, int]:
    return s.pool.num_used, s.req_slots.num_used, s.metadata_slots.num_used


def run_batch(s: PrefillScheduler, now: float, duration: float = 1.0):
    """Step at `now`; run the planned forward; hand it back at `now + duration`."""
    batch = s.step(now)
    if batch is not None:
        s.on_batch_done(batch, BatchResult(duration), now + duration)
    return batch


def extend_plans(s: PrefillScheduler) -> list[list[tuple[str, int, int]]]:
    """The extend batches `s` plans, one a second until it has none: (rid, start, end) a
    segment."""
    plans, t = [], 0.0
    while (b := run_batch(s, t)) is not None:
        plans.append([(g.req.rid, g.start, g.end) for g in b.segments])
        t += 1.0
    return plans


def test_prefill_forces_one_new_token():
    s = PrefillScheduler(cfg(), StubKV())
    r = req("r0", 10, n_out=200)
    s.add_request(r, 0.0)
    assert r.max_new_tokens == 1
    assert r.prefill_instance == 0 and r.queued_s == 0.0
    assert s.bootstrap == [r] and s.pending_tokens == 10 and s.num_active == 1


def test_sits_in_bootstrap_until_the_decode_side_has_sent_where_to_write():
    kv = StubKV()
    s = PrefillScheduler(cfg(), kv)
    r = req("r0", 10)
    s.add_request(r, 0.0)
    for t in (0.0, 1.0, 2.0):
        assert s.step(t) is None
        assert s.bootstrap == [r] and not s.waiting
        assert used(s) == (0, 0, 0)
        assert kv["r0"].calls == []
    kv["r0"].state = KVPoll.WaitingForInput
    batch = s.step(3.0)
    assert r.bootstrap_done_s == 3.0
    assert kv["r0"].calls == [("init", 3, 0)]  # 10 tokens on pages of 4, metadata slot 0
    assert s.bootstrap == []
    assert batch.kind == "extend" and [(g.req, g.start, g.end) for g in batch.segments] == [(r, 0, 10)]
    assert r.prefill_start_s == 3.0
    assert used(s) == (3, 1, 1)


def test_moves_to_waiting_only_when_a_metadata_slot_is_free():
    kv = StubKV(initial=KVPoll.WaitingForInput)  # the receivers are ready at once
    s = PrefillScheduler(cfg(metadata_slots=1), kv)
    r0, r1 = req("r0", 8), req("r1", 8)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    batch = s.step(0.0)
    assert [g.req for g in batch.segments] == [r0]
    assert s.bootstrap == [r1]  # ready, but the only metadata slot is r0's
    assert r1.metadata_slot == -1 and r1.req_slot == -1
    s.on_batch_done(batch, BatchResult(1.0), 1.0)
    assert s.inflight == [r0]
    assert s.step(1.0) is None and s.bootstrap == [r1]  # r0's transfer is still going
    kv["r0"].state = KVPoll.Success
    assert s.step(2.0) is None  # the bootstrap queue is polled before the inflight one...
    assert [x.rid for x in s.done] == ["r0"] and s.bootstrap == [r1]
    batch = s.step(2.0)  # ...so r1 takes the freed slot at the next step
    assert [g.req for g in batch.segments] == [r1]
    assert r1.metadata_slot == 0 and r1.bootstrap_done_s == 2.0
    assert kv["r1"].calls == [("init", 2, 0)]


def test_a_request_slot_shortage_also_holds_the_queue_and_returns_the_metadata_slot():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(max_running_requests=1), kv)
    r0, r1, r2 = req("r0", 4), req("r1", 4), req("r2", 4)
    for r in (r0, r1, r2):
        s.add_request(r, 0.0)
    s.step(0.0)
    assert s.bootstrap == [r1, r2]  # FIFO: both wait behind the first that cannot go
    assert s.metadata_slots.num_used == 1 and s.req_slots.num_used == 1


def test_chunked_prefill_sends_complete_pages_after_each_chunk():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(page_size=6, chunked_prefill_size=16), kv)
    r = req("r0", 40)
    s.add_request(r, 0.0)
    sender = kv["r0"]

    b1 = s.step(0.0)
    assert [(g.start, g.end) for g in b1.segments] == [(0, 16)]
    assert b1.shape.prefill_tokens == 16 and not b1.segments[0].is_last
    assert r.pages == list(range(7))  # the whole prompt's pages at the first chunk
    s.on_batch_done(b1, BatchResult(1.0), 1.0)
    assert sender.sends() == [([0, 1], False)]  # page 2 is only partly written (12 of 16 tokens)
    assert s.waiting[0] is r and r.computed_tokens == 16 and s.pending_tokens == 24

    b2 = s.step(1.0)
    assert [(g.start, g.end) for g in b2.segments] == [(16, 32)]
    assert b2.shape.prefill_tokens == 16
    s.on_batch_done(b2, BatchResult(1.0), 2.0)
    assert sender.sends()[1:] == [([2, 3, 4], False)]  # 32 tokens fill 5 pages

    b3 = s.step(2.0)
    assert [(g.start, g.end) for g in b3.segments] == [(32, 40)]
    assert b3.shape.prefill_tokens == 8 and b3.segments[0].is_last
    s.on_batch_done(b3, BatchResult(1.0, token_ids=[42], logprobs=[-0.25]), 3.0)
    assert sender.sends()[2:] == [([5, 6], True)]  # the rest, with the metadata
    assert sum((p for p, _ in sender.sends()), []) == r.pages == list(range(7))
    meta = kv.metadata.read(r.metadata_slot)
    assert meta.bootstrap_room == r.bootstrap_room
    assert (meta.first_token_id, meta.first_logprob, meta.cached_tokens) == (42, -0.25, 0)
    assert s.inflight == [r] and s.pending_tokens == 0
    assert (r.prefill_start_s, r.prefill_end_s, r.num_output, r.token_times_s) == (0.0, 3.0, 1, [3.0])
    # Chunk attention pairs: each chunk attends over everything before it, its prefix.
    assert b2.shape.prefill_attn_pairs == 16 * 16 + 16 * 17 / 2
    assert [b.shape.prefill_prefix_tokens for b in (b1, b2, b3)] == [0, 16, 32]


def test_inflight_success_frees_pages_and_slots():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(), kv)
    r = req("r0", 10)
    s.add_request(r, 0.0)
    run_batch(s, 0.0)
    assert used(s) == (3, 1, 1) and s.inflight == [r]
    kv["r0"].state = KVPoll.Transferring
    s.step(1.5)
    assert used(s) == (3, 1, 1) and s.inflight == [r]
    kv["r0"].state = KVPoll.Success
    s.step(2.0)
    assert used(s) == (0, 0, 0)
    assert s.done == [r] and r.finished and r.error == "" and r.finish_s == 2.0
    assert s.is_idle
    s.check_pools_full()


def test_sender_failure_in_flight_aborts_and_frees_everything():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(), kv)
    r0, r1 = req("r0", 10), req("r1", 6)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    run_batch(s, 0.0)
    kv["r0"].fail("decode side went away")
    kv["r1"].state = KVPoll.Success
    s.step(1.0)
    assert r0.error == "KV transfer failed: decode side went away"
    assert r1.error == "" and {x.rid for x in s.done} == {"r0", "r1"}
    assert r0.to_record("failed").error == r0.error
    s.check_pools_full()


def test_sender_failure_in_bootstrap_aborts_that_request_only():
    kv = StubKV()
    s = PrefillScheduler(cfg(), kv)
    r0, r1 = req("r0", 10), req("r1", 6)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    kv["r0"].fail("no route to decode rank")
    s.step(0.5)
    assert r0.finished and r0.error == "bootstrap failed: no route to decode rank"
    assert s.bootstrap == [r1] and s.pending_tokens == 6 and s.num_active == 1
    s.check_pools_full()


def test_bootstrap_timeout():
    kv = StubKV()
    s = PrefillScheduler(cfg(bootstrap_timeout_s=5.0), kv)
    r0, r1 = req("r0", 10), req("r1", 6)
    s.add_request(r0, 0.0)
    s.add_request(r1, 2.0)
    s.step(4.75)
    assert s.bootstrap == [r0, r1]  # before the limit: not yet
    s.step(5.0)
    assert s.bootstrap == [r1]
    assert r0.error == "bootstrap timed out after 5.0 s" and r0.finish_s == 5.0  # at the limit
    assert kv["r0"].calls == [("abort", "bootstrap timed out after 5.0 s")]  # decode is told
    assert s.pending_tokens == 6
    kv["r1"].state = KVPoll.WaitingForInput  # r1's decode side answers in time
    assert s.step(7.0) is not None
    assert not r1.finished
    s.step(100.0)
    assert not r1.finished  # past the handshake, no bootstrap timeout applies


def test_with_chunking_the_token_budget_stops_admitting_and_the_chunk_cuts():
    """SGLang's PrefillAdder with chunked prefill on: max_prefill_tokens stops admitting more
    requests once spent (the request that spends it goes whole), and only the chunk cuts a
    request; a lone request takes a whole chunk even beyond max_prefill_tokens."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(max_prefill_tokens=20, chunked_prefill_size=64), kv)
    for i in range(3):
        s.add_request(req(f"r{i}", 12), 0.0)
    assert extend_plans(s) == [[("r0", 0, 12), ("r1", 0, 12)], [("r2", 0, 12)]]
    lone = PrefillScheduler(cfg(max_prefill_tokens=16, chunked_prefill_size=32), kv)
    lone.add_request(req("r9", 40), 0.0)
    assert [(g.start, g.end) for g in run_batch(lone, 0.0).segments] == [(0, 32)]


def test_one_chunk_caps_each_extend_batch_however_many_requests_it_takes():
    """SGLang's PrefillAdder takes every admitted request's tokens off the chunk budget: short
    prompts share one chunk, and the one that crosses it is cut there."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(max_prefill_tokens=64, chunked_prefill_size=16), kv)
    for i in range(4):
        s.add_request(req(f"r{i}", 10), 0.0)
    assert extend_plans(s) == [
        [("r0", 0, 10), ("r1", 0, 6)],
        [("r1", 6, 10), ("r2", 0, 10), ("r3", 0, 2)],
        [("r3", 2, 10)],
    ]


def test_token_budget_without_chunking_runs_a_long_prompt_alone():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(max_prefill_tokens=20, chunked_prefill_size=0), kv)
    for rid, n in [("r0", 12), ("r1", 12), ("r2", 30), ("r3", 5)]:
        s.add_request(req(rid, n), 0.0)
    assert extend_plans(s) == [[("r0", 0, 12)], [("r1", 0, 12)], [("r2", 0, 30)],
                               [("r3", 0, 5)]]


def test_a_prompt_larger_than_the_pool_fails_at_once():
    kv = StubKV()
    s = PrefillScheduler(cfg(num_pages=4, page_size=4), kv)
    r = req("r0", 17)
    s.add_request(r, 1.0)
    assert r.finished and s.done == [r]
    assert "needs 17 KV tokens" in r.error and "holds 16" in r.error
    assert s.bootstrap == [] and s.pending_tokens == 0 and s.is_idle
    # the decode side is told why, with the sizes
    assert kv["r0"].calls == [("abort", f"prefill instance cannot hold the request: {r.error}")]


def test_with_the_fake_backend_end_to_end():
    wire = FakeWire()
    s = PrefillScheduler(cfg(page_size=4), FakeKVManager(wire))
    decode_side = FakeKVManager(wire)
    r = req("r0", 10)
    s.add_request(r, 0.0)
    receiver = decode_side.create_receiver(r)
    assert s.step(0.0) is None and s.bootstrap == [r]
    receiver.send_metadata([20, 21, 22], 5)
    batch = s.step(0.0)
    s.on_batch_done(batch, BatchResult(1.0, token_ids=[9], logprobs=[-0.1]), 1.0)
    assert receiver.poll() is KVPoll.Success
    assert wire.sent_pages[r.bootstrap_room] == [(0, 20), (1, 21), (2, 22)]
    meta = decode_side.metadata.read(5)  # landed in the decode side's slot
    assert (meta.bootstrap_room, meta.first_token_id) == (r.bootstrap_room, 9)
    s.step(1.0)
    assert s.done == [r] and r.error == ""
    s.check_pools_full()


@pytest.mark.parametrize("field", ["num_pages", "page_size", "max_prefill_tokens", "metadata_slots"])
def test_config_rejects_non_positive_sizes(field):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field} must be positive"):
        replace(cfg(), **{field: 0})  # past the knobs' own checks: the core's


def test_half_prefilled_requests_cannot_deadlock_the_pool():
    # 8 pages of 4 tokens; two 30-token prompts whose first chunks fit in one batch. Had each
    # taken pages chunk by chunk, both would hold 4 pages and wait for more forever.
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(num_pages=8, page_size=4, max_prefill_tokens=32, chunked_prefill_size=16), kv)
    r0, r1 = req("r0", 30), req("r1", 30)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    plans = []
    t = 0.0
    for _ in range(20):
        b = run_batch(s, t)
        t += 1.0
        if b is not None:
            plans.append([(g.req.rid, g.start, g.end) for g in b.segments])
        for r in s.inflight:
            kv[r.rid].state = KVPoll.Success
        if s.is_idle:
            break
    assert plans == [[("r0", 0, 16)], [("r0", 16, 30)], [("r1", 0, 16)], [("r1", 16, 30)]]
    assert r0.error == r1.error == "" and s.is_idle
    s.check_pools_full()


# ----- SGLang's overlap event loop: a batch is planned as the forward before it begins ---------

def _overlap_instance(ranks: int = 1, overlap: bool = True):
    from pdsim.core.instance import Instance
    kv = StubKV(KVPoll.WaitingForInput)  # every decode side has said where to write at once
    config = scheduler_config(64, page_size=4, max_running_requests=8, metadata_slots=8,
                              chunked_prefill_size=8, max_prefill_tokens=8)
    config = replace(config, overlap_schedule="plans_ahead" if overlap else "off")
    return Instance([PrefillScheduler(config, kv, i) for i in range(ranks)], lambda r: None)


def _planned(step) -> list[list[str]]:
    return [[] if b is None else [g.req.rid for g in b.segments] for b in step]


def _run(inst, step, now: float) -> None:
    inst.finish(step, BatchResult(1.0), now)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_schedule_plans_a_request_that_came_during_a_forward_one_batch_later(overlap):
    """SGLang's event_loop_overlap_disagg_prefill plans batch k+1 while batch k runs. r1, r2
    and r3 come while r0's forward runs; when r0's forward began nobody else waited, so no
    batch was planned then and they go at once. r4 comes during theirs, when the batch after
    it was already planned (r3's second chunk), so it waits one more forward."""
    from pdsim.core.instance import Add
    inst = _overlap_instance(overlap=overlap)
    step = inst.begin(0.0, [Add(req("r0", 8))])
    assert _planned(step) == [["r0"]]
    _run(inst, step, 1.0)
    step = inst.begin(1.0, [Add(req("r1", 2)), Add(req("r2", 2)), Add(req("r3", 8))])
    assert _planned(step) == [["r1", "r2", "r3"]]  # r3 cut at the 8-token chunk
    _run(inst, step, 2.0)
    step = inst.begin(2.0, [Add(req("r4", 4))])
    assert _planned(step) == ([["r3"]] if overlap else [["r3", "r4"]])
    _run(inst, step, 3.0)
    if overlap:
        step = inst.begin(3.0)
        assert _planned(step) == [["r4"]]


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_schedule_holds_a_request_back_on_a_rank_while_another_rank_runs(overlap):
    """Attention-DP ranks run in lockstep: a rank that planned nothing as a forward began runs
    an idle batch beside the others' next one, so its request that came meanwhile waits too."""
    from pdsim.core.instance import Add
    inst = _overlap_instance(ranks=2, overlap=overlap)
    a = [req("r0", 8), req("r1", 8)]
    for i, r in enumerate(a):
        r.bootstrap_room = 2 * i  # even rooms: rank 0 (follow_bootstrap_room)
    step = inst.begin(0.0, [Add(a[0]), Add(a[1])])
    assert _planned(step) == [["r0"], []]
    _run(inst, step, 1.0)
    b = req("r9", 4)
    b.bootstrap_room = 1  # rank 1
    step = inst.begin(1.0, [Add(b)])
    if not overlap:
        assert _planned(step) == [["r1"], ["r9"]]
        return
    assert _planned(step) == [["r1"], []]  # r9 came after r1's batch was planned
    _run(inst, step, 2.0)
    assert _planned(inst.begin(2.0)) == [[], ["r9"]]


@pytest.mark.parametrize("late", [False, True])
def test_late_results_send_a_batchs_kv_when_the_next_forward_ends(late):
    """With DeepEP the host waits inside each forward, and SGLang's overlap loop takes up a
    batch's results only after launching the next batch: r0's first token and KV go when r1's
    forward ends (or at once when nothing follows, as r1's do)."""
    from pdsim.core.instance import Add, Instance
    kv = StubKV(KVPoll.WaitingForInput)
    config = replace(scheduler_config(64, page_size=4, max_running_requests=8, metadata_slots=8,
                                      chunked_prefill_size=8, max_prefill_tokens=8),
                     overlap_schedule="late_results" if late else "off")
    inst = Instance([PrefillScheduler(config, kv)], lambda r: None)
    r0, r1 = req("r0", 8), req("r1", 4)
    step = inst.begin(0.0, [Add(r0)])
    inst.finish(step, BatchResult(1.0), 1.0)
    step = inst.begin(1.0, [Add(r1)])
    assert _planned(step) == [["r1"]]
    sent = [c for c in kv["r0"].calls if c[0] == "send"]
    assert sent == ([] if late else [("send", r0.pages, True)])
    inst.finish(step, BatchResult(1.0), 2.0)
    assert r0.prefill_end_s == 1.0 and r0.transfer_start_s == (2.0 if late else 1.0)
    assert [c for c in kv["r0"].calls if c[0] == "send"] == [("send", r0.pages, True)]
    assert inst.begin(2.0) is None
    assert r1.prefill_end_s == 2.0 and r1.transfer_start_s == 2.0
