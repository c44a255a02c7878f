"""The executor port: run one instance step (one batch per attention-DP rank, None where a rank
idles). The simulator's `CostExecutor` prices it with a cost model; the real backend's
`ModelExecutor` runs a torch/Triton forward and measures it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdsim.core.batch import Batch, BatchResult


class Executor(Protocol):
    def execute(self, step: Sequence[Batch | None]) -> BatchResult | list[BatchResult | None]:
        """The step's duration and, from a real forward, the sampled tokens (one per extend
        segment or decode request of the one rank's batch; with several ranks, one result per
        rank, None for an idle one)."""
        ...


def only_batch(step: Sequence[Batch | None]) -> Batch:
    """The batch of a one-rank step, for executors that run one attention-DP rank (the real
    backend's without attention DP, and the test harness's)."""
    if len(step) != 1 or step[0] is None:
        raise ValueError(f"this executor runs one attention-DP rank per step, got {len(step)} "
                         "(build the model with attention DP for more)")
    return step[0]
