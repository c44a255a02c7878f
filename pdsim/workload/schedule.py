"""Arrivals whose rate changes over time: Poisson with a rate schedule (a non-homogeneous
Poisson process). Piecewise-constant `steps`, or a `diurnal` curve between a trough and a peak.

A schedule is sampled by inverting its cumulative rate: the k-th arrival is at the time t where
the expected arrivals so far, the integral of rate(t), first reach the k-th point of a unit-rate
Poisson process (sums of exponential(1) gaps). The workload's `num_requests` sets how many are
drawn; after its last step (or forever, for the diurnal curve) the schedule keeps its shape.

```yaml
arrival: {process: steps, steps: [{at_s: 0, rate_rps: 2}, {at_s: 300, rate_rps: 8}]}
arrival: {process: diurnal, trough_rps: 1, peak_rps: 10, period_s: 1800}  # peak at period/2
```
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from pdsim.workload.registry import Spec
from pdsim.workload.synthetic import ARRIVAL_PROCESSES, Arrival


class ScheduledArrival(Arrival):
    """A Poisson process whose rate follows `rate_at(t)`; the subclass gives the inverse of
    its cumulative rate."""

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def time_of_expected(self, expected: np.ndarray) -> np.ndarray:
        """The times at which the expected arrivals so far reach `expected` (sorted)."""
        raise NotImplementedError

    def arrival_times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.time_of_expected(np.cumsum(rng.exponential(1.0, n)))


class RateStep(Spec):
    at_s: float = Field(ge=0, allow_inf_nan=False, description="this rate holds from here on")
    rate_rps: float = Field(ge=0, allow_inf_nan=False)


@ARRIVAL_PROCESSES.register
class StepsArrival(ScheduledArrival):
    """A piecewise-constant rate: each step's `rate_rps` from its `at_s` until the next step;
    the last holds forever. The first step is at 0 s; a step may be 0 (no traffic) but not
    the last."""

    process: Literal["steps"] = "steps"
    steps: list[RateStep] = Field(min_length=1)

    @model_validator(mode="after")
    def _well_formed(self) -> StepsArrival:
        times = [s.at_s for s in self.steps]
        if times[0] != 0:
            raise ValueError(f"steps: the first step must be at_s 0, got {times[0]:g}")
        if any(b <= a for a, b in zip(times, times[1:])):
            raise ValueError(f"steps: at_s must increase from step to step, got {times}")
        if self.steps[-1].rate_rps <= 0:
            raise ValueError("steps: the last step's rate_rps must be > 0 (it holds forever)")
        return self

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.array([s.at_s for s in self.steps])
        rates = np.array([s.rate_rps for s in self.steps])
        expected_at_start = np.concatenate([[0.0], np.cumsum(np.diff(starts) * rates[:-1])])
        return starts, rates, expected_at_start

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        starts, rates, _ = self._arrays()
        return rates[np.searchsorted(starts, t_s, side="right") - 1]

    def time_of_expected(self, expected: np.ndarray) -> np.ndarray:
        starts, rates, at_start = self._arrays()
        # the step in which the count is reached: the last with a positive rate that starts at
        # or below it (a zero-rate step adds nothing, so the count falls in a later one)
        k = np.searchsorted(at_start, expected, side="right") - 1
        while np.any(zero := rates[k] == 0):
            k[zero] += 1
        return starts[k] + (expected - at_start[k]) / rates[k]


@ARRIVAL_PROCESSES.register
class DiurnalArrival(ScheduledArrival):
    """A day-shaped rate: a sinusoid of `period_s` between `trough_rps` and `peak_rps`,
    peaking at `peak_at_s` (default: half a period in, so the run starts at the trough)."""

    process: Literal["diurnal"] = "diurnal"
    trough_rps: float = Field(ge=0, allow_inf_nan=False)
    peak_rps: float = Field(gt=0, allow_inf_nan=False)
    period_s: float = Field(gt=0, allow_inf_nan=False)
    peak_at_s: float | None = Field(None, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> DiurnalArrival:
        if self.trough_rps > self.peak_rps:
            raise ValueError(f"trough_rps ({self.trough_rps:g}) must be <= peak_rps "
                             f"({self.peak_rps:g})")
        return self

    @property
    def _phase_s(self) -> float:
        return self.period_s / 2 if self.peak_at_s is None else self.peak_at_s

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        mid, amp = (self.peak_rps + self.trough_rps) / 2, (self.peak_rps - self.trough_rps) / 2
        return mid + amp * np.cos(2 * math.pi * (np.asarray(t_s) - self._phase_s) / self.period_s)

    def _expected_by(self, t_s: np.ndarray) -> np.ndarray:
        mid, amp = (self.peak_rps + self.trough_rps) / 2, (self.peak_rps - self.trough_rps) / 2
        w = 2 * math.pi / self.period_s
        phase = self._phase_s
        return mid * t_s + amp / w * (np.sin(w * (t_s - phase)) - math.sin(-w * phase))

    def time_of_expected(self, expected: np.ndarray) -> np.ndarray:
        if not len(expected):
            return np.zeros(0)
        mid = (self.peak_rps + self.trough_rps) / 2
        # the cumulative rate is within amp * period / pi of mid * t: this grid reaches past the
        # last count; 2048 points a period keep the linear interpolation well under a ms a day
        end_s = (float(expected[-1]) + self.peak_rps * self.period_s) / mid + self.period_s
        grid = np.linspace(0.0, end_s, int(math.ceil(end_s / self.period_s * 2048)) + 2)
        return np.interp(expected, self._expected_by(grid), grid)
