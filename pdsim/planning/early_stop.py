"""Stop a candidate's simulation once its SLO can no longer be met.

A percentile target (q, D) over n values holds only if at least `needed(q, n)` of them are
at most D (NumPy's linear-interpolated percentile). So once more than n - needed(q, n)
finished requests are over D, no future request can bring the percentile back under it: the
candidate is infeasible whatever the rest of the run does, and simulating it further only
refines numbers the plan discards. The rule looks only at finished requests, so it never
stops a run that could still meet the SLO.

It needs every request inside the measurement window (`metrics` whole run); the planner
builds it only then.
"""

from __future__ import annotations

import numpy as np

from pdsim.core.request import Request
from pdsim.core.token_times import TokenTimes
from pdsim.planning.config import PlanConfig
from pdsim.planning.prefilter import needed
from pdsim.workload import Workload


class SloWatch:
    """Called with each finished request; returns why the SLO is out of reach, or ""."""

    def __init__(self, plan: PlanConfig, workload: Workload) -> None:
        output_tokens = workload.output_tokens
        n = len(output_tokens)
        with_gaps = int((output_tokens >= 2).sum())  # a one-token answer has no TPOT
        gaps = int(np.maximum(output_tokens - 1, 0).sum())
        slo = plan.slo
        # metric -> [(percentile, bound_s, misses allowed, misses so far)]
        self._limits = {
            metric: [[q, bound_s, total - needed(q, total), 0]
                     for q, bound_s in slo.percentile_targets(metric)]
            for metric, total in (("ttft", n), ("tpot", with_gaps), ("itl", gaps))}

    def __call__(self, req: Request) -> str:
        if req.error:  # the plan's SLO also asks that no request fails
            return f"request {req.rid} failed ({req.error})"
        times = req.token_times_s
        times = times.as_array() if isinstance(times, TokenTimes) else np.asarray(times, float)
        ttft = times[0] - req.arrival_s if len(times) else np.nan
        gaps = np.diff(times) if len(times) > 1 else None
        values = {"ttft": (ttft,), "tpot": () if gaps is None else (float(gaps.mean()),),
                  "itl": () if gaps is None else gaps}
        for metric, limits in self._limits.items():
            for limit in limits:
                q, bound_s, allowed, _ = limit
                limit[3] += int(np.count_nonzero(np.asarray(values[metric]) > bound_s))
                if limit[3] > allowed:
                    return (f"{limit[3]} {'gaps' if metric == 'itl' else 'requests'} over the "
                            f"{metric.upper()} p{q} target of {bound_s * 1e3:,.0f} ms (at most "
                            f"{allowed} may be)")
        return ""
