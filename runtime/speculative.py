"""Greedy speculative decoding in the real executor: an MTP draft head (runtime/model/draft.py)
proposes up to `k` tokens for a request, and the target verifies them in one extend of `k + 1`
tokens against the paged KV cache.

A verify of a request with `L` cached tokens and pending token `t` (its last output, not yet in
the cache) feeds `[t, d_1..d_k]` at positions `L..L + k`; the target's greedy tokens
`g_0..g_k` there accept the longest prefix with `d_{i+1} == g_i` (say `n` drafts), so the
request's next tokens are `d_1..d_n, g_n`: the target's own greedy tokens, whatever the draft
proposed. The KV of `t, d_1..d_n` is now in the cache; the rejected drafts' slots are stale and
the next verify overwrites them.

The core scheduler still plans one token per request per decode step, and its page accounting
stays exact because the executor never writes outside the pages the scheduler gave a request:
`k` is cut to the slots those pages hold beyond `L` (and to the tokens the request has left).
The step returns `d_1` (or `g_0`) and keeps the rest; the scheduler's next steps for that
request, which feed tokens whose KV is already cached, take them from there without a forward.
A decode step whose requests all hold verified tokens runs no forward at all.

Only greedy requests without top logprobs speculate; the others in the same step run a plain
decode forward (a second forward when both kinds are present). An extend of a request (a
recompute after retraction) drops what it holds. Models with a recurrent state (hybrid) are
refused: rolling a recurrent state back needs a snapshot per draft position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdsim.core.request import Request
from runtime.model import AttentionMetadata
from runtime.model.draft import MTPDraft
from runtime.sampler import sample
from runtime.sampling import SamplingParams

GREEDY = SamplingParams()


@dataclass(slots=True)
class AcceptanceStats:
    """Verify steps run (per request) and the drafts they accepted."""

    num_draft_tokens: int
    verify_steps: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0

    @property
    def mean_accepted_drafts(self) -> float:
        """Accepted drafts per verify step (0..k)."""
        return self.accepted_drafts / self.verify_steps if self.verify_steps else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens per verify step (accepted drafts + the target's own), SGLang's
        `spec_accept_length` and the simulator's `speculative.acceptance.mean_accept_len`."""
        return self.mean_accepted_drafts + 1.0


@dataclass(slots=True)
class _Verified:
    """Tokens verified ahead of the scheduler: the decode step at KV length `kv_len` returns
    `tokens[0]`."""

    kv_len: int
    tokens: list[int]
    logprobs: list[float]


@dataclass
class DecodeSpeculation:
    """The executor's speculative state: the draft head, `k`, each request's last hidden state
    (the draft's input) and the tokens verified ahead of the scheduler."""

    draft: MTPDraft
    num_draft_tokens: int
    stats: AcceptanceStats = field(init=False)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    verified: dict[str, _Verified] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}; must be >= 1")
        self.stats = AcceptanceStats(self.num_draft_tokens)

    def forget(self, rid: str) -> None:
        self.hidden.pop(rid, None)
        self.verified.pop(rid, None)

    def remember(self, reqs: Sequence[Request], sampled: Sequence[bool],
                 hidden: torch.Tensor) -> None:
        """Keep the last-token hidden states of a plain forward's rows; an extend's other rows
        (a chunk that is not the last) drop what their request held."""
        for row, (req, last) in enumerate(zip(reqs, sampled)):
            self.verified.pop(req.rid, None)
            if last:
                self.hidden[req.rid] = hidden[row]
            else:
                self.hidden.pop(req.rid, None)

    def can_verify(self, req: Request, top_k: dict[str, int]) -> bool:
        params = req.sampling
        return ((params is None or params.greedy) and req.rid not in top_k
                and req.rid in self.hidden)

    def take(self, req: Request, kv_len: int) -> tuple[int, float] | None:
        """The verified token of `req`'s decode step at `kv_len`, if it holds one."""
        got = self.verified.get(req.rid)
        if got is None or got.kv_len != kv_len:
            self.verified.pop(req.rid, None)
            return None
        token, logprob = got.tokens.pop(0), got.logprobs.pop(0)
        got.kv_len += 1
        if not got.tokens:
            del self.verified[req.rid]
        return token, logprob

    def drafts_for(self, req: Request, kv_len: int, page_size: int, max_position: int) -> int:
        """Drafts `req` may verify at `kv_len`: within its pages, its tokens left, positions."""
        room = len(req.pages) * page_size - kv_len - 1
        left = req.max_new_tokens - req.num_output - 1
        return max(0, min(self.num_draft_tokens, room, left, max_position - kv_len - 1))

    def verify(self, executor, reqs: Sequence[Request],
               kv_lens: Sequence[int]) -> list[tuple[int, float]]:
        """One verify forward for greedy `reqs`; each one's token for this step (the rest of
        its accepted tokens are kept for its next steps)."""
        model, device, vocab_limit = executor.model, executor.device, executor.vocab_limit
        ks = [self.drafts_for(r, L, executor.page_size, executor.config.max_position)
              for r, L in zip(reqs, kv_lens)]
        pending = [r.output_ids[-1] for r in reqs]
        drafts = self.draft.propose(
            torch.stack([self.hidden[r.rid] for r in reqs]),
            torch.tensor(pending, device=device), torch.tensor(list(kv_lens), device=device),
            max(ks), vocab_limit).tolist() if max(ks) else [[] for _ in reqs]
        ids = [t for p, d, k in zip(pending, drafts, ks) for t in [p, *d[:k]]]
        query_lens = [k + 1 for k in ks]
        meta = AttentionMetadata.build(query_lens, kv_lens, [r.pages for r in reqs],
                                       executor.page_size, device=device)
        hidden = model.hidden_states(torch.tensor(ids, dtype=torch.int64, device=device),
                                     meta.positions(), meta, executor.kv)
        logits = model.compute_logits(hidden)
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        result = sample(logits, [GREEDY] * len(ids), [None] * len(ids))
        greedy, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        out = []
        for req, d, k, start, L in zip(reqs, drafts, ks, meta.token_starts, kv_lens):
            n = 0
            while n < k and d[n] == greedy[start + n]:
                n += 1
            if k:
                self.stats.verify_steps += 1
                self.stats.proposed_drafts += k
                self.stats.accepted_drafts += n
            self.hidden[req.rid] = hidden[start + n]
            out.append((greedy[start], logprobs[start]))
            if n:
                self.verified[req.rid] = _Verified(L + 1, greedy[start + 1: start + n + 1],
                                                   logprobs[start + 1: start + n + 1])
        return out
