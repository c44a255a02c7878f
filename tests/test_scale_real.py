"""Scaling a real deployment while it serves: `pdsim serve` (the launcher, its router and real
prefill and decode worker processes: HTTP, ZMQ, Mooncake over TCP, tiny-llama with random
weights) takes decode 1 -> 2 -> 1 and prefill 1 -> 2 -> 1 (both roles at once) through `POST
/scale` under a steady stream of requests. No request fails or is cut, every answer is the static deployment's
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
SERVED_BY_NEW = 2  # requests the added worker must have finished before it is removed


def _get(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())


async def _scale_under_load(base: str, headers: dict) -> tuple[list[dict], dict, list[dict]]:
    """The reference answers of the static deployment, then, under CLIENTS clients sending
    PROMPTS round and round, both roles scaled up, their new workers left to serve, both
    scaled down; returns every result, the reference token ids by prompt, and the /scale
    answers (decode up, prefill up, decode down, prefill down)."""
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

        async def scale(role: str, n: int) -> dict:
            async with session.post(f"{base}/scale", json={"role": role, "instances": n},
                                    headers=headers) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
                return answer

        async def steps() -> list[dict]:
            try:
                up = await asyncio.gather(scale("decode", 2), scale("prefill", 2))
                async with session.get(f"{base}/workers", headers=headers) as resp:
                    workers = (await resp.json())["workers"]
                for new in (w["url"] for w in workers if w["name"].endswith(" worker 1")):
                    deadline = time.monotonic() + 120  # let it serve before it goes
                    while await served_by(new) < SERVED_BY_NEW:
                        assert time.monotonic() < deadline, f"{new} served nothing"
                        await asyncio.sleep(0.2)
                down = await asyncio.gather(scale("decode", 1), scale("prefill", 1))
            finally:
                done.set()
            return [*up, *down]

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
    up_decode, up_prefill, down_decode, down_prefill = answers
    assert up_decode["instances"]["decode"] == 2 and up_prefill["instances"]["prefill"] == 2
    assert up_decode["drained"] == up_prefill["drained"] == []
    assert [d["name"] for d in down_decode["drained"]] == ["decode worker 1"]
    assert [d["name"] for d in down_prefill["drained"]] == ["prefill worker 1"]
    drained = down_decode["drained"] + down_prefill["drained"]
    assert all(d["pools"]["full"] for d in drained), drained  # checked before it was stopped
    assert [w["name"] for w in final] == ["prefill worker 0", "decode worker 0"]
    bad = [r for r in results
           if not (r["status"] == 200 and r["ended"] and r["error"] is None
                   and r["token_ids"] == reference[r["prompt"]])]
    assert not bad, bad
    assert len(results) >= 4 * SERVED_BY_NEW


AUTOSCALING = """autoscaling:
  policy: fixed
  interval_s: 1
  decode: {min_instances: 1, max_instances: 2}
  fixed:
    schedule:
    - {at_s: 0, prefill: 1, decode: 1}
    - {at_s: 2, prefill: 1, decode: 2}
"""


async def _serve_until_joined(base: str, headers: dict) -> list[dict]:
    """Two clients send PROMPTS until the policy's decode worker 1 has served SERVED_BY_NEW
    and the policy has observed it serving."""
    import aiohttp

    t0 = time.monotonic()
    results: list[dict] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client(k: int) -> None:
            i = k
            while not done.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                results.append(await stream_completion(session, f"{base}/v1", prompt,
                                                       MAX_TOKENS, t0))
                i += 1

        async def watch() -> None:
            try:
                while True:
                    assert time.monotonic() - t0 < 300, "decode worker 1 never served"
                    await asyncio.sleep(0.5)
                    async with session.get(f"{base}/workers", headers=headers) as resp:
                        workers = (await resp.json())["workers"]
                    new = [w["url"] for w in workers if w["name"] == "decode worker 1"]
                    if not new:
                        continue
                    async with session.get(f"{new[0]}/records", headers=headers) as resp:
                        served = len(await resp.json())
                    async with session.get(f"{base}/autoscaling", headers=headers) as resp:
                        seen = [d["observation"]["decode"]["running"]
                                for d in (await resp.json())["decisions"]]
                    if served >= SERVED_BY_NEW and 2 in seen:
                        return
            finally:
                done.set()

        await asyncio.gather(client(0), client(1), watch())
    return results


def test_pdsim_serve_with_an_autoscaling_section_follows_its_policy(tmp_path, monkeypatch):
    """The policy (a fixed schedule: decode 1, then 2 from 2 s on) runs every interval_s on
    observations of the real workers' load; the instance it adds serves, nothing fails."""
    from pd_harness import Proc
    from runtime.security import SECRET_ENV, key_of, new_secret

    cfg = tmp_path / "pd.yaml"
    cfg.write_text(tiny_pd_yaml(decode_pages=256, extra=AUTOSCALING))
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    headers = key_of(secret).headers()
    launcher = Proc(str(cfg))
    try:
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+)/v1").group(1)
        results = asyncio.run(_serve_until_joined(url, headers))
        auto = _get(f"{url}/autoscaling", headers)
    finally:
        assert launcher.stop() == 0
    assert auto["policy"] == "FixedSchedule" and auto["interval_s"] == 1
    decisions = auto["decisions"]
    targets = [(d["target"]["prefill"], d["target"]["decode"]) for d in decisions]
    assert targets[0] == (1, 1) and targets[-1] == (1, 2)
    assert targets == sorted(targets)  # (1, 1) until 2 s, then (1, 2) only
    observed = [d["observation"] for d in decisions]
    assert all(o["window_s"] >= 1.0 for o in observed)  # one interval, or a scaling's more
    assert any(o["decode"]["running"] == 2 for o in observed)
    assert any(o["decode"]["kv_usage"] > 0 for o in observed)  # from the workers' /metrics
    assert any(o["arrivals"] > 0 for o in observed)
    assert {o["mean_output_tokens"] for o in observed} - {None} == {MAX_TOKENS}
    bad = [r for r in results if not (r["status"] == 200 and r["ended"] and r["error"] is None
                                      and r["tokens"] == MAX_TOKENS)]
    assert not bad, bad
