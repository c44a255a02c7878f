"""Pipeline-parallel prefill: an instance of `pp` stages, its chunks overlapping across them.

The core plans one extend batch at a time and the simulated instance waits out each step
before planning the next. With stages, SGLang starts the next chunk on stage 0 as soon as the
previous one has left it, so up to `pp` chunks are in flight and C chunks back to back take
(C + pp - 1) stage times, not C * pp. `PipelineExecutor` reproduces those completion times in
the one-step-at-a-time loop: the cost model prices a step as one stage's (pdsim.sim.cost,
Parallelism.pp) and the executor answers how long after the step's start its chunk leaves the
last stage:

- after an idle spell the chunk enters stage 0 at once and leaves the last stage pp stage
  times later (the pipeline fills: the bubble);
- back to back (the step is planned the moment the previous one finished) it entered stage 0
  when the previous chunk left it, so it leaves the last stage one stage time after the
  previous chunk did, or pp stage times after it entered, whichever is later.

The stage priced is the slowest (pdsim.specs.pipeline), as if every stage took its time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdsim.core.batch import Batch, BatchResult
from pdsim.sim.cost import CostModel
from pdsim.sim.instance import CostExecutor


class PipelineExecutor(CostExecutor):
    """`CostExecutor` of an instance with `pp` pipeline stages; `clock()` is the simulated now
    at which a step starts."""

    def __init__(self, cost: CostModel, pp: int, clock: Callable[[], float]):
        super().__init__(cost)
        self.pp = pp
        self._clock = clock
        self._stage0_free_s = -math.inf  # when the last chunk left stage 0
        self._done_s = -math.inf  # when the last chunk left the last stage

    def execute(self, step: Sequence[Batch | None]) -> BatchResult:
        stage_s = self.step_time_s(step)
        now = self._clock()
        entry = now if now > self._done_s else min(self._stage0_free_s, now)
        done = max(entry + self.pp * stage_s, max(self._done_s, now) + stage_s)
        duration = done - now
        self._stage0_free_s = entry + stage_s
        self._done_s = now + duration  # the float the simulated clock will read at the end
        return BatchResult(duration)


def make_executor(cost: CostModel, pp: int, clock: Callable[[], float]) -> CostExecutor:
    """The executor of one simulated instance: pipelined with stages, plain without."""
    return CostExecutor(cost) if pp == 1 else PipelineExecutor(cost, pp, clock)
