"""The silicon cost model: step times from NVIDIA's measured per-op kernel tables.

Registers two cost models: "silicon" (needs `pip install 'pdsim[silicon]'` and a GPU with
tables) and "auto", which is silicon where the hardware has tables and the package is installed,
and the roofline otherwise. `resolve_cost_model` says which one "auto" picks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from pdsim.sim.cost import CostModel, Parallelism, RooflineCostModel, register_cost_model
from pdsim.sim.silicon.model import SiliconCostModel, SiliconParams
from pdsim.sim.silicon.ops import MissingTable
from pdsim.sim.silicon.tables import SYSTEMS, has_tables
from pdsim.sim.speculative import SpeculativeCostModel
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec

__all__ = ["SYSTEMS", "SiliconCostModel", "SiliconParams", "cost_columns", "has_tables",
           "resolve_cost_model", "roofline_reliance_warning"]

register_cost_model("silicon")(SiliconCostModel)


def resolve_cost_model(name: str, hardware: HardwareSpec) -> str:
    """The cost model `name` stands for on `hardware`: "auto" → "silicon" or "roofline"."""
    if name != "auto":
        return name
    return "silicon" if has_tables(hardware) else "roofline"


@register_cost_model("auto")
def auto_cost_model(model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism,
                    **params: object) -> CostModel:
    """Silicon where `hardware` has measured tables (and aiconfigurator-core is installed),
    else the roofline; also the roofline when the GPU's tables lack an op the model needs
    (MLA on an A100, DeepEP on an L40S). Params go to whichever is chosen; the summary's
    `cost_model` column says which one ran."""
    if resolve_cost_model("auto", hardware) == "silicon":
        try:
            return SiliconCostModel(model, hardware, parallel, **params)
        except MissingTable:
            pass
    return RooflineCostModel(model, hardware, parallel, **params)


# A point whose lookups rest more than this share on roofline ratios (transferred or
# extrapolated) is flagged by `pdsim run`: its silicon answer is then mostly the roofline's shape.
ROOFLINE_RELIANCE_WARN_FRAC = 0.5


def cost_columns(requested: str, costs: Iterable[CostModel]) -> dict[str, object]:
    """Summary columns of a run: `cost_model`, the model(s) that priced it ("auto" resolved),
    and the coverage of its silicon table lookups, shares summing to 1 (NaN when no silicon
    model ran): `cost_interpolated_frac` (inside a measured grid), `cost_transferred_frac`
    (inside the grid of a curve moved from a measured shape, dtype or GPU to this one by a
    roofline ratio) and `cost_extrapolated_frac` (outside a table's grid)."""
    names: set[str] = set()
    lookups = transferred = extrapolated = 0
    costs = [part for cost in costs for part in  # a speculative step: its target and draft
             ((cost.target, cost.draft) if isinstance(cost, SpeculativeCostModel) else (cost,))]
    for cost in costs:
        if isinstance(cost, SiliconCostModel):
            names.add("silicon")
            lookups += cost.lookups
            transferred += cost.transferred_lookups
            extrapolated += cost.extrapolated_lookups
        elif isinstance(cost, RooflineCostModel):
            names.add("roofline")
        else:
            names.add(requested)

    def share(n: int) -> float:
        return n / lookups if lookups else math.nan

    return {"cost_model": "+".join(sorted(names)) or requested,
            "cost_interpolated_frac": share(lookups - transferred - extrapolated),
            "cost_transferred_frac": share(transferred),
            "cost_extrapolated_frac": share(extrapolated)}


def roofline_reliance_warning(rows: Iterable[Mapping[str, object]]) -> str | None:
    """One line naming the summary rows (points) whose silicon lookups rest more than
    ROOFLINE_RELIANCE_WARN_FRAC on transfers or extrapolations, or None when none do."""
    flagged = []
    for row in rows:
        scaled = float(row.get("cost_transferred_frac", math.nan)) + float(
            row.get("cost_extrapolated_frac", math.nan))
        if scaled > ROOFLINE_RELIANCE_WARN_FRAC:  # NaN (no silicon model) compares False
            flagged.append(f"{row.get('label', row.get('point'))} ({scaled:.0%})")
    if not flagged:
        return None
    return (f"warning: silicon lookups of {len(flagged)} point(s) rest mostly on roofline "
            f"ratios (transferred + extrapolated > {ROOFLINE_RELIANCE_WARN_FRAC:.0%}): "
            f"{', '.join(flagged)}; see cost_transferred_frac and cost_extrapolated_frac in "
            f"summary.csv")
