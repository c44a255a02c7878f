"""Capacity planning: for a model, a GPU, a workload and percentile SLOs, the cheapest
deployment (colocated or disaggregated, P/D counts and parallelism per role) and how to launch
it. `plan(PlanConfig or PLAN.yaml)` returns a `PlanResult`; `pdsim plan` is its command.

    from pdsim.planning import load_plan, plan
    result = plan(load_plan("experiments/plan_qwen3_32b.yaml"), write=False)
    result.frontier                     # Pareto frontier, a DataFrame
    result.recommended.launch.script()  # SGLang commands
"""

from pdsim.planning.config import PlanConfig, load_plan, parse_plan
from pdsim.planning.result import Choice, PlanResult
from pdsim.planning.run import plan
from pdsim.planning.search import meets

__all__ = ["Choice", "PlanConfig", "PlanResult", "load_plan", "meets", "parse_plan", "plan"]
