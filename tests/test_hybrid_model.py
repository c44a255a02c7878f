"""The tiny hybrid model (sliding-window, linear-recurrence and full-attention layers) in the real
backend: greedy serving through the core scheduler against a full recompute of the model.

The reference runs the model over the whole sequence for every new token, without a cache: each
linear layer starts from zero state and sliding-window layers mask to the window, so it shares
nothing with the served path's paged KV, state slots or chunking.
"""

from __future__ import annotations

import pytest
import torch
from configs import scheduler_config

from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from runtime.executor import ModelExecutor
from runtime.model import AttentionMetadata, ModelConfig, PagedKVCache, build_model
from runtime.model.hybrid import with_state_slots
from runtime.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.real]

VOCAB = ByteTokenizer.vocab_size
CONFIG = ModelConfig.preset("tiny-hybrid")


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG, seed=5)


def reference_greedy(model, prompt, max_new):
    tokens, out = list(prompt), []
    for _ in range(max_new):
        meta = AttentionMetadata.without_cache([len(tokens)])
        hidden = model.hidden_states(torch.tensor(tokens), meta.positions(), meta, None)
        token = int(model.compute_logits(hidden[-1:])[0, :VOCAB].argmax())
        out.append(token)
        tokens.append(token)
    return out


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_preset_mixes_the_three_layer_kinds():
    assert CONFIG.layer_types == ("sliding_attention", "linear_attention", "full_attention",
                                  "linear_attention")
    assert CONFIG.kv_layers == (0, 2) and CONFIG.linear_layers == (1, 3)
    assert ModelConfig.from_hf_config(CONFIG.to_hf_config()) == CONFIG


def test_greedy_through_the_scheduler_equals_full_recompute(model):
    """Chunked prefill (8 tokens), batching and retraction under a small pool, prompts and outputs
    longer than the 16-token window: outputs equal the full recompute's, token for token, and
    every state slot comes back."""
    cfg = with_state_slots(scheduler_config(
        num_pages=20, page_size=4, max_running_requests=4, max_prefill_tokens=32,
        chunked_prefill_size=8, num_reserved_decode_tokens=2), CONFIG)
    assert cfg.state_slots == cfg.max_running_requests + cfg.pre_alloc_size
    sched = ColocatedScheduler(cfg)
    retractions = []
    retract = sched._retract_one
    sched._retract_one = lambda *a: retractions.append(1) or retract(*a)
    executor = ModelExecutor(model, num_pages=cfg.num_pages, page_size=cfg.page_size,
                             vocab_limit=VOCAB, state_slots=cfg.state_slots)
    executor.warmup()
    reqs = [Request(f"r{i}", 6 + 7 * i, 14, arrival_s=0.0, prompt_ids=prompt(6 + 7 * i, i))
            for i in range(5)]
    now = 0.0
    for r in reqs:
        sched.add_request(r, now)
    while not sched.is_idle:
        batch = sched.step(now)
        assert batch is not None, "the scheduler stalled"
        result = executor.forward(batch)
        now += result.duration_s
        sched.on_batch_done(batch, result, now)
    sched.check_pools_full()
    assert retractions, "the pool was meant to be too small for all five at once"
    for r in reqs:
        assert not r.error, r.error
        assert r.output_ids == reference_greedy(model, r.prompt_ids, 14), r.rid


def test_sliding_window_hides_tokens_beyond_it(model):
    """The sliding-window layer's output at the last token ignores a token more than 16 back,
    and sees one inside the window."""
    layer = model.model.layers[0].self_attn
    x = torch.randn(30, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.without_cache([30])

    def last(inputs):
        with torch.inference_mode():
            return layer(inputs, meta.positions(), meta, None)[-1]

    far, near = x.clone(), x.clone()
    far[29 - 16] += 1.0
    near[29 - 15] += 1.0
    assert torch.equal(last(far), last(x))
    assert not torch.allclose(last(near), last(x))


def test_state_slots_must_match_the_model():
    with pytest.raises(ValueError, match="state_slots=0; must be >= 1"):
        PagedKVCache.for_model(CONFIG, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        PagedKVCache.for_model(ModelConfig.preset("tiny-llama"), num_pages=4, page_size=4,
                               state_slots=2)
    with pytest.raises(ValueError, match="prefix_cache must be false"):
        with_state_slots(scheduler_config(num_pages=8, prefix_cache=True), CONFIG)
    plain = scheduler_config(num_pages=8)
    assert with_state_slots(plain, ModelConfig.preset("tiny-llama")) is plain


def test_bad_hybrid_config_is_named():
    with pytest.raises(ValueError, match="sliding_window=0"):
        CONFIG.with_(sliding_window=0)
    with pytest.raises(ValueError, match="layer_types.*one entry per layer"):
        CONFIG.with_(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="'moe'.*allowed"):
        CONFIG.with_(layer_types=("moe",) * 4)
