"""Next-token sampling: greedy, or temperature / top-k / top-p with a per-request generator.

Each non-greedy request draws from its own `torch.Generator` (seed it with `make_generator`), so
a request's tokens depend only on its seed and its logits, never on what else is in the batch.
The returned logprob is that of the chosen token under the model's unmodified distribution
(`log_softmax` of the raw logits), whatever the sampling settings (runtime/sampling.py).

A row whose sampling fails (its generator cannot be seeded, its distribution is not one) gets the
greedy token and is reported in `SampleResult.failed`: the caller fails that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.sampling import SamplingParams


@dataclass(frozen=True, eq=False)
class SampleResult:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32
    failed: dict[int, str]  # row -> why its sampling failed (it holds the greedy token)


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> SampleResult:
    """Pick one token per row of `logits` `[S, vocab]`; non-greedy rows need a generator. A row
    that cannot be sampled keeps the greedy token and is listed in `failed`."""
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params and "
                         f"{len(generators)} generators")
    logits = logits.float()
    logprobs_all = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    failed: dict[int, str] = {}
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        if gen is None:
            raise ValueError(f"row {row} samples with temperature {p.temperature} but has no "
                             "generator")
        try:
            probs = filtered_probs(logits[row], p)
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
        except RuntimeError as exc:  # not a distribution (inf or nan): this row alone fails
            failed[row] = f"sampling failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
    logprobs = logprobs_all.gather(-1, tokens[:, None])[:, 0]
    return SampleResult(token_ids=tokens, logprobs=logprobs, failed=failed)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one row samples from: temperature, then top-k, then top-p."""
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        drop = before >= p.top_p  # the top token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs
