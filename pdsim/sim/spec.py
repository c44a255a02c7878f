"""What a simulated cluster is made of: its roles' instances and the fabric between them, as
pdsim/sim/build.py derives them from an experiment and pdsim/sim/cluster.py runs them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pdsim.core.config import SchedulerConfig
from pdsim.faults import FaultsConfig
from pdsim.sim.cost import CostModel
from pdsim.sim.network import NetworkModel


@dataclass(frozen=True)
class ColdLine:
    """A forward after idle takes `step_s` + `factor` x the same forward right after another:
    on a CPU host it runs slower (docs/validation.md, "Forwards after idle")."""

    step_s: float
    factor: float

    def extra_s(self, duration_s: float) -> float:
        """What a forward of `duration_s` back to back takes more after idle."""
        return self.step_s + (self.factor - 1) * duration_s


@dataclass(frozen=True)
class ColdStart(ColdLine):
    """A step that starts after its instance idled `after_s` or longer runs cold."""

    after_s: float

    def duration_s(self, duration_s: float) -> float:
        return duration_s + self.extra_s(duration_s)


@dataclass(frozen=True)
class RoleSpec:
    """The instances of one role (prefill, decode or colocated)."""

    instances: int
    dp_attention: int
    gpus_per_instance: int
    scheduler: SchedulerConfig
    cost: Callable[[], CostModel]  # one cost model per instance
    nic_bytes_per_s: float = math.inf  # the instance's NIC bandwidth, all its GPUs together
    kv_bytes_per_page: float = 0.0  # bytes a page of this role's KV weighs on the wire
    state_bytes_per_request: float = 0.0  # lands with a request's last chunk (draft, SWA, state)
    wakeup_s: float = 0.0  # an idle scheduler of this role notices new work this late
    cold: ColdStart | None = None  # its first step after idle runs slower
    pp: int = 1  # pipeline stages per instance (pdsim/sim/pipeline.py)
    weight_bytes_per_gpu: float = 0.0  # what a new instance's GPUs load at a cold start
    host_demand: float = 1.0  # host cores one forward of an instance wants (cluster host_cores)
    host_copy_s_per_page: float = 0.0  # a KV page copied between a GPU and its host (KVMove)


@dataclass(frozen=True)
class ClusterSpec:
    mode: str  # "disaggregated" or "colocated"
    router_policy: str
    network: NetworkModel
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    colocated: RoleSpec | None = None
    frontend_latency_s: float = 0.0  # tokenizer + HTTP + router, per request
    idle_wakeup_s: float = 0.0  # more on the way in for a request that finds the deployment idle
    idle_after_s: float = 0.025  # ... for this long or longer (nothing in flight)
    jitter_s: tuple[float, ...] = ()  # extra way-in delays, one drawn per request
    idle_jitter_s: tuple[float, ...] = ()  # drawn instead by a request that found it idle
    dp_assignment: str = "auto"  # how an instance picks the attention-DP rank of a request
    faults: FaultsConfig = FaultsConfig()
    router_options: dict[str, float] = field(default_factory=dict)  # the policy's settings
    host_cores: float | None = None  # forwards share these host cores (pdsim/sim/host.py)
    notes: tuple[str, ...] = ()  # what SGLang would not run as configured (priced anyway) or
    # runs by a default the config does not show (a speculating instance's 48 requests)

    @property
    def num_gpus(self) -> int:
        roles = [r for r in (self.prefill, self.decode, self.colocated) if r is not None]
        return sum(r.instances * r.gpus_per_instance for r in roles)
