"""When each request of a run is sent: `OpenLoop` at the workload's times, `ClosedLoopSource`
when a client's previous request ends. A request sent at t reaches the router and its instances
at t + `frontend_latency_s` (tokenizer, HTTP, router; on shared host cores the simulation
charges it as host work instead and gives the sources 0); its record's `arrival_s` is the send
time. A source calls `sim.submit(i, sent_s)` and `sim.give_up_at(t)`; the simulation calls its
`finished()` whenever a request ends."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import simpy

from pdsim.workload import ClosedLoop


class Simulation(Protocol):
    """What a source uses of the simulation (pdsim/sim/cluster.py)."""

    env: simpy.Environment
    num_requests: int
    max_duration_s: float
    frontend_latency_s: float
    next_arrival_s: float  # when the open-loop source sends next (inf: unknown)

    def submit(self, i: int, sent_s: float) -> None: ...

    def give_up_at(self, at_s: float) -> None: ...


class ArrivalSource(Protocol):
    """Decides when each request of a run is sent (`Simulation.submit`)."""

    def start(self, sim: Simulation) -> None: ...

    def finished(self) -> None:
        """A request ended (completed or failed)."""


class OpenLoop:
    """Requests sent at the workload's arrival times, whatever the cluster does."""

    def __init__(self, arrival_s: np.ndarray):
        self.arrival_s = arrival_s

    def start(self, sim: Simulation) -> None:
        sim.give_up_at(float(self.arrival_s[-1]) + sim.max_duration_s)
        sim.env.process(self._send_all(sim))

    def _send_all(self, sim: Simulation):
        env = sim.env
        delay = sim.frontend_latency_s
        for i, sent in enumerate(self.arrival_s.tolist()):
            at = sim.next_arrival_s = sent + delay
            if at > env.now:
                yield env.timeout(at - env.now)
            sim.submit(i, sent)
        sim.next_arrival_s = math.inf

    def finished(self) -> None:
        pass


class ClosedLoopSource:
    """`concurrency` clients start at 0 s; each sends the next unsent request (in workload
    order) `think_time_s` after its previous one ended, completed or failed."""

    def __init__(self, loop: ClosedLoop):
        self.loop = loop
        self.next_index = 0

    def start(self, sim: Simulation) -> None:
        self.sim = sim
        for _ in range(min(self.loop.concurrency, sim.num_requests)):
            self._send(0.0)

    def finished(self) -> None:
        if self.next_index < self.sim.num_requests:
            self._send(self.sim.env.now + self.loop.think_time_s)

    def _send(self, sent_s: float) -> None:
        # Always through an event, even with no delay: `finished` runs inside an instance's
        # hand-off of its done requests, which must not be re-entered.
        sim, i = self.sim, self.next_index
        self.next_index += 1
        at = sent_s + sim.frontend_latency_s
        sim.env.timeout(at - sim.env.now).callbacks.append(lambda _ev: sim.submit(i, sent_s))
        if self.next_index == sim.num_requests:
            sim.give_up_at(sent_s + sim.max_duration_s)
