"""Hundreds of concurrent streaming clients through the router in front of real prefill and
decode workers (Mooncake over TCP): every request completes with all its tokens, and the
workers' pools are full again afterwards."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from pd_harness import Proc
from runtime.security import SECRET_ENV, ClusterKey, new_secret

pytestmark = [pytest.mark.real, pytest.mark.slow]

CONFIG = """\
model: tiny-llama
seed: 0
device: cpu
cluster:
  mode: disaggregated
  prefill:
    threads: 1
    scheduler: &knobs {page_size: 8, num_pages: 1024, metadata_slots: 256,
                       max_running_requests: 128, max_prefill_tokens: 1024,
                       chunked_prefill_size: 256, num_reserved_decode_tokens: 8}
  decode: {threads: 1, scheduler: {<<: *knobs, pre_alloc_size: 64}}
router: {port: 0, policy: least_loaded}
"""
N = 300
TOKENS = 6
SECRET = new_secret()  # the deployment's: the workers' /pools and /records need its token


def get(url: str) -> dict:
    request = urllib.request.Request(url, headers=ClusterKey.from_secret(SECRET).headers())
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def test_three_hundred_concurrent_streams_through_real_workers(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(CONFIG)
    launcher = Proc(str(cfg))
    try:
        prefill = launcher.wait_for(r"prefill worker 0 \(tiny-llama, tp 1\) at (http://[^\s,]+)")
        decode = launcher.wait_for(r"decode worker 0 \(tiny-llama, tp 1\) at (http://[^\s,]+)")
        url = launcher.wait_for(r"at (http://\S+/v1)$").group(1)
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str | None, int]:
            stream = await client.completions.create(
                model="tiny-llama", prompt=f"request {i} " * (1 + i % 7), max_tokens=TOKENS,
                temperature=0, stream=True, extra_body={"ignore_eos": True,
                                                        "return_token_ids": True})
            finish, tokens = None, 0
            async for chunk in stream:
                tokens += len(chunk.choices[0].token_ids or [])
                finish = chunk.choices[0].finish_reason or finish
            return finish, tokens

        async def all_of_them():
            return await asyncio.gather(*(one(i) for i in range(N)))

        results = asyncio.run(all_of_them())
        assert results == [("length", TOKENS)] * N  # none lost, none short
        for worker in (prefill.group(1), decode.group(1)):
            assert get(worker + "/pools")["full"], get(worker + "/pools")
        done = get(decode.group(1) + "/records")
        assert len(done) == N and all(r["status"] == "ok" for r in done)
        assert all(r["output_tokens"] == TOKENS for r in done)
    finally:
        assert launcher.stop() == 0
