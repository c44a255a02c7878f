"""Per-token times from what a streaming client saw: the arrival time of each chunk.

An endpoint may put several tokens in one chunk (a detokenizer holding back half a character,
a server streaming every few tokens), and a client that reads text alone cannot tell how many
tokens a chunk held. Then the chunk times say when the first and the last token arrived, not
when each one in between did: those are spread evenly between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def token_times(chunk_times_s: Sequence[float], n_tokens: int) -> tuple[list[float], bool]:
    """`n_tokens` times from the chunks' arrival times, and whether they are exact (one chunk
    per token). Otherwise the tokens are spread evenly from the first chunk to the last."""
    if n_tokens <= 0 or not len(chunk_times_s):
        return [], n_tokens <= 0
    if len(chunk_times_s) == n_tokens:
        return [float(t) for t in chunk_times_s], True
    first, last = float(chunk_times_s[0]), float(chunk_times_s[-1])
    return np.linspace(first, last, n_tokens).tolist(), False
