"""An MTP-style draft head for speculative decoding (DeepSeek-V3's multi-token prediction,
scaled down): one extra decoder layer fed the target's last hidden state and the embedding of
the next token, sharing the target's embedding and LM head.

    x = eh_proj([enorm(embed(token)); hnorm(hidden)])
    hidden' = layer(x);  draft = argmax(lm_head(norm(hidden')))

Chained `k` times it proposes `k` draft tokens. The layer keeps no KV cache: its attention sees
only the token it runs on, so the draft's only per-request state is the target's last hidden
state. Weights are random (seeded), so with a random target the acceptance is low; greedy
verification (runtime/speculative.py) makes the output the target's own whatever it proposes.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.attention import AttentionMetadata
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
        self.layer = DecoderLayer(config, 0, rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self._target = (target,)  # not a submodule: its parameters are the target's

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                k: int, vocab_limit: int | None = None) -> torch.Tensor:
        """`[n, k]` greedy drafts following `tokens` `[n]` (at `positions`), from the target's
        hidden states `[n, hidden]` of the tokens before them."""
        target = self._target[0]
        meta = AttentionMetadata.without_cache([1] * tokens.shape[0], device=tokens.device)
        drafts = []
        for step in range(k):
            x = torch.cat([self.enorm(target.model.embed_tokens(tokens)), self.hnorm(hidden)], -1)
            hidden = self.layer(self.eh_proj(x), positions + step, meta, None)
            logits = target.compute_logits(self.norm(hidden))
            if vocab_limit is not None:
                logits = logits[:, :vocab_limit]
            tokens = logits.argmax(-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


def build_draft(target: CausalLM, *, seed: int = 0) -> MTPDraft:
    """An MTP draft head for `target` with random weights from `seed`, on the target's device
    and in its dtype."""
    param = next(target.parameters())
    draft = MTPDraft(target).to(device=param.device, dtype=param.dtype)
    init_random(draft, seed)
    return draft.eval()
