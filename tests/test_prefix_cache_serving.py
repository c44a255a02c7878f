"""The radix prefix cache in the real servers (CPU, torch kernels, tiny Llama): a repeated prompt
takes its whole pages from the cache, reports them as OpenAI's `cached_tokens`, and generates the
greedy tokens a server without the cache generates; the same through a real PD pair (Mooncake
over loopback), where the decode side learns the hit from the KV metadata; the real router's
cache-aware policy; and the early send of the cached pages through the real Mooncake sender."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from openai import OpenAI
from configs import colocated_config, scheduler_config

from pdsim.core.kvpoll import KVPoll
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.radix import token_page_keys
from pdsim.core.request import Request
from runtime.executor import ModelExecutor
from runtime.model import ModelConfig, build_model
from runtime.openai.protocol import Limits
from runtime.colocated import BackgroundServer
from runtime.router import PDRouter, WorkerAddress
from runtime.tokenizer import ByteTokenizer
from runtime.transfer.bootstrap_server import BootstrapServer
from runtime.transfer.layout import KVArgs
from runtime.transfer.metadata import MetadataBuffer
from runtime.transfer.mooncake import MooncakeKVManager
from tests.pd_harness import body, generate, pd_config, start_worker, stop_workers, wait_healthy

pytestmark = [pytest.mark.real, pytest.mark.slow]

PAGE = 8
PROMPT = "A long shared system prompt, then a question: what comes next?"
CACHED_PAGES = (len(PROMPT.encode()) - 1) // PAGE  # a repeat's whole pages short of its last token


def whole_pages_short_of_last(prompt_tokens: int) -> int:
    """What a repeat of a prompt takes from the cache: its whole pages, short of its last token."""
    return (prompt_tokens - 1) // PAGE * PAGE


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


def complete_twice(disable_radix_cache: bool) -> list[tuple[list[int], int]]:
    """The same greedy completion twice, one after the other: (token ids, prompt tokens,
    cached tokens) of each."""
    cfg = colocated_config(num_pages=64, page_size=PAGE, seed=5,
                           scheduler=dict(chunked_prefill_size=32,
                                          disable_radix_cache=disable_radix_cache))
    out = []
    with BackgroundServer(cfg) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(2):
            reply = client.completions.create(
                model=srv.server.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            out.append((reply.choices[0].token_ids, reply.usage.prompt_tokens,
                        reply.usage.prompt_tokens_details.cached_tokens))
        srv.engine.check_pools_full()
    return out


def test_colocated_repeat_hits_the_cache_with_equal_tokens():
    (first, n, first_hit), (second, _, second_hit) = complete_twice(disable_radix_cache=False)
    (plain, _, plain_hit), (plain2, _, plain2_hit) = complete_twice(disable_radix_cache=True)
    assert n == len(PROMPT.encode()) + 1  # the tokenizer's BOS
    assert (first_hit, second_hit) == (0, whole_pages_short_of_last(n)) == (0, 56)
    assert (plain_hit, plain2_hit) == (0, 0)
    assert first == second == plain == plain2 and len(first) == 8


def test_pd_decode_tokens_equal_with_and_without_the_prefill_cache():
    cached = start_worker(pd_config("tiny-llama"), "prefill")
    off = {"scheduler": {"disable_radix_cache": True}}
    plain = start_worker(pd_config("tiny-llama", prefill=off), "prefill")
    decode = start_worker(pd_config("tiny-llama"), "decode")
    ids = list(PROMPT.encode())
    cached_len = whole_pages_short_of_last(len(ids))
    try:
        wait_healthy([cached, plain, decode])
        runs = {}
        for name, prefill in (("cached", cached), ("plain", plain)):
            runs[name] = [generate(prefill, decode, [body(f"{name}{i}", ids, 6, prefill)])[0]
                          for i in range(2)]
        for outcomes in runs.values():
            assert all(o.prefill_status == o.decode_status == 200 and not o.error for o in outcomes)
        tokens = {o.token_ids == runs["plain"][0].token_ids for r in runs.values() for o in r}
        assert tokens == {True} and len(runs["plain"][0].token_ids) == 6
        hits = {name: [o.last["cached_tokens"] for o in r] for name, r in runs.items()}
        assert hits == {"cached": [0, cached_len], "plain": [0, 0]}
        records = {r["rid"]: r["cached_tokens"] for r in decode.get("/records")}
        assert records == {"cached0": 0, "cached1": cached_len, "plain0": 0, "plain1": 0}
        assert cached.wait_pools_full()["full"] and decode.wait_pools_full()["full"]
    finally:
        stop_workers([cached, plain, decode])


async def records_reach(router: PDRouter, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the router holds `n` records: the client's last chunk can arrive before them."""
    deadline = time.monotonic() + timeout_s
    while len(router.records) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"the router has {len(router.records)} records, not {n}")
        await asyncio.sleep(0.01)


def test_cache_aware_router_sends_a_repeated_prefix_to_the_prefill_worker_that_holds_it():
    """Two prefill workers, one decode worker and the real router (`cache_aware`, keyed by the
    prompt's pages): X, X', Y, Y' (X' repeats X's system prompt) go to prefill 0, 0, 1, 1 (round
    robin would alternate), and each repeat finds its prefix in that worker's cache."""
    cfg = pd_config("tiny-llama", prefill={"instances": 2}, router={"policy": "cache_aware"})
    prefill = [start_worker(cfg, "prefill", instance=i) for i in range(2)]
    decode = start_worker(cfg, "decode")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    try:
        wait_healthy([*prefill, decode])
        router = PDRouter(
            [WorkerAddress(w.url, "127.0.0.1", w.bootstrap_port) for w in prefill],
            [WorkerAddress(decode.url)], cfg, tokenizer=ByteTokenizer(), model_name="tiny",
            limits=Limits(max_model_len=512, pool_tokens=512, max_position=4096,
                          model_vocab=ByteTokenizer.vocab_size))
        on_loop(router.start())
        client = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
        x = "System prompt X: answer briefly, in plain words, and exactly. "
        y = "Another preamble Y, unlike the first one from its first byte on. "
        hits = []
        for prompt in (x + "First?", x + "Second one?", y + "Third?", y + "And fourth?"):
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                              temperature=0, extra_body={"ignore_eos": True})
            hits.append(reply.usage.prompt_tokens_details.cached_tokens)
        on_loop(records_reach(router, 4))  # a record lands once the prefill call has returned too
        assert [r.prefill_instance for r in router.records] == [0, 0, 1, 1]
        shared = [(len(p.encode()) + 1) // cfg.page_size * cfg.page_size for p in (x, y)]  # + BOS
        assert hits == [0, shared[0], 0, shared[1]] and min(shared) > 0
        on_loop(router.close())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        stop_workers([*prefill, decode])


def test_the_cached_prefix_reaches_the_decode_side_before_the_suffix_forward_runs():
    """The prefill scheduler with the real executor and the real Mooncake sender (in process):
    on a hit, the cached pages are in the decode side's KV memory before the suffix's forward
    has even started (the engine would run it right after this step), and the suffix follows."""
    model = build_model(ModelConfig.preset("tiny-llama"), seed=3)
    heads = model.config.num_kv_heads
    server = BootstrapServer().start()
    sides = {}
    for role in ("prefill", "decode"):
        ex = ModelExecutor(model, num_pages=32, page_size=PAGE,
                           vocab_limit=ByteTokenizer.vocab_size)
        md = MetadataBuffer.allocate(4)
        sides[role] = (ex, MooncakeKVManager(KVArgs.for_cache(ex.kv, md, total_kv_heads=heads)))
    (pex, pmgr), (dex, dmgr) = sides["prefill"], sides["decode"]
    for buffer in dex.kv.buffers:  # what no transfer wrote differs from any computed KV
        buffer.fill_(-1.0)
    pmgr.register_with_bootstrap("127.0.0.1", server.port)
    cfg = scheduler_config(32, page_size=PAGE, max_running_requests=4,
                           max_prefill_tokens=64, chunked_prefill_size=64,
                           num_reserved_decode_tokens=4, prefix_cache=True, metadata_slots=4)
    sched = PrefillScheduler(cfg, pmgr)
    prompt = list(PROMPT.encode())
    dst_free = list(range(31, -1, -1))
    now = 0.0

    def serve(rid: str, ids: list[int], room: int):
        """Add one request with its receiver; step until its sender has the decode side's
        pages; return (request, receiver, its first step's batch, the destination pages)."""
        nonlocal now

        def make():
            return Request(rid, len(ids), 2, arrival_s=now, prompt_ids=ids,
                           prefix_keys=token_page_keys(ids, PAGE), bootstrap_host="127.0.0.1",
                           bootstrap_port=server.port, bootstrap_room=room)
        r = make()
        sched.add_request(r, now)
        receiver = dmgr.create_receiver(make())
        deadline = time.monotonic() + 10
        while receiver.poll() < KVPoll.WaitingForInput:
            assert time.monotonic() < deadline, "the receiver did not bootstrap"
            time.sleep(0.002)
        dst = [dst_free.pop() for _ in range(-(-len(ids) // PAGE))]
        receiver.send_metadata(dst, 0)
        while (batch := sched.step(now)) is None:
            assert time.monotonic() < deadline, "the sender did not bootstrap"
            time.sleep(0.002)
            now += 0.002
        return r, receiver, batch, dst

    def finish(r, receiver, batch):
        nonlocal now
        result = pex.forward(batch)
        now += result.duration_s
        sched.on_batch_done(batch, result, now)
        deadline = time.monotonic() + 10
        while receiver.poll() is not KVPoll.Success or not r.finished:
            assert time.monotonic() < deadline and receiver.poll() is not KVPoll.Failed
            time.sleep(0.002)
            now += 0.002
            sched.step(now)

    def arrived(src_pages, dst_pages) -> bool:
        return all(torch.equal(d[dst_pages], s[src_pages])
                   for s, d in zip(pex.kv.buffers, dex.kv.buffers))

    try:
        first = serve("first", prompt, 1)
        finish(*first[:3])
        second, receiver, batch, dst = serve("second", prompt + list(b" Again?"), 2)
        assert second.cached_tokens == CACHED_PAGES * PAGE
        src, cached_pages = list(second.pages), second.pages[:CACHED_PAGES]
        assert not arrived(src, dst)
        segments = [(g.start, g.end) for g in batch.segments]
        assert segments == [(second.cached_tokens, second.input_len)]
        deadline = time.monotonic() + 10
        while not arrived(cached_pages, dst[:CACHED_PAGES]):  # the suffix's forward not yet run
            assert time.monotonic() < deadline, "the cached pages did not arrive before the forward"
            time.sleep(0.002)
        assert not second.output_ids and not arrived(src, dst)  # no forward yet: no suffix KV
        finish(second, receiver, batch)
        assert arrived(src, dst)  # then the suffix's pages too
        sched.check_pools_full()
    finally:
        pmgr.close()
        dmgr.close()
        server.stop()
