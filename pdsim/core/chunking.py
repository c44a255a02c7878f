"""How a prompt is cut into prefill chunks: a fixed chunk, or SGLang's dynamic chunking.

With pipeline stages, chunks of one size take longer as the prompt goes on (each attends over
every key before it), so the stages fall out of step and the pipeline bubbles. SGLang's
`--enable-dynamic-chunking` (`DynamicChunkSizer` in sglang/srt/managers/scheduler_pp_mixin.py)
shrinks a request's later chunks so that each costs what its first one did: it times one
stage's forward of lone prompts, fits f(l) = a·l² + b·l + c, and sizes the chunk after `L`
computed tokens as the x with f(L + x) − f(L) = f(base) − f(0), `base` being the
`--chunked-prefill-size`. The fit lives with the simulator (pdsim.sim.pipeline); the rule that
turns it into chunk sizes is here, for the scheduler and for what prices a prompt alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# SGLang aligns a dynamic chunk down to a multiple of max(page size, this).
DYNAMIC_CHUNK_ALIGN = 64


@dataclass(frozen=True, slots=True)
class DynamicChunking:
    """A fitted forward time f(l) = a·l² + b·l + c (the constant drops out) and SGLang's rule
    for the chunk after `history` tokens (module docstring). `smooth` is
    SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR: the chunk moves that share of the way from `base`
    to the model's answer; it is never below a quarter of `base`, is aligned down to
    max(page size, 64) and is at most `max_tokens` (`--max-prefill-tokens`)."""

    a: float
    b: float
    base: int
    smooth: float
    page_size: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.a > 0:
            raise ValueError(f"a dynamic-chunking fit needs a positive quadratic term, got "
                             f"a={self.a}")

    def chunk_after(self, history: int) -> int:
        """Tokens of the chunk that follows `history` computed tokens of a request."""
        a, b, base = self.a, max(self.b, 0.0), self.base
        target = a * base * base + b * base
        slope = 2 * a * history + b
        x = (-slope + math.sqrt(slope * slope + 4 * a * target)) / (2 * a)
        size = max(int(base + self.smooth * (x - base)), base // 4)
        align = max(self.page_size, DYNAMIC_CHUNK_ALIGN)
        size = min(max(size // align * align, align), self.max_tokens) // align * align
        return size if size >= align else base  # SGLang then keeps the fixed size


def chunk_cap(chunked_prefill_size: int, dynamic: DynamicChunking | None,
              history: int) -> int:
    """The chunk limit of an extend batch whose first request has `history` tokens computed by
    its earlier chunks (0 for a new request, whose first chunk is always the fixed size)."""
    if dynamic is None or not history or not chunked_prefill_size:
        return chunked_prefill_size
    return dynamic.chunk_after(history)


def prompt_chunks(prompt: int, chunked_prefill_size: int,
                  dynamic: DynamicChunking | None = None) -> list[tuple[int, int]]:
    """(tokens already computed, new tokens) of each extend of a lone `prompt`-token request,
    as the scheduler runs it: chunks of at most `chunked_prefill_size` (dynamic: the later ones
    sized by `dynamic`, which keeps them within max_prefill_tokens); with chunking off (0), in
    one piece. A lone request's chunk is not cut to `max_prefill_tokens`: SGLang's budget
    stops admitting more requests, never the first."""
    if not chunked_prefill_size:
        return [(0, prompt)]
    chunks, done = [], 0
    while done < prompt:
        n = min(chunk_cap(chunked_prefill_size, dynamic, done), prompt - done)
        chunks.append((done, n))
        done += n
    return chunks
