"""The radix prefix cache in the real servers (CPU, torch kernels, tiny Llama): a repeated prompt
takes its whole pages from the cache, reports them as OpenAI's `cached_tokens`, and generates the
greedy tokens a server without the cache generates; the same through a real PD pair (Mooncake
over loopback), where the decode side learns the hit from the KV metadata."""

from __future__ import annotations

import pytest
from openai import OpenAI

from runtime.openai.server import BackgroundServer
from runtime.serve_config import ServeConfig
from tests.pd_harness import body, generate, pd_config, start_worker, stop_workers, wait_healthy

PAGE = 8
PROMPT = "A long shared system prompt, then a question: what comes next?"


def whole_pages_short_of_last(prompt_tokens: int) -> int:
    """What a repeat of a prompt takes from the cache: its whole pages, short of its last token."""
    return (prompt_tokens - 1) // PAGE * PAGE


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


def complete_twice(disable_radix_cache: bool) -> list[tuple[list[int], int]]:
    """The same greedy completion twice, one after the other: (token ids, prompt tokens,
    cached tokens) of each."""
    cfg = ServeConfig(model="tiny-llama", num_pages=64, page_size=PAGE, port=0, seed=5,
                      scheduler=dict(chunked_prefill_size=32, disable_radix_cache=disable_radix_cache))
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
    plain = start_worker(pd_config("tiny-llama", prefill={"scheduler": {"disable_radix_cache": True}}),
                         "prefill")
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
