"""The decode scheduler's queues, stepped by hand with scripted receivers and a manual clock."""

from __future__ import annotations

import pytest
from configs import scheduler_config
from core_harness import StubKV

from pdsim.core.batch import BatchResult
from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=4, max_running_requests=8, pre_alloc_size=2,
                metadata_slots=8, num_reserved_decode_tokens=0, waiting_timeout_s=10.0)
    base.update(kw)
    return scheduler_config(**base)


def req(rid: str, n_in: int, n_out: int, **kw) -> Request:
    return Request(rid, n_in, n_out, arrival_s=0.0, bootstrap_room=1000 + int(rid[1:]), **kw)


def used(s: DecodeScheduler) -> tuple[int, int, int]:
    return s.pool.num_used, s.req_slots.num_used, s.metadata_slots.num_used


class Loop:
    """Steps one decode scheduler: each decode step takes `decode_s`, each extend `extend_s`;
    `deliver_all` makes the prefill side answer every preallocated request at once."""

    def __init__(self, s: DecodeScheduler, kv: StubKV, decode_s=1.0, extend_s=2.0, deliver_all=True):
        self.s, self.kv = s, kv
        self.t = 0.0
        self.decode_s, self.extend_s = decode_s, extend_s
        self.deliver_all = deliver_all
        self.batches = []

    def _deliver(self) -> bool:
        todo = [r for r in self.s.transfer if self.kv[r.rid].state is not KVPoll.Success]
        if self.deliver_all:
            for r in todo:
                self.kv.deliver(r)
        return bool(todo) and self.deliver_all

    def once(self):
        s = self.s
        self._deliver()
        batch = s.step(self.t)
        if batch is None and self._deliver():
            batch = s.step(self.t)  # what was just preallocated arrives at once
        if batch is None:
            return None
        self.batches.append(batch)
        self.t += self.extend_s if batch.kind == "extend" else self.decode_s
        s.on_batch_done(batch, BatchResult(0.0), self.t)
        return batch

    def run(self, check=lambda s: None, max_steps=10_000):
        for _ in range(max_steps):
            check(self.s)
            if self.s.is_idle:
                return
            if self.once() is None and self.s.step(self.t) is None:
                self.t += 1.0
        raise AssertionError("did not finish")


def test_prealloc_waits_while_the_receiver_is_bootstrapping():
    kv = StubKV()
    s = DecodeScheduler(cfg(), kv)
    r = req("r0", 10, 4)
    s.add_request(r, 0.0)
    for t in (0.0, 1.0):
        assert s.step(t) is None
        assert s.prealloc == [r] and used(s) == (0, 0, 0) and kv["r0"].calls == []
    kv["r0"].state = KVPoll.WaitingForInput
    assert s.step(2.0) is None
    assert s.prealloc == [] and s.transfer == [r] and r.queued_s == 2.0
    assert kv["r0"].calls == [("send_metadata", [0, 1, 2], 0)]
    assert (r.pages, r.req_slot, r.metadata_slot) == ([0, 1, 2], 0, 0)
    assert used(s) == (3, 1, 1)


def r1_blocked_behind_r0(kv) -> tuple[DecodeScheduler, Request, Request, Request]:
    """8 pages of 4 = 32 tokens, 8 reserved per request that decodes or holds KV. r0 took 8
    tokens; budget = 24 free - 8 reserved = 16 < r1's 12 + 8; r2 would fit but waits."""
    s = DecodeScheduler(cfg(num_pages=8, num_reserved_decode_tokens=8), kv)
    r0, r1, r2 = req("r0", 8, 2), req("r1", 12, 2), req("r2", 4, 2)
    for r in (r0, r1, r2):
        s.add_request(r, 0.0)
    s.step(0.0)
    assert s.transfer == [r0] and s.prealloc == [r1, r2]
    return s, r0, r1, r2


def test_admission_by_token_budget_is_first_come_first_served():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s, r0, r1, r2 = r1_blocked_behind_r0(kv)
    kv.deliver(r0)
    batch = s.step(1.0)
    assert s.running.reqs.keys() == {r0} and s.prealloc == [r1, r2]  # r0 still reserves its 8
    s.on_batch_done(batch, BatchResult(1.0), 2.0)
    assert r0.finished and r0.num_output == 2
    s.step(2.0)
    assert s.transfer == [r1, r2] and s.prealloc == []
    assert r1.queued_s == r2.queued_s == 2.0


def test_the_first_request_goes_even_when_it_needs_more_than_the_budget():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=8, num_reserved_decode_tokens=64), kv)
    r = req("r0", 20, 4)
    s.add_request(r, 0.0)
    s.step(0.0)
    assert s.transfer == [r]  # nothing else decodes, so it cannot starve anyone


def test_prealloc_keeps_room_for_the_largest_running_request_to_finish():
    """SGLang's `pop_preallocated` (v0.5.10, v0.5.23) takes off the free tokens what the
    largest running request still needs were the others retracted (its prompt +
    min(max_new_tokens, 4096) less the running batch's KV): r0 (8 + up to 40 tokens) runs in
    a 64-token pool, so r1's 20-token prompt waits until r0 ends, and nothing is retracted."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=16, page_size=4), kv)
    r0, r1 = req("r0", 8, 40), req("r1", 20, 4)
    s.add_request(r0, 0.0)
    s.step(0.0)
    kv.deliver(r0)
    batch = s.step(0.0)
    assert batch.reqs == [r0]
    s.add_request(r1, 0.0)
    s.on_batch_done(batch, BatchResult(1.0), 1.0)
    loop = Loop(s, kv)
    loop.t = 1.0
    waited = []
    loop.run(lambda s: waited.append(r1 in s.prealloc) if not r0.finished else None)
    assert all(waited) and len(waited) > 30 and s.retractions == 0
    assert r1.num_output == 4 and r1.queued_s >= r0.finish_s


def test_prealloc_needs_room_for_the_prompt_and_its_output_beyond_the_running_kv():
    """... and refuses a request whose prompt + min(max_new_tokens, 4096) does not fit beside
    what the others hold, less the running batch's KV (none here: r0's KV is on its way)."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=16, page_size=4), kv)
    r0, r1 = req("r0", 8, 4), req("r1", 8, 52)  # r1: 8 + 52 = 60 > 64 - 8
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    s.step(0.0)
    assert s.transfer == [r0] and s.prealloc == [r1]
    Loop(s, kv).run()
    assert r0.num_output == 4 and r1.num_output == 52 and s.retractions == 0


def test_request_slot_reserve_caps_running_at_max_running():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(max_running_requests=2, pre_alloc_size=1), kv)
    assert s.req_slots.size == 3
    reqs = [req(f"r{i}", 6, 3 + i) for i in range(6)]
    for r in reqs:
        s.add_request(r, 0.0)
    s.step(0.0)
    assert len(s.transfer) == 3 and len(s.prealloc) == 3  # slots, not pages, hold the rest
    seen = {"running": 0, "slots": 0}

    def check(s):
        assert len(s.running) <= 2
        assert s.req_slots.num_used <= 3
        assert s.req_slots.num_used == sum(r.req_slot >= 0 for r in reqs)
        seen["running"] = max(seen["running"], len(s.running))
        seen["slots"] = max(seen["slots"], s.req_slots.num_used)

    Loop(s, kv).run(check)
    assert seen == {"running": 2, "slots": 3}
    assert [r.num_output for r in reqs] == [3, 4, 5, 6, 7, 8]
    s.check_pools_full()


def test_prebuilt_waits_for_room_and_sends_its_first_token_when_it_joins():
    """As SGLang streams it from the prebuilt batch: a request whose KV landed while the running
    batch is full sends its first token only when it joins, so the wait for room is in its
    TTFT, not in its first inter-token gap."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(max_running_requests=1, pre_alloc_size=2), kv)
    r0, r1 = req("r0", 4, 3), req("r1", 4, 3)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    s.step(0.0)
    kv.deliver(r0)
    kv.deliver(r1)
    batch = s.step(1.0)
    assert list(s.running.reqs) == [r0] and list(s.prebuilt) == [r1]
    assert s.emitted == [r0] and r0.token_times_s == [1.0] and r0.decode_join_s == 1.0
    assert r1.transfer_done_s == 1.0 and r1.token_times_s == [] and r1.num_output == 0
    assert batch.reqs == [r0]
    t = 1.0
    while not r0.finished:  # r0 decodes its two other tokens; r1 waits in the prebuilt line
        t += 0.5
        s.on_batch_done(batch, BatchResult(0.5), t)
        batch = s.step(t)
    assert r0.token_times_s == [1.0, 1.5, 2.0] and s.emitted == [r1]
    assert r1.decode_join_s == 2.0 and r1.token_times_s == [2.0]  # sent as it joins
    assert batch.reqs == [r1]
    while not r1.finished:
        t += 0.5
        s.on_batch_done(batch, BatchResult(0.5), t)
        batch = s.step(t)
    assert r1.token_times_s == [2.0, 2.5, 3.0]  # ITLs of one step each: the wait is in TTFT
    s.check_pools_full()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_full_batch_lets_a_landed_request_in_one_plan_after_a_request_ends(overlap):
    """SGLang sizes the prebuilt merge by the running batch before it filters out the requests
    that ended in the step just taken up (`get_next_disagg_decode_batch_to_run`:
    `get_new_prebuilt_batch`, then `update_running_batch`): r0 ends at 2.0 in a batch of two
    (max_running_requests 2), so r2, landed long before, joins (and streams its first token)
    at the plan after, 3.0, while r1 decodes alone in between."""
    from dataclasses import replace

    from pdsim.core.instance import Instance
    kv = StubKV(initial=KVPoll.WaitingForInput)
    config = replace(cfg(max_running_requests=2, pre_alloc_size=2),
                     overlap_schedule="plans_ahead" if overlap else "off")
    inst = Instance([DecodeScheduler(config, kv)], lambda r: None)
    r0, r1, r2 = req("r0", 4, 3), req("r1", 4, 8), req("r2", 4, 3)
    for r in (r0, r1, r2):
        inst.add_request(r, 0.0)
    inst.begin(0.0)
    for r in (r0, r1, r2):
        kv.deliver(r)
    step = inst.begin(0.0)
    assert step[0].reqs == [r0, r1] and list(inst.schedulers[0].prebuilt) == [r2]
    t = 0.0
    while not r2.token_times_s:
        t += 1.0
        inst.finish(step, BatchResult(1.0), t)
        step = inst.begin(t)
    assert r0.token_times_s == [0.0, 1.0, 2.0]
    assert r2.token_times_s == [3.0] and r2.decode_join_s == 3.0
    while not r2.finished:
        t += 1.0
        inst.finish(step, BatchResult(1.0), t)
        step = inst.begin(t)
    assert r2.token_times_s == ([3.0, 5.0, 6.0] if overlap else [3.0, 4.0, 5.0])


def test_crossed_metadata_fails_the_request_and_frees_everything():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(), kv)
    r0, r1 = req("r0", 10, 4), req("r1", 10, 4)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    s.step(0.0)
    kv.deliver(r0, room=r1.bootstrap_room)  # r1's metadata landed in r0's slot
    s.step(1.0)
    assert r0.finished and "crossed" in r0.error
    assert f"metadata room {r1.bootstrap_room} does not match request room {r0.bootstrap_room}" in r0.error
    assert r0.num_output == 0 and r0.token_times_s == []
    assert (r0.pages, r0.req_slot, r0.metadata_slot) == ([], -1, -1)
    assert used(s) == (3, 1, 1)  # only r1's
    assert s.transfer == [r1]


def test_missing_metadata_counts_as_crossed():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(), kv)
    r = req("r0", 10, 4)
    s.add_request(r, 0.0)
    s.step(0.0)
    kv["r0"].state = KVPoll.Success  # success reported, but no metadata written
    s.step(1.0)
    assert "metadata room None does not match" in r.error and "crossed" in r.error
    s.check_pools_full()


def test_receiver_failure_in_either_queue():
    kv = StubKV()
    s = DecodeScheduler(cfg(), kv)
    r0, r1 = req("r0", 10, 4), req("r1", 10, 4)
    s.add_request(r0, 0.0)
    s.add_request(r1, 0.0)
    kv["r0"].fail("prefill rank unknown")
    kv["r1"].state = KVPoll.WaitingForInput
    s.step(0.0)
    assert r0.error == "handshake failed: prefill rank unknown"
    assert s.transfer == [r1]
    kv["r1"].fail("connection reset")
    s.step(0.5)
    assert r1.error == "KV transfer failed: connection reset"
    s.check_pools_full()
    assert s.is_idle


def test_waiting_timeout():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(waiting_timeout_s=10.0), kv)
    r = req("r0", 10, 4)
    s.add_request(r, 0.0)
    s.step(1.0)
    assert s.transfer == [r] and r.queued_s == 1.0
    kv["r0"].state = KVPoll.Transferring
    s.step(10.75)
    assert s.transfer == [r]  # before the limit: not yet
    s.step(11.0)
    assert r.error == "KV did not arrive within 10.0 s" and r.finish_s == 11.0  # at the limit
    assert kv["r0"].calls[-1] == ("abort", "KV did not arrive within 10.0 s")
    s.check_pools_full()


def test_a_request_too_big_for_the_pool_fails_and_tells_the_prefill_side():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=4, page_size=4), kv)
    r = req("r0", 10, 7)
    s.add_request(r, 0.0)
    assert r.finished and "needs 17 KV tokens" in r.error
    assert kv["r0"].calls == [("abort", f"decode instance cannot hold the request: {r.error}")]
    assert s.prealloc == [] and s.is_idle


def test_first_token_comes_from_the_metadata():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(), kv)
    r = req("r0", 4, 1, prompt_ids=[1, 2, 3, 4])
    sim = req("r1", 4, 1)  # the simulator's requests carry no ids
    s.add_request(r, 0.0)
    s.add_request(sim, 0.0)
    s.step(0.0)
    kv.deliver(r, first_token=77, logprob=-0.75, cached_tokens=2)
    kv.deliver(sim, first_token=77)
    assert s.step(3.5) is None  # max_new_tokens=1: done on arrival, nothing to decode
    assert r.output_ids == [77] and r.first_logprob == -0.75 and r.output_logprobs == [-0.75]
    assert r.cached_tokens == 2
    assert r.token_times_s == [3.5] and r.transfer_done_s == 3.5 and r.finish_s == 3.5
    assert r.num_output == 1 and r.finished and r.error == ""
    assert sim.output_ids == [] and sim.token_times_s == [3.5]
    rec = r.to_record("ok")
    assert rec.first_token_s == 3.5 and rec.output_tokens == 1
    s.check_pools_full()


def test_running_batch_makes_exactly_max_new_tokens():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(), kv)
    reqs = [req(f"r{i}", 5 + 3 * i, n) for i, n in enumerate([1, 2, 5, 9, 17])]
    for r in reqs:
        s.add_request(r, 0.0)
    loop = Loop(s, kv, decode_s=0.5)
    loop.run()
    for r in reqs:
        assert r.error == "" and r.num_output == r.max_new_tokens
        assert len(r.token_times_s) == r.max_new_tokens
        # The first token at the transfer (t=0), then one per decode step of 0.5 s.
        assert r.token_times_s == [0.5 * k for k in range(r.max_new_tokens)]
        assert r.finish_s == r.token_times_s[-1]
        assert r.computed_tokens == r.input_len + r.max_new_tokens - 1
    assert all(b.kind == "decode" for b in loop.batches)
    assert [len(b.reqs) for b in loop.batches] == [4, 3, 3, 3, 2, 2, 2, 2] + [1] * 8
    # Context tokens read by the first step: each request's prompt plus its first token.
    assert loop.batches[0].shape.decode_context_tokens == sum(r.input_len + 1 for r in reqs[1:])
    s.check_pools_full()


def test_running_requests_take_a_page_each_time_they_fill_one():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(page_size=4), kv)
    r = req("r0", 4, 10)
    s.add_request(r, 0.0)
    s.step(0.0)
    kv.deliver(r)
    planned = []  # (KV tokens before the step, pages held for it)
    t = 0.0
    while (batch := s.step(t)) is not None:
        planned.append((s.running.kv_len(r), len(r.pages)))
        t += 1.0
        s.on_batch_done(batch, BatchResult(1.0), t)
    # Each step writes one token; the page is taken just before the step that needs it.
    assert planned == [(4, 2), (5, 2), (6, 2), (7, 2), (8, 3), (9, 3), (10, 3), (11, 3), (12, 4)]
    assert r.num_output == 10 and r.pages == []
    s.check_pools_full()


def outgrowing_three() -> tuple[DecodeScheduler, list, Loop]:
    """12 pages of 4 tokens; three requests that each grow to 8 + 11 = 19 tokens (5 pages):
    the pool cannot hold them all to the end."""
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=12, page_size=4, pre_alloc_size=0, max_running_requests=4), kv)
    reqs = [req(f"r{i}", 8, 12) for i in range(3)]
    for r in reqs:
        s.add_request(r, 0.0)
    return s, reqs, Loop(s, kv)


def test_retraction_keeps_the_kv_on_the_host_and_still_finishes_every_request():
    """SGLang's PD decode retracts by offloading (`offload_kv_cache`): the victim, the one
    with the fewest tokens generated, frees its pages and request slot, its KV is copied out
    before the next forward and copied back into new pages when the pool has room, and no
    forward recomputes it."""
    s, reqs, loop = outgrowing_three()
    seen = []

    def check(s):
        assert s.pool.num_used <= 12 and len(s.running) + len(s.retracted) <= 3
        for r in s.retracted:  # no pages, no slot, its KV kept (on the host)
            assert r.pages == [] and r.req_slot == -1 and r.computed_tokens > r.input_len
            seen.append(r.rid)

    loop.run(check)
    assert seen, "the pool was too small for all three, something must have been retracted"
    assert all(b.kind == "decode" for b in loop.batches)  # nothing recomputed
    moves = [m for b in loop.batches for m in b.kv_moves]
    out = {m.rid: len(m.pages) for m in moves if m.to_host}
    back = {m.rid: len(m.pages) for m in moves if not m.to_host}
    assert set(out) == set(seen) and back == out  # each copied back into as many pages
    assert s.retractions == len([m for m in moves if m.to_host])
    for r in reqs:
        assert r.error == "" and r.num_output == 12 and len(r.token_times_s) == 12
        assert r.token_times_s == sorted(r.token_times_s)
    s.check_pools_full()


def test_nothing_new_is_taken_in_while_a_request_is_retracted():
    # max_running 2, and two more requests preallocated: while a retracted request waits, no
    # other is preallocated or taken from the transfer queue (SGLang's process_decode_queue
    # returns early); a resumed one waits in the prebuilt line for room in the batch.
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = DecodeScheduler(cfg(num_pages=12, page_size=4, max_running_requests=2, pre_alloc_size=2), kv)
    reqs = [req(f"r{i}", 8, 12) for i in range(5)]
    for r in reqs:
        s.add_request(r, 0.0)
    loop = Loop(s, kv)
    retracted, waited, blocked = [], [], []
    step = s.step

    def watched_step(now):
        queues = (list(s.prealloc), list(s.transfer))
        before = list(s.retracted)
        batch = step(now)
        # retracted before the step and still after its resumption: nothing taken in (one
        # retracted by this step's own plan came after its preallocation, as in SGLang)
        if before and s.retracted and set(before) & set(s.retracted):
            blocked.append(now)
            assert s.prealloc == queues[0] and set(s.transfer) <= set(queues[1])  # (polled)
        return batch

    s.step = watched_step

    def check(s):
        assert len(s.running) <= 2
        retracted.extend(s.retracted)
        waited.extend(r for r in s.prebuilt if r.num_output > 1)  # resumed, back in line

    loop.run(check)
    assert retracted and waited and blocked
    assert [r.num_output for r in reqs] == [12] * 5
    s.check_pools_full()


def test_an_aborted_retracted_request_drops_its_host_copy():
    s, _, loop = outgrowing_three()
    while not s.retracted:
        assert loop.once() is not None
    victim = s.retracted[0]
    assert s.abort(victim.rid, "client went away", loop.t)
    loop.run()
    moves = [m for b in loop.batches for m in b.kv_moves if m.rid == victim.rid]
    assert [(m.to_host, len(m.pages)) for m in moves] == [(True, len(moves[0].pages)), (False, 0)]
    assert victim.error == "client went away"
    s.check_pools_full()


class SteadyKV(StubKV):
    """Endpoints that change only when the test says so (`bump`), as a real manager's epoch."""

    def __init__(self, initial: KVPoll = KVPoll.WaitingForInput):
        super().__init__(initial)
        self.epoch = 0

    def poll_epoch(self) -> int:
        return self.epoch


def test_a_blocked_prealloc_queue_is_read_again_only_when_room_grows():
    kv = SteadyKV()
    # 8 pages of 4 tokens, 4 reserved per decoding request: r1 does not fit beside r0.
    s = DecodeScheduler(cfg(num_pages=8, num_reserved_decode_tokens=4), kv)
    scans = []
    pop = s._pop_preallocated
    s._pop_preallocated = lambda now: scans.append(now) or pop(now)
    r0, r1, r2 = req("r0", 4, 12), req("r1", 24, 2), req("r2", 4, 2)
    for r in (r0, r1, r2):
        s.add_request(r, 0.0)
    s.step(0.0)
    assert s.transfer == [r0] and s.prealloc == [r1, r2] and scans == [0.0]
    kv.deliver(r0)
    kv.epoch += 1  # r0's KV landed: the queue is read once more, r1 still does not fit
    t = 1.0
    while not r0.finished:
        batch = s.step(t)
        t += 1.0
        s.on_batch_done(batch, BatchResult(1.0), t)
    # Read again at 2.0 only: r0's metadata slot came back when its first token was read
    # (step 1.0). Then r0 took a page every 4 tokens: room only shrank, no step read it again.
    assert scans == [0.0, 1.0, 2.0] and t > 10.0 and s.prealloc == [r1, r2]
    s.step(t)  # r0 finished: its pages and its reserve came back
    assert scans[-1] == t and s.transfer == [r1] and s.prealloc == [r2]


def test_aborting_the_blocked_head_lets_the_next_request_in():
    s, r0, r1, r2 = r1_blocked_behind_r0(SteadyKV())
    assert s.abort("r1", "client went away", 1.0)
    s.step(1.0)  # nothing grew and no endpoint changed, but the head is gone
    assert s.transfer == [r0, r2] and s.prealloc == []


# ----- SGLang's overlap event loop: a step is planned as the step before it begins ------------

@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_schedule_a_request_that_lands_during_a_step_decodes_a_step_later(overlap):
    """SGLang's event_loop_overlap_disagg_decode polls transfers, merges the prebuilt batch
    (streaming its first tokens) and plans step k+1 while step k runs. r1's KV lands during
    r0's first step: its first token goes at that step's end either way, but the step that
    follows was planned when r0's step began, so under the overlap loop r1 decodes from the
    step after it and its first inter-token gap is two steps."""
    from dataclasses import replace

    from pdsim.core.instance import Instance
    kv = StubKV(initial=KVPoll.WaitingForInput)
    config = replace(cfg(), overlap_schedule="plans_ahead" if overlap else "off")
    inst = Instance([DecodeScheduler(config, kv)], lambda r: None)
    r0, r1 = req("r0", 4, 4), req("r1", 4, 3)
    inst.add_request(r0, 0.0)
    inst.add_request(r1, 0.0)
    assert inst.begin(0.0) is None  # both preallocated; no KV yet
    kv.deliver(r0)
    step = inst.begin(0.0)  # idle: r0 runs at once
    assert step[0].reqs == [r0] and r0.token_times_s == [0.0]
    kv.deliver(r1)  # lands during r0's step
    t = 0.0
    planned = []
    while not (r0.finished and r1.finished):
        t += 1.0
        inst.finish(step, BatchResult(1.0), t)
        step = inst.begin(t)
        planned.append(sorted(r.rid for r in step[0].reqs) if step else [])
    assert r1.token_times_s[0] == 1.0 and inst.emitted == [] and r1.decode_join_s == 1.0
    if overlap:
        assert planned == [["r0"], ["r0", "r1"], ["r1"], []]
        assert r1.token_times_s == [1.0, 3.0, 4.0]
    else:
        assert planned == [["r0", "r1"], ["r0", "r1"], []]
        assert r1.token_times_s == [1.0, 2.0, 3.0]
    assert r0.token_times_s == [0.0, 1.0, 2.0, 3.0]
    inst.schedulers[0].check_pools_full()


def test_overlap_schedule_an_idle_decode_instance_runs_what_lands_at_once():
    """With nothing running (no step was planned ahead), SGLang's loop merges and launches in
    the same iteration: a request staged with nobody to run beside it is planned at once, and
    its first token is still streamed once."""
    from dataclasses import replace

    from pdsim.core.instance import Instance
    kv = StubKV(initial=KVPoll.WaitingForInput)
    config = replace(cfg(), overlap_schedule="plans_ahead")
    inst = Instance([DecodeScheduler(config, kv)], lambda r: None)
    r0, r1 = req("r0", 4, 1), req("r1", 4, 3)
    inst.add_request(r0, 0.0)
    inst.add_request(r1, 0.0)
    inst.begin(0.0)
    kv.deliver(r0)
    kv.deliver(r1)
    step = inst.begin(0.0)  # r0 wants one token only: it ends at its merge
    assert r0.finished and step[0].reqs == [r1] and inst.emitted == [r0, r1]
