"""`plan()`: a plan's entry point. A plan on one GPU type is searched by
pdsim.planning.search, one listing `gpu_types` by pdsim.planning.hardware_mix."""

from __future__ import annotations

from pathlib import Path

from pdsim.planning.config import PlanConfig, load_plan
from pdsim.planning.hardware_mix import plan_hardware_mix
from pdsim.planning.result import PlanResult
from pdsim.planning.search import plan_one_hardware


def plan(source: PlanConfig | str | Path, *, out_dir: str | Path | None = None,
         jobs: int | None = None, progress: bool = False, prefilter: bool | None = None,
         write: bool = True, base_dir: str | None = None, executor: str = "local",
         ray_address: str | None = None) -> PlanResult:
    """Run a plan (a PlanConfig or a PLAN.yaml path); write results/<name>/ unless `write` is
    False. `prefilter` overrides the plan's `prefilter.enabled`. `executor`/`ray_address`: where
    the simulations run (pdsim.pools: `local` process pool or `ray`)."""
    if not isinstance(source, PlanConfig):
        path = Path(source)
        source, base_dir = load_plan(path), str(path.parent.resolve())
    search = plan_hardware_mix if source.gpu_types else plan_one_hardware
    return search(source, out_dir=out_dir, jobs=jobs, progress=progress, prefilter=prefilter,
                  write=write, base_dir=base_dir, executor=executor, ray_address=ray_address)
