"""A draft for the PD speculation tests (tests/test_spec_pd.py) that accepts only when the draft's
state on the decode side is right.

`CheckedOracleDraft` is the real MTP draft (its extends and chains write the draft KV as served)
whose proposals come from a reference instead: the request's true continuation (wrong at every
third position, as `test_spec_real.OracleDraft`), but only while the hidden state it is handed
and the draft KV of every cached token equal the reference's (`references`: computed in the
test process from the target's greedy outputs). Otherwise every draft is wrong, so a hidden
state or draft KV that did not travel shows as no accepted draft at all.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.model.draft import MTPDraft
from runtime.model.loader import init_random

TOLERANCE = 1e-3  # float noise of other batchings is far below; a wrong state far above


def references(model, draft: MTPDraft, sequences: list[list[int]]) -> dict[str, np.ndarray]:
    """Per sequence: its tokens, the target's hidden state at every position and the draft's
    key (K, or MLA latent) at every slot, `seq{i}`, `hidden{i}`, `draftk{i}`."""
    from runtime.model import AttentionMetadata
    from runtime.model.kv_cache import PagedKVCache

    out = {}
    for i, seq in enumerate(sequences):
        n = len(seq)
        ids = torch.tensor(seq)
        meta = AttentionMetadata.build([n], [0], [list(range(n))], 1)
        kv = PagedKVCache.for_model(model.config, num_pages=n, page_size=1)
        hidden = model.hidden_states(ids, meta.positions(), meta, kv)
        prev = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]])
        draft_kv = draft.make_cache(kv)
        draft.extend(ids, prev, meta, draft_kv)
        out[f"seq{i}"] = np.array(seq)
        out[f"hidden{i}"] = hidden.float().numpy()
        out[f"draftk{i}"] = draft_kv.buffers[0].reshape(n, -1).float().numpy()
    return out


class CheckedOracleDraft(MTPDraft):
    def __init__(self, target, refs: dict[str, np.ndarray]) -> None:
        super().__init__(target)
        self.refs = {}  # (token, position) -> (sequence, hidden states, draft keys)
        for key in refs:
            if key.startswith("seq"):
                i = key[3:]
                seq = refs[key].tolist()
                for pos, token in enumerate(seq):
                    self.refs[(token, pos)] = (seq, refs[f"hidden{i}"], refs[f"draftk{i}"])

    @classmethod
    def load(cls, target, seed: int, path: str) -> CheckedOracleDraft:
        """Built like `build_draft(target, seed=seed)` (the same weights)."""
        with np.load(path, allow_pickle=False) as data:
            refs = dict(data)
        param = next(target.parameters())
        draft = cls(target, refs).to(device=param.device, dtype=param.dtype)
        init_random(draft, seed)
        return draft.eval()

    def propose(self, tokens, hidden, kv_lens, page_tables, ks, kv, vocab_limit=None):
        super().propose(tokens, hidden, kv_lens, page_tables, ks, kv, vocab_limit)  # as served
        keys = kv.buffers[0].reshape(kv.num_pages * kv.page_size, -1)
        rows = []
        for i, (token, L, k) in enumerate(zip(tokens.tolist(), kv_lens, ks)):
            seq, ref_hidden, ref_keys = self.refs[(token, L)]
            table = torch.as_tensor(list(page_tables[i]))
            slots = table[torch.arange(L) // kv.page_size] * kv.page_size \
                + torch.arange(L) % kv.page_size
            right = (np.allclose(hidden[i].float().numpy(), ref_hidden[L - 1], atol=TOLERANCE)
                     and np.allclose(keys[slots].float().numpy(), ref_keys[:L], atol=TOLERANCE))
            follow = (seq[L + 1:] + [0] * k)[:k]
            rows.append([(t + 1) % vocab_limit if not right or (L + j) % 3 == 0 else t
                         for j, t in enumerate(follow)])
        return rows
