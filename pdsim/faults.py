"""Fault injection: one `faults:` section for experiments (sim) and serve configs (real).

    faults:
      seed: 7                            # which transfers fail (default 0)
      fail_transfers: 0.3                # this fraction of KV transfers fails (seeded, by rid)
      kill:                              # worker instances killed at a time (s since start)
        - {role: decode, instance: 0, at_s: 5.0, restart_after_s: 2.0}
      slow_nic:                          # KV writes from or into this instance take x times longer
        - {role: prefill, instance: 0, factor: 4}
      bootstrap_delay_s: 0.2             # every bootstrap-server answer comes this much later

Both backends take their choices from the pure functions here, so a fault picks the same
requests in the simulator and in the real deployment: `transfer_fails(seed, fraction, rid)`
depends on nothing else. `fault_summary` reads the shared per-request records, so the sim's
summary and a real run report failures and recovery the same way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pdsim.core.records import RequestRecord

TRANSFER_FAULT = "injected fault: KV transfer failed"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KillFault(_Spec):
    """Kill one worker instance (all its ranks) at `at_s`; bring it back `restart_after_s`
    later (sim: it serves again then; real: the launcher starts the process again then, and it
    serves once it has loaded). None: it stays dead."""

    role: Literal["prefill", "decode"]
    instance: int = Field(0, ge=0)
    at_s: float = Field(ge=0, description="seconds after the start (sim: simulated time 0; "
                        "real: the moment the router serves)")
    restart_after_s: float | None = Field(None, ge=0)


class SlowNic(_Spec):
    role: Literal["prefill", "decode"]
    instance: int = Field(0, ge=0)
    factor: float = Field(gt=0, description="KV writes from or into the instance take this many "
                          "times as long (its bandwidth divided by it)")


class FaultsConfig(_Spec):
    seed: int = Field(0, description="seeds the choice of failing transfers")
    fail_transfers: float = Field(0.0, ge=0, le=1, description="fraction of KV transfers that fail")
    kill: list[KillFault] = []
    slow_nic: list[SlowNic] = []
    bootstrap_delay_s: float = Field(0.0, ge=0, description="delay of every bootstrap answer")

    @property
    def any(self) -> bool:
        return bool(self.fail_transfers or self.kill or self.slow_nic or self.bootstrap_delay_s)

    def check_instances(self, instances: Mapping[str, int]) -> None:
        """ValueError naming the field unless every fault names an existing role instance
        (`instances`: instances per role; a role missing from it has none)."""
        for kind, items in (("kill", self.kill), ("slow_nic", self.slow_nic)):
            for i, item in enumerate(items):
                n = instances.get(item.role, 0)
                if item.instance >= n:
                    allowed = f"0..{n - 1}" if n else "none (the deployment has no such role)"
                    raise ValueError(f"faults.{kind}.{i}.instance: {item.instance}; allowed: "
                                     f"{allowed} ({item.role} has {n} instance"
                                     f"{'' if n == 1 else 's'})")
        if not instances and (self.fail_transfers or self.bootstrap_delay_s):
            name = "fail_transfers" if self.fail_transfers else "bootstrap_delay_s"
            raise ValueError(f"faults.{name}: {getattr(self, name)}; allowed: 0 when serving "
                             "colocated (no KV transfers, no bootstrap server)")
        roles = [(k.role, k.instance) for k in self.kill]
        if len(set(roles)) != len(roles):
            raise ValueError(f"faults.kill: an instance is killed twice ({roles}); allowed: "
                             "one kill per instance")

    def nic_factor(self, role: str, instance: int) -> float:
        """How many times longer KV writes from or into this instance take (1: not slowed)."""
        return math.prod(s.factor for s in self.slow_nic
                         if s.role == role and s.instance == instance)

    def fails_transfer(self, rid: str) -> bool:
        return transfer_fails(self.seed, self.fail_transfers, rid)


def transfer_fails(seed: int, fraction: float, rid: str) -> bool:
    """Whether request `rid`'s KV transfer is one of the failing `fraction`: a pure function of
    (seed, rid), the same in every process and backend."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}/{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def fault_summary(records: Iterable[RequestRecord], fault_s: float | None) -> dict[str, float]:
    """Failure and recovery columns of a run's summary (`summarize` counts the failed ones).

    - ``error_latency_p50_s`` / ``error_latency_max_s``: arrival to error of the failed ones;
    - ``recovery_s``: from the fault (`fault_s`, the first kill) until the first request that
      arrived after it completes successfully; NaN without a kill or if none does.
    """
    records = list(records)
    failed = [r.finish_s - r.arrival_s for r in records if not r.ok]
    lat = np.asarray([x for x in failed if not math.isnan(x)], dtype=float)
    recovery = math.nan
    if fault_s is not None:
        ends = [r.finish_s for r in records if r.ok and r.arrival_s >= fault_s]
        if ends:
            recovery = min(ends) - fault_s
    return {
        "error_latency_p50_s": float(np.percentile(lat, 50)) if len(lat) else math.nan,
        "error_latency_max_s": float(lat.max()) if len(lat) else math.nan,
        "recovery_s": recovery,
    }


def first_kill_s(faults: FaultsConfig) -> float | None:
    return min((k.at_s for k in faults.kill), default=None)
