"""Replay a workload against a real endpoint, open loop.

Request i is sent at `start + arrival_s[i]` whatever happened to the ones before it, with a
prompt of exactly `input_tokens[i]` tokens (pdsim.validation.prompts) and `output_tokens[i]` as
both the most and the fewest new tokens (`ignore_eos`, `min_tokens`), streamed; every token's
arrival at the client is recorded. Two APIs:

- `completions`: OpenAI `POST /v1/completions` (SGLang, vLLM, Dynamo, `pdsim serve`), the prompt
  as token ids or as text; `stream_options.include_usage` asks for the token counts, and
  `return_token_ids` (vLLM, `pdsim serve`) for how many tokens each chunk holds.
- `generate`: SGLang's native `POST /generate` with `input_ids`; each chunk's `meta_info` holds
  the prompt and (cumulative) completion token counts.

Each reply is a `RequestRecord` on the client's clock (0 = the replay's start), the schema the
simulator writes, so both go through `pdsim.metrics.summarize`; its token counts are the ones
the endpoint reported (`Reply` says whether it reported them). Its `rid` is the id the server
streamed (the workers' records carry it too), or `replay-<i>` when none came.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from pdsim.core.records import RequestRecord
from pdsim.validation.prompts import id_prompts
from pdsim.validation.timing import token_times

APIS = ("completions", "generate")


@dataclass(frozen=True)
class Reply:
    """One replayed request: its record and the token counts the endpoint reported (None: it
    reported none; the record then holds the client's own count)."""

    record: RequestRecord
    prompt_tokens: int | None
    completion_tokens: int | None


def _body(api: str, model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    if api == "generate":
        return {"input_ids": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


class _Stream:
    """What the chunks of one streamed reply said, chunk by chunk."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.chunk_times: list[float] = []  # one per chunk that carried tokens
        self.times: list[float] = []  # one per token, where each chunk's count is known
        self.counted_exactly = True
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error = ""

    def chunk(self, api: str, data: dict, now: float) -> None:
        if "error" in data:
            self.error = str(data["error"])[:200]
            return
        if api == "generate":
            meta = data.get("meta_info") or {}
            self.rid = str(meta.get("id") or self.rid)
            self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
            done = meta.get("completion_tokens")
            new = 0 if done is None else done - (self.completion_tokens or 0)
            self.completion_tokens = done if done is not None else self.completion_tokens
            self._add(new, now)
            return
        self.rid = data.get("id") or self.rid
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids")
            if ids is None:  # no per-chunk count: a chunk with text holds at least one token
                self.counted_exactly = False
                self._add(1 if choice.get("text") else 0, now)
            else:
                self._add(len(ids), now)
        if usage := data.get("usage"):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")

    def _add(self, new: int, now: float) -> None:
        if new > 0:
            self.chunk_times.append(now)
            self.times.extend([now] * new)

    def token_times(self) -> list[float]:
        """One time per token: the chunks' times, spread when the endpoint's count disagrees
        with what the chunks were counted to hold."""
        n = self.completion_tokens
        if n is None or (self.counted_exactly and n == len(self.times)):
            return self.times
        return token_times(self.chunk_times, n)[0]


async def _sse_chunks(content: aiohttp.StreamReader
                      ) -> AsyncIterator[tuple[float, list[bytes]]]:
    """The `data:` payloads of an SSE body but `[DONE]`, per read from the socket with the
    read's time: the client shares the machine with the server, so it takes whatever arrived
    at once in one go rather than awaiting it line by line."""
    partial = b""
    async for block in content.iter_any():
        now = time.perf_counter()
        *lines, partial = (partial + block).split(b"\n")
        chunks = [data for line in lines if line.startswith(b"data:")
                  and (data := line[5:].strip()) != b"[DONE]"]
        if chunks:
            yield now, chunks


async def _one(session: aiohttp.ClientSession, url: str, api: str, model: str, rid: str,
               prompt: list[int] | str, n_prompt: int, max_tokens: int, send_at: float,
               t0: float) -> Reply:
    await asyncio.sleep(max(0.0, send_at - (time.perf_counter() - t0)))
    arrival = time.perf_counter() - t0
    stream = _Stream(rid)
    path = "/generate" if api == "generate" else "/v1/completions"
    try:
        async with session.post(url + path, json=_body(api, model, prompt, max_tokens)) as resp:
            if resp.status != 200:
                stream.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for now, chunks in _sse_chunks(resp.content):
                    for data in chunks:
                        stream.chunk(api, json.loads(data), now - t0)
                        if stream.error:
                            break
                    if stream.error:
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    times = stream.token_times()
    ok = not stream.error and bool(times)
    if not stream.error and not times:
        stream.error = "no token streamed"
    record = RequestRecord(
        rid=stream.rid, input_tokens=stream.prompt_tokens or n_prompt,
        output_tokens=len(times), status="ok" if ok else "failed", error=stream.error,
        arrival_s=arrival, first_token_s=times[0] if times else float("nan"),
        finish_s=times[-1] if ok else time.perf_counter() - t0, token_times_s=times)
    return Reply(record, stream.prompt_tokens, stream.completion_tokens)


async def _replay(url, api, model, arrival_s, prompts, input_tokens, output_tokens, headers,
                  timeout_s):
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     headers=headers) as session:
        t0 = time.perf_counter()
        return await asyncio.gather(*(
            _one(session, url, api, model, f"replay-{i}", p, int(n), int(o), float(a), t0)
            for i, (a, p, n, o) in enumerate(zip(arrival_s, prompts, input_tokens,
                                                 output_tokens))))


def replay_endpoint(url: str, model: str, arrival_s: Sequence[float],
                    input_tokens: Sequence[int], output_tokens: Sequence[int], *,
                    api: str = "completions", prompts: Sequence[list[int] | str] | None = None,
                    api_key: str | None = None, seed: int = 0,
                    timeout_s: float = 600.0) -> list[Reply]:
    """Send the workload to `url` (the API root, without /v1). `prompts` default to random
    token ids of the input lengths (seeded); `generate` takes ids only."""
    if api not in APIS:
        raise ValueError(f"api {api!r}; allowed: {', '.join(APIS)}")
    prompts = id_prompts(input_tokens, seed) if prompts is None else prompts
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return asyncio.run(_replay(url.rstrip("/"), api, model, arrival_s, prompts, input_tokens,
                               output_tokens, headers, timeout_s))


def replay(url: str, model: str, arrival_s: Sequence[float], input_tokens: Sequence[int],
           output_tokens: Sequence[int], *, seed: int = 0,
           timeout_s: float = 600.0) -> list[RequestRecord]:
    """`replay_endpoint` on /v1/completions with token-id prompts: the records alone."""
    return [r.record for r in replay_endpoint(url, model, arrival_s, input_tokens, output_tokens,
                                              seed=seed, timeout_s=timeout_s)]
