"""An MTP-style draft head for speculative decoding (DeepSeek-V3's multi-token prediction,
scaled down): one extra decoder layer fed the target's last hidden state and the embedding of
the next token, sharing the target's embedding and LM head.

    x_p = eh_proj([enorm(embed(t_p)); hnorm(h_{p-1})])      (h_{-1} = 0)
    z_p = layer(x_p);  draft after t_p = argmax(lm_head(norm(z_p)))

The layer attends over its own KV of the sequence so far, kept in a one-layer paged cache
indexed by the same pages as the target's: slot `p` holds the draft's K/V of `(t_p, h_{p-1})`,
a function of the tokens up to `p` only. `extend` writes those slots for tokens whose target
hidden states are known (a prefill chunk, a decode step, the accepted drafts of a verify);
`propose` chains `k` drafts from a request's pending token, its own output standing in for the
target's hidden state after the first. Weights are random (seeded), so with a random target the
acceptance is low; greedy verification (runtime/speculative.py) makes the output the target's
own whatever it proposes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runtime.model.attention import AttentionMetadata
from runtime.model.kv_cache import PagedKVCache
from runtime.model.loader import init_random
from runtime.model.layers import RMSNorm
from runtime.model.model import CausalLM, DecoderLayer


class MTPDraft(nn.Module):
    """The draft head of `target` (it borrows the target's embedding, rotary and LM head)."""

    def __init__(self, target: CausalLM) -> None:
        super().__init__()
        config = target.config
        if config.layer_type(0) == "linear_attention":
            raise ValueError(f"model {config.name!r}: its layer 0 is linear attention; the MTP "
                             "draft copies an attention layer (full, sliding or MLA)")
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        rotary = target.model.layers[0].self_attn.rotary
        self.layer = DecoderLayer(config, 0, rotary)  # buffer 0 of its own one-layer cache
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self._target = (target,)  # not a submodule: its parameters are the target's

    def make_cache(self, target_kv: PagedKVCache) -> PagedKVCache:
        """The draft layer's paged cache: one layer shaped like `target_kv`'s, same pages."""
        return PagedKVCache(num_layers=1, num_pages=target_kv.num_pages,
                            page_size=target_kv.page_size, heads=target_kv.heads,
                            head_dim=target_kv.head_dim, mla=target_kv.mla,
                            dtype=target_kv.dtype, device=target_kv.device)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, meta: AttentionMetadata,
               kv: PagedKVCache) -> torch.Tensor:
        """Write the draft's KV of `tokens` `[T]` at `meta`'s slots, each fed the target's
        hidden state of the token before it (`prev_hidden` `[T, hidden]`); the draft's output
        `[T, hidden]`."""
        target = self._target[0]
        x = torch.cat([self.enorm(target.model.embed_tokens(tokens)), self.hnorm(prev_hidden)],
                      -1)
        return self.layer(self.eh_proj(x), meta.positions(), meta, kv)

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, hidden: torch.Tensor, kv_lens: Sequence[int],
                page_tables: Sequence[Sequence[int]], ks: Sequence[int], kv: PagedKVCache,
                vocab_limit: int | None = None) -> list[list[int]]:
        """Up to `ks[i]` greedy drafts after request i's pending token `tokens[i]` (at position
        `kv_lens[i]`), from the target's hidden state of the token before it (`hidden[i]`).
        Draft j is written to slot `kv_lens[i] + j`, which `page_tables[i]` must hold."""
        target = self._target[0]
        rows = list(range(len(ks)))
        drafts: list[list[int]] = [[] for _ in rows]
        step = 0
        while rows := [i for i in rows if ks[i] > step]:
            index = torch.tensor(rows, device=tokens.device)
            meta = AttentionMetadata.build([1] * len(rows), [kv_lens[i] + step for i in rows],
                                           [page_tables[i] for i in rows], kv.page_size,
                                           device=tokens.device)
            out = self.extend(tokens[index], hidden[index], meta, kv)
            logits = target.compute_logits(self.norm(out))
            if vocab_limit is not None:
                logits = logits[:, :vocab_limit]
            tokens, hidden = tokens.clone(), hidden.clone()
            tokens[index] = logits.argmax(-1)
            hidden[index] = out
            for i, token in zip(rows, tokens[index].tolist()):
                drafts[i].append(token)
            step += 1
        return drafts


def build_draft(target: CausalLM, *, seed: int = 0) -> MTPDraft:
    """An MTP draft head for `target` with random weights from `seed`, on the target's device
    and in its dtype."""
    param = next(target.parameters())
    draft = MTPDraft(target).to(device=param.device, dtype=param.dtype)
    init_random(draft, seed)
    return draft.eval()
