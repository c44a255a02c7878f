"""The executor port: run one planned batch. The SimPy backend prices it with a cost model; the
real backend runs a torch/Triton forward and measures it."""

from __future__ import annotations

from typing import Protocol

from pdsim.core.batch import Batch, BatchResult


class Executor(Protocol):
    def execute(self, batch: Batch) -> BatchResult: ...
