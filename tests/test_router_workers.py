"""Workers join and leave the PD router while it serves (`/workers`, runtime/router_control.py),
against scripted workers (tests/test_router.py's) on loopback: a joined worker takes requests,
a removed one drains (no new requests; its streams and prefill calls finish) before the call
returns, bad input is a clear 4xx, and the routes take the cluster token, never the API key.
tests/test_scale_real.py scales real workers under load."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from pdsim.deployment import Deployment
from runtime.openai.protocol import Limits
from runtime.router import PDRouter, WorkerAddress
from runtime.security import AUTH_HEADER, ClusterKey, new_secret
from runtime.tokenizer import ByteTokenizer
from test_router import ScriptedWorker

pytestmark = [pytest.mark.real]

KEY = ClusterKey.from_secret(new_secret())
TOKEN = KEY.headers()


class SlowPrefill(ScriptedWorker):
    """A prefill worker whose calls take `delay_s` (its KV on the way)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__("prefill")
        self.delay_s = delay_s
        self.done: list[str] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generated.append(body)
        await asyncio.sleep(self.delay_s)
        self.done.append(body["rid"])
        return web.json_response({"rid": body["rid"], "status": "ok"})


async def started(*workers: ScriptedWorker):
    for w in workers:
        await w.start()
    return workers


def make_router(prefill, decode, api_key: str | None = None, *, start: bool = True):
    """A router with the cluster key in front of scripted workers; started (a coroutine to
    await) unless `start` is False (then the caller protects and starts it)."""
    router = PDRouter([WorkerAddress(w.url, "127.0.0.1", 9999) for w in prefill],
                      [WorkerAddress(w.url) for w in decode], Deployment(),
                      tokenizer=ByteTokenizer(), model_name="tiny",
                      limits=Limits(max_model_len=4096, pool_tokens=4096, max_position=4096,
                                    model_vocab=512), cluster_key=KEY)
    if not start:
        return router

    async def started_router() -> PDRouter:
        router.protect(api_key=api_key)
        await router.start()
        return router

    return started_router()


async def complete(session: aiohttp.ClientSession, router: PDRouter, prompt: str,
                   headers: dict | None = None) -> tuple[int, str]:
    """A streamed completion: its status and text (the scripted decode echoes the prompt)."""
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": len(prompt), "stream": True}
    async with session.post(f"{router.url}/v1/completions", json=payload,
                            headers=headers) as resp:
        if resp.status != 200:
            return resp.status, ""
        text = ""
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
        return 200, text


async def call(session, router, method: str, path: str, body: dict | None = None,
               headers: dict | None = None) -> tuple[int, dict]:
    async with session.request(method, router.url + path, json=body,
                               headers=TOKEN if headers is None else headers) as resp:
        return resp.status, await resp.json()


async def cleanup(router: PDRouter, *workers: ScriptedWorker) -> None:
    await router.close()
    for w in workers:
        await w.runner.cleanup()


def test_a_decode_worker_joins_and_takes_requests_then_drains_its_streams_and_leaves():
    async def main():
        pre, d0, d1 = await started(ScriptedWorker("prefill"), ScriptedWorker("decode"),
                                    ScriptedWorker("decode", token_delay_s=0.05))
        router = await make_router([pre], [d0])
        try:
            async with aiohttp.ClientSession() as s:
                status, entry = await call(s, router, "POST", "/workers",
                                           {"role": "decode", "url": d1.url + "/"})
                assert status == 200, entry
                assert entry == {"name": "decode worker 1", "role": "decode", "url": d1.url,
                                 "state": "serving", "requests": 0}
                # round robin over both: two requests, one each; d1 streams slowly
                slow = [asyncio.create_task(complete(s, router, f"stream {i}"))
                        for i in range(4)]
                while len(d1.generated) < 2:
                    await asyncio.sleep(0.01)
                assert len(d0.generated) == 2
                removal = asyncio.create_task(call(s, router, "POST", "/workers/remove",
                                                   {"url": d1.url}))
                await asyncio.sleep(0.05)
                assert not removal.done()  # its two streams are still running
                status, listing = await call(s, router, "GET", "/workers")
                states = {w["url"]: (w["state"], w["requests"]) for w in listing["workers"]}
                assert states[d1.url] == ("draining", 2), listing
                # requests sent while it drains go to d0 alone
                during = await asyncio.gather(*(complete(s, router, f"more {i}")
                                                for i in range(3)))
                assert all(r == (200, f"more {i}") for i, r in enumerate(during)), during
                assert len(d1.generated) == 2
                status, left = await removal
                assert status == 200 and left["state"] == "left" and left["requests"] == 0
                results = await asyncio.gather(*slow)
                assert results == [(200, f"stream {i}") for i in range(4)]  # none cut
                status, listing = await call(s, router, "GET", "/workers")
                assert [w["url"] for w in listing["workers"]] == [pre.url, d0.url]
                assert not d1.aborted
                assert router.client.loads() == ([0], [0])
                records = list(router.records)
                assert all(r.ok for r in records) and len(records) == 7
                assert sorted(r.decode_instance for r in records) == [0] * 5 + [1] * 2
        finally:
            await cleanup(router, pre, d0, d1)

    asyncio.run(main())


def test_a_prefill_worker_drains_its_prefill_calls_before_it_leaves():
    async def main():
        # as on real workers, the decode side's stream starts once the KV is in (held here
        # longer than the prefill calls take)
        p0, p1, dec = await started(SlowPrefill(0.0), SlowPrefill(0.4),
                                    ScriptedWorker("decode", hold_s=0.6))
        router = await make_router([p0], [dec])
        try:
            async with aiohttp.ClientSession() as s:
                status, entry = await call(s, router, "POST", "/workers", {
                    "role": "prefill", "url": p1.url, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": 7777})
                assert status == 200 and entry["name"] == "prefill worker 1", entry
                sent = [asyncio.create_task(complete(s, router, f"p{i}")) for i in range(4)]
                while len(p1.generated) < 2:
                    await asyncio.sleep(0.01)
                assert {b["bootstrap_port"] for b in p1.generated} == {7777}
                start = time.monotonic()
                status, left = await call(s, router, "POST", "/workers/remove", {"url": p1.url})
                assert status == 200 and left["state"] == "left"
                assert len(p1.done) == 2  # it left only once both prefill calls returned
                assert time.monotonic() - start > 0.2
                assert await asyncio.gather(*sent) == [(200, f"p{i}") for i in range(4)]
                assert (await complete(s, router, "after")) == (200, "after")
                assert len(p1.generated) == 2 and len(p0.generated) == 3
        finally:
            await cleanup(router, p0, p1, dec)

    asyncio.run(main())


def test_bad_worker_changes_are_4xx_errors_naming_what_is_wrong():
    async def main():
        pre, dec, other = await started(ScriptedWorker("prefill"), ScriptedWorker("decode"),
                                        ScriptedWorker("decode"))
        router = await make_router([pre], [dec])
        try:
            async with aiohttp.ClientSession() as s:
                cases = [
                    ("/workers", {"url": other.url}, 400, "role: missing"),
                    ("/workers", {"role": "decode", "url": other.url, "x": 1}, 400,
                     "unknown field 'x'; allowed: role, url, bootstrap_host, bootstrap_port"),
                    ("/workers", {"role": "colocated", "url": other.url}, 400,
                     "role: 'colocated'; allowed: prefill, decode"),
                    ("/workers", {"role": "decode", "url": "tcp://h:1"}, 400,
                     "allowed: http://HOST:PORT"),
                    ("/workers", {"role": "decode", "url": other.url + "/v1"}, 400,
                     "allowed: http://HOST:PORT"),
                    ("/workers", {"role": "decode", "url": 5}, 400, "url: 5; allowed: a str"),
                    ("/workers", {"role": "prefill", "url": other.url,
                                  "bootstrap_port": 5}, 400, "give both or neither"),
                    ("/workers", {"role": "decode", "url": other.url,
                                  "bootstrap_host": "h", "bootstrap_port": 5}, 400,
                     "a decode worker has no bootstrap server"),
                    ("/workers", {"role": "prefill", "url": other.url}, 400,
                     "its /health names role 'decode', not 'prefill'"),
                    ("/workers", {"role": "decode", "url": "http://127.0.0.1:9"}, 400,
                     "cannot join as a decode worker: unreachable"),
                    ("/workers", {"role": "decode", "url": dec.url}, 409,
                     "already a worker of this router"),
                    ("/workers/remove", {"url": other.url}, 404,
                     "is not a worker of this router"),
                    ("/workers/remove", {"url": dec.url}, 409,
                     "decode worker 0 is the last decode worker serving"),
                    ("/workers/remove", [dec.url], 400, "the body is a JSON list"),
                ]
                for path, body, status, message in cases:
                    got, answer = await call(s, router, "POST", path, body)
                    assert got == status and message in answer["error"]["message"], (
                        body, answer)
                async with s.post(router.url + "/workers", data=b"{", headers=TOKEN) as resp:
                    assert resp.status == 400
                    assert "not valid JSON" in (await resp.json())["error"]["message"]
                _, listing = await call(s, router, "GET", "/workers")
                assert len(listing["workers"]) == 2  # nothing changed
        finally:
            await cleanup(router, pre, dec, other)

    asyncio.run(main())


def test_the_worker_routes_take_the_cluster_token_and_never_the_api_key():
    async def main():
        pre, dec = await started(ScriptedWorker("prefill"), ScriptedWorker("decode"))
        router = await make_router([pre], [dec], api_key="public-key")
        bearer = {"Authorization": "Bearer public-key"}
        try:
            async with aiohttp.ClientSession() as s:
                for headers in ({}, bearer, {AUTH_HEADER: "0" * 64}):
                    for method, path in (("GET", "/workers"), ("POST", "/workers"),
                                         ("POST", "/workers/remove")):
                        status, answer = await call(s, router, method, path, {}, headers)
                        assert status == 401, (headers, path, answer)
                        assert AUTH_HEADER in answer["error"]["message"]
                assert (await call(s, router, "GET", "/workers"))[0] == 200
                # the public API still wants the key, and not the token
                assert (await complete(s, router, "hi", TOKEN))[0] == 401
                assert await complete(s, router, "hi", bearer) == (200, "hi")
        finally:
            await cleanup(router, pre, dec)

    asyncio.run(main())
