"""A request's sampling settings: greedy, or temperature / top-k / top-p with a seed.

`parse_sampling` checks a request's fields against the ranges the OpenAI API and SGLang accept.
Temperatures below `GREEDY_BELOW` are greedy (dividing logits by them overflows float32).
No torch here: the HTTP fronts and the PD router parse requests without loading the model;
runtime/sampler.py draws the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.checks import is_int, short_repr

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (SGLang's floor is 1e-6)
MAX_TEMPERATURE = 2.0  # the OpenAI API's upper bound
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer
TOP_K_MAX = 2**31 - 1
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (the executor returns them)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below `GREEDY_BELOW`) means greedy; top_k 0 and top_p 1 disable those
    filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature}; must be in [0, {MAX_TEMPERATURE}]")
        if not 0 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k={self.top_k}; must be in 0..{TOP_K_MAX} (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}; must be in (0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed={self.seed}; must be a 64-bit signed integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class SamplingError(ValueError):
    """A sampling field out of its range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_finite(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def parse_sampling(raw: dict, *, default_temperature: float) -> SamplingParams:
    """`SamplingParams` from a request's `temperature`, `top_p`, `top_k` (-1 or 0: off) and
    `seed` (missing or null: the defaults); `SamplingError` names the first bad field."""
    temperature = raw.get("temperature")
    temperature = default_temperature if temperature is None else temperature
    if not _is_finite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise SamplingError("temperature", f"temperature={short_repr(temperature)}; allowed: a "
                            f"number in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g}: greedy)")
    top_p = raw.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _is_finite(top_p) or not 0 < top_p <= 1:
        raise SamplingError("top_p", f"top_p={short_repr(top_p)}; allowed: a number in (0, 1]")
    top_k = raw.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if not is_int(top_k) or not 0 <= top_k <= TOP_K_MAX:
        raise SamplingError("top_k", f"top_k={short_repr(top_k)}; allowed: an integer in "
                            f"1..{TOP_K_MAX}, or 0 or -1 (off)")
    seed = raw.get("seed")
    if seed is not None and not (is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise SamplingError("seed", f"seed={short_repr(seed)}; allowed: null or an integer in "
                            "-2**63..2**63-1")
    return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                          seed=seed)
