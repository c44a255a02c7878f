"""How unevenly routed tokens land on the ranks of an expert-parallel group.

Under expert parallelism a MoE layer (its expert GEMMs, DeepEP's dispatch and combine) takes as
long as its busiest rank. `ExpertLoad.imbalance(tokens)` is E[max rank load] / mean rank load
for `tokens` tokens of one layer, each routed to `top_k` experts:

- expert popularity: one draw per modelled layer of `num_experts` weights from a power law
  p(x) ~ x^-alpha on [x_min, x_max], normalised (NVIDIA aiconfigurator's routing model for its
  MoE kernel tables, over [0.01, 2]: alpha 1.01 for DeepSeek-V3/R1 and its architecture, 1.2
  for other MoE models; `routing_alpha`, docs/cost_model.md);
- placement: without EPLB SGLang's default, expert e on rank e * ep // num_experts; with EPLB
  (SGLang's --enable-eplb with --ep-num-redundant-experts N) the N spare slots replicate the
  experts with the most load per copy, each copy taking an equal share of its expert's load,
  and the slots are packed onto ranks heaviest first, each to the least-loaded rank with a
  free slot (the balanced packing of DeepSeek's EPLB);
- routing noise: the `tokens * top_k` routed copies fall on the ranks multinomially with the
  ranks' shares of the popularity.

With few tokens the multinomial's maximum dominates; with many, the popularity skew left by
the placement. The estimate is a seeded Monte Carlo mean, cached per copy count.
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pdsim.specs.models import ModelSpec

DEFAULT_ALPHA = 1.01  # aiconfigurator's power-law exponent for DeepSeek-V3/R1 routing
GENERIC_MOE_ALPHA = 1.2  # aiconfigurator's for its generic MoE models (Qwen3, Mixtral, gpt-oss)
DEFAULT_X_MIN, DEFAULT_X_MAX = 0.01, 2.0  # aiconfigurator's support of the power law
LAYER_DRAWS = 32  # popularity draws (layers) the estimate averages over
ROUTING_DRAWS = 4  # multinomial routings per popularity draw


def routing_alpha(model: ModelSpec) -> float:
    """The power-law exponent of a model's expert popularity, as aiconfigurator assigns it by
    model class: 1.01 for DeepSeek-V3's architecture (MLA; Kimi-K2 shares it), 1.2 for its
    generic MoE class (Qwen2/3-MoE, Qwen3.5, Mixtral, gpt-oss, MiniMax-M2)."""
    return DEFAULT_ALPHA if model.is_mla else GENERIC_MOE_ALPHA


def check_redundant_experts(redundant: int, num_experts: int, ep: int) -> None:
    """SGLang's rules for EPLB's --ep-num-redundant-experts: the physical slots (experts plus
    redundant copies) split evenly over the EP ranks, and copies need more than one rank."""
    if redundant < 0:
        raise ValueError(f"eplb.redundant_experts must be >= 0, got {redundant}")
    if redundant and ep < 2:
        raise ValueError(f"eplb.redundant_experts={redundant} needs expert parallelism (ep > 1), "
                         f"got ep={ep}")
    if (num_experts + redundant) % ep:
        raise ValueError(
            f"eplb.redundant_experts={redundant}: {num_experts} experts + {redundant} copies "
            f"must split evenly over ep={ep} ranks; e.g. "
            f"{' or '.join(map(str, even_copies(num_experts, ep)))}")
    if redundant > num_experts * (ep - 1):
        raise ValueError(f"eplb.redundant_experts={redundant} exceeds one copy of every expert "
                         f"on every other rank ({num_experts * (ep - 1)})")


def even_copies(num_experts: int, ep: int) -> tuple[int, int]:
    """The two fewest redundant copies (0 included) with which `num_experts` split evenly
    over `ep` ranks."""
    first = -num_experts % ep
    return first, first + ep


def uneven_split_note(role: str, model: str, num_experts: int, ep: int) -> str | None:
    """Without EPLB SGLang places `num_experts` in equal blocks on the `ep` ranks and refuses
    to start when they do not divide; the simulator prices the uneven blocks (a skew, not a
    deployment). The note says so and which EPLB copies make it one, or None."""
    if ep < 2 or not num_experts % ep:
        return None
    return (f"{role}: ep={ep} does not divide {model}'s {num_experts} experts, which SGLang "
            f"refuses without EPLB; priced as uneven blocks. `eplb: {{redundant_experts: "
            f"{even_copies(num_experts, ep)[0]}}}` makes it a deployment SGLang runs")


def popularity(num_experts: int, rng: np.random.Generator, alpha: float = DEFAULT_ALPHA,
               x_min: float = DEFAULT_X_MIN, x_max: float = DEFAULT_X_MAX) -> np.ndarray:
    """One layer's expert popularity: power-law weights (inverse-CDF draws), summing to 1."""
    u = rng.random(num_experts)
    if abs(alpha - 1.0) < 1e-9:
        x = x_min * (x_max / x_min) ** u
    else:
        a = 1.0 - alpha
        x = ((x_max**a - x_min**a) * u + x_min**a) ** (1.0 / a)
    return x / x.sum()


def default_shares(pop: np.ndarray, ep: int) -> np.ndarray:
    """Each rank's share of the load with SGLang's default placement (contiguous blocks)."""
    ranks = np.arange(len(pop)) * ep // len(pop)
    return np.bincount(ranks, weights=pop, minlength=ep)


def eplb_shares(pop: np.ndarray, ep: int, redundant: int) -> np.ndarray:
    """Each rank's share of the load after EPLB: replicate, then pack (module docstring)."""
    copies = np.ones(len(pop), dtype=int)
    heap = [(-w, e) for e, w in enumerate(pop)]  # load per copy, largest first
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-pop[e] / copies[e], e))
    slot_loads = np.sort(np.repeat(pop / copies, copies))[::-1]
    per_rank = len(slot_loads) // ep
    shares = np.zeros(ep)
    open_ranks = [(0.0, r) for r in range(ep)]  # (load so far, rank), ranks with a free slot
    filled = [0] * ep
    for load in slot_loads.tolist():
        total, r = heapq.heappop(open_ranks)
        shares[r] = total + load
        filled[r] += 1
        if filled[r] < per_rank:
            heapq.heappush(open_ranks, (shares[r], r))
    return shares


class ExpertLoad:
    """The imbalance factor of one (experts, top_k, EP, EPLB, exponent) setting, seeded.

    redundant_experts None: no EPLB (default placement); an int: EPLB with that many copies."""

    def __init__(self, num_experts: int, top_k: int, ep: int, redundant_experts: int | None = None,
                 seed: int = 0, alpha: float = DEFAULT_ALPHA) -> None:
        if num_experts < 1 or top_k < 1 or ep < 1:
            raise ValueError(f"num_experts, top_k and ep must be >= 1, got {num_experts}, "
                             f"{top_k}, {ep}")
        if redundant_experts is not None:
            check_redundant_experts(redundant_experts, num_experts, ep)
        self.num_experts, self.top_k, self.ep, self.alpha = num_experts, top_k, ep, alpha
        self.redundant_experts, self.seed = redundant_experts, seed
        rng = np.random.default_rng([seed, num_experts, ep])
        shares = []
        for _ in range(LAYER_DRAWS if ep > 1 else 0):
            pop = popularity(num_experts, rng, alpha)
            shares.append(default_shares(pop, ep) if redundant_experts is None
                          else eplb_shares(pop, ep, redundant_experts))
        self._shares = np.array(shares)
        self._cache: dict[int, float] = {}

    def imbalance(self, tokens: float) -> float:
        """E[max rank load] / mean rank load for `tokens` tokens of one layer (1 at EP 1)."""
        copies = int(round(tokens * self.top_k))
        if self.ep == 1 or copies == 0:
            return 1.0
        factor = self._cache.get(copies)
        if factor is None:
            rng = np.random.default_rng([self.seed, copies])
            counts = rng.multinomial(copies, self._shares, size=(ROUTING_DRAWS, LAYER_DRAWS))
            factor = self._cache[copies] = float(counts.max(axis=-1).mean() * self.ep / copies)
        return factor


@lru_cache(maxsize=32)
def expert_load(num_experts: int, top_k: int, ep: int, redundant_experts: int | None,
                seed: int, alpha: float = DEFAULT_ALPHA) -> ExpertLoad:
    """One shared `ExpertLoad` per setting: every instance of a role reuses its draws and its
    cache."""
    return ExpertLoad(num_experts, top_k, ep, redundant_experts, seed, alpha)
