"""Stop a candidate's simulation once its SLO can no longer be met.

A percentile target (q, D) over n values holds only if at least `needed(q, n)` of them are
at most D (NumPy's linear-interpolated percentile). So once more than n - needed(q, n)
requests are certain to be over D, no future request can bring the percentile back under it:
the candidate is infeasible whatever the rest of the run does, and simulating it further only
refines numbers the plan discards. A request is certain to miss

- a TTFT target D once it finished over it, or (open loop) once the run's clock is past its
  arrival + D and it has no first token yet: an overload shows as overdue requests long
  before they finish;
- a TPOT or ITL target once it finished over it (for ITL each gap counts).

The overdue count is taken as each request is routed and as each one finishes, with the
clock at that request's arrival or last token. A first token is stamped by the event that
produces it (the end of a prefill step, a PD decode instance taking the request in), never
afterwards, so a request without one at that moment has none up to then. (A finish is not
stamped so: a run of decode steps settles its tokens when it ends, which is why the TPOT
rule waits for finishes.) The rule never stops a run that could still meet the SLO.

It needs every request inside the measurement window (`metrics` whole run); the planner
builds it only then.
"""

from __future__ import annotations

import numpy as np

from pdsim.core.request import Request
from pdsim.core.token_times import TokenTimes
from pdsim.planning.config import PlanConfig
from pdsim.planning.prefilter import needed
from pdsim.sim.faults import RETRY_SUFFIX
from pdsim.workload import Workload


class _Limit:
    """One percentile target: its bound, the misses it allows and the misses so far."""

    __slots__ = ("metric", "q", "bound_s", "allowed", "misses")

    def __init__(self, metric: str, q: int, bound_s: float, total: int) -> None:
        self.metric, self.q, self.bound_s = metric, q, bound_s
        self.allowed, self.misses = total - needed(q, total), 0

    def over(self) -> str:
        if self.misses <= self.allowed:
            return ""
        what = "gaps" if self.metric == "itl" else "requests"
        return (f"{self.misses} {what} over the {self.metric.upper()} p{self.q} target of "
                f"{self.bound_s * 1e3:,.0f} ms (at most {self.allowed} may be)")


class SloWatch:
    """Called with each finished request, and (`sent`) with each routed one; returns why the
    SLO is out of reach, or ""."""

    def __init__(self, plan: PlanConfig, workload: Workload) -> None:
        output_tokens = workload.output_tokens
        n = len(output_tokens)
        with_gaps = int((output_tokens >= 2).sum())  # a one-token answer has no TPOT
        gaps = int(np.maximum(output_tokens - 1, 0).sum())
        slo = plan.slo
        totals = {"ttft": n, "tpot": with_gaps, "itl": gaps}
        self._limits = {metric: [_Limit(metric, q, bound_s, total)
                                 for q, bound_s in slo.percentile_targets(metric)]
                        for metric, total in totals.items()}
        # Open loop: arrivals are known ahead, so overdue requests count before they finish.
        self._open = workload.closed_loop is None
        self._arrival_s = workload.arrival_s
        self._sent: dict[int, Request] = {}
        self._next_overdue = [0] * len(self._limits["ttft"])  # per TTFT target, arrival order

    def sent(self, req: Request) -> str:
        if not self._open:
            return ""
        self._sent[_index(req)] = req
        return self._overdue(req.arrival_s)

    def __call__(self, req: Request) -> str:
        if req.error:  # the plan's SLO also asks that no request fails
            return f"request {req.rid} failed ({req.error})"
        times = req.token_times_s
        times = times.as_array() if isinstance(times, TokenTimes) else np.asarray(times, float)
        if not len(times):
            return ""
        if not self._open:
            for limit in self._limits["ttft"]:
                limit.misses += int(times[0] - req.arrival_s > limit.bound_s)
        if len(times) > 1:
            gaps = np.diff(times)
            tpot_s = float(gaps.mean())
            for limit in self._limits["tpot"]:
                limit.misses += int(tpot_s > limit.bound_s)
            for limit in self._limits["itl"]:
                limit.misses += int(np.count_nonzero(gaps > limit.bound_s))
        return self._overdue(float(times[-1])) if self._open else self._over()

    def _overdue(self, now_s: float) -> str:
        """Count the requests certain, at `now_s`, to miss a TTFT target (those that arrived
        more than the target before and have no first token within it); then `_over`."""
        arrival_s = self._arrival_s
        for k, limit in enumerate(self._limits["ttft"]):
            j = self._next_overdue[k]
            while j < len(arrival_s) and arrival_s[j] + limit.bound_s < now_s:
                req = self._sent.get(j)
                times = req.token_times_s if req is not None else ()
                limit.misses += int(not (len(times) and times[0] - arrival_s[j] <= limit.bound_s))
                j += 1
            self._next_overdue[k] = j
        return self._over()

    def _over(self) -> str:
        """Why a target is out of reach, or ""."""
        for limits in self._limits.values():
            for limit in limits:
                reason = limit.over()
                if reason:
                    return reason
        return ""


def _index(req: Request) -> int:
    return int(req.rid.removesuffix(RETRY_SUFFIX))
