"""`abort` finds a request in every queue of the PD schedulers (the workers' `POST /abort`): its
pages, request slot and metadata slot go back, its sender or receiver is aborted so the other
side learns, and the prefill side's pending-token count stays right."""

from __future__ import annotations

from configs import scheduler_config
from core_harness import StubKV

from pdsim.core.batch import BatchResult
from pdsim.core.decode import DecodeScheduler
from pdsim.core.kvpoll import KVPoll
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request

CFG = scheduler_config(16, page_size=4, max_prefill_tokens=8, chunked_prefill_size=4,
                       num_reserved_decode_tokens=4, max_running_requests=1, pre_alloc_size=2,
                       metadata_slots=4)


def req(rid: str, n_in: int, n_out: int = 4) -> Request:
    return Request(rid, n_in, n_out, prompt_ids=list(range(1, n_in + 1)),
                   bootstrap_room=100 + int(rid[1:]))


def run(sched, now: float) -> None:
    """One step, and its forward done at once (token 9 for every row)."""
    batch = sched.step(now)
    if batch is not None:
        n = len(batch.segments) if batch.kind == "extend" else len(batch.reqs)
        sched.on_batch_done(batch, BatchResult(0.1, token_ids=[9] * n, logprobs=[-1.0] * n), now)


def assert_clean(sched) -> None:
    assert sched.is_idle
    sched.check_pools_full()


def test_prefill_abort_in_each_queue():
    kv = StubKV(KVPoll.WaitingForInput)
    p = PrefillScheduler(CFG, kv)
    # r0: 12-token prompt, one 4-token chunk computed, back in the waiting queue.
    p.add_request(r0 := req("r0", 12), 0.0)
    run(p, 0.0)
    assert list(p.waiting) == [r0] and r0.computed_tokens == 4 and p.pending_tokens == 8
    assert p.abort("r0", "client disconnected", 1.0)
    assert r0.error == "client disconnected" and p.pending_tokens == 0
    assert kv["r0"].calls[-1] == ("abort", "client disconnected")
    assert_clean(p)
    # r1: prefilled, its KV in flight.
    p.add_request(r1 := req("r1", 4), 2.0)
    run(p, 2.0)
    assert p.inflight == [r1]
    assert p.abort("r1", "router gave up", 3.0)
    assert kv["r1"].calls[-1] == ("abort", "router gave up") and p.done[-1] is r1
    assert_clean(p)
    # r2: still waiting for the decode side.
    kv.initial = KVPoll.Bootstrapping
    p.add_request(r2 := req("r2", 6), 4.0)
    run(p, 4.0)
    assert p.bootstrap == [r2] and p.pending_tokens == 6
    assert p.abort("r2", "aborted", 5.0)
    assert p.pending_tokens == 0 and kv["r2"].calls == [("abort", "aborted")]
    assert not p.abort("r2", "again", 6.0) and not p.abort("nope", "x", 6.0)
    assert [r.rid for r in p.done] == ["r0", "r1", "r2"]
    assert_clean(p)


def test_decode_abort_in_each_queue():
    kv = StubKV(KVPoll.Bootstrapping)
    d = DecodeScheduler(CFG, kv)
    d.add_request(r0 := req("r0", 5), 0.0)
    run(d, 0.0)
    assert d.prealloc == [r0]
    assert d.abort("r0", "client disconnected", 1.0)
    assert kv["r0"].calls == [("abort", "client disconnected")]
    assert_clean(d)
    # r1 running (the batch holds one), r2 with its KV in place waits in prebuilt, r3 in transfer.
    kv.initial = KVPoll.WaitingForInput
    for r in (r1 := req("r1", 5, 20), r2 := req("r2", 6), r3 := req("r3", 7)):
        d.add_request(r, 2.0)
    run(d, 2.0)
    assert d.transfer == [r1, r2, r3]
    kv.deliver(r1)
    kv.deliver(r2)
    run(d, 3.0)
    assert list(d.running.reqs) == [r1] and list(d.prebuilt) == [r2] and d.transfer == [r3]
    assert d.abort("r2", "gone", 4.0)
    assert kv["r2"].calls[-1][0] == "send_metadata"  # its KV had arrived: nobody to tell
    assert d.abort("r3", "gone", 4.0)
    assert kv["r3"].calls[-1] == ("abort", "gone")
    assert d.abort("r1", "gone", 4.0)  # the running batch: the shared path
    assert [r.rid for r in d.done] == ["r0", "r2", "r3", "r1"]
    assert all(r.error == "gone" for r in (r1, r2, r3))
    assert_clean(d)
