"""One streamed completion through a real router, as the fault and restart tests send it."""

from __future__ import annotations

import json
import time


async def stream_completion(session, url: str, prompt: str, max_tokens: int, t0: float) -> dict:
    """POST a streamed completion to `url`/completions (an aiohttp `session`): when it was sent
    and ended (s since `t0`), its HTTP status and Retry-After, the tokens streamed (their count
    and ids), the error it ended with (if any), and whether it ended at all (an error answer, or
    `[DONE]`)."""
    out = {"sent": time.monotonic() - t0, "status": 0, "retry_after": None, "tokens": 0,
           "token_ids": [], "error": None, "ended": False}
    payload = {"model": "tiny-llama", "prompt": prompt, "stream": True, "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with session.post(f"{url}/completions", json=payload) as resp:
        out["status"], out["retry_after"] = resp.status, resp.headers.get("Retry-After")
        if resp.status != 200:
            out["error"], out["ended"] = (await resp.json())["error"]["message"], True
        else:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["ended"] = True
                elif line.startswith("data:"):
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]["message"]
                    else:
                        ids = chunk["choices"][0].get("token_ids") or ()
                        out["tokens"] += len(ids)
                        out["token_ids"].extend(ids)
    out["end"] = time.monotonic() - t0
    return out
