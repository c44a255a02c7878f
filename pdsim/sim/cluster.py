"""A simulated cluster: its roles' instances (pdsim/sim/instance.py) on one SimPy clock, the
router in front of them, the fabric between them, fault injection, and the records of a run.

An arrival source (pdsim/sim/arrivals.py) decides when each request is sent; `submit` routes it
and hands it to its instances (in PD mode one `Request` on each side, meeting by room).
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdsim.core.config import SchedulerConfig
from pdsim.core.decode import DecodeScheduler
from pdsim.core.instance import Instance
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.records import RequestRecord
from pdsim.core.request import Request
from pdsim.core.router import InflightLoad, Router
from pdsim.core.scheduler import ColocatedScheduler, InstanceScheduler
from pdsim.core.token_times import TokenTimes
from pdsim.faults import FaultsConfig
from pdsim.sim.arrivals import ArrivalSource, ClosedLoopSource, OpenLoop
from pdsim.sim.cost import CostModel
from pdsim.sim.faults import RETRY_SUFFIX, SimFaults
from pdsim.sim.instance import SimInstance
from pdsim.sim.network import Link, NetworkModel, SimFabric, SimKVManager
from pdsim.sim.pipeline import make_executor
from pdsim.workload import ClosedLoop, PrefixBlocks


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
    state_bytes_per_request: float = 0.0  # sent with a request's last chunk (draft state)
    wakeup_s: float = 0.0  # an idle scheduler of this role notices new work this late
    pp: int = 1  # pipeline stages per instance (pdsim/sim/pipeline.py)


@dataclass(frozen=True)
class ClusterSpec:
    mode: str  # "disaggregated" or "colocated"
    router_policy: str
    network: NetworkModel
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    colocated: RoleSpec | None = None
    frontend_latency_s: float = 0.0  # tokenizer + HTTP + router, per request
    dp_assignment: str = "room"  # how an instance picks the attention-DP rank of a request
    faults: FaultsConfig = FaultsConfig()
    router_options: dict[str, float] = field(default_factory=dict)  # the policy's settings

    @property
    def num_gpus(self) -> int:
        roles = [r for r in (self.prefill, self.decode, self.colocated) if r is not None]
        return sum(r.instances * r.gpus_per_instance for r in roles)


@dataclass
class SimResult:
    records: list[RequestRecord]
    sim_time_s: float
    instances: list["SimInstance"] = field(repr=False)
    prefill_busy_frac: float = math.nan  # mean fraction of the run a prefill instance computed
    decode_busy_frac: float = math.nan  # the same for decode (or colocated) instances
    kv_transfer_gb: float = 0.0  # KV moved between instances, GB
    decode_mean_batch: float = math.nan  # time-average requests per decode (or colocated) instance
    stopped: str = ""  # why the run ended before every request finished (`stop`), or ""

    def check_pools_full(self) -> None:
        for inst in self.instances:
            if inst.alive:  # a killed one lost its state
                inst.instance.check_pools_full()


class Simulation:
    """One simulated run of a cluster on a workload."""

    def __init__(self, cluster: ClusterSpec, seed: int, max_duration_s: float = math.inf,
                 decode_runs: bool = True, stop: Callable[[Request], str] | None = None):
        self.cluster = cluster
        self.stop = stop  # called with each finished request: a reason ends the run there
        self._stop_sees = getattr(stop, "sent", None)  # and, if it has one, with each one routed
        self.stopped = ""
        self.decode_runs = decode_runs
        self.env = simpy.Environment()
        self.fabric = SimFabric(self.env, cluster.network)
        self.router_seed = seed
        self.max_duration_s = max_duration_s
        self.frontend_latency_s = cluster.frontend_latency_s
        self.next_arrival_s = math.inf  # when the open-loop source sends next (inf: unknown)
        self.final: dict[str, Request] = {}
        self.prefill_side: dict[str, Request] = {}
        self.instances: list[SimInstance] = []
        self.faults: SimFaults | None = None
        if cluster.mode == "colocated":
            self.serving = self._build_role(cluster.colocated, "colocated", 0)
            self.prefills: list[SimInstance] = []
        else:
            self.prefills = self._build_role(cluster.prefill, "prefill", 0)
            self.serving = self._build_role(cluster.decode, "decode", len(self.prefills))
            if cluster.faults.any:
                self.faults = SimFaults(self.env, self.fabric, self.prefills, self.serving,
                                        cluster.faults, self._request_done,
                                        lambda i: self.inflight.prefill_lost(i))

    def _build_role(self, role: RoleSpec, kind: str, key_base: int) -> list[SimInstance]:
        insts = []
        for i in range(role.instances):
            holder: list[SimInstance] = []
            notify = lambda h=holder: h[0].notify()  # noqa: E731  (bound once the instance exists)
            make_schedulers = self._schedulers_of(role, kind, i, key_base + i, notify)
            on_done = self._prefill_done if kind == "prefill" else self._request_done
            inst = SimInstance(
                self.env, Instance(make_schedulers(), on_done, self.cluster.dp_assignment),
                make_executor(role.cost(), role.pp, lambda: self.env.now), make_schedulers, wakes_on_arrival=kind == "colocated",
                wakeup_s=role.wakeup_s, decode_runs=self.decode_runs,
                next_arrival_s=(lambda: self.next_arrival_s) if kind == "colocated"
                else lambda: math.inf)
            holder.append(inst)
            insts.append(inst)
        self.instances.extend(insts)
        return insts

    def _schedulers_of(self, role: RoleSpec, kind: str, index: int, key: int,
                       notify: Callable[[], None]) -> Callable[[], list[InstanceScheduler]]:
        """What builds instance `index`'s schedulers, one per attention-DP rank: at the start,
        and again for a new process after a kill (with the same NIC links, so what shares or
        slows a link goes on)."""
        dp = role.dp_attention
        if kind == "colocated":
            return lambda: [ColocatedScheduler(role.scheduler, index) for _ in range(dp)]
        # A DP rank's KV lives on its own GPUs: it sends through their NICs only.
        links = [Link(role.nic_bytes_per_s / dp, max(1, role.gpus_per_instance // dp))
                 for _ in range(dp)]
        cls = PrefillScheduler if kind == "prefill" else DecodeScheduler

        def make() -> list[InstanceScheduler]:
            return [cls(role.scheduler, SimKVManager(self.fabric, key, link, role.kv_bytes_per_page,
                                                     notify, role.state_bytes_per_request), index)
                    for link in links]
        return make

    def _prefill_done(self, req: Request) -> None:
        self.prefill_side[req.rid] = req
        self.inflight.prefill_returned(req.prefill_instance, req.input_len)

    def _request_done(self, req: Request) -> None:
        self.inflight.decode_returned(req.decode_instance)
        if (self.faults is not None and req.error and not req.token_times_s
                and not req.rid.endswith(RETRY_SUFFIX) and self.faults.retryable(req.error)):
            # The real router sends a request that failed with a 503 before any token once
            # more, as a new pair and room (runtime/router.py): so does this one, as an event
            # of its own (the instance that failed it is still settling its step).
            i = int(req.rid)
            self.env.timeout(0).callbacks.append(
                lambda _ev: self.submit(i, self._sent_s[i], retry=True))
            return
        self.final[req.rid.removesuffix(RETRY_SUFFIX)] = req
        self._source.finished()
        if len(self.final) == self.num_requests:
            self._all_done.succeed()
        elif self.stop is not None and not self.stopped:
            self._stop_if(self.stop(req))

    def _stop_if(self, reason: str) -> None:
        if reason:
            self.stopped = reason
            if not self._give_up.triggered:
                self._give_up.succeed()

    def submit(self, i: int, sent_s: float, retry: bool = False) -> None:
        """Route request `i`, sent by its client at `sent_s`, to its instances (now); `retry`:
        the router's second try after a failed first one (rid `i.retry`)."""
        now = self.env.now
        self._sent_s[i] = sent_s
        rid = str(i) + (RETRY_SUFFIX if retry else "")
        n_in, n_out = self._inputs[i], self._outputs[i]
        keys = () if self._prefix is None else self._prefix.ids_of(i).tolist()  # router: blocks
        inflight = self.inflight
        tries = 1 if retry else 2  # a pair with a dead worker: the router tries once more
        for n in range(tries):
            p, d, room = self._router.route(inflight.prefill_tokens.__getitem__,
                                            inflight.decode_requests.__getitem__, keys)
            inflight.sent(p, d, n_in)
            if self.faults is None or not (dead := self.faults.dead(p, d)):
                break
            inflight.prefill_returned(p, n_in)  # the connection refused: both calls return
            if n == tries - 1:
                self.faults.refuse(rid, n_in, n_out, sent_s, p, d, dead)
                return
            inflight.decode_returned(d)
        if self.prefills:
            pre = self.prefills[p]
            preq = Request(rid, n_in, n_out, arrival_s=sent_s, bootstrap_room=room,
                           prefix_keys=self._page_keys(self.cluster.prefill, i, n_in))
            pre.instance.add_request(preq, now)
            pre.admitted()
        dec = self.serving[d]
        dreq = Request(rid, n_in, n_out, arrival_s=sent_s, bootstrap_room=room, prefill_instance=p,
                       prefix_keys=None if self.prefills else self._page_keys(self.cluster.colocated, i, n_in),
                       token_times_s=TokenTimes())  # compact: views of the step times
        dec.instance.add_request(dreq, now)
        dec.admitted()
        if self._stop_sees is not None and not self.stopped:
            self._stop_if(self._stop_sees(dreq))
        if self.faults is not None:
            self.faults.track(preq, dreq)

    def _page_keys(self, role: RoleSpec, i: int, n_in: int) -> list | None:
        """Request i's prefix-cache keys, when its prompt side caches and the workload knows them."""
        if self._prefix is None or not role.scheduler.prefix_cache:
            return None
        return self._prefix.page_keys(i, n_in, role.scheduler.page_size)

    def give_up_at(self, at_s: float) -> None:
        """Requests unfinished at `at_s` (simulated) count as failed; the run ends there."""
        if math.isfinite(at_s):
            self.env.timeout(max(at_s - self.env.now, 0.0)).callbacks.append(
                lambda _ev: self._give_up.succeed() if not self._give_up.triggered else None)

    def run(self, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
            closed_loop: ClosedLoop | None = None, prefix: PrefixBlocks | None = None) -> SimResult:
        """Serve the requests: open loop at `arrival_s`, or by `closed_loop`'s clients (then
        `arrival_s` is ignored and the records hold the times the clients sent at). `prefix`
        (the workload's prefix blocks) keys the router and, where enabled, the prefix caches."""
        self._prefix = prefix
        self.num_requests = len(input_tokens)
        self._all_done = self.env.event()
        self._give_up = self.env.event()
        if self.num_requests == 0:
            return SimResult([], 0.0, self.instances)
        self._inputs, self._outputs = input_tokens.tolist(), output_tokens.tolist()
        self._sent_s = [math.nan] * self.num_requests
        self.inflight = InflightLoad(len(self.prefills), len(self.serving))
        self._router = Router(self.cluster.router_policy, len(self.prefills), len(self.serving),
                              self.router_seed, policy_options=self.cluster.router_options)
        self._source: ArrivalSource = (OpenLoop(arrival_s) if closed_loop is None
                                       else ClosedLoopSource(closed_loop))
        self._source.start(self)
        with _collector_paused():
            self.env.run(until=self._all_done | self._give_up)
            records = self._records(input_tokens)
        # The records hold what is kept; the requests would only outlive the run (the
        # instances, which a result keeps, reach this object) and burden the collector.
        self.final.clear()
        self.prefill_side.clear()
        span = self.env.now or math.nan
        return SimResult(
            records, self.env.now, self.instances,
            prefill_busy_frac=_mean_busy(self.prefills, span),
            decode_busy_frac=_mean_busy(self.serving, span),
            kv_transfer_gb=self.fabric.kv_bytes / 1e9,
            decode_mean_batch=sum(i.decode_req_s for i in self.serving) / (len(self.serving) * span),
            stopped=self.stopped,
        )

    def _records(self, input_tokens) -> list[RequestRecord]:
        records = []
        for i in range(self.num_requests):
            rid = str(i)
            req = self.final.get(rid)
            if req is None:
                sent = self._sent_s[i]
                records.append(RequestRecord(
                    rid=rid, input_tokens=int(input_tokens[i]), output_tokens=0, status="failed",
                    error=f"not simulated: the run stopped early, {self.stopped}" if self.stopped
                    else "never sent: its client's earlier request did not finish in time"
                    if math.isnan(sent) else "did not finish before the simulation's time limit",
                    arrival_s=sent,
                ))
                continue
            rec = req.to_record("failed" if req.error else "ok")
            rec.rid = rid  # a retried request's record is its client's
            pre = self.prefill_side.get(req.rid)
            if pre is not None:
                rec.prefill_instance = pre.prefill_instance
                rec.bootstrap_done_s = pre.bootstrap_done_s
                rec.prefill_start_s = pre.prefill_start_s
                rec.prefill_end_s = pre.prefill_end_s
                rec.transfer_start_s = pre.transfer_start_s
            records.append(rec)
        return records


def _mean_busy(instances: Sequence[SimInstance], span_s: float) -> float:
    if not instances:
        return math.nan
    return sum(i.busy_s for i in instances) / (len(instances) * span_s)


@contextmanager
def _collector_paused():
    """A run allocates many small objects that live until it ends and no cyclic garbage (a
    collection right after a run finds none that the run made: PD with kills and failed
    transfers, prefix caching, speculative decoding, closed loops, trace replay), so Python's
    cycle collector, which would rescan the live ones over and over (~20% of the run at its
    default thresholds), is paused while it runs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(cluster: ClusterSpec, arrival_s, input_tokens, output_tokens, *, seed: int = 0,
             max_duration_s: float = math.inf, closed_loop: ClosedLoop | None = None,
             decode_runs: bool = True, prefix: PrefixBlocks | None = None,
             stop: Callable[[Request], str] | None = None) -> SimResult:
    """Serve the workload on the cluster. `decode_runs=False` simulates every decode step as
    its own event (the reference the faster runs of steps must match). `stop`, called with
    each finished request, may end the run early by returning why (unfinished requests then
    fail with that reason: the planner's SLO watch); its `sent` method, if it has one, is
    called the same way with each request (the one that streams its tokens) as it is routed."""
    return Simulation(cluster, seed, max_duration_s, decode_runs, stop).run(
        np.asarray(arrival_s, dtype=float), np.asarray(input_tokens), np.asarray(output_tokens),
        closed_loop, prefix,
    )
