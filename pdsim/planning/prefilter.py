"""The analytic pre-filter: discard a deployment only when no simulation of it could meet the
plan's SLO.

Every test here is a *necessary* condition for the SLO, checked with optimistic figures
(capacities multiplied by the plan's `prefilter.slack`), so the filter errs towards keeping:

- **memory**: the weights fit next to at least one KV page (pdsim.sim.build's sizing).
- **ITL / TPOT floor**: a gap between two tokens of a request lasts at least the decode step
  that produced the second one. If even a one-request step takes longer than an ITL or TPOT
  target, every gap, and every request's mean gap, misses it.
- **TTFT floor**: a request's TTFT is at least the frontend latency plus its prefill alone
  (chunk by chunk); if the TTFT percentile of these floors misses a target, the run does.
- **prefill capacity**: the prefill side computes at most C_p tokens/s (its best tokens per
  second over batch sizes up to the step budget, attention at its cheapest). For a TTFT target
  (q, D) the run needs m = floor(q (N - 1)) + 1 requests with TTFT <= D; all of them are
  prefilled by the last arrival + D, so the m smallest prompts must fit in C_p (a_last + D).
- **decode capacity**: the decode side emits at most C_d tokens/s: its best rate at a batch the
  request cap and KV pool allow, with a share q of the steps at the largest batch whose step
  meets the ITL target (q: the ITL percentile). Of the m requests meeting the TTFT target at
  most K (running slots plus what the KV pool can hold) are still decoding at a_last + D, so the
  decode work of the m - K smallest outputs must fit in C_d (a_last + D).

- **colocated, both at once**: pdsim's colocated scheduler runs a prefill step or a decode
  step, never both in one, so the two times above add up on the same GPUs.

The capacity tests need open-loop arrivals and a whole-run measurement window; with a
closed loop or a window only the memory and floor tests run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchShape, extend_shape
from pdsim.core.chunking import prompt_chunks
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.config import PlanConfig
from pdsim.sim.build import build_role
from pdsim.sim.pipeline import pipelined_s
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec
from pdsim.workload import Workload


@dataclass
class RoleCapacity:
    """What one instance of a role can do at best (per instance unless said)."""

    shape: RoleShape
    kv_tokens_per_rank: int
    max_running_per_rank: int
    prefill_tok_s: float  # best prefill tokens/s of the instance
    decode_step_s: dict[int, float]  # batch per rank -> step time at the smallest context
    decode_floor_s: float  # a step of one request at the smallest context, other ranks idle
    prefill_alone_s: dict[int, float] = field(default_factory=dict)  # prompt length -> time

    @property
    def dp(self) -> int:
        return self.shape.dp_attention

    def max_batch(self, min_context_tokens: int) -> int:
        """Requests one DP rank can run at once (request cap, KV pool at the smallest context)."""
        return max(0, min(self.max_running_per_rank, self.kv_tokens_per_rank // min_context_tokens))

    def decode_tok_s(self, itl_targets: list[tuple[int, float]], slack: float) -> float:
        """Best decode tokens/s of the instance, with the ITL targets' share of small steps."""
        rates = {b: self.dp * b / t for b, t in self.decode_step_s.items()}
        best = max(rates.values()) * slack
        worst_case = best
        for q, bound_s in itl_targets:
            fitting = [rates[b] for b, t in self.decode_step_s.items() if t / slack <= bound_s]
            if not fitting:
                return 0.0
            share = q / 100
            capped = 1.0 / (share / (max(fitting) * slack) + (1 - share) / best)
            worst_case = min(worst_case, capped)
        return worst_case


@dataclass
class Verdict:
    """The pre-filter's answer on one deployment; `reason` says why it was discarded."""

    keep: bool
    reason: str = ""
    prefill_util: float = math.nan  # offered prefill tokens/s over capacity
    decode_util: float = math.nan  # offered decode tokens/s over capacity


class Prefilter:
    """Capacities per (role, shape), computed once and shared by every deployment."""

    def __init__(self, plan: PlanConfig, model: ModelSpec, hw: HardwareSpec, workload: Workload,
                 base_dir: str | None = None):
        self.plan, self.model, self.hw, self.base_dir = plan, model, hw, base_dir
        self.workload = workload
        self.slack = plan.prefilter.slack
        self._capacity: dict[tuple[str, RoleShape], RoleCapacity | str] = {}
        inputs = workload.input_tokens
        self.min_context_tokens = int(inputs.min()) + 1 if len(inputs) else 1
        self.open_loop = workload.closed_loop is None and plan.metrics.whole_run

    @cached_property
    def _longest_prompt(self) -> int:
        return int(self.workload.input_tokens.max(initial=0))

    @cached_property
    def _longest_request(self) -> int:
        w = self.workload
        return int((w.input_tokens + w.output_tokens).max(initial=0))

    @cached_property
    def _sorted_inputs(self) -> np.ndarray:
        return np.sort(self.workload.input_tokens.astype(np.float64))

    @cached_property
    def _sorted_decode_work(self) -> np.ndarray:
        return np.sort(np.maximum(self.workload.output_tokens - 1, 0).astype(np.float64))

    def capacity(self, role: str, shape: RoleShape) -> RoleCapacity | str:
        """The role's capacity, or why an instance of this shape cannot run at all."""
        key = (role, shape)
        if key not in self._capacity:
            self._capacity[key] = self._measure(role, shape)
        return self._capacity[key]

    def _measure(self, role: str, shape: RoleShape) -> RoleCapacity | str:
        # One instance of the shape, built as a colocated one (a pipelined prefill one: as a
        # prefill instance, the one role with stages).
        one = Candidate("colocated", (("colocated", 1, shape),)) if shape.pp == 1 else \
            Candidate("disaggregated", (("prefill", 1, shape), ("decode", 1, RoleShape(shape.tp))))
        cfg = parse_experiment(one.experiment_data(self.plan), f"plan {self.plan.name}")
        built = cfg.cluster.colocated if shape.pp == 1 else cfg.cluster.prefill
        try:
            spec = build_role(cfg, built, role, self.model, self.hw, base_dir=self.base_dir)
        except ConfigError as exc:
            return f"memory: {exc}"
        sched, cost = spec.scheduler, spec.cost()
        dp = shape.dp_attention
        kv_tokens = sched.num_pages * sched.page_size
        # an extend step holds at most one chunk; unchunked, a long prompt runs alone
        largest = sched.chunked_prefill_size or max(sched.max_prefill_tokens,
                                                     self._longest_prompt)
        prefill = 0.0
        for n in _geometric(largest):
            t = cost.step_time_s([BatchShape(prefill_tokens=n, prefill_attn_pairs=n)] * dp)
            prefill = max(prefill, dp * n / t)
        ctx = self.min_context_tokens
        limit = max(1, min(sched.max_running_requests, kv_tokens // ctx))
        decode = {b: cost.step_time_s([BatchShape(decode_reqs=b, decode_context_tokens=b * ctx)] * dp)
                  for b in _geometric(limit)}
        idle = [BatchShape()] * (dp - 1)
        floor = cost.step_time_s([BatchShape(decode_reqs=1, decode_context_tokens=ctx)] + idle)
        alone = {}
        for n in np.unique(self.workload.input_tokens):
            n = int(n)
            steps = prompt_chunks(n, sched.chunked_prefill_size, sched.dynamic_chunking)
            alone[n] = pipelined_s([cost.step_time_s([extend_shape(k, c)] + idle)
                                    for c, k in steps], shape.pp)
        return RoleCapacity(shape, kv_tokens, sched.max_running_requests, prefill, decode, floor,
                            alone)

    def check(self, dep: Candidate) -> Verdict:
        caps = []
        for role, n, shape in dep.roles:
            cap = self.capacity(role, shape)
            if isinstance(cap, str):
                return Verdict(False, f"{role}: {cap}")
            # an instance refuses a request its pool cannot hold whole: a prefill one its
            # prompt, the others its prompt and every token it may generate (pdsim.core)
            need = self._longest_prompt if role == "prefill" else self._longest_request
            if need > cap.kv_tokens_per_rank:
                return Verdict(False, f"{role} memory: the longest request needs {need:,} KV "
                               f"tokens, a rank's pool holds {cap.kv_tokens_per_rank:,}")
            caps.append((role, n, cap))
        serving = caps[-1]  # decode, or the colocated role
        first = caps[0]  # prefill, or the colocated role
        slo = self.plan.slo
        itl_targets = slo.percentile_targets("itl")
        _, _, dcap = serving
        step = dcap.decode_floor_s / self.slack
        for metric in ("itl", "tpot"):  # a request's mean gap is no shorter than its gaps
            for q, bound_s in slo.percentile_targets(metric):
                if step > bound_s:
                    return Verdict(False, f"{metric.upper()} floor: a one-request decode step "
                                   f"takes {step * 1e3:.1f} ms > {metric.upper()} p{q} target "
                                   f"{bound_s * 1e3:.1f} ms")
        reason = self._ttft_floor(first[2], slo.percentile_targets("ttft"))
        if reason:
            return Verdict(False, reason)
        p_rate = first[1] * first[2].prefill_tok_s * self.slack
        d_rate = serving[1] * dcap.decode_tok_s(itl_targets, self.slack)
        verdict = Verdict(True, prefill_util=self._offered(self._sorted_inputs) / p_rate,
                          decode_util=(self._offered(self._sorted_decode_work) / d_rate
                                       if d_rate > 0 else math.inf))
        if not self.open_loop:
            return verdict
        a_last = float(self.workload.arrival_s[-1]) if len(self.workload.arrival_s) else 0.0
        n_req = len(self._sorted_inputs)
        in_flight = serving[1] * dcap.dp * (dcap.max_batch(self.min_context_tokens)
                                            + dcap.kv_tokens_per_rank // self.min_context_tokens)
        def discard(reason: str) -> Verdict:
            return Verdict(False, reason, verdict.prefill_util, verdict.decode_util)

        for q, bound_s in slo.percentile_targets("ttft"):
            m = needed(q, n_req)
            horizon = a_last + bound_s
            need_p = float(self._sorted_inputs[:m].sum())
            if need_p > p_rate * horizon:
                return discard(f"prefill capacity: the {m} smallest prompts ({need_p:,.0f} tokens) "
                               f"exceed {p_rate:,.0f} tokens/s x {horizon:.1f} s, yet must be "
                               f"prefilled by then to meet TTFT p{q}")
            done = max(0, m - in_flight)
            need_d = float(self._sorted_decode_work[:done].sum())
            if need_d > d_rate * horizon:
                return discard(f"decode capacity: {done} requests' decode ({need_d:,.0f} tokens) "
                               f"exceeds {d_rate:,.0f} tokens/s x {horizon:.1f} s, yet must be "
                               f"done by then to meet TTFT p{q}")
            if dep.mode == "colocated" and need_p / p_rate + need_d / d_rate > horizon:
                return discard(f"prefill + decode capacity: prefilling {m} prompts and decoding "
                               f"{done} answers take more than {horizon:.1f} s on the same GPUs, "
                               f"yet must be done by then to meet TTFT p{q}")
        return verdict

    def _offered(self, work_sorted: np.ndarray) -> float:
        """Offered tokens/s of the work (over the arrival span; NaN for a closed loop)."""
        span = float(self.workload.arrival_s[-1]) if len(self.workload.arrival_s) else 0.0
        if not self.open_loop or span <= 0:
            return math.nan
        return float(work_sorted.sum()) / span

    def _ttft_floor(self, cap: RoleCapacity, targets: list[tuple[int, float]]) -> str:
        if not targets:
            return ""
        floors = np.sort(self.plan.router.frontend_latency_s + np.array(
            [cap.prefill_alone_s[int(n)] for n in self.workload.input_tokens]) / self.slack)
        for q, bound_s in targets:
            floor = floors[needed(q, len(floors)) - 1]
            if floor > bound_s:
                return (f"TTFT floor: prefill alone gives TTFT p{q} >= {floor * 1e3:,.0f} ms > "
                        f"target {bound_s * 1e3:,.0f} ms")
        return ""


def needed(q: int, n: int) -> int:
    """Requests that must be within a bound for NumPy's linear-interpolated p`q` of `n` values
    to be: the order statistic at floor(q (n - 1) / 100) already is, and so are all below it."""
    return int(math.floor(q * (n - 1) / 100)) + 1 if n else 0


def _geometric(limit: int) -> list[int]:
    """1, 2, 3, ... by factors of about 1.25 up to `limit`, with `limit` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b = max(b + 1, int(b * 1.25))
    return out + [limit]
