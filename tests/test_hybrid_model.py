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
from core_loop import drive

from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from runtime.executor import ModelExecutor
from runtime.model import AttentionMetadata, ModelConfig, build_model
from runtime.model.hybrid import recurrent_state_for, with_state_slots
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
    drive(sched, executor, reqs)
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
        recurrent_state_for(CONFIG, 0)
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        recurrent_state_for(ModelConfig.preset("tiny-llama"), 2)
    assert recurrent_state_for(CONFIG, 3, tp_size=2).tensor.shape == (3, 2, 1, 704)
    assert not with_state_slots(scheduler_config(num_pages=8, prefix_cache=True),
                                CONFIG).prefix_cache
    plain = scheduler_config(num_pages=8)
    assert with_state_slots(plain, ModelConfig.preset("tiny-llama")) is plain


def test_bad_hybrid_config_is_named():
    with pytest.raises(ValueError, match="sliding_window=0"):
        CONFIG.with_(sliding_window=0)
    with pytest.raises(ValueError, match="layer_types.*one entry per layer"):
        CONFIG.with_(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="'moe'.*allowed"):
        CONFIG.with_(layer_types=("moe",) * 4)


def _args(tp_rank, tp_size, *, state_layers=2, heads=2, head_bytes=16, slots=4):
    from runtime.transfer.layout import KVArgs

    slot = state_layers * heads // tp_size * head_bytes
    page = 64 // tp_size  # 4 tokens x this rank's KV heads x 8 bytes
    return KVArgs(kv_data_ptrs=[1 << 20], kv_data_lens=[4 * page], kv_item_lens=[page],
                  metadata_ptr=1 << 30, metadata_len=64, metadata_item_len=64, page_size=4,
                  kv_dtype="float32", tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=2,
                  kv_heads_per_rank=2 // tp_size, state_ptr=1000 * (tp_rank + 1),
                  state_len=slots * slot, state_slot_len=slot, state_layers=state_layers,
                  total_state_heads=heads)


def _register(args):
    from runtime.protocol.transfer import RegisterDecode

    return RegisterDecode(
        session_id="d:1", endpoint="tcp://d:2", tp_rank=args.tp_rank, tp_size=args.tp_size,
        kv_data_ptrs=list(args.kv_data_ptrs), kv_data_lens=list(args.kv_data_lens),
        kv_item_lens=list(args.kv_item_lens), metadata_ptr=args.metadata_ptr,
        metadata_len=args.metadata_len, metadata_item_len=args.metadata_item_len,
        page_size=args.page_size, kv_dtype=args.kv_dtype, is_mla=False, total_kv_heads=2,
        kv_heads_per_rank=args.kv_heads_per_rank, state_ptr=args.state_ptr,
        state_len=args.state_len, state_slot_len=args.state_slot_len,
        state_layers=args.state_layers, total_state_heads=args.total_state_heads)


def test_state_moves_whole_at_equal_tp_and_as_head_slices_at_tp2_to_1():
    """Decode tp 1 holds 2 layers x 2 heads of 16 bytes per slot (64 bytes); a tp-2 prefill rank
    holds 1 head per layer (32-byte slots) and writes it at its head's offset in each layer."""
    from runtime.transfer.layout import state_descriptors
    from runtime.transfer.prefill import plan_peer

    decode = _register(_args(0, 1))
    same = plan_peer(_args(0, 1), decode)
    assert same.state_piece is None
    assert state_descriptors(1000, 64, decode.state_ptr, 64, 2, [3], [1], None) == \
        ([1000 + 3 * 64], [1000 + 64], [64])
    for rank in (0, 1):
        local = _args(rank, 2)
        plan = plan_peer(local, decode)
        srcs, dsts, lens = state_descriptors(local.state_ptr, 32, decode.state_ptr, 64, 2, [3],
                                             [1], plan.state_piece)
        assert srcs == [local.state_ptr + 3 * 32, local.state_ptr + 3 * 32 + 16]
        assert dsts == [1000 + 64 + rank * 16, 1000 + 64 + 32 + rank * 16]
        assert lens == [16, 16]


def test_a_decode_rank_with_another_state_layout_is_refused():
    from runtime.transfer.prefill import plan_peer

    with pytest.raises(ValueError, match="recurrent state state_layers: prefill 2, decode 3"):
        plan_peer(_args(0, 1), _register(_args(0, 1, state_layers=3)))
    with pytest.raises(ValueError, match="recurrent-state heads differ"):
        plan_peer(_args(0, 1), _register(_args(0, 1, head_bytes=8)))
