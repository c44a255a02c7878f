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
  previous chunk did, or pp stage times after it entered, whichever is later;
- but never before its requests could be scheduled: a request that finished its bootstrap after
  the previous chunk had left stage 0 enters stage 0 then (SGLang's stage 0 schedules it in the
  loop iteration after it is ready), and so takes pp stage times from its readiness, however
  the pipeline was filled before it.

The stage priced is the slowest (pdsim.specs.pipeline), as if every stage took its time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pdsim.core.batch import Batch, BatchResult, BatchShape, extend_shape
from pdsim.core.chunking import DynamicChunking
from pdsim.core.config import SchedulerConfig
from pdsim.sim.cost import CostModel
from pdsim.sim.instance import CostExecutor

# SGLang's profile for dynamic chunking: 128 lone prompts from 1.25 chunks down in equal
# steps, the first (its warm-up) dropped before the fit.
PROFILE_SAMPLES = 128
PROFILE_SPAN = 1.25


def next_chunk(stage0_free_s: float, done_s: float, now: float, stage_s: float, pp: int,
               ready_s: float = -math.inf) -> tuple[float, float]:
    """(when a chunk of `stage_s` per stage, planned at `now`, leaves stage 0, when it leaves
    the last stage), the previous chunk having left them at `stage0_free_s` and `done_s`, its
    requests schedulable since `ready_s` (<= now; module docstring)."""
    entry = now if now > done_s else max(min(stage0_free_s, now), ready_s)
    return entry + stage_s, max(entry + pp * stage_s, max(done_s, now) + stage_s)


def step_ready_s(step: Sequence[Batch | None]) -> float:
    """The latest time a request of `step` became schedulable: its KV sender's bootstrap end
    (`SimKVSender.ready_s`); -inf where no sender says (a continuing chunk's request was ready
    long before, so only a step's new requests bind)."""
    ready = -math.inf
    for batch in step:
        for seg in getattr(batch, "segments", ()):  # a decode batch has none
            ready = max(ready, getattr(seg.req.sender, "ready_s", -math.inf))
    return ready


def pipelined_s(stage_times_s: Sequence[float], pp: int) -> float:
    """Seconds from an idle start until the last of chunks run back to back (one stage time
    each) leaves the last of `pp` stages: (C + pp - 1) stage times when they are equal."""
    stage0_free = done = -math.inf
    now = 0.0
    for stage_s in stage_times_s:
        stage0_free, done = next_chunk(stage0_free, done, now, stage_s, pp)
        now = done
    return now


class PipelineExecutor(CostExecutor):
    """`CostExecutor` of an instance with `pp` pipeline stages; `clock()` is the simulated now
    at which a step starts."""

    def __init__(self, cost: CostModel, pp: int, clock: Callable[[], float],
                 host_copy_s_per_page: float = 0.0):
        super().__init__(cost, host_copy_s_per_page)
        self.pp = pp
        self._clock = clock
        self._stage0_free_s = -math.inf  # when the last chunk left stage 0
        self._done_s = -math.inf  # when the last chunk left the last stage

    def execute(self, step: Sequence[Batch | None]) -> BatchResult:
        now = self._clock()
        ready = step_ready_s(step) if now <= self._done_s else -math.inf
        self._stage0_free_s, done = next_chunk(self._stage0_free_s, self._done_s, now,
                                               self.step_time_s(step)
                                               + self.kv_moves_s(step), self.pp,
                                               min(ready, now))
        duration = done - now
        self._done_s = now + duration  # the float the simulated clock will read at the end
        return BatchResult(duration)


def make_executor(cost: CostModel, pp: int, clock: Callable[[], float],
                  host_copy_s_per_page: float = 0.0) -> CostExecutor:
    """The executor of one simulated instance: pipelined with stages, plain without."""
    if pp == 1:
        return CostExecutor(cost, host_copy_s_per_page)
    return PipelineExecutor(cost, pp, clock, host_copy_s_per_page)


def profile_lengths(base: int) -> list[int]:
    """The prompt lengths SGLang times to fit its dynamic chunking (warm-up sample dropped)."""
    top = base * PROFILE_SPAN
    step = top // PROFILE_SAMPLES
    lengths = [int(top - i * step) for i in range(PROFILE_SAMPLES)]
    return [n for n in lengths if n > 0][1:]


def fit_dynamic_chunking(cost: CostModel, sched: SchedulerConfig, dp_attention: int,
                         smooth: float) -> DynamicChunking | None:
    """SGLang's dynamic chunking for one DP rank of a pipelined prefill instance: one stage's
    step (`cost`) timed on the profile's lone prompts, the other DP ranks idle, fitted with
    a quadratic by least squares; None where the fit's quadratic term is not positive (SGLang
    then keeps the fixed chunk)."""
    lengths = profile_lengths(sched.chunked_prefill_size)
    idle = [BatchShape()] * (dp_attention - 1)
    times = [cost.step_time_s([extend_shape(n)] + idle) for n in lengths]
    a, b, _ = np.polyfit(np.array(lengths, dtype=float), np.array(times), 2)
    if not a > 0:
        return None
    return DynamicChunking(float(a), float(b), sched.chunked_prefill_size, smooth,
                           sched.page_size, sched.max_prefill_tokens)
