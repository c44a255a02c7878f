"""A prefill and a decode scheduler over the fake transfer backend, with fixed forward times
(extend 1 s, decode step 0.25 s): the exact queue transitions of tiny scenarios, SimPy-docs style.

Log entries read "<rid> <instance>:<queue>" at the time the request entered that queue.
"""

from __future__ import annotations

import random

from configs import scheduler_config
from core_harness import Driver, FixedExecutor

from pdsim.core.decode import DecodeScheduler
from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request

PREFILL = scheduler_config(16, page_size=4, max_prefill_tokens=8, chunked_prefill_size=8)
DECODE = scheduler_config(16, page_size=4, num_reserved_decode_tokens=4)


def pd_pair(prefill=PREFILL, decode=DECODE, token_fn=None):
    wire = FakeWire()
    p = PrefillScheduler(prefill, FakeKVManager(wire), instance_id=0)
    d = DecodeScheduler(decode, FakeKVManager(wire), instance_id=1)
    drv = Driver(FixedExecutor(extend_s=1.0, decode_s=0.25, token_fn=token_fn))
    drv.add_instance("P", p)
    drv.add_instance("D", d)
    return drv, p, d, wire


def submit(drv, at_s, rid, n_in, n_out, **kw):
    """Like the router: the same request, with one room, to both sides."""
    room = 1000 + int(rid[1:])
    pre = Request(rid, n_in, n_out, arrival_s=at_s, bootstrap_room=room, **kw)
    dec = Request(rid, n_in, n_out, arrival_s=at_s, bootstrap_room=room, **kw)
    drv.submit(at_s, "P", pre)
    drv.submit(at_s, "D", dec)
    return pre, dec


def test_two_requests():
    drv, p, d, wire = pd_pair()
    p0, d0 = submit(drv, 0.0, "r0", 8, 3)
    p1, d1 = submit(drv, 0.0, "r1", 8, 2)
    drv.run()
    assert drv.log == [
        ("r0 P:bootstrap", 0.0),
        ("r0 D:prealloc", 0.0),
        ("r1 P:bootstrap", 0.0),
        ("r1 D:prealloc", 0.0),
        # Decode handshakes and sends where to write; then prefill's bootstrap queue lets both
        # go, but one 8-token batch holds only r0.
        ("r0 D:transfer", 0.0),
        ("r1 D:transfer", 0.0),
        ("r0 P:extend", 0.0),
        ("r1 P:waiting", 0.0),
        # r0's KV and metadata land (the fake backend is instant): prefill frees it, decode
        # emits the first token and starts decoding.
        ("r0 P:inflight", 1.0),
        ("r0 P:done", 1.0),
        ("r1 P:extend", 1.0),
        ("r0 D:running", 1.0),
        ("r0 D:done", 1.5),
        ("r1 P:inflight", 2.0),
        ("r1 P:done", 2.0),
        ("r1 D:running", 2.0),
        ("r1 D:done", 2.25),
    ]
    assert d0.token_times_s == [1.0, 1.25, 1.5] and d1.token_times_s == [2.0, 2.25]
    assert (d0.transfer_done_s, d1.transfer_done_s) == (1.0, 2.0)
    assert (p0.bootstrap_done_s, p0.prefill_start_s, p0.prefill_end_s) == (0.0, 0.0, 1.0)
    assert (p1.bootstrap_done_s, p1.prefill_start_s, p1.prefill_end_s) == (0.0, 1.0, 2.0)
    assert p0.max_new_tokens == 1 and d0.max_new_tokens == 3
    # r0: prefill pages 0-1 into decode pages 0-1. r1 gets the next free pages, 2-3: r0's freed
    # pages wait aside until the sorted free list runs short (SGLang's allocator).
    assert wire.sent_pages == {1000: [(0, 0), (1, 1)], 1001: [(2, 2), (3, 3)]}
    for s in (p, d):
        assert s.is_idle
        s.check_pools_full()


def test_decode_budget_holds_the_second_request_on_both_sides():
    # A 16-token decode pool with 4 reserved per request: r1 (8 + 4) does not fit next to r0, so
    # it stays in prealloc; its prefill side, never told where to write, stays in bootstrap.
    drv, p, d, _ = pd_pair(decode=scheduler_config(4, page_size=4, num_reserved_decode_tokens=4))
    submit(drv, 0.0, "r0", 8, 3)
    _, d1 = submit(drv, 0.0, "r1", 8, 2)
    drv.run()
    assert drv.log == [
        ("r0 P:bootstrap", 0.0),
        ("r0 D:prealloc", 0.0),
        ("r1 P:bootstrap", 0.0),
        ("r1 D:prealloc", 0.0),
        ("r0 D:transfer", 0.0),
        ("r0 P:extend", 0.0),
        ("r0 P:inflight", 1.0),
        ("r0 P:done", 1.0),
        ("r0 D:running", 1.0),
        ("r0 D:done", 1.5),
        ("r1 D:transfer", 1.5),
        ("r1 P:extend", 1.5),
        ("r1 P:inflight", 2.5),
        ("r1 P:done", 2.5),
        ("r1 D:running", 2.5),
        ("r1 D:done", 2.75),
    ]
    assert d1.token_times_s == [2.5, 2.75]
    d.check_pools_full()
    p.check_pools_full()


def test_an_injected_transfer_failure_fails_both_sides_and_spares_the_other_request():
    drv, p, d, wire = pd_pair()
    p0, d0 = submit(drv, 0.0, "r0", 8, 3)
    p1, d1 = submit(drv, 0.5, "r1", 8, 2)
    drv.run(until_s=0.5)
    wire.fail_room(1001, "decode rank lost")  # r1 is preallocated; prefill is busy with r0
    drv.run()
    assert drv.log == [
        ("r0 P:bootstrap", 0.0),
        ("r0 D:prealloc", 0.0),
        ("r0 D:transfer", 0.0),
        ("r0 P:extend", 0.0),
        ("r1 P:bootstrap", 0.5),
        ("r1 D:prealloc", 0.5),
        ("r1 D:transfer", 0.5),
        ("r1 D:failed", 0.5),  # decode is idle and sees it at once
        ("r0 P:inflight", 1.0),
        ("r0 P:done", 1.0),
        ("r1 P:failed", 1.0),  # prefill when its forward ends
        ("r0 D:running", 1.0),
        ("r0 D:done", 1.5),
    ]
    assert p1.error == "bootstrap failed: decode rank lost"
    assert d1.error == "KV transfer failed: decode rank lost"
    assert d0.error == "" and d0.token_times_s == [1.0, 1.25, 1.5]
    p.check_pools_full()
    d.check_pools_full()


def test_a_refusal_on_either_side_reaches_the_other_at_once():
    drv, p, d, _ = pd_pair(decode=scheduler_config(32, page_size=4))  # 64 and 128 tokens
    p0, d0 = submit(drv, 0.0, "r0", 8, 130)  # 138 > decode's 128
    p1, d1 = submit(drv, 0.0, "r1", 65, 1)  # 65 > prefill's 64
    drv.run()
    assert drv.log == [
        ("r0 P:bootstrap", 0.0),
        ("r0 D:failed", 0.0),
        ("r1 P:failed", 0.0),
        ("r1 D:prealloc", 0.0),
        ("r0 P:failed", 0.0),
        ("r1 D:failed", 0.0),
    ]
    assert d0.error == "request needs 138 KV tokens but the instance's pool holds 128 (32 pages of 4)"
    assert p0.error == f"bootstrap failed: decode instance cannot hold the request: {d0.error}"
    assert p1.error == "request needs 65 KV tokens but the instance's pool holds 64 (16 pages of 4)"
    assert d1.error == f"handshake failed: prefill instance cannot hold the request: {p1.error}"
    p.check_pools_full()
    d.check_pools_full()


def test_kv_that_never_comes_times_out_on_the_decode_side():
    # The request reaches only the decode instance: it preallocates, then waits for KV in vain.
    drv, p, d, _ = pd_pair(decode=scheduler_config(16, page_size=4, waiting_timeout_s=5.0))
    drv.tick_s = 1.0
    lost = Request("r0", 8, 4, arrival_s=0.0, bootstrap_room=1000)
    drv.submit(0.0, "D", lost)
    drv.run()
    assert drv.log == [("r0 D:prealloc", 0.0), ("r0 D:transfer", 0.0), ("r0 D:failed", 5.0)]
    assert lost.error == "KV did not arrive within 5.0 s"
    d.check_pools_full()


def test_token_ids_flow_from_prefill_to_decode():
    # A "real" executor: every token id is 10 * (forward index) + position in the batch.
    drv, p, d, _ = pd_pair(token_fn=lambda batch, i: 10 * batch.step + i if batch.kind == "decode" else 99)
    _, d0 = submit(drv, 0.0, "r0", 4, 4, prompt_ids=[1, 2, 3, 4])
    drv.run()
    assert d0.output_ids == [99, 10, 20, 30]  # the first from prefill's metadata, then decode steps
    assert d0.output_logprobs == [-1.0] * 4 and d0.first_logprob == -1.0
    assert d0.num_output == 4


class CountingExecutor(FixedExecutor):
    def __init__(self):
        super().__init__(extend_s=1.0, decode_s=0.25)
        self.extends = 0

    def forward(self, batch):
        self.extends += batch.kind == "extend"
        return super().forward(batch)


def test_random_pd_workload_under_small_pools_leaks_nothing():
    rng = random.Random(99)
    # Decode: 20 pages of 8 = 160 tokens and no reserve, so decoding requests outgrow the pool
    # and get retracted (their KV kept on the host, never recomputed); prefill: 96 tokens, so
    # long prompts queue for pages and the longest cannot be served.
    drv, p, d, _ = pd_pair(
        prefill=scheduler_config(12, page_size=8, max_prefill_tokens=64, chunked_prefill_size=32,
                                 metadata_slots=4, max_running_requests=4, bootstrap_timeout_s=1e9),
        decode=scheduler_config(20, page_size=8, max_running_requests=6, pre_alloc_size=2,
                                num_reserved_decode_tokens=0, metadata_slots=5),
    )
    decode_executor = CountingExecutor()
    drv.slots["D"].executor = decode_executor
    pairs = []
    t = 0.0
    for i in range(120):
        t += rng.expovariate(4.0)
        pairs.append(submit(drv, t, f"r{i}", rng.randint(1, 110), rng.randint(1, 70)))
    drv.run()
    assert d.retractions > 0, "the decode pool should have forced retractions"
    assert decode_executor.extends == 0
    errors = set()
    for pre, dec in pairs:
        assert pre.finished and dec.finished
        if pre.input_len > 96:  # prefill refuses first (it gets the request first) and says so
            assert "pool holds 96" in pre.error
            if dec.input_len + dec.max_new_tokens > 160:
                assert "pool holds 160" in dec.error
            else:
                assert dec.error == ("handshake failed: prefill instance cannot hold the "
                                     f"request: {pre.error}")
        elif dec.input_len + dec.max_new_tokens > 160:
            assert "pool holds 160" in dec.error
            assert pre.error == ("bootstrap failed: decode instance cannot hold the request: "
                                 f"{dec.error}")
        else:
            assert pre.error == dec.error == ""
            assert dec.num_output == dec.max_new_tokens == len(dec.token_times_s)
            assert dec.token_times_s == sorted(dec.token_times_s)
            assert pre.prefill_end_s <= dec.transfer_done_s == dec.token_times_s[0]
        errors.add(bool(dec.error))
    assert errors == {True, False}
    for s in (p, d):
        assert s.is_idle
        s.check_pools_full()


class _SamplingFailsFor(FixedExecutor):
    """A prefill executor whose sampling fails for one request, as the real one reports it."""

    def __init__(self, rid: str):
        super().__init__(extend_s=1.0, token_fn=lambda batch, i: 7)
        self.rid = rid

    def forward(self, batch):
        result = super().forward(batch)
        if batch.kind == "extend" and any(seg.req.rid == self.rid for seg in batch.segments):
            result.failed = {self.rid: "sampling failed: bad seed"}
        return result


def test_a_prefill_whose_sampling_fails_sends_no_first_token_and_both_sides_fail_it_alone():
    """The failed row's (greedy) token must not reach the decode side: that request's KV is
    never sent as complete, the decode side learns of the abort, and the other request of the
    same extend batch is served as usual."""
    drv, p, d, wire = pd_pair(token_fn=lambda batch, i: 5)
    drv.add_instance("P", p, _SamplingFailsFor("r1"))
    p0, d0 = submit(drv, 0.0, "r0", 4, 2)
    p1, d1 = submit(drv, 0.0, "r1", 4, 2)
    drv.run()
    assert p1.error == "sampling failed: bad seed" and p1.num_output == 0
    assert d1.error and d1.num_output == 0 and 1001 not in wire.sent_pages
    assert not p0.error and not d0.error and d0.num_output == 2 and 1000 in wire.sent_pages
    for s in (p, d):
        assert s.is_idle
        s.check_pools_full()
