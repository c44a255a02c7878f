"""The failure edges of disaggregated serving (docs/architecture.md), on real workers over
loopback: bootstrap and waiting-for-KV timeouts, aborts and refusals reaching the other side, a
decode worker killed mid-run (its requests fail with the reason; prefill goes on with a fresh
decode worker), a crossed metadata slot, a request whose sampling fails on either side (it fails
alone), and the router in front of roles started apart when the decode worker is killed
mid-stream (every client gets an error event and `[DONE]`; /health names the worker). After
each, every page, request slot and metadata slot is back.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import aiohttp
import pytest

from pd_harness import (
    body, generate, pd_config, post_decode, post_json, post_prefill, start_worker, stop_workers,
    wait_healthy,
)
from runtime.streams import PEER_LOST

pytestmark = [pytest.mark.real, pytest.mark.slow]

TIMEOUT_S = 3.0
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
ORPHANS = 8  # test_killing_the_decode_worker: requests left on the prefill side by a dead decode


def config(knobs: dict | None = None, **changes):
    """A prefill pool of 128 tokens, a decode pool of 512, and short timeouts."""
    base = dict(prefill={"scheduler": {"num_pages": 16}}, decode={"scheduler": {"num_pages": 64}},
                transfer={"heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
                          "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                          "handshake_timeout_s": TIMEOUT_S})
    timeouts = {"bootstrap_timeout_s": TIMEOUT_S, "waiting_timeout_s": TIMEOUT_S}
    return pd_config("tiny-llama", knobs={**timeouts, **(knobs or {})}, **{**base, **changes})


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    cfg = config()
    workers = {"prefill": start_worker(cfg, "prefill"), "decode": start_worker(cfg, "decode")}
    try:
        wait_healthy(list(workers.values()))
        yield cfg, workers
    finally:
        stop_workers(list(workers.values()))


def wait_queue(worker, name: str, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.get("/load")["queues"][name] != n:
        assert time.monotonic() < deadline, f"{worker.role} never had {n} in {name}"
        time.sleep(0.02)


def assert_pools_full(*workers) -> None:
    for w in workers:
        assert w.wait_pools_full() == {"full": True, "detail": ""}, w.role


async def _alone(worker, b: dict):
    async with aiohttp.ClientSession() as session:
        if worker.role == "prefill":
            return await post_prefill(session, worker, b)
        status, events, err = await post_decode(session, worker, b)
        return status, err if err is not None else events


def alone(worker, b: dict):
    """One side of a request only (its partner never shows up)."""
    return asyncio.run(_alone(worker, b))


def test_timeouts_when_the_other_side_never_comes(cluster):
    _, w = cluster
    p, d = w["prefill"], w["decode"]
    start = time.monotonic()
    results = {}
    threads = [threading.Thread(target=lambda w=w, side=side: results.update(
        {side: alone(w, body(f"lonely-{side}", prompt(9), 4, p))}))
        for side, w in (("p", p), ("d", d))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - start
    status, err = results["p"]
    # a queue timeout means "too busy now": 503 with Retry-After, not a server fault
    assert status == 503 and err["error"]["message"] == f"bootstrap timed out after {TIMEOUT_S} s"
    status, err = results["d"]
    assert status == 503 and err["error"]["message"] == f"KV did not arrive within {TIMEOUT_S} s"
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3
    assert_pools_full(p, d)


def test_decode_abort_reaches_prefill(cluster):
    _, w = cluster
    p, d = w["prefill"], w["decode"]
    b = body("abort-d", prompt(20), 8, p)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(alone(d, b))).start()
    wait_queue(d, "transfer", 1)  # decode has told prefill where to write
    assert post_json(d.url + "/abort", {"rid": "abort-d", "reason": "client went away"})[0] == 200
    # withdrawn by its router, not failed by this worker: 503 on both sides
    status, err = got.get(timeout=10)
    assert status == 503 and err["error"]["message"] == "aborted by the router: client went away"
    status, err = alone(p, b)  # the prefill half, late: the decode side has already aborted
    assert status == 503
    assert err["error"]["message"] == ("bootstrap failed: decode side aborted: aborted by the "
                                       "router: client went away")
    assert_pools_full(p, d)


def test_prefill_abort_reaches_decode(cluster):
    _, w = cluster
    p, d = w["prefill"], w["decode"]
    b = body("abort-p", prompt(20), 8, p)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(alone(p, b))).start()
    wait_queue(p, "bootstrap", 1)
    post_json(p.url + "/abort", {"rid": "abort-p", "reason": "router gave up"})
    status, err = got.get(timeout=10)
    assert status == 503 and err["error"]["message"] == "aborted by the router: router gave up"
    # The decode half comes after the prefill side forgot the request; it still learns why.
    status, err = alone(d, b)
    assert status == 503
    assert err["error"]["message"] == ("KV transfer failed: prefill rank 0: aborted by the "
                                       "router: router gave up")
    assert_pools_full(p, d)


def test_refusals_reach_the_other_side(cluster):
    _, w = cluster
    p, d = w["prefill"], w["decode"]
    # 200 prompt tokens fit the decode pool (512) but not the prefill pool (128).
    b = body("too-long-for-prefill", prompt(200), 8, p)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(alone(d, b))).start()
    wait_queue(d, "transfer", 1)
    status, err = alone(p, b)
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"] == ("request needs 200 KV tokens but the instance's pool holds "
                                       "128 (16 pages of 8)")
    status, err = got.get(timeout=10)
    assert status == 500 and err["error"]["message"] == (
        "KV transfer failed: prefill rank 0: prefill instance cannot hold the request: request "
        "needs 200 KV tokens but the instance's pool holds 128 (16 pages of 8)")
    # 20 + 600 tokens fit the prefill side (it keeps the prompt only) but not the decode pool.
    b = body("too-long-for-decode", prompt(20), 600, p)
    status, err = alone(d, b)
    assert status == 400 and "request needs 620 KV tokens" in err["error"]["message"]
    status, err = alone(p, b)
    assert status == 500 and err["error"]["message"] == (
        "bootstrap failed: decode side aborted: decode instance cannot hold the request: "
        "request needs 620 KV tokens but the instance's pool holds 512 (64 pages of 8)")
    assert_pools_full(p, d)


def test_crossed_metadata_is_caught():
    """A real prefill and decode pair in this process (Mooncake on loopback, the PD engines and
    the core schedulers), the prefill side writing a wrong room into the metadata slot."""
    import torch

    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.distributed import TPGroup
    from runtime.pd.worker import RankSpec, build_rank

    class CrossedRooms:
        """What a crossed buffer looks like to the decode side: someone else's room."""

        def __init__(self, inner):
            self.inner = inner

        def write(self, slot, meta):
            self.inner.write(slot, replace(meta, bootstrap_room=meta.bootstrap_room ^ 1))

        def read(self, slot):
            return self.inner.read(slot)

    threads = torch.get_num_threads()
    cfg = config()
    server = BootstrapServer().start()
    ranks = []
    try:
        for role in ("prefill", "decode"):
            spec = RankSpec(role, 0, 0, 1, bootstrap_host="127.0.0.1", bootstrap_port=server.port)
            ranks.append(build_rank(cfg, spec, TPGroup.single()))
        pre, dec = (r.engine.start() for r in ranks)
        honest = pre.kv.metadata
        pre.kv.metadata = CrossedRooms(honest)

        def run(rid: str, room: int) -> tuple[list, list]:
            events = {"p": queue.Queue(), "d": queue.Queue()}
            kw = dict(rid=rid, bootstrap_host="127.0.0.1", bootstrap_port=server.port,
                      bootstrap_room=room)
            dec.submit(prompt(30), 6, events["d"].put, **kw)
            pre.submit(prompt(30), 6, events["p"].put, **kw)
            out = {}
            for side, q in events.items():
                out[side] = [q.get(timeout=20)]
                while not out[side][-1].finished:
                    out[side].append(q.get(timeout=20))
            return out["p"], out["d"]

        p_events, d_events = run("crossed", 4242)
        assert p_events[-1].error is None  # prefill sent its KV; only decode can tell
        assert d_events[-1].token_ids == () and len(d_events) == 1
        assert d_events[-1].error == ("metadata room 4243 does not match request room 4242: the "
                                      "metadata buffer was crossed")
        for engine in (pre, dec):
            engine.check_pools_full(timeout=10)
        pre.kv.metadata = honest  # and the pair goes on
        p_events, d_events = run("straight", 4244)
        assert d_events[-1].error is None and d_events[-1].completion_tokens == 6
        for engine in (pre, dec):
            engine.check_pools_full(timeout=10)
    finally:
        for r in ranks:
            r.close()
        server.stop()
        torch.set_num_threads(threads)


def test_decode_with_another_page_size_refuses_to_pair(cluster):
    """A decode rank (in this process) pointed at a prefill instance whose KV pages differ."""
    import torch

    from runtime.distributed import TPGroup
    from runtime.pd.worker import RankSpec, build_rank

    _, w = cluster
    port = w["prefill"].bootstrap_port
    threads = torch.get_num_threads()
    rank = build_rank(config({"page_size": 16}), RankSpec("decode", 0, 0, 1), TPGroup.single())
    try:
        engine = rank.engine.start()
        events: queue.Queue = queue.Queue()
        engine.submit(prompt(10), 4, events.put, rid="mismatch", bootstrap_host="127.0.0.1",
                      bootstrap_port=port, bootstrap_room=777)
        event = events.get(timeout=20)
        assert event.finished and event.error == (
            f"handshake failed: bootstrap with 127.0.0.1:{port} failed: prefill and decode KV "
            "layouts differ (page_size: prefill 8, decode 16); KV pages can only be copied "
            "between identical layouts")
        engine.check_pools_full(timeout=10)
    finally:
        rank.close()
        torch.set_num_threads(threads)


SILENT = re.compile(r"bootstrap failed: decode side silent for \d+\.\d s "
                    rf"\(heartbeat timeout {re.escape(str(HEARTBEAT_TIMEOUT_S))} s\); "
                    rf"{PEER_LOST}")


def test_killing_the_decode_worker(cluster):
    """Requests on a decode worker that dies fail with the reason; the prefill side keeps serving
    with a fresh decode worker. (Runs last: it replaces the cluster's decode worker.)"""
    cfg, w = cluster
    p, d = w["prefill"], w["decode"]
    before = generate(p, d, [body("before", prompt(12, 1), 6, p)])[0].token_ids

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            # A long stream on the decode worker...
            long = body("long", prompt(10), 400, p)
            prefill_long = asyncio.ensure_future(post_prefill(session, p, long))
            resp = await session.post(d.url + "/generate", json=long)
            assert resp.status == 200
            first = await resp.content.readline()
            assert first.startswith(b"data: {")
            assert (await prefill_long)[0] == 200
            # ...and requests whose decode side has told prefill where to write.
            pending = [body(f"orphan{i}", prompt(15, i), 4, p) for i in range(ORPHANS)]
            decode_halves = [asyncio.ensure_future(post_decode(session, d, b)) for b in pending]
            while (await (await session.get(d.url + "/load")).json())["queues"]["transfer"] \
                    < ORPHANS:
                await asyncio.sleep(0.02)
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
            killed = time.monotonic()
            # At once, the prefill side finds out when it writes the KV: the reason is the
            # write's, so it came before the heartbeats were missed...
            first = asyncio.ensure_future(post_prefill(session, p, pending[0]))
            with pytest.raises(aiohttp.ClientError):
                async for _ in resp.content:  # the stream breaks
                    pass
                raise aiohttp.ClientPayloadError("the stream ended")
            for half in decode_halves:
                with pytest.raises(aiohttp.ClientError):
                    await half
            first = await first
            # ...and, once they have been missing past the timeout, before it computes. The
            # liveness check runs every heartbeat interval: late halves go one at a time until
            # one is refused for the silence (one before fails in its transfer, like the first),
            # then the rest; ORPHANS bounds the wait.
            await asyncio.sleep(max(0.0, killed + HEARTBEAT_TIMEOUT_S - time.monotonic()))
            late, early = pending[1:], []
            while late:
                status, err = await post_prefill(session, p, late.pop(0))
                if status == 503 and SILENT.fullmatch(err["error"]["message"]):
                    break
                early.append((status, err))
                await asyncio.sleep(0.5)
            rest = await asyncio.gather(*(post_prefill(session, p, b) for b in late))
            return first, early, rest

    (status, err), early, rest = asyncio.run(scenario())
    # The decode worker is gone, not broken: 503 (retry), the reason saying so.
    assert status == 503 and err["error"]["message"].startswith(
        "KV transfer failed: KV write failed: batch_transfer_sync_write to 127.0.0.1:"), err
    assert err["error"]["message"].endswith(PEER_LOST), err
    for status, err in early:
        assert status == 503 and err["error"]["message"].startswith("KV transfer failed: "), err
    assert rest, f"no late prefill half refused for the silence: {early}"
    for status, err in rest:
        assert status == 503 and SILENT.fullmatch(err["error"]["message"]), err
    assert_pools_full(p)
    w["decode"] = fresh = start_worker(cfg, "decode")
    wait_healthy([fresh])
    (o,) = generate(p, fresh, [body("after", prompt(12, 1), 6, p)])
    assert o.decode_status == 200 and o.token_ids == before
    assert_pools_full(p, fresh)


def test_separate_roles_decode_killed_mid_stream_every_client_gets_an_end(cluster):
    """Roles started apart (as `--role`), the router alone in front of them: kill -9 of the
    decode worker mid-stream ends every client's stream with an error event and `[DONE]`, the
    router's /health turns 503 naming the worker, and a new request fails fast with 503."""
    from runtime.launcher import make_router

    cfg, w = cluster
    p, d = w["prefill"], w["decode"]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    router = make_router(cfg, [p.url], [d.url], {p.url: p.get("/health")})
    on_loop(router.start())

    async def streams(n: int) -> list[list[str]]:
        first = asyncio.Semaphore(0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one(i: int) -> list[str]:
                data: list[str] = []
                async with session.post(router.url + "/v1/completions", json={
                        "prompt": f"apart {i}", "max_tokens": 400, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as resp:
                    assert resp.status == 200
                    async for raw in resp.content:
                        if raw.startswith(b"data:"):
                            if not data:
                                first.release()
                            data.append(raw[5:].decode().strip())
                return data

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            for _ in range(n):
                await asyncio.wait_for(first.acquire(), 30)
            d.proc.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 15)

    try:
        for data in asyncio.run(streams(6)):
            assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), data[-3:]
        time.sleep(router.client.health_ttl_s)
        status, health = get_json(router.url + "/health")
        assert status == 503 and list(health["problems"]) == ["decode worker 0"]
        start = time.monotonic()
        status, err = post_json(router.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and "decode worker" in err["error"]["message"], err
        assert time.monotonic() - start < 2.0
        assert_pools_full(p)
    finally:
        on_loop(router.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_request_whose_sampling_fails_fails_alone_on_either_side():
    """A real prefill and decode pair in this process; one request's sampling is broken on the
    prefill side (its first token), another's on the decode side (a seed validation keeps out,
    smuggled in): each fails with the reason, the other requests of their batches finish."""
    import torch

    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.distributed import TPGroup
    from runtime.pd.worker import RankSpec, build_rank
    from runtime.sampling import SamplingParams

    bad = SamplingParams(temperature=1.0, seed=1)
    object.__setattr__(bad, "seed", 2**64)
    threads = torch.get_num_threads()
    cfg = config()
    server = BootstrapServer().start()
    ranks = []
    try:
        for role in ("prefill", "decode"):
            spec = RankSpec(role, 0, 0, 1, bootstrap_host="127.0.0.1", bootstrap_port=server.port)
            ranks.append(build_rank(cfg, spec, TPGroup.single()))
        pre, dec = (r.engine.start() for r in ranks)
        events = {side: queue.Queue() for side in ("p", "d")}
        poisoned = {"p": 2, "d": 4}  # the request whose sampling breaks on that side
        for i in range(6):
            kw = dict(rid=f"s{i}", bootstrap_host="127.0.0.1", bootstrap_port=server.port,
                      bootstrap_room=7000 + i)
            for side, engine in (("d", dec), ("p", pre)):
                sampling = bad if poisoned[side] == i else SamplingParams(temperature=0.5, seed=i)
                engine.submit(prompt(20, i), 6, lambda e, i=i, q=events[side]: q.put((i, e)),
                              sampling=sampling, **kw)
        final = {}
        for side, q in events.items():
            final[side] = {}
            while len(final[side]) < 6:
                i, event = q.get(timeout=30)
                if event.finished:
                    final[side][i] = event
        assert "sampling failed" in final["p"][2].error and final["d"][2].error
        assert final["p"][4].error is None and "sampling failed" in final["d"][4].error
        for i in (0, 1, 3, 5):
            assert final["p"][i].error is None and final["d"][i].error is None
            assert final["d"][i].completion_tokens == 6
        for engine in (pre, dec):
            engine.check_pools_full(timeout=10)
    finally:
        for r in ranks:
            r.close()
        server.stop()
        torch.set_num_threads(threads)
