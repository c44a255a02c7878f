"""Speculative decoding on the real model (runtime/speculative.py, runtime/model/draft.py):
greedy output identical to the target's own greedy decoding, drafts accepted or rejected."""

import pytest
import torch

from runtime.executor import ModelExecutor
from runtime.model import AttentionMetadata, PRESETS, build_model
from runtime.model.draft import build_draft
from runtime.speculative import SpeculativeDecoder

pytestmark = pytest.mark.real

PROMPTS = [[1, 2, 3], [7] * 9, list(range(40, 60)), [300, 5, 300, 5, 300]]
NEW_TOKENS = 12
PAGE_SIZE = 4
NUM_PAGES = 64


def reference(model, prompt, new_tokens):
    """Greedy decoding by recomputing the whole sequence without a cache each step."""
    seq = list(prompt)
    for _ in range(new_tokens):
        meta = AttentionMetadata.without_cache([len(seq)])
        logits = model(torch.tensor(seq), meta.positions(), meta, None)
        seq.append(int(logits[0].argmax()))
    return seq[len(prompt):]


def setup(preset):
    model = build_model(PRESETS[preset], seed=3)
    executor = ModelExecutor(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    return model, executor


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mla"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_draft_output_equals_greedy(preset, k):
    model, executor = setup(preset)
    decoder = SpeculativeDecoder(executor, build_draft(model, seed=5), k, range(NUM_PAGES))
    got = decoder.generate(PROMPTS, NEW_TOKENS)
    assert got == [reference(model, p, NEW_TOKENS) for p in PROMPTS]
    stats = decoder.stats
    assert stats.verify_steps >= len(PROMPTS) * (NEW_TOKENS - 1) / (k + 1)
    assert 0 <= stats.mean_accepted_drafts <= k
    assert sorted(decoder.free_pages) == list(range(NUM_PAGES))  # every page came back
    print(f"{preset} k={k}: {stats.mean_accepted_drafts:.2f} drafts accepted per verify step")


class OracleDraft:
    """Proposes the reference continuation, wrong wherever position % 3 == 0, so verify steps
    accept 0..k drafts."""

    def __init__(self, prompt, ref):
        self.prompt, self.ref = prompt, ref

    def propose(self, hidden, tokens, positions, k, vocab_limit=None):
        start = int(positions[0]) - len(self.prompt) + 1  # index in ref of the first draft
        out = []
        for j in range(k):
            i = start + j
            tok = self.ref[i] if i < len(self.ref) else 0
            out.append((tok + 1) % 512 if (i + len(self.prompt)) % 3 == 0 else tok)
        return torch.tensor([out])


def test_accepted_and_rejected_drafts_keep_greedy_output():
    model, executor = setup("tiny-llama")
    k = 3
    for prompt in PROMPTS:
        ref = reference(model, prompt, NEW_TOKENS)
        decoder = SpeculativeDecoder(executor, OracleDraft(prompt, ref), k, range(NUM_PAGES))
        assert decoder.generate([prompt], NEW_TOKENS) == [ref]
        lens = decoder.stats.accept_lens
        assert 0 < decoder.stats.accepted_drafts and min(lens) < k  # both paths ran
        assert len(lens) < NEW_TOKENS - 1  # fewer forwards than plain decoding


def test_hybrid_refused():
    model = build_model(PRESETS["tiny-hybrid"], seed=0)
    executor = ModelExecutor(model, num_pages=8, page_size=4, state_slots=2)
    with pytest.raises(ValueError, match="recurrent state"):
        SpeculativeDecoder(executor, None, 2, range(8))


def test_bad_arguments():
    model, executor = setup("tiny-llama")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeDecoder(executor, build_draft(model), 0, range(NUM_PAGES))
    decoder = SpeculativeDecoder(executor, build_draft(model), 2, range(2))
    with pytest.raises(RuntimeError, match="out of KV pages"):
        decoder.generate([list(range(20))], 4)
