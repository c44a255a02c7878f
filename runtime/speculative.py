"""Greedy speculative decoding on the real model: an MTP draft head (runtime/model/draft.py)
proposes `k` tokens per request, and the target verifies them in one extend forward of `k + 1`
tokens against the paged KV cache.

A verify step of a request with `kv_len` cached tokens and pending token `t` (its last output,
not yet in the cache) feeds `[t, d_1..d_k]` at positions `kv_len..kv_len + k`; the target's
greedy tokens `g_0..g_k` at those positions accept the longest prefix with `d_{i+1} == g_i`
(say `n` drafts), and the step emits `d_1..d_n, g_n`. The cache then holds `kv_len + n + 1`
valid tokens; the rejected drafts' slots are stale and are overwritten by the next step, and the
pages that only they used go back to the free list. The target's hidden state at the last
accepted position feeds the next draft. So the output is exactly the target's greedy output,
whatever the draft proposes.

Scope: greedy requests run to `max_new_tokens` in one batch here (`SpeculativeDecoder.generate`);
the core scheduler's running batch, the serving engine and PD do not speculate yet. Models with
a recurrent state (hybrid) are refused: rolling a recurrent state back needs a snapshot per
draft position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.executor import ModelExecutor
from runtime.model import AttentionMetadata
from runtime.model.draft import MTPDraft


@dataclass(slots=True)
class AcceptanceStats:
    """Verify steps run and the drafts they accepted (per request step, not per batch)."""

    num_draft_tokens: int
    verify_steps: int = 0
    accepted_drafts: int = 0
    accept_lens: list[int] = field(default_factory=list)  # drafts accepted by each step

    @property
    def mean_accepted_drafts(self) -> float:
        """Accepted drafts per verify step (0..k)."""
        return self.accepted_drafts / self.verify_steps if self.verify_steps else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token), the
        simulator's `speculative.acceptance.mean_accept_len`."""
        return self.mean_accepted_drafts + 1.0

    def record(self, accepted: int) -> None:
        self.verify_steps += 1
        self.accepted_drafts += accepted
        self.accept_lens.append(accepted)


class SpeculativeDecoder:
    """Greedy generation with `num_draft_tokens` MTP drafts per step, on `executor`'s model and
    paged cache; `free_pages` are the cache pages it may use (it takes and returns them)."""

    def __init__(self, executor: ModelExecutor, draft: MTPDraft, num_draft_tokens: int,
                 free_pages: Sequence[int]) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}; must be >= 1")
        if executor.kv.state:
            raise ValueError(f"model {executor.config.name!r} keeps a recurrent state; "
                             "speculative decoding supports attention-only models")
        self.executor, self.draft, self.k = executor, draft, num_draft_tokens
        self.page_size = executor.page_size
        self.free_pages = list(free_pages)
        self.stats = AcceptanceStats(num_draft_tokens)

    def _pages_for(self, pages: list[int], tokens: int) -> None:
        """Grow or shrink `pages` to exactly cover `tokens` slots."""
        need = -(-tokens // self.page_size)
        while len(pages) < need:
            if not self.free_pages:
                raise RuntimeError(f"out of KV pages: a request needs {need} for {tokens} tokens")
            pages.append(self.free_pages.pop())
        while len(pages) > need:
            self.free_pages.append(pages.pop())

    def _hidden(self, ids: list[int], query_lens: list[int], cached_lens: list[int],
                tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and greedy next tokens of every fed token."""
        ex = self.executor
        meta = AttentionMetadata.build(query_lens, cached_lens, tables, self.page_size,
                                       device=ex.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=ex.device)
        hidden = ex.model.hidden_states(input_ids, meta.positions(), meta, ex.kv)
        logits = ex.model.compute_logits(hidden)
        if ex.vocab_limit is not None:
            logits = logits[:, : ex.vocab_limit]
        return hidden, logits.argmax(-1)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Each prompt's greedy continuation of `max_new_tokens` tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}; must be >= 1")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, each of at least one token")
        n, k, device = len(prompts), self.k, self.executor.device
        pages: list[list[int]] = [[] for _ in range(n)]
        for p, table in zip(prompts, pages):
            self._pages_for(table, len(p))
        hidden, greedy = self._hidden([t for p in prompts for t in p], [len(p) for p in prompts],
                                      [0] * n, pages)
        last = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
        state = hidden[last]  # the target's hidden state before each pending token
        outputs = [[t] for t in greedy[last].tolist()]
        kv_lens = [len(p) for p in prompts]
        active = [i for i in range(n) if max_new_tokens > 1]
        while active:
            tokens = torch.tensor([outputs[i][-1] for i in active], device=device)
            positions = torch.tensor([kv_lens[i] for i in active], device=device)
            drafts = self.draft.propose(state[active], tokens, positions, k,
                                        self.executor.vocab_limit).tolist()
            for i in active:
                self._pages_for(pages[i], kv_lens[i] + k + 1)
            hidden, greedy = self._hidden(
                [t for j, i in enumerate(active) for t in [outputs[i][-1], *drafts[j]]],
                [k + 1] * len(active), [kv_lens[i] for i in active], [pages[i] for i in active])
            greedy = greedy.view(len(active), k + 1).tolist()
            keep = []
            for j, i in enumerate(active):
                accepted = 0
                while accepted < k and drafts[j][accepted] == greedy[j][accepted]:
                    accepted += 1
                self.stats.record(accepted)
                emitted = (drafts[j][:accepted] + [greedy[j][accepted]])
                outputs[i].extend(emitted[: max_new_tokens - len(outputs[i])])
                kv_lens[i] += accepted + 1
                state[i] = hidden[j * (k + 1) + accepted]
                if len(outputs[i]) < max_new_tokens:
                    self._pages_for(pages[i], kv_lens[i])  # the rejected drafts' pages return
                    keep.append(i)
                else:
                    self._pages_for(pages[i], 0)
            active = keep
        for table in pages:
            self._pages_for(table, 0)
        return outputs
