"""The real backend's model, tokenizer and sampler on tiny random models (CPU, torch kernels)."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.model.kv_cache import PagedKVCache
from runtime.model import AttentionMetadata, ModelConfig, build_model, load_model, save_safetensors
from runtime.sampler import filtered_probs, make_generator, sample
from runtime.sampling import SamplingParams
from runtime.tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, load_tokenizer

pytestmark = [pytest.mark.real, pytest.mark.slow]

PRESETS = ["tiny-llama", "tiny-mla"]


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return build_model(ModelConfig.preset(request.param), seed=7)


class Session:
    """Runs requests against one paged cache, handing out pages from a shuffled free list."""

    def __init__(self, model, num_pages=48, page_size=4, seed=0):
        self.model = model
        self.page_size = page_size
        self.kv = PagedKVCache.for_model(model.config, num_pages=num_pages, page_size=page_size)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def _meta(self, segments):
        for rid, tokens in segments:
            pages = self.pages.setdefault(rid, [])
            need = self.cached.get(rid, 0) + len(tokens)
            while len(pages) * self.page_size < need:
                pages.append(self.free.pop())
        return AttentionMetadata.build([len(t) for _, t in segments],
                                       [self.cached.get(rid, 0) for rid, _ in segments],
                                       [self.pages[rid] for rid, _ in segments], self.page_size)

    def step(self, segments):
        """Last-token logits `[S, vocab]` of segments `[(request id, new tokens)]`."""
        meta = self._meta(segments)
        ids = torch.tensor([t for _, tokens in segments for t in tokens])
        logits = self.model(ids, meta.positions(), meta, self.kv)
        self._advance(segments)
        return logits

    def all_logits(self, segments):
        meta = self._meta(segments)
        ids = torch.tensor([t for _, tokens in segments for t in tokens])
        hidden = self.model.hidden_states(ids, meta.positions(), meta, self.kv)
        self._advance(segments)
        return self.model.compute_logits(hidden)

    def _advance(self, segments):
        for rid, tokens in segments:
            self.cached[rid] = self.cached.get(rid, 0) + len(tokens)


def dense_logits(model, tokens):
    """Logits of every position, recomputed from scratch without any cache."""
    meta = AttentionMetadata.without_cache([len(tokens)])
    hidden = model.hidden_states(torch.tensor(tokens), meta.positions(), meta, None)
    return model.compute_logits(hidden)


def prompt(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- forward ----------------------------------------------------------------------------


def test_greedy_decode_with_cache_equals_recompute(model):
    tokens = prompt(7)
    session = Session(model)
    logits = session.step([("a", tokens)])
    for _ in range(18):
        reference = dense_logits(model, tokens)[-1]
        torch.testing.assert_close(logits[0], reference, atol=1e-4, rtol=1e-4)
        assert int(logits[0].argmax()) == int(reference.argmax())
        tokens.append(int(logits[0].argmax()))
        logits = session.step([("a", tokens[-1:])])
    assert len(tokens) == 7 + 18


def test_chunked_prefill_equals_one_shot(model):
    tokens = prompt(23, seed=1)
    one_shot = Session(model).all_logits([("a", tokens)])
    chunked_session = Session(model, seed=5)
    chunked = torch.cat([chunked_session.all_logits([("a", tokens[i: i + 5])])
                         for i in range(0, len(tokens), 5)])
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one_shot, dense_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_separate_runs(model):
    a, b, c = prompt(12, seed=2), prompt(6, seed=3), prompt(9, seed=4)
    mixed = Session(model)
    mixed.step([("a", a[:5])])
    mixed.step([("b", b), ("c", c)])
    # One request extends by a 7-token chunk between two requests decoding one token each.
    got = mixed.step([("b", [11]), ("a", a[5:]), ("c", [22])])

    expected = []
    for rid, history, new in [("b", [b], [11]), ("a", [a[:5]], a[5:]), ("c", [c], [22])]:
        alone = Session(model, seed=9)
        for chunk in history:
            alone.step([(rid, chunk)])
        expected.append(alone.step([(rid, new)])[0])
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-4, rtol=1e-4)


def test_first_token_decode_segment_without_cached_tokens(model):
    """A one-token prompt takes the decode kernel path with no cached context."""
    got = Session(model).step([("a", [42])])
    torch.testing.assert_close(got[0], dense_logits(model, [42])[0], atol=1e-5, rtol=1e-5)


def test_metadata_slots_and_positions():
    meta = AttentionMetadata.build([3, 1], [2, 5], [[7, 3], [4, 1]], page_size=4)
    assert meta.positions().tolist() == [2, 3, 4, 5]
    assert meta.out_slots.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 1 * 4 + 1]
    assert meta.context_lens == (5, 6)
    assert meta.last_token_indices().tolist() == [2, 3]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([3], [6], [[1, 2]], page_size=4)


def test_mla_without_q_lora_and_qwen2_bias_run():
    for cfg in (ModelConfig.preset("tiny-mla").with_(q_lora_rank=None, num_experts=0),
                ModelConfig.preset("tiny-llama").with_(qkv_bias=True, tie_word_embeddings=True)):
        model = build_model(cfg, seed=1)
        tokens = prompt(9, seed=6)
        session = Session(model)
        session.step([("a", tokens[:4])])
        logits = session.step([("a", tokens[4:])])
        torch.testing.assert_close(logits[0], dense_logits(model, tokens)[-1], atol=1e-4,
                                   rtol=1e-4)


def test_random_weights_depend_only_on_seed():
    cfg = ModelConfig.preset("tiny-llama")
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("cfg", [
    ModelConfig.preset("tiny-llama").with_(qkv_bias=True, tie_word_embeddings=True),
    ModelConfig.preset("tiny-mla"),
], ids=["qwen2-tied", "deepseek-moe"])
def test_safetensors_round_trip(cfg, tmp_path):
    model = build_model(cfg, seed=4)
    save_safetensors(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.with_(name=cfg.name) == cfg
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    if cfg.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = prompt(10, seed=8)
    torch.testing.assert_close(dense_logits(loaded, tokens), dense_logits(model, tokens))


def test_load_rejects_mismatched_checkpoint(tmp_path):
    save_safetensors(build_model(ModelConfig.preset("tiny-llama")), tmp_path)
    other = build_model(ModelConfig.preset("tiny-llama").with_(qkv_bias=True))
    from runtime.model import load_safetensors

    with pytest.raises(ValueError, match="missing .*q_proj.bias"):
        load_safetensors(other, tmp_path)


# ---- config -------------------------------------------------------------------------------


def test_from_hf_config_llama_qwen2_deepseek(tmp_path):
    llama = ModelConfig.from_hf_config(dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True, torch_dtype="bfloat16",
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)))
    assert (llama.head_dim, llama.num_kv_heads, llama.qkv_bias) == (64, 8, False)
    assert llama.rope_scaling.factor == 32.0
    assert llama.kv_bytes_per_token() == 16 * 2 * 8 * 64 * 2
    assert llama.kv_bytes_per_token(tp_size=4) == 16 * 2 * 2 * 64 * 2

    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, '
        '"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, '
        '"intermediate_size": 4864, "tie_word_embeddings": true, "torch_dtype": "bfloat16"}')
    qwen = ModelConfig.from_hf_config(tmp_path)
    assert qwen.qkv_bias and qwen.head_dim == 64 and qwen.tie_word_embeddings

    deepseek = ModelConfig.from_hf_config(dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        n_shared_experts=2, first_k_dense_replace=1, scoring_func="softmax",
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096)))
    assert deepseek.is_mla and deepseek.kv_cache_heads == 1
    assert deepseek.kv_bytes_per_token() == 27 * (512 + 64) * 2
    assert deepseek.is_moe_layer(1) and not deepseek.is_moe_layer(0)
    with pytest.raises(NotImplementedError, match="yarn"):
        build_model(deepseek.with_(num_layers=1, vocab_size=16, hidden_size=8, num_experts=0,
                                   num_heads=1, num_kv_heads=1, kv_lora_rank=4,
                                   qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2,
                                   intermediate_size=8, max_position=8))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})


def test_llama3_rope_scaling_model_runs():
    cfg = ModelConfig.preset("tiny-llama").with_(rope_scaling=ModelConfig.from_hf_config(dict(
        model_type="llama", vocab_size=8, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=1, intermediate_size=8,
        rope_scaling=dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
    )).rope_scaling)
    model = build_model(cfg)
    tokens = prompt(6)
    session = Session(model)
    session.step([("a", tokens[:3])])
    torch.testing.assert_close(session.step([("a", tokens[3:])])[0],
                               dense_logits(model, tokens)[-1], atol=1e-4, rtol=1e-4)


def test_presets_and_validation():
    llama, mla = ModelConfig.preset("tiny-llama"), ModelConfig.preset("tiny-mla")
    assert llama.vocab_size >= ByteTokenizer.vocab_size and mla.num_experts == 4
    assert ModelConfig.from_hf_config(mla.to_hf_config()).with_(name="tiny-mla") == mla
    assert ModelConfig.from_hf_config(llama.to_hf_config()).with_(name="tiny-llama") == llama
    with pytest.raises(ValueError, match="num_kv_heads=3; must divide num_heads=4"):
        llama.with_(num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("gpt-5")


# ---- tokenizer ----------------------------------------------------------------------------


TEXT = "héllo wörld, 你好 🎉!"


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(TEXT.encode())
    assert tok.decode(ids + [tok.eos_id]) == TEXT
    assert tok.encode("a", add_bos=False) == [97]


def test_stream_decoder_never_splits_a_character():
    tok = ByteTokenizer()
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(TEXT)]
    assert "".join(pieces) + stream.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)
    first_cjk = tok.encode(TEXT).index("你".encode()[0])
    assert pieces[first_cjk: first_cjk + 3] == ["", "", "你"]
    emoji = StreamDecoder(tok)
    assert [emoji.push(b) for b in "🎉".encode()] == ["", "", "", "🎉"]
    cut = StreamDecoder(tok)
    cut.push("é".encode()[0])
    assert cut.flush() == "\ufffd"


def test_hf_tokenizer_json(tmp_path):
    import tokenizers  # the optional HF path: installed with the test extra
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("hello world")
    assert ids == [1, 3, 4]
    assert tok.decode(ids + [2]) == "hello world"
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "hello world"


# ---- sampling -----------------------------------------------------------------------------


def logits_batch(rows=4, vocab=50):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_sampling_and_logprobs():
    logits = logits_batch()
    result = sample(logits, [SamplingParams()] * 4, [None] * 4)
    assert torch.equal(result.token_ids, logits.argmax(-1))
    expected = logits.log_softmax(-1).gather(-1, result.token_ids[:, None])[:, 0]
    torch.testing.assert_close(result.logprobs, expected)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = logits_batch()
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(4)]

    def draw(rows):
        gens = [make_generator(params[r].seed) for r in rows]
        out = []
        for _ in range(20):
            out.append(sample(logits[rows], [params[r] for r in rows], gens).token_ids.tolist())
        return out

    full = draw([0, 1, 2, 3])
    assert full == draw([0, 1, 2, 3])
    alone = draw([2])
    assert [step[2] for step in full] == [step[0] for step in alone]
    assert len({tuple(step) for step in full}) > 1


def test_top_k_and_top_p_filters():
    logits = logits_batch(1)[0]
    top3 = set(logits.topk(3).indices.tolist())
    params = SamplingParams(temperature=2.0, top_k=3, seed=1)
    gen = make_generator(1)
    drawn = {int(sample(logits[None], [params], [gen]).token_ids[0]) for _ in range(100)}
    assert drawn <= top3 and len(drawn) > 1
    only_best = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert int(only_best.argmax()) == int(logits.argmax()) and float(only_best.max()) == 1.0
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    kept = probs > 0
    assert logits.softmax(-1)[kept].sum() >= 0.5
    with pytest.raises(ValueError, match="no generator"):
        sample(logits[None], [SamplingParams(temperature=1.0)], [None])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
