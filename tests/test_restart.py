"""A worker killed and restarted under load (the launcher's fault injection), and a router whose
cluster secret the workers reject.

Through a restart every client request either gets its tokens or a 503 with Retry-After, never
a 500; once the restarted worker answers `/health` again, requests succeed within seconds, not
after the transfer heartbeat timeout (set long here, so waiting it out would show); and
both workers get every page, request slot and metadata slot back.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from configs import tiny_pd_yaml
from stream_client import stream_completion

pytestmark = [pytest.mark.real, pytest.mark.slow]

# Longer than a restart takes (30-40 s for tiny-llama on 2 busy cores): waiting it out would show.
HEARTBEAT_TIMEOUT_S = 120.0
RECOVERY_S = 10.0  # from the worker's /health answering again to a request's success, at most
KILL_S, BACK_S = 10.0, 1.0  # the kill comes after the two sides have served together a while
CONCURRENCY = 4
SUCCESSES_AFTER = 8  # requests that succeed after the worker is back before the load stops
SETTLE_S = 1.0  # from then on every request succeeds


def restart_yaml(role: str) -> str:
    """The small deployment with the default heartbeat interval and a long heartbeat timeout,
    one `role` worker killed at KILL_S and started again BACK_S later."""
    text = tiny_pd_yaml(decode_pages=256, extra=(
        f"faults:\n  kill: [{{role: {role}, instance: 0, at_s: {KILL_S}, "
        f"restart_after_s: {BACK_S}}}]\n"))
    old = "transfer: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 5.0}"
    assert old in text
    return text.replace(old, "transfer: {heartbeat_interval_s: 2.0, heartbeat_timeout_s: "
                             f"{HEARTBEAT_TIMEOUT_S}}}")


async def _one(session, url: str, t0: float) -> dict:
    return await stream_completion(session, url, "A worker restarts under load", 6, t0)


def ok(r: dict) -> bool:
    return r["status"] == 200 and r["ended"] and r["error"] is None and r["tokens"] == 6


async def drive_through_restart(url: str, worker_url: str, *, deadline_s: float = 300.0):
    """Requests from CONCURRENCY clients back to back while `worker_url` is killed and comes
    back; stops once SUCCESSES_AFTER requests sent SETTLE_S after its return have succeeded. Returns the
    results and when (s since the start) the worker's /health first failed and answered
    again."""
    import aiohttp

    t0 = time.monotonic()
    results: list[dict] = []
    seen = {"down": None, "back": None}

    def enough() -> bool:
        back = seen["back"]
        return back is not None and sum(ok(r) and r["sent"] >= back + SETTLE_S
                                        for r in results) >= SUCCESSES_AFTER

    async def watch(session) -> None:
        while not enough():
            try:
                async with session.get(worker_url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    healthy = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                healthy = False
            now = time.monotonic() - t0
            if not healthy and seen["down"] is None:
                seen["down"] = now
            elif healthy and seen["down"] is not None and seen["back"] is None:
                seen["back"] = now
            await asyncio.sleep(0.05)

    async def client(session) -> None:
        while not enough():
            assert time.monotonic() - t0 < deadline_s, (seen, results[-5:])
            results.append(await _one(session, url, t0))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(watch(session), *(client(session) for _ in range(CONCURRENCY)))
    return results, seen["down"], seen["back"]


def recovery_s(results: list[dict], back_s: float) -> float:
    """From the worker's return to the end of the first request sent after it that succeeded."""
    return min(r["end"] for r in results if ok(r) and r["sent"] >= back_s) - back_s


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_restarted_worker_costs_503s_never_500s_and_serves_again_at_once(role, tmp_path,
                                                                           monkeypatch):
    from pd_harness import Proc, wait_pools_full
    from runtime.security import SECRET_ENV, key_of, new_secret

    cfg = tmp_path / "pd.yaml"
    cfg.write_text(restart_yaml(role))
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)  # the deployment's: /pools needs it
    launcher = Proc(str(cfg))
    try:
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+/v1)").group(1)
        workers = {r: launcher.wait_for(rf"{r} worker 0 .* at (http://[^\s,]+)").group(1)
                   for r in ("prefill", "decode")}
        results, down, back = asyncio.run(drive_through_restart(url, workers[role]))
        launcher.wait_for(rf"fault injection: restart {role} worker 0", timeout_s=5)
        assert launcher.proc.poll() is None
        for r, worker in workers.items():  # nothing held for the dead one's requests
            state = wait_pools_full(worker, key_of(secret).headers())
            assert state["full"], (r, state)
    finally:
        assert launcher.stop() == 0
    assert down is not None and back is not None and down < back
    assert sum(ok(r) and r["end"] < down for r in results) >= SUCCESSES_AFTER  # before the kill
    statuses = {r["status"] for r in results}
    assert statuses <= {200, 503}, [r for r in results if r["status"] not in (200, 503)]
    refused = [r for r in results if r["status"] == 503]
    assert refused, "requests sent while the worker was down should have been refused"
    for r in refused:
        assert r["retry_after"] == "1" and r["error"], r
        assert r["end"] - r["sent"] < 5.0, r  # refused promptly, not after a timeout
    for r in results:
        if r["status"] == 200 and not ok(r):  # only a stream the kill cut may end early,
            assert role == "decode" and r["ended"] and r["tokens"] > 0, r  # with its tokens
            assert r["sent"] < down + 1.0, r
    # Back: the next requests succeed, well before the heartbeat timeout could have run out.
    assert recovery_s(results, back) < RECOVERY_S, (back, results[-12:])
    later = [r for r in results if r["sent"] >= back + SETTLE_S]
    assert later and all(ok(r) for r in later), [r for r in later if not ok(r)]


ROUTER_PAGES = 512  # the decode side's: four 1500-token streams run a while before the kill


@pytest.fixture(scope="module")
def secured_workers():
    """A prefill and a decode worker that need the cluster secret, shared by the router tests
    (each leaves them as it found them: nothing held, checked); yields them and the secret."""
    from pd_harness import pd_config, worker_cluster
    from runtime.security import SECRET_ENV, new_secret

    secret = new_secret()
    cfg = pd_config("tiny-llama", security={"insecure": False},
                    decode={"scheduler": {"num_pages": ROUTER_PAGES}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, secret)  # the workers read it from their environment
        with worker_cluster({("prefill", 0): cfg, ("decode", 0): cfg}) as (workers, _):
            yield [workers["prefill", 0], workers["decode", 0]], secret


def router_yaml(tmp_path) -> str:
    path = tmp_path / "pd.yaml"
    path.write_text(tiny_pd_yaml(decode_pages=ROUTER_PAGES))
    return str(path)


def test_a_router_whose_secret_the_workers_reject_is_unhealthy(secured_workers, tmp_path,
                                                               monkeypatch):
    from pd_harness import Proc
    from runtime.security import SECRET_ENV, new_secret

    workers, right = secured_workers
    wrong = new_secret()
    cfg_path = router_yaml(tmp_path)
    routers = []
    try:
        for secret in (wrong, right):
            monkeypatch.setenv(SECRET_ENV, secret)
            routers.append(Proc(cfg_path, "--role", "router", "--prefill-url",
                                workers[0].url, "--decode-url", workers[1].url))
        bad, good = (p.wait_for(r"at (http://\S+/v1)").group(1) for p in routers)
        status, body, headers = get(bad.removesuffix("/v1") + "/health")
        assert status == 503 and headers.get("Retry-After") == "1", body
        assert set(body["problems"]) == {"prefill worker 0", "decode worker 0"}, body
        for why in body["problems"].values():
            assert "cluster secret" in why and "401" in why
        text = json.dumps(body)
        assert right not in text and wrong not in text and "127.0.0.1" not in text
        assert get(good.removesuffix("/v1") + "/health")[0] == 200
    finally:
        for p in routers:
            p.stop()


def get(url: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def test_a_restarted_router_leaves_nothing_held_and_serves_at_once(secured_workers, tmp_path):
    """The router killed (-9) with streams in flight: the workers see its connections close and
    abort those requests (every page and slot back); a router started again serves at once."""
    import signal

    import aiohttp

    from pd_harness import Proc, wait_pools_full
    from runtime.security import key_of

    workers, secret = secured_workers
    args = (router_yaml(tmp_path), "--role", "router", "--prefill-url", workers[0].url,
            "--decode-url", workers[1].url)

    async def streams(url: str, n: int, max_tokens: int) -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one() -> dict:
                payload = {"model": "tiny-llama", "prompt": "router restart", "stream": True,
                           "max_tokens": max_tokens, "ignore_eos": True}
                out = {"status": 0, "chunks": 0, "done": False}
                try:
                    async with session.post(f"{url}/completions", json=payload) as resp:
                        out["status"] = resp.status
                        async for raw in resp.content:
                            out["chunks"] += raw.startswith(b"data: {")
                            out["done"] |= raw.strip() == b"data: [DONE]"
                except aiohttp.ClientError as exc:  # the router died under it
                    out["cut"] = type(exc).__name__
                return out
            return list(await asyncio.gather(*(one() for _ in range(n))))

    async def serve_four(url: str) -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return list(await asyncio.gather(*(_one(session, url, time.monotonic())
                                               for _ in range(4))))

    first = second = None
    try:
        first = Proc(*args)
        url = first.wait_for(r"at (http://\S+/v1)").group(1)
        loop = asyncio.new_event_loop()
        inflight = loop.create_task(streams(url, 4, 1500))
        loop.run_until_complete(asyncio.sleep(3.0))  # streaming by now
        first.proc.send_signal(signal.SIGKILL)
        cut = loop.run_until_complete(inflight)
        loop.close()
        assert all(r["status"] == 200 and r["chunks"] > 0 and not r["done"] for r in cut), cut
        for w in workers:  # the workers aborted what the dead router had asked for
            state = wait_pools_full(w.url, key_of(secret).headers())
            assert state["full"], (w.role, state)
        start = time.monotonic()
        second = Proc(*args)
        url = second.wait_for(r"at (http://\S+/v1)").group(1)
        served = asyncio.run(serve_four(url))
        assert all(ok(r) for r in served), served
        assert time.monotonic() - start < 60
    finally:
        for p in (first, second):
            if p is not None and p.proc.poll() is None:
                p.stop()


def test_the_decode_side_switches_to_a_restarted_prefill_at_its_first_failed_send():
    """No heartbeats at all, so only the send can tell: the decode side has the old prefill
    instance's ranks cached, the instance restarts (a new bootstrap server on the same port, its
    rank at a new ZMQ endpoint), and the next request's transfer info, refused by the old
    endpoint, goes to the new one -- the request succeeds; the stale state is gone."""
    from pdsim.core.kvpoll import KVPoll
    from pdsim.deployment import TransferConfig
    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.transfer.mooncake import MooncakeKVManager
    from test_mooncake_transfer import Cluster, Rank

    config = TransferConfig(heartbeat_interval_s=0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    cluster = Cluster.start(1, 1, config=config)
    try:
        senders, receivers = cluster.transfer(1, [0, 1], [2, 3])
        assert all(e.poll() is KVPoll.Success for e in senders + receivers)
        decode = cluster.decode[0][1].decode
        (old,) = decode._registered
        # The prefill instance dies and comes back on the same bootstrap port.
        (_, dead), port = cluster.prefill[0], cluster.server.port
        dead.close()
        cluster.server.stop()
        cluster.server = BootstrapServer(port=port).start()
        rank = Rank.make(fill=cluster.full)
        fresh = MooncakeKVManager(rank.args, config)
        fresh.register_with_bootstrap("127.0.0.1", port)
        cluster.prefill = [(rank, fresh)]
        start = time.monotonic()
        senders, receivers = cluster.transfer(2, [4, 5, 6], [7, 8, 9])
        assert time.monotonic() - start < 5.0
        for end in senders + receivers:
            assert end.poll() is KVPoll.Success, end.failure_reason()
        assert decode._registered == {fresh.channel.endpoint} != {old}
        assert old not in decode._last_echo and old in decode._lost
    finally:
        cluster.close()
