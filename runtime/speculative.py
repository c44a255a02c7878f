"""Greedy speculative decoding in the real executor: an MTP draft head (runtime/model/draft.py)
proposes up to `k` tokens for a request, and the target verifies them in one extend of `k + 1`
tokens against the paged KV cache.

A verify of a request with `L` cached tokens and pending token `t` (its last output, not yet in
the cache) feeds `[t, d_1..d_k]` at positions `L..L + k`; the target's greedy tokens
`g_0..g_k` there accept the longest prefix with `d_{i+1} == g_i` (say `n` drafts), so the
request's next tokens are `d_1..d_n, g_n`: the target's own greedy tokens, whatever the draft
proposed. The KV of `t, d_1..d_n` is now in the cache; the rejected drafts' slots are stale and
the next verify overwrites them.

The draft's own state per request: its KV (slot `p` from token `p` and the target's hidden
state at `p - 1`, in a one-layer cache on the target's pages) and, in the request's state slot
(`Request.state_indices`, `with_draft_slots`), the target's hidden state of its last cached
token: the draft's next input. Every target forward extends the draft over the tokens it
cached (a verify: over the accepted drafts, whose slots the chain wrote from its own outputs),
so a prefill leaves the prompt's draft KV and the last hidden state ready to move to a decode
instance with the request's KV (runtime/transfer/prefill.py). A chunk that starts after a
cached prefix has no hidden state for the token before it and feeds zeros there (as position
0 does): the drafts may differ, never the output.

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
from dataclasses import dataclass, field, replace

import torch

from pdsim.core.config import SchedulerConfig
from pdsim.core.request import Request
from runtime.model import AttentionMetadata
from runtime.model.draft import MTPDraft
from runtime.model.kv_cache import PagedKVCache
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


def with_draft_slots(sched: SchedulerConfig) -> SchedulerConfig:
    """`sched` with a state slot per request slot (running and, on decode, preallocated): where
    a speculating executor keeps each request's last hidden state, which PD moves with its
    last chunk like a recurrent state."""
    return replace(sched, state_slots=sched.max_running_requests + sched.pre_alloc_size)


@dataclass
class DecodeSpeculation:
    """The executor's speculative state: the draft head, `k`, the draft's KV (`kv`), each
    request's last hidden state at its state slot (`hidden`, `[slots, hidden_size]`) and the
    tokens verified ahead of the scheduler."""

    draft: MTPDraft
    num_draft_tokens: int
    kv: PagedKVCache
    hidden: torch.Tensor
    stats: AcceptanceStats = field(init=False)
    verified: dict[str, _Verified] = field(default_factory=dict)
    # The position whose hidden state a request's slot holds, for requests extended here (a
    # request that came with its KV holds the prefill's, for its last prompt token).
    carried: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}; must be >= 1")
        self.stats = AcceptanceStats(self.num_draft_tokens)

    def forget(self, rid: str) -> None:
        self.carried.pop(rid, None)
        self.verified.pop(rid, None)

    def _carry(self, req: Request, position: int, decoding: bool) -> torch.Tensor:
        """The target's hidden state at `position - 1`, the draft's input for `position`."""
        if decoding or (position > 0 and self.carried.get(req.rid) == position - 1):
            return self.hidden[req.state_indices[0]]
        return self.hidden.new_zeros(self.hidden.shape[1])  # position 0, or a cached prefix

    @torch.inference_mode()
    def after_forward(self, reqs: Sequence[Request], meta: AttentionMetadata,
                      ids: torch.Tensor, hidden: torch.Tensor, *, decoding: bool) -> None:
        """After a plain target forward (`hidden`: every token's): the draft's KV of the
        tokens it cached, each request's new last hidden state; verified tokens dropped."""
        prev = torch.empty_like(hidden)
        starts = meta.token_starts
        for s, req in enumerate(reqs):
            a, b = starts[s], starts[s + 1]
            prev[a] = self._carry(req, meta.cached_lens[s], decoding)
            prev[a + 1:b] = hidden[a:b - 1]
        self.draft.extend(ids, prev, meta, self.kv)
        for s, req in enumerate(reqs):
            self.hidden[req.state_indices[0]] = hidden[starts[s + 1] - 1]
            self.carried[req.rid] = meta.context_lens[s] - 1
            self.verified.pop(req.rid, None)

    def can_verify(self, req: Request, top_k: dict[str, int]) -> bool:
        params = req.sampling
        return (params is None or params.greedy) and req.rid not in top_k

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
        slots = [r.state_indices[0] for r in reqs]
        tables = [r.pages for r in reqs]
        drafts = self.draft.propose(
            torch.tensor(pending, device=device), self.hidden[slots], kv_lens, tables, ks,
            self.kv, vocab_limit) if max(ks) else [[] for _ in reqs]
        ids = [t for p, d, k in zip(pending, drafts, ks) for t in [p, *d[:k]]]
        meta = AttentionMetadata.build([k + 1 for k in ks], kv_lens, tables, executor.page_size,
                                       device=device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        hidden = model.hidden_states(input_ids, meta.positions(), meta, executor.kv)
        logits = model.compute_logits(hidden)
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        result = sample(logits, [GREEDY] * len(ids), [None] * len(ids))
        greedy, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        out, accepted = [], []
        for req, d, k, start, L in zip(reqs, drafts, ks, meta.token_starts, kv_lens):
            n = 0
            while n < k and d[n] == greedy[start + n]:
                n += 1
            if k:
                self.stats.verify_steps += 1
                self.stats.proposed_drafts += k
                self.stats.accepted_drafts += n
            accepted.append(n)
            out.append((greedy[start], logprobs[start]))
            if n:
                self.verified[req.rid] = _Verified(L + 1, greedy[start + 1: start + n + 1],
                                                   logprobs[start + 1: start + n + 1])
        self._settle_draft(reqs, kv_lens, ks, accepted, meta, input_ids, hidden)
        return out

    @torch.inference_mode()
    def _settle_draft(self, reqs, kv_lens, ks, accepted, verify_meta, ids, hidden) -> None:
        """After a verify: the draft's KV of the tokens it cached that the chain did not write
        from the target's hidden states (the accepted drafts; the pending token when no draft
        ran), and each request's new last hidden state."""
        starts = verify_meta.token_starts
        rows, prev, qlens, cached, tables = [], [], [], [], []
        for req, L, k, n, start in zip(reqs, kv_lens, ks, accepted, starts):
            if k and n:  # slots L+1..L+n: the accepted drafts, after the target's L..L+n-1
                rows.extend(range(start + 1, start + n + 1))
                prev.append(hidden[start:start + n])
                qlens.append(n)
                cached.append(L + 1)
            elif not k:  # slot L: the pending token, after the request's last hidden state
                rows.append(start)
                prev.append(self.hidden[req.state_indices[0]][None])
                qlens.append(1)
                cached.append(L)
            else:
                continue
            tables.append(req.pages)
        if rows:
            meta = AttentionMetadata.build(qlens, cached, tables, verify_meta.page_size,
                                           device=ids.device)
            self.draft.extend(ids[rows], torch.cat(prev), meta, self.kv)
        for req, L, n, start in zip(reqs, kv_lens, accepted, starts):
            self.hidden[req.state_indices[0]] = hidden[start + n]
            self.carried[req.rid] = L + n
