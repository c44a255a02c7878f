"""Host cores shared by every instance's forwards and host work: the real backend on one CPU
machine.

A GPU deployment gives each instance its own devices, and the cost model's step time is what
the step takes. The real backend on a CPU runs every rank process of every instance on the same
few cores (`cluster.host_cores`): a step's cost-model time is its work alone on its cores, and
while more rank threads want to run than there are cores they share them equally (processor
sharing, as the OS scheduler does), so concurrent forwards of a prefill and two decode
instances on 2 cores each run at 2/3 speed.

Each job asks for `demand` cores (its instance's rank processes times their torch threads) and
gets `demand × min(1, cores / Σ demand)`; its work (seconds at full speed) runs down at that
rate, and every start or end of a job re-shares the cores. The fixed costs a request pays on
the way that are CPU work on such a machine -- the front end (client, router, HTTP), the PD
handshake, each KV transfer's floor -- run here too, on one core each (`after_work`): with
spare cores they take their calibrated time, and while the forwards hold every core they
stretch as the real ones do.
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

SLACK_S = 1e-12  # work left that counts as none (float rounding of the shares)


class _Job:
    __slots__ = ("demand", "work_s", "done")

    def __init__(self, demand: float, work_s: float, done: simpy.Event) -> None:
        self.demand = demand
        self.work_s = work_s  # left, at full speed
        self.done = done


class SharedHost:
    """`cores` host cores that every forward of a simulation runs on (module docstring)."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        if cores <= 0:
            raise ValueError(f"host cores={cores}; must be > 0")
        self.env = env
        self.cores = cores
        self._jobs: list[_Job] = []
        self._speed = 1.0  # of every running job: min(1, cores / demand)
        self._since = 0.0  # when the jobs' work was last brought up to date
        self._epoch = 0  # the pending end-of-job timer is stale unless it carries this

    def run(self, demand: float, work_s: float) -> simpy.Event:
        """An event that fires when `work_s` seconds of work at full speed on `demand` cores
        are done, sharing the cores with every other job meanwhile."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        self._jobs.append(_Job(demand, work_s, done))
        self._reshare()
        return done

    def after_work(self, work_s: float, fn: Callable[[], None]) -> None:
        """Call `fn()` once `work_s` seconds of one core's work are done: host work outside the
        forwards (the front end's HTTP and routing, a handshake, a transfer's posting and
        completion), which stretches while forwards hold the cores as theirs does."""
        self.run(1.0, work_s).callbacks.append(lambda _ev: fn())

    def _advance(self) -> None:
        elapsed = (self.env.now - self._since) * self._speed
        self._since = self.env.now
        if elapsed > 0:
            for job in self._jobs:
                job.work_s -= elapsed

    def _reshare(self) -> None:
        demand = sum(job.demand for job in self._jobs)
        self._speed = min(1.0, self.cores / demand) if demand else 1.0
        self._epoch += 1
        if self._jobs:
            first = min(job.work_s for job in self._jobs)
            epoch = self._epoch
            self.env.timeout(max(0.0, first) / self._speed).callbacks.append(
                lambda _ev: self._job_ends(epoch))

    def _job_ends(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # re-shared since: a later timer stands
        self._advance()
        # The timer was set for the job with the least work left; rounding may leave it (and any
        # tied with it) a sliver above zero.
        least = min(job.work_s for job in self._jobs)
        ended = [job for job in self._jobs if job.work_s <= max(least, 0.0) + SLACK_S]
        self._jobs = [job for job in self._jobs if job not in ended]
        self._reshare()
        for job in ended:
            job.done.succeed()
