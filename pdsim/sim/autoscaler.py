"""The simulator's side of autoscaling: every `interval_s` it observes the cluster, asks the
configured policy (pdsim/core/autoscale.py) for a target, and starts or drains instances.

- Scale-up: a new instance holds its GPUs from the decision on, and joins the router after its
  cold start, process_start_s + the weight bytes of one GPU's shard / weights_gb_per_s. A
  scale-down before it joined cancels it (the newest starting one first).
- Scale-down: the newest serving instance leaves the router at once and drains: a decode
  instance finishes every request it was sent, a prefill instance every prefill (its KV sent);
  then it leaves and its GPUs are free. At least one instance of each role keeps serving.

What a run did is kept as `InstanceSpan`s (GPU-hours) and one `TimelineSample` per interval
(instances, queues, KV usage, busy time per role); pdsim.metrics joins them with the records
into the run's timeline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pdsim.autoscaling_config import AutoscalingConfig
from pdsim.core.autoscale import ROLES, RoleState, ScaleObservation, ScaleTarget
from pdsim.core.batch import BatchShape
from pdsim.core.records import RequestRecord
from pdsim.metrics import SLO, timeline

if TYPE_CHECKING:
    import pandas as pd

    import simpy

    from pdsim.core.request import Request
    from pdsim.core.router import InflightLoad, Router
    from pdsim.sim.instance import SimInstance
    from pdsim.sim.spec import ClusterSpec, RoleSpec


class ScalableSim(Protocol):
    """What the autoscaler drives of a simulation (pdsim/sim/cluster.py's `Simulation`)."""

    env: simpy.Environment
    cluster: ClusterSpec
    prefills: list[SimInstance]
    serving: list[SimInstance]
    inflight: InflightLoad
    router: Router

    def add_instance(self, kind: str) -> int: ...


@dataclass(frozen=True)
class AutoscaleSetup:
    """What a simulation's autoscaler needs beyond the cluster: the config and the ITL target
    the SLA planner's decode capacity is derived at."""

    config: AutoscalingConfig
    itl_slo_s: float


@dataclass
class InstanceSpan:
    """One instance's life: GPUs held from `requested_s` to `left_s` (NaN: to the run's end)."""

    role: str
    gpus: int
    requested_s: float
    joined_s: float = math.nan  # NaN: never joined (cancelled while starting)
    drain_s: float = math.nan
    left_s: float = math.nan
    index: int = -1  # among its role's instances, once it joined

    def held_s(self, end_s: float) -> float:
        return (end_s if math.isnan(self.left_s) else self.left_s) - self.requested_s


@dataclass(frozen=True)
class TimelineSample:
    """The cluster at the end of the window (end_s - interval, end_s], and the target the
    policy set then."""

    end_s: float
    running: dict[str, int]
    starting: dict[str, int]
    draining: dict[str, int]
    queue_len: dict[str, int]
    kv_usage: dict[str, float]
    busy_instances: dict[str, float]  # forward time in the window / the window: busy instances
    target: dict[str, int]


def cold_start_s(config: AutoscalingConfig, role: RoleSpec) -> float:
    cold = config.cold_start
    return cold.process_start_s + role.weight_bytes_per_gpu / (cold.weights_gb_per_s * 1e9)


def derived_capacities(prefill: RoleSpec, decode: RoleSpec, mean_input_tokens: float,
                       mean_output_tokens: float, itl_slo_s: float) -> tuple[float, float]:
    """(prompt tokens/s of one prefill instance, output tokens/s of one decode instance) from
    the roles' cost models, for the SLA planner. Prefill: back-to-back batches of whole mean
    prompts up to the batch limit. Decode: the largest batch (within its request slots and KV
    pages at the mean context) whose step at the mean context, input + half the output, takes
    at most the ITL target; its tokens per step time. Neither counts queueing: plan below them
    with `headroom`."""
    isl = max(1, round(mean_input_tokens))
    p = prefill.scheduler
    per_batch = max(1, min(p.max_prefill_tokens, p.chunked_prefill_size or p.max_prefill_tokens)
                    // isl)
    tokens = min(per_batch * isl, p.max_prefill_tokens) if per_batch > 1 else isl
    k = max(1, tokens // isl)
    shape = BatchShape(prefill_tokens=k * isl, prefill_attn_pairs=k * isl * (isl + 1) / 2)
    cost = prefill.cost()
    prefill_tps = prefill.dp_attention * k * isl / cost.step_time_s([shape] * prefill.dp_attention)

    d = decode.scheduler
    context = max(1, round(mean_input_tokens + mean_output_tokens / 2))
    per_request = max(1, round(mean_input_tokens + mean_output_tokens))
    most = max(1, min(d.max_running_requests, d.num_pages * d.page_size // per_request))
    cost = decode.cost()

    def step_s(b: int) -> float:
        return cost.step_time_s([BatchShape(decode_reqs=b, decode_context_tokens=b * context)]
                                * decode.dp_attention)

    lo, hi = 1, most  # the largest b with step_s(b) <= itl_slo_s (1 when none is)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid) <= itl_slo_s:
            lo = mid
        else:
            hi = mid - 1
    return prefill_tps, decode.dp_attention * lo / step_s(lo)


class SimAutoscaler:
    def __init__(self, sim: ScalableSim, setup: AutoscaleSetup, input_tokens: np.ndarray,
                 output_tokens: np.ndarray):
        self.sim = sim
        self.config = config = setup.config
        spec = sim.cluster
        self.roles: dict[str, RoleSpec] = {"prefill": spec.prefill, "decode": spec.decode}
        self.instances = {"prefill": sim.prefills, "decode": sim.serving}
        self.cold_start_s = {r: cold_start_s(config, s) for r, s in self.roles.items()}
        self.capacities: tuple[float, float] | None = None
        sla = config.sla
        if config.policy == "sla" and (sla is None or sla.prefill_tokens_per_s is None
                                       or sla.decode_tokens_per_s is None):
            self.capacities = derived_capacities(
                spec.prefill, spec.decode, float(np.mean(input_tokens)),
                float(np.mean(output_tokens)), setup.itl_slo_s)
        self.policy = config.make_policy(*(self.capacities or (None, None)))
        self.spans: list[InstanceSpan] = []
        self.serving: dict[str, list[int]] = {r: [] for r in ROLES}
        self.starting: dict[str, list[InstanceSpan]] = {r: [] for r in ROLES}
        self.draining: dict[str, dict[int, InstanceSpan]] = {r: {} for r in ROLES}
        self._span_of: dict[tuple[str, int], InstanceSpan] = {}
        for role in ROLES:
            for i in range(len(self.instances[role])):
                self._joined(role, i, InstanceSpan(role, self.roles[role].gpus_per_instance, 0.0))
        self.samples: list[TimelineSample] = []
        self._window_start_s = 0.0
        self._arrivals: list[tuple[int, int]] = []
        self._ttft_s: list[float] = []
        self._itl_s: list[float] = []
        self._busy_s = {r: 0.0 for r in ROLES}  # forward seconds of each role so far
        self._busy_window = {r: 0.0 for r in ROLES}  # ... in the last window, / its length

    # ----- what the simulation tells it ----------------------------------------------------

    def arrived(self, input_tokens: int, output_tokens: int) -> None:
        self._arrivals.append((input_tokens, output_tokens))

    def finished(self, req: Request) -> None:
        times = req.token_times_s
        if not req.error and times:
            self._ttft_s.append(times[0] - req.arrival_s)
            if len(times) > 1:
                self._itl_s.append((times[-1] - times[0]) / (len(times) - 1))
        self.returned("decode", req.decode_instance)

    def returned(self, role: str, index: int) -> None:
        """A call to instance `index` of `role` returned: a draining one may leave now."""
        span = self.draining[role].get(index)
        if span is not None and self._load(role, index) == 0:
            del self.draining[role][index]
            span.left_s = self.sim.env.now

    # ----- the loop ------------------------------------------------------------------------

    def start(self) -> None:
        self._route()
        self.sim.env.process(self._loop())

    def _loop(self):
        env = self.sim.env
        while True:
            yield env.timeout(self.policy.interval_s)
            obs = self._observe()
            target = self.policy.decide(obs)
            self._sample(obs, target)
            for role in ROLES:
                self._scale(role, target.of(role))

    def _observe(self) -> ScaleObservation:
        now = self.sim.env.now
        arrivals = self._arrivals
        n = len(arrivals)
        obs = ScaleObservation(
            now_s=now, window_s=now - self._window_start_s,
            prefill=self._role_state("prefill"), decode=self._role_state("decode"),
            arrivals=n,
            mean_input_tokens=sum(a for a, _ in arrivals) / n if n else None,
            mean_output_tokens=sum(b for _, b in arrivals) / n if n else None,
            ttft_p90_s=_p90(self._ttft_s), itl_p90_s=_p90(self._itl_s))
        self._window_start_s = now
        arrivals.clear()
        self._ttft_s.clear()
        self._itl_s.clear()
        return obs

    def _role_state(self, role: str) -> RoleState:
        insts = [self.instances[role][i] for i in self.serving[role]]
        scheds = [s for inst in insts for s in inst.schedulers]
        if role == "prefill":
            queue = sum(len(s.bootstrap) + len(s.waiting) for s in scheds)
        else:
            queue = sum(len(s.prealloc) + len(s.waiting) for s in scheds)
        kv = sum(s.pool.num_used / s.pool.size for s in scheds) / len(scheds)
        return RoleState(running=len(insts), starting=len(self.starting[role]),
                         draining=len(self.draining[role]), queue_len=queue, kv_usage=kv,
                         busy=self._busy_share(role, len(insts)))

    def _busy_share(self, role: str, running: int) -> float | None:
        """The role's forward time in the window over the window times its serving instances
        (draining ones' work counts: it was load), capped at 1; None in an empty window."""
        window_s = self.sim.env.now - self._window_start_s
        if window_s <= 0:
            return None
        total = sum(inst.busy_s for inst in self.instances[role])
        self._busy_window[role] = (total - self._busy_s[role]) / window_s
        self._busy_s[role] = total
        return min(1.0, self._busy_window[role] / running)

    def _sample(self, obs: ScaleObservation, target: ScaleTarget) -> None:
        busy = dict(self._busy_window)
        states = {r: obs.role(r) for r in ROLES}
        self.samples.append(TimelineSample(
            obs.now_s, {r: s.running for r, s in states.items()},
            {r: s.starting for r, s in states.items()}, {r: s.draining for r, s in states.items()},
            {r: s.queue_len for r, s in states.items()}, {r: s.kv_usage for r, s in states.items()},
            busy, {r: target.of(r) for r in ROLES}))

    # ----- acting on a target --------------------------------------------------------------

    def _scale(self, role: str, target: int) -> None:
        now = self.sim.env.now
        have = len(self.serving[role]) + len(self.starting[role])
        for _ in range(target - have):
            span = InstanceSpan(role, self.roles[role].gpus_per_instance, now)
            self.spans.append(span)
            self.starting[role].append(span)
            self.sim.env.process(self._cold_start(role, span))
        for _ in range(have - target):
            if self.starting[role]:
                self.starting[role].pop().left_s = now
            elif len(self.serving[role]) > 1:
                self._drain(role, self.serving[role].pop())
                self._route()

    def _cold_start(self, role: str, span: InstanceSpan):
        yield self.sim.env.timeout(self.cold_start_s[role])
        if not math.isnan(span.left_s):
            return  # cancelled while starting
        self.starting[role].remove(span)
        self._joined(role, self.sim.add_instance(role), span)
        self._route()

    def _joined(self, role: str, index: int, span: InstanceSpan) -> None:
        span.index, span.joined_s = index, self.sim.env.now
        if span not in self.spans:
            self.spans.append(span)
        self.serving[role].append(index)
        self._span_of[role, index] = span

    def _drain(self, role: str, index: int) -> None:
        span = self._span_of[role, index]
        span.drain_s = self.sim.env.now
        self.draining[role][index] = span
        self.returned(role, index)

    def _load(self, role: str, index: int) -> int:
        inflight = self.sim.inflight
        return (inflight.prefill_tokens if role == "prefill" else inflight.decode_requests)[index]

    def _route(self) -> None:
        self.sim.router.set_serving(self.serving["prefill"], self.serving["decode"])

    # ----- after the run -------------------------------------------------------------------

    def serving_s(self, role: str, end_s: float) -> float:
        """Seconds the role's instances were joined (serving or draining), summed."""
        return sum((end_s if math.isnan(s.left_s) else s.left_s) - s.joined_s
                   for s in self.spans if s.role == role and not math.isnan(s.joined_s))

    def gpu_hours(self, end_s: float) -> float:
        return sum(s.gpus * s.held_s(end_s) for s in self.spans) / 3600

    def gpus_at(self, t_s: float) -> int:
        return sum(s.gpus for s in self.spans if s.requested_s <= t_s
                   and (math.isnan(s.left_s) or s.left_s > t_s))

    def summary(self, end_s: float) -> dict[str, float]:
        """GPU-hours, and against a static cluster of the run's peak size held for the run."""
        changes = sorted({0.0} | {s.requested_s for s in self.spans})
        peak = max(self.gpus_at(t) for t in changes)
        hours = self.gpu_hours(end_s)
        static = peak * end_s / 3600
        row = {"gpu_hours": hours, "peak_gpus": peak, "mean_gpus": hours * 3600 / end_s,
               "static_peak_gpu_hours": static,
               "gpu_hours_vs_static_peak": hours / static if static else math.nan,
               "scale_ups": sum(1 for s in self.spans if s.requested_s > 0),
               "scale_downs": sum(1 for s in self.spans if not math.isnan(s.drain_s)),
               "cold_start_prefill_s": self.cold_start_s["prefill"],
               "cold_start_decode_s": self.cold_start_s["decode"]}
        if self.capacities is not None:
            row["sla_prefill_tokens_per_s"], row["sla_decode_tokens_per_s"] = self.capacities
        return row


def _p90(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def timeline_frame(scaler: SimAutoscaler, records: Sequence[RequestRecord], end_s: float,
                   slo: SLO) -> pd.DataFrame:
    """One row per policy interval (and the part after the last one): the window's load and
    latencies (pdsim.metrics.timeline) with the instances of each role at its end (running,
    starting, draining), their queues, KV usage, busy instances (forward time / window), the
    policy's target and the GPUs held."""
    import pandas as pd

    ends = [s.end_s for s in scaler.samples]
    if not ends or end_s > ends[-1]:
        ends.append(end_s)
    rows = timeline(records, ends, slo)
    for row, sample in zip(rows, scaler.samples):
        for role in ROLES:
            for name in ("running", "starting", "draining", "queue_len", "kv_usage",
                         "busy_instances", "target"):
                row[f"{role}_{name}"] = getattr(sample, name)[role]
        row["gpus"] = scaler.gpus_at(sample.end_s)
    return pd.DataFrame(rows)
