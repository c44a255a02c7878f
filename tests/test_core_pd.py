"""A prefill and a decode scheduler over the fake transfer backend, with fixed forward times
(extend 1 s, decode step 0.25 s): the exact queue transitions of tiny scenarios, SimPy-docs style.

Log entries read "<rid> <instance>:<queue>" at the time the request entered that queue.
"""

from __future__ import annotations

from core_harness import Driver, FixedExecutor

from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request

PREFILL = SchedulerConfig(num_pages=16, page_size=4, max_prefill_tokens=8, chunked_prefill_size=8)
DECODE = SchedulerConfig(num_pages=16, page_size=4, num_reserved_decode_tokens=4)


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
    # r0: prefill pages 0-1 into decode pages 0-1. r1 reuses r0's freed pages, last freed first.
    assert wire.sent_pages == {1000: [(0, 0), (1, 1)], 1001: [(1, 2), (0, 3)]}
    for s in (p, d):
        assert s.is_idle
        s.check_pools_full()


def test_decode_budget_holds_the_second_request_on_both_sides():
    # A 16-token decode pool with 4 reserved per request: r1 (8 + 4) does not fit next to r0, so
    # it stays in prealloc; its prefill side, never told where to write, stays in bootstrap.
    drv, p, d, _ = pd_pair(decode=SchedulerConfig(num_pages=4, page_size=4, num_reserved_decode_tokens=4))
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


def test_token_ids_flow_from_prefill_to_decode():
    # A "real" executor: every token id is 10 * (forward index) + position in the batch.
    drv, p, d, _ = pd_pair(token_fn=lambda batch, i: 10 * batch.step + i if batch.kind == "decode" else 99)
    _, d0 = submit(drv, 0.0, "r0", 4, 4, prompt_ids=[1, 2, 3, 4])
    drv.run()
    assert d0.output_ids == [99, 10, 20, 30]  # the first from prefill's metadata, then decode steps
    assert d0.output_logprobs == [-1.0] * 4 and d0.first_logprob == -1.0
    assert d0.num_output == 4


def test_random_pd_workload_under_small_pools_leaks_nothing():
    import random

    rng = random.Random(99)
    # Decode: 20 pages of 8 = 160 tokens and no reserve, so decoding requests outgrow the pool
    # and get retracted; prefill: 12 pages, so long prompts queue for pages.
    drv, p, d, _ = pd_pair(
        prefill=SchedulerConfig(num_pages=12, page_size=8, max_prefill_tokens=64, chunked_prefill_size=32,
                                metadata_slots=4, max_running_requests=4),
        decode=SchedulerConfig(num_pages=20, page_size=8, max_running_requests=6, pre_alloc_size=2,
                               num_reserved_decode_tokens=0, metadata_slots=5),
    )
    pairs = []
    t = 0.0
    for i in range(120):
        t += rng.expovariate(4.0)
        pairs.append(submit(drv, t, f"r{i}", rng.randint(1, 110), rng.randint(1, 70)))
    recomputes = 0
    orig = drv.slots["D"].executor.execute

    def execute(batch):
        nonlocal recomputes
        recomputes += batch.kind == "extend"
        return orig(batch)

    drv.slots["D"].executor = type("E", (), {"execute": staticmethod(execute)})()
    drv.run()
    assert recomputes > 0
    for pre, dec in pairs:
        assert pre.finished and dec.finished
        if dec.input_len + dec.max_new_tokens > 160 or pre.input_len > 96:
            assert "pool holds" in dec.error or "cannot hold" in dec.error or "pool holds" in pre.error
            continue
        assert pre.error == dec.error == ""
        assert dec.num_output == dec.max_new_tokens == len(dec.token_times_s)
        assert dec.token_times_s == sorted(dec.token_times_s)
        assert pre.prefill_end_s <= dec.transfer_done_s == dec.token_times_s[0]
    for s in (p, d):
        assert s.is_idle
        s.check_pools_full()
