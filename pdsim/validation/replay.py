"""Replay a workload against a real OpenAI-compatible endpoint, open loop.

Request i is sent at `start + arrival_s[i]` whatever happened to the ones before it, with a
prompt of exactly `input_tokens[i]` token ids and `max_tokens = output_tokens[i]` with
`ignore_eos`, streamed; every token's arrival at the client is recorded. The result is one
`RequestRecord` per request on the client's clock (0 = the replay's start), the schema the
simulator writes, so both go through `pdsim.metrics.summarize`. Its `rid` is the id the server
streamed (the workers' records carry it too), or `replay-<i>` when none came.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import aiohttp
import numpy as np

from pdsim.core.records import RequestRecord

PROMPT_VOCAB = 256  # prompt ids are drawn below this: every servable preset's vocabulary holds them


def prompts(input_tokens: Sequence[int], seed: int) -> list[list[int]]:
    """One random prompt of exactly `n` token ids per request (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, PROMPT_VOCAB, int(n)).tolist() for n in input_tokens]


async def _one(session: aiohttp.ClientSession, url: str, model: str, rid: str,
               prompt: list[int], max_tokens: int, send_at: float, t0: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, send_at - (time.perf_counter() - t0)))
    arrival = time.perf_counter() - t0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    times: list[float] = []
    error = ""
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    rid = chunk.get("id") or rid
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        break
                    now = time.perf_counter() - t0
                    for choice in chunk.get("choices", []):
                        times.extend([now] * len(choice.get("token_ids") or []))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not error and len(times) != max_tokens:
        error = f"{len(times)} tokens streamed, {max_tokens} asked for"
    ok = not error
    return RequestRecord(
        rid=rid, input_tokens=len(prompt), output_tokens=len(times), status="ok" if ok else "failed",
        error=error, arrival_s=arrival, first_token_s=times[0] if times else float("nan"),
        finish_s=times[-1] if ok else time.perf_counter() - t0, token_times_s=times)


async def _replay(url, model, arrival_s, input_tokens, output_tokens, seed, timeout_s):
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        return await asyncio.gather(*(
            _one(session, url, model, f"replay-{i}", p, int(o), float(a), t0)
            for i, (a, p, o) in enumerate(zip(arrival_s, prompts(input_tokens, seed),
                                              output_tokens))))


def replay(url: str, model: str, arrival_s: Sequence[float], input_tokens: Sequence[int],
           output_tokens: Sequence[int], *, seed: int = 0,
           timeout_s: float = 600.0) -> list[RequestRecord]:
    """Send the workload to `url` (the API root, without /v1) and return its records."""
    return asyncio.run(_replay(url, model, arrival_s, input_tokens, output_tokens, seed,
                               timeout_s))
