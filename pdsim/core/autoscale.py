"""Autoscaling policies: how many prefill and decode instances a PD cluster should have next.

Both backends run the same policies. Every `interval_s` the backend builds a `ScaleObservation`
of the window that just ended (its own clock: simulated or wall) and calls `decide`; the
`ScaleTarget` it gets back is the number of instances each role should have, counting those
still starting. The backend then starts instances (they pay a cold start before they take
requests) or drains them (they take no new requests and leave once their work is done).

A policy keeps only what it needs between calls (a cooldown's last change, a predictor's
history), keyed on `now_s` from the observation; nothing here reads a clock.

- `StaticPolicy`: the counts the cluster has (a baseline with the same timeline and GPU-hours).
- `FixedSchedule`: the counts at given times (tests, and a known daily profile).
- `ThresholdPolicy`: one instance more or less per role when its queue per instance, its KV
  usage or (where given) its busy share crosses a threshold, with a cooldown per role.
- `SlaPlanner`, in the style of NVIDIA Dynamo's SLA planner: predict the next interval's
  request rate and mean input and output lengths from the past windows, and give each role as
  many instances as that load needs at a per-instance capacity measured at the SLO (prompt
  tokens per second within the TTFT target, output tokens per second within the ITL target).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleState:
    """One role's instances and load at the end of a window."""

    running: int  # in the router, taking requests
    starting: int = 0  # cold-starting: counted as capacity to come, not yet routed to
    draining: int = 0  # out of the router, finishing their work
    queue_len: int = 0  # prefill: requests waiting; decode: requests waiting or pre-allocating
    kv_usage: float = 0.0  # share of the running instances' KV pages in use, 0..1
    busy: float | None = None  # share of the window the running instances computed (None: unknown)

    @property
    def provisioned(self) -> int:
        """Instances that serve now or will once started."""
        return self.running + self.starting


@dataclass(frozen=True)
class ScaleObservation:
    """What a policy sees: the window (now_s - window_s, now_s]."""

    now_s: float
    window_s: float
    prefill: RoleState
    decode: RoleState
    arrivals: int = 0  # requests that arrived in the window
    mean_input_tokens: float | None = None  # of those arrivals (None: none arrived)
    mean_output_tokens: float | None = None
    ttft_p90_s: float | None = None  # of requests whose first token came in the window
    itl_p90_s: float | None = None  # of requests that finished in the window (mean gap each)

    @property
    def arrival_rate_rps(self) -> float:
        return self.arrivals / self.window_s if self.window_s > 0 else 0.0

    def role(self, name: str) -> RoleState:
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r}; allowed: {', '.join(ROLES)}")
        return getattr(self, name)


@dataclass(frozen=True)
class ScaleTarget:
    """Instances each role should have, those starting included."""

    prefill: int
    decode: int

    def __post_init__(self):
        for name in ROLES:
            n = getattr(self, name)
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"ScaleTarget.{name} must be a whole number >= 0, got {n!r}")

    def of(self, role: str) -> int:
        return getattr(self, role)


@dataclass(frozen=True)
class Bounds:
    """The fewest and most instances of each role a policy may ask for."""

    min_prefill: int = 1
    max_prefill: int = 1_000_000
    min_decode: int = 1
    max_decode: int = 1_000_000

    def __post_init__(self):
        for role in ROLES:
            lo, hi = self.limits(role)
            if lo < 1 or hi < lo:
                raise ValueError(f"{role} bounds must satisfy 1 <= min <= max, got "
                                 f"min {lo}, max {hi}")

    def limits(self, role: str) -> tuple[int, int]:
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")

    def clamp(self, role: str, n: int) -> int:
        lo, hi = self.limits(role)
        return min(max(n, lo), hi)

    def target(self, prefill: int, decode: int) -> ScaleTarget:
        return ScaleTarget(self.clamp("prefill", prefill), self.clamp("decode", decode))


class AutoscalePolicy(Protocol):
    interval_s: float

    def decide(self, obs: ScaleObservation) -> ScaleTarget: ...


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class StaticPolicy:
    """Keeps what the cluster has: the baseline autoscaling is measured against."""

    def __init__(self, interval_s: float):
        _positive("interval_s", interval_s)
        self.interval_s = interval_s

    def decide(self, obs: ScaleObservation) -> ScaleTarget:
        return ScaleTarget(obs.prefill.provisioned, obs.decode.provisioned)


class FixedSchedule:
    """The counts of the latest step at or before `now_s`: `steps` are (at_s, prefill,
    decode) in increasing at_s. Before the first step the cluster keeps what it has."""

    def __init__(self, steps: Sequence[tuple[float, int, int]], interval_s: float,
                 bounds: Bounds = Bounds()):
        _positive("interval_s", interval_s)
        if not steps:
            raise ValueError("a fixed schedule needs at least one (at_s, prefill, decode) step")
        times = [float(s[0]) for s in steps]
        if any(b <= a for a, b in zip(times, times[1:])):
            raise ValueError(f"fixed schedule steps must have increasing at_s, got {times}")
        self.steps = [(float(t), bounds.clamp("prefill", int(p)), bounds.clamp("decode", int(d)))
                      for t, p, d in steps]
        self.interval_s = interval_s

    def decide(self, obs: ScaleObservation) -> ScaleTarget:
        current = ScaleTarget(obs.prefill.provisioned, obs.decode.provisioned)
        for at_s, p, d in self.steps:
            if at_s > obs.now_s:
                break
            current = ScaleTarget(p, d)
        return current


@dataclass(frozen=True)
class RoleThresholds:
    """When one role grows or shrinks by one instance: up when its queue per running instance
    exceeds `queue_up`, its KV usage `kv_up` or its busy share `busy_up`; down when all are
    below `queue_down`, `kv_down` and `busy_down` and nothing of the role is starting or
    draining. The busy thresholds (None: not used) read `RoleState.busy`, a window's average,
    where the queue and KV usage are what the end of the window holds: a prefill instance
    busy 90% of the time may have an empty queue whenever it is looked at."""

    queue_up: float = 4.0
    queue_down: float = 0.5
    kv_up: float = 0.85
    kv_down: float = 0.4
    busy_up: float | None = None
    busy_down: float | None = None

    def __post_init__(self):
        if not 0 <= self.queue_down < self.queue_up:
            raise ValueError(f"thresholds need 0 <= queue_down < queue_up, got queue_down "
                             f"{self.queue_down}, queue_up {self.queue_up}")
        if not 0 <= self.kv_down < self.kv_up <= 1:
            raise ValueError(f"thresholds need 0 <= kv_down < kv_up <= 1, got kv_down "
                             f"{self.kv_down}, kv_up {self.kv_up}")
        if (self.busy_up is None) != (self.busy_down is None) or (
                self.busy_up is not None and not 0 <= self.busy_down < self.busy_up <= 1):
            raise ValueError(f"thresholds need both busy_down and busy_up or neither, with "
                             f"0 <= busy_down < busy_up <= 1, got busy_down {self.busy_down}, "
                             f"busy_up {self.busy_up}")

    def grow(self, state: RoleState) -> bool:
        queue = state.queue_len / max(state.running, 1)
        busy = self.busy_up is not None and state.busy is not None and state.busy > self.busy_up
        return queue > self.queue_up or state.kv_usage > self.kv_up or busy

    def shrink(self, state: RoleState) -> bool:
        queue = state.queue_len / max(state.running, 1)
        idle = self.busy_down is None or state.busy is None or state.busy < self.busy_down
        return (queue < self.queue_down and state.kv_usage < self.kv_down and idle
                and not state.starting and not state.draining)


class ThresholdPolicy:
    """One instance more or fewer per role and interval, by queue length and KV usage; a role
    that changed does not change again for `cooldown_s` (its new instance must start, or the
    load must settle on the fewer ones, before the signal means anything)."""

    def __init__(self, prefill: RoleThresholds, decode: RoleThresholds, interval_s: float,
                 cooldown_s: float = 0.0, bounds: Bounds = Bounds()):
        _positive("interval_s", interval_s)
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.thresholds = {"prefill": prefill, "decode": decode}
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self.bounds = bounds
        self.last_change_s = {role: -math.inf for role in ROLES}

    def decide(self, obs: ScaleObservation) -> ScaleTarget:
        counts = {}
        for role in ROLES:
            state, th = obs.role(role), self.thresholds[role]
            n = state.provisioned
            if obs.now_s - self.last_change_s[role] >= self.cooldown_s:
                if th.grow(state):
                    n += 1
                elif th.shrink(state):
                    n -= 1
            n = self.bounds.clamp(role, n)
            if n != state.provisioned:
                self.last_change_s[role] = obs.now_s
            counts[role] = n
        return ScaleTarget(**counts)


PREDICTORS = ("last", "moving_average", "linear")


class Predictor:
    """The next interval's value of a series from its last `window` values: `last` repeats
    the latest, `moving_average` their mean, `linear` a least-squares line through them one
    step on (never below 0). Missing values (None: no sample in a window) are skipped."""

    def __init__(self, kind: str, window: int):
        if kind not in PREDICTORS:
            raise ValueError(f"unknown predictor {kind!r}; allowed: {', '.join(PREDICTORS)}")
        if window < 1:
            raise ValueError(f"predictor window must be >= 1, got {window}")
        self.kind = kind
        self.values: deque[float] = deque(maxlen=1 if kind == "last" else window)

    def add(self, value: float | None) -> None:
        if value is not None:
            self.values.append(float(value))

    def predict(self) -> float | None:
        v = self.values
        if not v:
            return None
        if self.kind == "last":
            return v[-1]
        if self.kind == "moving_average" or len(v) == 1:
            return sum(v) / len(v)
        n = len(v)
        mean_x, mean_y = (n - 1) / 2, sum(v) / n
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(v))
                 / sum((x - mean_x) ** 2 for x in range(n)))
        return max(0.0, mean_y + slope * (n - mean_x))


@dataclass
class SlaPlanner:
    """Dynamo-style sizing: prefill instances = predicted rate x input length / the prompt
    tokens per second one instance sustains within the TTFT target; decode instances =
    predicted rate x output length / the output tokens per second one instance sustains
    within the ITL target. Both capacities are inputs (the simulator derives them from its
    cost model; `pdsim plan` or a benchmark gives them for real hardware). `headroom` (<= 1)
    plans each instance at that share of its capacity."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    interval_s: float
    predictor: str = "moving_average"
    window: int = 3
    headroom: float = 1.0
    bounds: Bounds = Bounds()
    _series: dict[str, Predictor] = field(init=False, repr=False)

    def __post_init__(self):
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("decode_tokens_per_s", self.decode_tokens_per_s)
        _positive("interval_s", self.interval_s)
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom must lie in (0, 1], got {self.headroom!r}")
        self._series = {k: Predictor(self.predictor, self.window)
                        for k in ("rate", "input", "output")}

    def decide(self, obs: ScaleObservation) -> ScaleTarget:
        s = self._series
        s["rate"].add(obs.arrival_rate_rps)
        s["input"].add(obs.mean_input_tokens)
        s["output"].add(obs.mean_output_tokens)
        rate, isl, osl = (s[k].predict() for k in ("rate", "input", "output"))
        if isl is None or osl is None:  # nothing has arrived yet: the floor
            return self.bounds.target(0, 0)
        prefill = rate * isl / (self.prefill_tokens_per_s * self.headroom)
        decode = rate * osl / (self.decode_tokens_per_s * self.headroom)
        return self.bounds.target(math.ceil(prefill - 1e-9), math.ceil(decode - 1e-9))
