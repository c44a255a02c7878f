"""Kernels: torch references against dense attention, Triton (interpreted on CPU) against them.

TRITON_INTERPRET must be set before `runtime.kernels.triton_kernels` is imported, because
`triton.jit` reads it at decoration time; `runtime.kernels` imports that module lazily, so
setting it here, at import time of this test module, is early enough.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime import kernels  # noqa: E402
from runtime.kernels import reference  # noqa: E402
from runtime.model.attention import AttentionMetadata, paged_attention  # noqa: E402

import triton  # noqa: E402,F401  (the real extra installs it; its interpreter runs on CPU)

pytestmark = [pytest.mark.real, pytest.mark.slow]


def _triton_module_interprets() -> bool:
    module = sys.modules.get("runtime.kernels.triton_kernels")
    if module is None:
        return True
    return type(module._store_rows_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True)
def _interpreted():
    if not _triton_module_interprets():
        pytest.fail("runtime.kernels.triton_kernels was imported before TRITON_INTERPRET=1 was "
                    "set, so its kernels would need a GPU: run this module in its own process")


def paged_setup(context_lens, page_size, kv_heads, dim, v_dim=None, seed=0, dtype=torch.float32):
    """Random K/V laid out in shuffled pages, plus each request's contiguous copy."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages_per_req) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_buf = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(num_pages, page_size, kv_heads, v_dim or dim, generator=gen).to(dtype)
    tables, start = [], 0
    for n in pages_per_req:
        tables.append(order[start: start + n])
        start += n
    width = max(pages_per_req)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    dense = []
    for n, table in zip(context_lens, tables):
        k = k_buf[table].flatten(0, 1)[:n]
        v = v_buf[table].flatten(0, 1)[:n]
        dense.append((k, v))
    return k_buf, v_buf, page_table, tables, dense


def dense_attention(q, k, v, scale, causal_offset=None):
    """Plain softmax attention: q `[n, H, D]`, k/v `[m, KVH, D]`, query i sees keys <= offset+i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        allowed = torch.arange(m)[None, :] <= causal_offset + torch.arange(n)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


CONTEXTS = [1, 5, 33, 70]


# ---- references against dense attention -------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_gqa_decode_equals_dense(page_size):
    heads, kv_heads, dim = 8, 2, 16
    k_buf, v_buf, table, _, dense = paged_setup(CONTEXTS, page_size, kv_heads, dim)
    q = torch.randn(len(CONTEXTS), heads, dim, generator=torch.Generator().manual_seed(1))
    out = reference.decode_attention_gqa(q, k_buf, v_buf, table, torch.tensor(CONTEXTS), 0.25)
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[i], dense_attention(q[i: i + 1], k, v, 0.25)[0])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_mla_decode_equals_dense(page_size):
    heads, lora, rope = 4, 32, 8
    latent, _, table, _, dense = paged_setup(CONTEXTS, page_size, 1, lora + rope)
    q = torch.randn(len(CONTEXTS), heads, lora + rope, generator=torch.Generator().manual_seed(2))
    out = reference.decode_attention_mla(q, latent, table, torch.tensor(CONTEXTS), lora, 0.3)
    for i, (k, _) in enumerate(dense):
        expected = dense_attention(q[i: i + 1], k, k[..., :lora], 0.3)[0]
        torch.testing.assert_close(out[i], expected)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_paged_attention_mixed_segments_equals_dense_causal(mla, page_size):
    """Extend segments (with and without cached tokens) and decode segments in one batch."""
    query_lens, contexts = [6, 1, 9, 1], [6, 13, 20, 1]
    heads, kv_heads, dim, lora = 4, (1 if mla else 2), 24, 16
    k_buf, v_buf, table, tables, dense = paged_setup(contexts, page_size, kv_heads, dim, seed=3)
    if mla:
        v_buf = k_buf[..., :lora]
    meta = AttentionMetadata.build(query_lens, [c - q for q, c in zip(query_lens, contexts)],
                                   tables, page_size)
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(4))

    def decode(q1, page_table, context_lens, max_len):
        if mla:
            return reference.decode_attention_mla(q1, k_buf, page_table, context_lens, lora, 0.2,
                                                  max_len)
        return reference.decode_attention_gqa(q1, k_buf, v_buf, page_table, context_lens, 0.2,
                                              max_len)

    out = paged_attention(q, meta, k_buf, v_buf, decode, 0.2)
    start = 0
    for n, ctx, (k, v) in zip(query_lens, contexts, dense):
        v = k[..., :lora] if mla else v
        expected = dense_attention(q[start: start + n], k, v, 0.2, causal_offset=ctx - n)
        torch.testing.assert_close(out[start: start + n], expected, atol=1e-5, rtol=1e-5)
        start += n


# ---- Triton (interpreted) against the references -----------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (8, 1, 16), (3, 3, 24)])
def test_triton_gqa_decode_matches_reference(page_size, heads, kv_heads, dim):
    contexts = torch.tensor(CONTEXTS)
    k_buf, v_buf, table, _, _ = paged_setup(CONTEXTS, page_size, kv_heads, dim, seed=page_size)
    q = torch.randn(len(CONTEXTS), heads, dim, generator=torch.Generator().manual_seed(5))
    expected = reference.decode_attention_gqa(q, k_buf, v_buf, table, contexts, 0.2)
    for splits in (1, 3):
        out = kernels.decode_attention_gqa(q, k_buf, v_buf, table, contexts, 0.2,
                                           backend="triton", num_splits=splits, block_n=16)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,lora,rope", [(4, 64, 16), (20, 48, 8)])
def test_triton_mla_decode_matches_reference(page_size, heads, lora, rope):
    contexts = torch.tensor(CONTEXTS)
    latent, _, table, _, _ = paged_setup(CONTEXTS, page_size, 1, lora + rope, seed=page_size)
    q = torch.randn(len(CONTEXTS), heads, lora + rope, generator=torch.Generator().manual_seed(6))
    expected = reference.decode_attention_mla(q, latent, table, contexts, lora, 0.15)
    for splits in (1, 2):
        out = kernels.decode_attention_mla(q, latent, table, contexts, lora, 0.15,
                                           backend="triton", num_splits=splits, block_n=16)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_triton_gqa_decode_half_precision():
    contexts = torch.tensor([3, 40])
    k_buf, v_buf, table, _, _ = paged_setup([3, 40], 8, 2, 32, seed=9, dtype=torch.float16)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(7)).half()
    expected = reference.decode_attention_gqa(q, k_buf, v_buf, table, contexts, 0.2)
    out = kernels.decode_attention_gqa(q, k_buf, v_buf, table, contexts, 0.2, backend="triton",
                                       num_splits=2, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("heads,dim", [(2, 16), (1, 80)])
def test_triton_store_kv_matches_reference(heads, dim):
    gen = torch.Generator().manual_seed(8)
    buffer = torch.randn(6, 4, heads, dim, generator=gen)
    new = torch.randn(7, heads, dim, generator=gen)
    slots = torch.tensor([0, 23, 5, 6, 7, 12, 19])
    expected = buffer.clone()
    reference.store_kv(expected, new, slots)
    kernels.store_kv(buffer, new, slots, backend="triton")
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mla"])
def test_model_decode_with_triton_kernels_matches_torch(preset, monkeypatch):
    from runtime.model.kv_cache import PagedKVCache
    from runtime.model import ModelConfig, build_model

    model = build_model(ModelConfig.preset(preset), seed=3)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0))

    def run(backend):
        monkeypatch.setenv(kernels.ENV_VAR, backend)
        kv = PagedKVCache.for_model(model.config, num_pages=8, page_size=4)
        tables = [[5, 2, 7], [1, 6, 0]]
        meta = AttentionMetadata.build([9, 2], [0, 0], tables, 4)
        model(ids, meta.positions(), meta, kv)
        meta = AttentionMetadata.build([1, 1], [9, 2], tables, 4)
        return model(torch.tensor([7, 9]), meta.positions(), meta, kv), kv

    (logits_t, kv_t), (logits_r, kv_r) = run("triton"), run("torch")
    torch.testing.assert_close(logits_t, logits_r, atol=1e-4, rtol=1e-4)
    for a, b in zip(kv_t.buffers, kv_r.buffers):
        torch.testing.assert_close(a, b)


# ---- dispatch -------------------------------------------------------------------------------


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.resolve_backend(cpu) == "torch"
    assert kernels.resolve_backend(torch.device("cuda")) == "triton"
    assert kernels.resolve_backend(torch.device("cuda"), "torch") == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.resolve_backend(cpu) == "triton"  # TRITON_INTERPRET=1 is set above
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="allowed: auto, triton, torch"):
        kernels.resolve_backend(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.resolve_backend(cpu, "triton")
