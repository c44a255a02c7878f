"""The colocated and prefill schedulers with a radix prefix cache: a request computes only the
suffix after its cached prefix, reports it as cached tokens, and every page is free or cached
(unpinned) when the instance is idle."""

from __future__ import annotations

import random

from configs import scheduler_config
from core_harness import Driver, FixedExecutor, StubKV
from hypothesis import given, settings
from hypothesis import strategies as st

from pdsim.core.batch import BatchResult
from pdsim.core.config import SchedulerConfig
from pdsim.core.kvpoll import KVPoll
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.radix import token_page_keys
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler

PAGE = 4


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=PAGE, max_running_requests=16, max_prefill_tokens=64,
                chunked_prefill_size=32, num_reserved_decode_tokens=4, prefix_cache=True,
                metadata_slots=8)
    base.update(kw)
    return scheduler_config(**base)


def req(rid: str, tokens: list[int], n_out: int = 3, room: int = 0) -> Request:
    return Request(rid, len(tokens), n_out, arrival_s=0.0, bootstrap_room=room,
                   prefix_keys=token_page_keys(tokens, PAGE))


SYSTEM = list(range(100, 116))  # 16 tokens: four pages


def extends(ex: FixedExecutor) -> list[tuple[str, int, int]]:
    return [(g.req.rid, g.start, g.end) for b in ex.batches if b.kind == "extend" for g in b.segments]


def test_a_later_request_computes_only_the_suffix_after_the_cached_prefix():
    s = ColocatedScheduler(cfg())
    ex = FixedExecutor(extend_s=1.0, decode_s=0.25)
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    r0, r1 = req("r0", SYSTEM + [1, 2, 3]), req("r1", SYSTEM + [7, 8, 9, 10, 11])
    d.submit(0.0, "C", r0)
    d.submit(5.0, "C", r1)  # after r0 finished and cached its whole pages
    d.run()
    assert extends(ex) == [("r0", 0, 19), ("r1", 16, 21)]
    assert [b.shape.prefill_prefix_tokens for b in ex.batches if b.kind == "extend"] == [0, 16]
    assert (r0.cached_tokens, r1.cached_tokens) == (0, 16)
    assert r1.to_record("ok").cached_tokens == 16  # into the per-request records
    assert r1.num_output == 3 and not r1.error
    assert s.cache.total_cached_pages == 4 + 1  # the system prompt, and r1's own fifth page
    s.check_pools_full()


def test_without_the_cache_every_prompt_is_computed_whole():
    s = ColocatedScheduler(cfg(prefix_cache=False))
    ex = FixedExecutor()
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    d.submit(0.0, "C", req("r0", SYSTEM + [1, 2, 3]))
    d.submit(5.0, "C", req("r1", SYSTEM + [7, 8, 9, 10, 11]))
    d.run()
    assert s.cache is None
    assert extends(ex) == [("r0", 0, 19), ("r1", 0, 21)]
    s.check_pools_full()


def test_an_identical_prompt_still_computes_its_last_token():
    s = ColocatedScheduler(cfg())
    ex = FixedExecutor()
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    d.submit(0.0, "C", req("r0", SYSTEM))
    d.submit(5.0, "C", req("r1", SYSTEM))
    d.run()
    assert extends(ex) == [("r0", 0, 16), ("r1", 12, 16)]  # three pages reused, the fourth recomputed
    s.check_pools_full()


def test_memory_pressure_evicts_and_retracts_without_leaking_a_page():
    """Many requests over a few shared prefixes in a small pool: the cache must give pages back
    for new requests and decode growth, pins must hold, and the run must end clean."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([8, 12, 20]))] for _ in range(3)]
    s = ColocatedScheduler(cfg(num_pages=40, max_prefill_tokens=48, chunked_prefill_size=16,
                               num_reserved_decode_tokens=2))
    ex = FixedExecutor(extend_s=1.0, decode_s=0.25)
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    reqs = []
    for i in range(40):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        r = req(f"r{i}", tokens, n_out=rng.randrange(1, 30))
        reqs.append(r)
        d.submit(rng.uniform(0, 30), "C", r)
    d.run()
    assert all(r.finished and not r.error and r.num_output == r.max_new_tokens for r in reqs)
    assert sum(r.cached_tokens for r in reqs) > 0
    s.check_pools_full()
    assert s.cache.total_cached_pages > 0 and s.pool.num_free < s.pool.size


def test_prefill_sends_cached_pages_and_reports_cached_tokens():
    kv = StubKV(initial=KVPoll.WaitingForInput)
    s = PrefillScheduler(cfg(), kv)
    first, second = req("p0", SYSTEM + [1, 2], room=11), req("p1", SYSTEM + [5, 6, 7], room=12)
    s.add_request(first, 0.0)
    b = s.step(0.0)
    s.on_batch_done(b, BatchResult(1.0), 1.0)
    kv["p0"].state = KVPoll.Success
    s.step(1.0)
    assert first.finished and s.pending_tokens == 0
    cached_pages = kv["p0"].sends()[0][0][:4]

    s.add_request(second, 2.0)
    assert s.pending_tokens == 19
    b = s.step(2.0)
    assert [(g.start, g.end) for g in b.segments] == [(16, 19)]
    assert s.pending_tokens == 3  # the cached 16 are not computed here
    assert ("init", 5, second.metadata_slot) in kv["p1"].calls  # the decode side gets every page
    assert kv["p1"].sends() == [(cached_pages, False)]  # sent before the suffix's forward runs
    s.on_batch_done(b, BatchResult(1.0), 3.0)
    assert s.pending_tokens == 0
    assert len(kv["p1"].sends()) == 2 and kv["p1"].sends()[1][1]  # then the last page, last=True
    assert len(kv["p1"].sends()[1][0]) == 1
    assert kv.metadata.read(second.metadata_slot).cached_tokens == 16
    kv["p1"].state = KVPoll.Success
    s.step(3.0)
    assert second.finished and not second.error
    s.check_pools_full()


def test_aborting_a_request_that_matched_drops_its_pin():
    s = ColocatedScheduler(cfg(num_pages=12))
    d = Driver(FixedExecutor(), log=False)
    d.add_instance("C", s)
    d.submit(0.0, "C", req("r0", SYSTEM + [1]))
    d.run()
    assert s.cache.evictable_pages == 4
    hog = s.pool.alloc_many(6)  # held by others: 2 pages stay free
    r1 = req("r1", SYSTEM + list(range(24)))
    s.add_request(r1, 10.0)
    assert s.step(10.0) is None  # matched and pinned 4 pages, but 6 more do not fit
    assert r1.cached_tokens == 16 and s.cache.evictable_pages == 0
    assert s.abort("r1", "client left", 11.0)
    assert s.cache.evictable_pages == 4 and r1.cache_node is None
    s.pool.free_many(hog)
    s.check_pools_full()


class TokenTimedExecutor(FixedExecutor):
    """An extend costs 10 ms plus 0.1 ms a computed token; a decode step 20 ms."""

    def forward(self, batch):
        self.batches.append(batch)
        if batch.kind == "extend":
            return BatchResult(0.01 + 1e-4 * batch.shape.prefill_tokens)
        return BatchResult(0.02)


def serve(workload, prefix_cache: bool):
    s = ColocatedScheduler(cfg(num_pages=4096, page_size=16, max_prefill_tokens=8192,
                               chunked_prefill_size=2048, prefix_cache=prefix_cache))
    ex = TokenTimedExecutor()
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    reqs = []
    for i, (t, n_in, n_out) in enumerate(zip(workload.arrival_s.tolist(), workload.input_tokens.tolist(),
                                             workload.output_tokens.tolist())):
        r = Request(str(i), n_in, n_out, arrival_s=t,
                    prefix_keys=workload.prefix.page_keys(i, n_in, 16))
        reqs.append(r)
        d.submit(t, "C", r)
    d.run()
    s.check_pools_full()
    assert all(r.finished and not r.error for r in reqs)
    computed = sum(b.shape.prefill_tokens for b in ex.batches if b.kind == "extend")
    ttft = sum(r.token_times_s[0] - r.arrival_s for r in reqs) / len(reqs)
    return computed, ttft, reqs


def test_shared_system_prompts_cut_prefill_tokens_and_ttft():
    from pdsim.workload import generate, ideal_cached_tokens

    w = generate({"num_requests": 150, "seed": 2, "arrival": {"process": "poisson", "rate_rps": 2.5},
                  "input_len": {"dist": "lognormal", "mean": 200, "cv": 0.5, "min": 16},
                  "output_len": {"dist": "fixed", "value": 8},
                  "prefix": {"system_prompts": 3, "system_prompt_len": 3000, "share": 0.9}})
    off_tokens, off_ttft, _ = serve(w, prefix_cache=False)
    on_tokens, on_ttft, reqs = serve(w, prefix_cache=True)
    assert off_tokens == int(w.input_tokens.sum())
    cached = sum(r.cached_tokens for r in reqs)
    assert on_tokens == off_tokens - cached
    # an unbounded cache with requests one at a time is the most it can get; overlapping
    # requests with the same prompt miss while the first still computes it
    assert 0.6 * ideal_cached_tokens(w, 16).sum() < cached <= ideal_cached_tokens(w, 16).sum()
    assert on_tokens < 0.35 * off_tokens
    assert on_ttft < 0.5 * off_ttft


def test_pd_decode_side_learns_the_cached_tokens_through_the_metadata():
    from pdsim.core.decode import DecodeScheduler
    from pdsim.core.fake_transfer import FakeKVManager, FakeWire

    wire = FakeWire()
    p = PrefillScheduler(cfg(num_pages=16, max_prefill_tokens=8, chunked_prefill_size=8), FakeKVManager(wire))
    dec = DecodeScheduler(cfg(num_pages=16, prefix_cache=False), FakeKVManager(wire), instance_id=1)
    drv = Driver(FixedExecutor(extend_s=1.0, decode_s=0.25), log=False)
    drv.add_instance("P", p)
    drv.add_instance("D", dec)
    decoded = []
    for k in range(4):
        tokens = SYSTEM[:8] + [k, k + 1, k + 2]
        at = 3.0 * k  # one at a time: each finds the previous ones' prefix cached
        pre = req(f"r{k}", tokens, room=500 + k)
        d = Request(f"r{k}", len(tokens), 3, arrival_s=at, bootstrap_room=500 + k)
        drv.submit(at, "P", pre)
        drv.submit(at, "D", d)
        decoded.append(d)
    drv.run()
    assert [d.cached_tokens for d in decoded] == [0, 8, 8, 8]
    assert all(d.num_output == 3 and not d.error for d in decoded)
    assert p.cache.total_cached_pages == 2 and p.pending_tokens == 0
    p.check_pools_full()
    dec.check_pools_full()


PROMPTS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(1, 12),
                             st.floats(0, 20)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(PROMPTS, st.integers(24, 60), st.sampled_from([0, 4, 8, 16]))
def test_any_mix_of_shared_prompts_finishes_clean(specs, num_pages, chunk):
    """Prompts = one of four shared prefixes (cut to a random length) + a unique tail. Every
    request finishes with all its tokens; each one's extends start where its cache hit ended and
    run contiguously to the end of its fill; nothing leaks."""
    rng = random.Random(len(specs))
    prefixes = [[rng.randrange(9) for _ in range(24)] for _ in range(4)]
    s = ColocatedScheduler(cfg(num_pages=num_pages, max_prefill_tokens=24, chunked_prefill_size=chunk,
                               num_reserved_decode_tokens=2))
    ex = FixedExecutor(extend_s=1.0, decode_s=0.25)
    d = Driver(ex, log=False)
    d.add_instance("C", s)
    reqs = []
    for i, (which, cut, n_out, at) in enumerate(specs):
        tokens = prefixes[which][:cut] + [100 + i, 200 + i]
        r = req(f"r{i}", tokens, n_out=n_out)
        reqs.append(r)
        d.submit(at, "C", r)
    d.run()
    s.check_pools_full()
    segs: dict[str, list[tuple[int, int]]] = {}
    for rid, start, end in extends(ex):
        segs.setdefault(rid, []).append((start, end))
    for r in reqs:
        assert r.finished and not r.error and r.num_output == r.max_new_tokens
        runs = segs[r.rid]
        assert runs[0][0] == r.cached_tokens < r.input_len
        for (_, end), (start, _) in zip(runs, runs[1:]):
            # the next chunk, or a recompute after a retraction from a cached page boundary
            assert start == end or (start < end and start % PAGE == 0)
        assert runs[-1][1] >= r.input_len
