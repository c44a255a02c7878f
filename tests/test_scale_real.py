"""Scaling a real deployment while it serves: `pdsim serve` (the launcher, its router and real
prefill and decode worker processes: HTTP, ZMQ, Mooncake over TCP, tiny-llama with random
weights) takes decode 1 -> 2 -> 1 and prefill 1 -> 2 -> 1 through `POST /scale` under a steady
stream of requests. No request fails or is cut, every answer is the static deployment's
(greedy), the added worker serves some, and every worker -- the drained ones before they are
stopped, the others at the end -- has all its pages and slots back."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from configs import tiny_pd_yaml
from stream_client import stream_completion

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS = [f"scale while serving {i}" for i in range(4)]
MAX_TOKENS = 8
CLIENTS = 3
STEPS = [("decode", 2), ("decode", 1), ("prefill", 2), ("prefill", 1)]
SERVED_BY_NEW = 2  # requests the added worker must have finished before it is removed


def _get(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())


async def _scale_under_load(base: str, headers: dict) -> tuple[list[dict], dict, list[dict]]:
    """The reference answers of the static deployment, then the steps under CLIENTS clients
    sending PROMPTS round and round; returns every result, the reference token ids by prompt,
    and the /scale answers."""
    import aiohttp

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        static = await asyncio.gather(*(stream_completion(session, f"{base}/v1", p, MAX_TOKENS,
                                                          t0) for p in PROMPTS))
        assert all(r["status"] == 200 and r["tokens"] == MAX_TOKENS for r in static), static
        reference = {p: r["token_ids"] for p, r in zip(PROMPTS, static)}
        results: list[dict] = []
        done = asyncio.Event()

        async def client(k: int) -> None:
            i = k
            while not done.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                results.append({**await stream_completion(session, f"{base}/v1", prompt,
                                                          MAX_TOKENS, t0), "prompt": prompt})
                i += 1

        async def served_by(url: str) -> int:
            async with session.get(f"{url}/records", headers=headers) as resp:
                return len(await resp.json())

        async def steps() -> list[dict]:
            answers = []
            try:
                for role, n in STEPS:
                    async with session.post(f"{base}/scale", json={"role": role, "instances": n},
                                            headers=headers) as resp:
                        answer = await resp.json()
                        assert resp.status == 200, answer
                    answers.append(answer)
                    if n == 2:  # let the new worker serve before it goes
                        new = next(w["url"] for w in answer["workers"]
                                   if w["name"] == f"{role} worker 1")
                        deadline = time.monotonic() + 120
                        while await served_by(new) < SERVED_BY_NEW:
                            assert time.monotonic() < deadline, f"{role} worker 1 served nothing"
                            await asyncio.sleep(0.2)
            finally:
                done.set()
            return answers

        *_, answers = await asyncio.gather(*(client(k) for k in range(CLIENTS)), steps())
    return results, reference, answers


def test_decode_and_prefill_scale_1_2_1_under_load_without_losing_a_request(tmp_path,
                                                                            monkeypatch):
    from pd_harness import Proc
    from runtime.security import SECRET_ENV, key_of, new_secret

    cfg = tmp_path / "pd.yaml"
    cfg.write_text(tiny_pd_yaml(decode_pages=256))
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)  # the deployment's: /scale and /pools need it
    headers = key_of(secret).headers()
    launcher = Proc(str(cfg))
    try:
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+)/v1").group(1)
        results, reference, answers = asyncio.run(_scale_under_load(url, headers))
        final = _get(f"{url}/workers", headers)["workers"]
        for w in final:  # the workers that stayed: nothing held
            assert _get(f"{w['url']}/pools", headers)["full"], w
        assert launcher.proc.poll() is None
    finally:
        assert launcher.stop() == 0
    assert [a["instances"] for a in answers] == [
        {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1},
        {"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 1}]
    drained = [d for a in answers for d in a["drained"]]
    assert [d["name"] for d in drained] == ["decode worker 1", "prefill worker 1"]
    assert all(d["pools"]["full"] for d in drained), drained  # checked before it was stopped
    assert [w["name"] for w in final] == ["prefill worker 0", "decode worker 0"]
    bad = [r for r in results
           if not (r["status"] == 200 and r["ended"] and r["error"] is None
                   and r["token_ids"] == reference[r["prompt"]])]
    assert not bad, bad
    assert len(results) >= 4 * SERVED_BY_NEW
