"""The radix prefix cache with the real executor (CPU, torch kernels): prompts that reuse cached
pages generate exactly the greedy tokens they generate without the cache."""

from __future__ import annotations

import pytest
import torch
from configs import scheduler_config

from pdsim.core.radix import token_page_keys
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from runtime.executor import ModelExecutor
from runtime.model import ModelConfig, build_model
from runtime.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.real, pytest.mark.slow]

VOCAB = ByteTokenizer.vocab_size
PAGE = 4


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mla"])
def model(request):
    return build_model(ModelConfig.preset(request.param), seed=3)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = [tokens(13, 100), tokens(22, 101)]  # two system prompts, not page multiples


def waves(prefix_cache: bool, model, num_pages: int):
    """Two waves of requests over two shared prefixes, the second after the first finished (so
    it finds their prompts cached); returns (outputs by rid, cached tokens by rid)."""
    cfg = scheduler_config(num_pages, page_size=PAGE, max_running_requests=8,
                           max_prefill_tokens=48, chunked_prefill_size=8,
                           num_reserved_decode_tokens=2, prefix_cache=prefix_cache)
    sched = ColocatedScheduler(cfg)
    executor = ModelExecutor(model, num_pages=num_pages, page_size=PAGE, vocab_limit=VOCAB)
    now, reqs = 0.0, []
    for wave in range(2):
        for k in range(2):
            prompt = SHARED[k % 2] + tokens(3 + k + wave, 10 * wave + k)
            r = Request(f"w{wave}r{k}", len(prompt), 6, arrival_s=now, prompt_ids=prompt,
                        prefix_keys=token_page_keys(prompt, PAGE))
            sched.add_request(r, now)
            reqs.append(r)
        while not sched.is_idle:
            batch = sched.step(now)
            assert batch is not None, "the scheduler stalled"
            result = executor.forward(batch)
            now += result.duration_s
            sched.on_batch_done(batch, result, now)
    sched.check_pools_full()
    assert all(not r.error and r.num_output == 6 for r in reqs)
    return {r.rid: r.output_ids for r in reqs}, {r.rid: r.cached_tokens for r in reqs}


def test_cached_greedy_output_equals_uncached(model):
    """A pool of 12 pages: the second wave evicts the first wave's cached tails."""
    plain, none_cached = waves(False, model, 12)
    cached, hits = waves(True, model, 12)
    assert not any(none_cached.values())
    assert sum(hits.values()) > 0
    assert cached == plain
