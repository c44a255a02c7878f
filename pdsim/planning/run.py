"""`plan()`: a plan's entry point. A plan on one GPU type is searched by
pdsim.planning.search, one listing `gpu_types` by pdsim.planning.hardware_mix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdsim.planning.config import PlanConfig, load_plan, parse_plan
from pdsim.planning.hardware_mix import plan_hardware_mix
from pdsim.planning.result import PlanResult
from pdsim.planning.search import plan_one_hardware
from pdsim.specs import hardware_preset_names, model_preset_names


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
    if base_dir is not None:
        source = parse_plan(anchored(source.model_dump(mode="json", exclude_unset=True),
                                     Path(base_dir)), source.name)
    search = plan_hardware_mix if source.gpu_types else plan_one_hardware
    return search(source, out_dir=out_dir, jobs=jobs, progress=progress, prefilter=prefilter,
                  write=write, base_dir=base_dir, executor=executor, ray_address=ray_address)


# The keys whose string value may name a file (a model's config.json or YAML, a hardware YAML,
# a trace, a profiled model's timings, an EAGLE draft).
FILE_KEYS = frozenset({"model", "hardware", "trace", "timings", "draft_model"})


def anchored(data: Any, base: Path) -> Any:
    """`data` (a plan as a mapping) with every relative file it names under FILE_KEYS made
    absolute at `base`, the plan's folder, where the plan found it: the plan.yaml and
    recommended.yaml written into results/ then name the same files. Preset names stay."""
    presets = {*model_preset_names(), *hardware_preset_names()}
    if isinstance(data, list):
        return [anchored(v, base) for v in data]
    if not isinstance(data, dict):
        return data
    return {k: str((base / v).resolve())
            if (k in FILE_KEYS and isinstance(v, str) and v not in presets
                and not Path(v).is_absolute() and (base / v).exists())
            else anchored(v, base) for k, v in data.items()}
