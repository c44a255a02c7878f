"""A request's sampling settings: greedy, or temperature / top-k / top-p with a seed.

`parse_sampling` checks a request's fields against the ranges the OpenAI API and SGLang accept,
narrowed to what runtime/sampler.py computes (top_p >= `MIN_TOP_P`).
Temperatures below `GREEDY_BELOW` are greedy (dividing logits by them overflows float32).
No torch here: the HTTP fronts and the PD router parse requests without loading the model;
runtime/sampler.py draws the tokens.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from runtime.checks import is_int, short_repr

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (SGLang's floor is 1e-6)
MAX_TEMPERATURE = 2.0  # the OpenAI API's upper bound
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer
TOP_K_MAX = 2**31 - 1
# top_p is compared with float32 probability sums: a smaller one rounds to 0 there and would drop
# every token. 1e-6 keeps the top token alone already (it is float32's resolution near 1).
MIN_TOP_P = 1e-6
# ... and the float32 nearest to it (9.99999997e-07) passes too: routers that hold top_p as a
# float32 (SGLang's) hand the workers that.
_MIN_TOP_P_F32 = struct.unpack("f", struct.pack("f", MIN_TOP_P))[0]
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (the executor returns them)


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


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below `GREEDY_BELOW`) means greedy; top_k 0 and top_p 1 disable those
    filters. Every value the sampler cannot compute with is refused here (`SamplingError`
    naming the field and what is allowed), so whatever is built here can be sampled."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if not _is_finite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise SamplingError("temperature", f"temperature={short_repr(t)}; allowed: a "
                                f"number in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g}: "
                                "greedy)")
        if not _is_finite(p) or not min(MIN_TOP_P, _MIN_TOP_P_F32) <= p <= 1:
            raise SamplingError("top_p", f"top_p={short_repr(p)}; allowed: a number in "
                                f"[{MIN_TOP_P:g}, 1] (smaller: the most likely token alone, as "
                                f"{MIN_TOP_P:g} does)")
        if not is_int(k) or not 0 <= k <= TOP_K_MAX:
            raise SamplingError("top_k", f"top_k={short_repr(k)}; allowed: an integer in "
                                f"1..{TOP_K_MAX}, or 0 or -1 (off)")
        if seed is not None and not (is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
            raise SamplingError("seed", f"seed={short_repr(seed)}; allowed: null or an integer "
                                "in -2**63..2**63-1")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def parse_sampling(raw: dict, *, default_temperature: float) -> SamplingParams:
    """`SamplingParams` from a request's `temperature`, `top_p`, `top_k` (-1 or 0: off) and
    `seed` (missing or null: the defaults); `SamplingError` names the first bad field."""
    temperature, top_p, top_k = (raw.get(name) for name in ("temperature", "top_p", "top_k"))
    if is_int(top_k) and top_k == -1:
        top_k = 0
    return SamplingParams(temperature=default_temperature if temperature is None else temperature,
                          top_k=0 if top_k is None else top_k,
                          top_p=1.0 if top_p is None else top_p, seed=raw.get("seed"))
