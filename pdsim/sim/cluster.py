"""A simulated cluster: its roles' instances (pdsim/sim/instance.py) on one SimPy clock, the
router in front of them, the fabric between them, fault injection, and the records of a run.

An arrival source (pdsim/sim/arrivals.py) decides when each request is sent; `submit` routes it
and hands it to its instances (in PD mode one `Request` on each side, meeting by room).
"""

from __future__ import annotations

import gc
import math
import random
from contextlib import contextmanager
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdsim.core.decode import DecodeScheduler
from pdsim.core.instance import Instance
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.records import RequestRecord
from pdsim.core.request import Request
from pdsim.core.router import InflightLoad, Router
from pdsim.core.scheduler import ColocatedScheduler, InstanceScheduler
from pdsim.core.token_times import TokenTimes
from pdsim.sim.arrivals import ArrivalSource, ClosedLoopSource, OpenLoop
from pdsim.sim.autoscaler import AutoscaleSetup, SimAutoscaler
from pdsim.sim.faults import RETRY_SUFFIX, SimFaults
from pdsim.sim.host import SharedHost
from pdsim.sim.instance import SimInstance
from pdsim.sim.network import Link, SimFabric, SimKVManager
from pdsim.sim.pipeline import make_executor
from pdsim.sim.spec import ClusterSpec, RoleSpec
from pdsim.workload import ClosedLoop, PrefixBlocks


@dataclass
class SimResult:
    records: list[RequestRecord]
    sim_time_s: float
    instances: list["SimInstance"] = field(repr=False)
    prefill_busy_frac: float = math.nan  # mean fraction of the run a prefill instance computed
    decode_busy_frac: float = math.nan  # the same for decode (or colocated) instances
    kv_transfer_gb: float = 0.0  # KV moved between instances, GB
    decode_mean_batch: float = math.nan  # time-average requests per decode (or colocated) instance
    retractions: int = 0  # running requests retracted for want of KV pages, every instance
    stopped: str = ""  # why the run ended before every request finished (`stop`), or ""
    autoscaler: SimAutoscaler | None = field(default=None, repr=False)  # its spans and samples

    def check_pools_full(self) -> None:
        for inst in self.instances:
            if inst.alive:  # a killed one lost its state
                inst.instance.check_pools_full()


class Simulation:
    """One simulated run of a cluster on a workload."""

    def __init__(self, cluster: ClusterSpec, seed: int, max_duration_s: float = math.inf,
                 decode_runs: bool = True, stop: Callable[[Request], str] | None = None,
                 autoscale: AutoscaleSetup | None = None):
        if autoscale is not None and cluster.faults.any:
            raise ValueError("autoscaling with fault injection is not simulated: drop faults "
                             "or autoscaling")
        self.cluster = cluster
        self.autoscale = autoscale
        self.autoscaler: SimAutoscaler | None = None
        self.stop = stop  # called with each finished request: a reason ends the run there
        self._stop_sees = getattr(stop, "sent", None)  # and, if it has one, with each one routed
        self.stopped = ""
        self.env = simpy.Environment()
        # Forwards on shared host cores stretch while others run: no closed-form decode runs.
        self.host = (None if cluster.host_cores is None
                     else SharedHost(self.env, cluster.host_cores))
        self.decode_runs = decode_runs and self.host is None
        self.fabric = SimFabric(self.env, cluster.network)
        self.fabric.host = self.host
        self.router_seed = seed
        self.max_duration_s = max_duration_s
        # The sources delay each request by the front end; on shared host cores it is CPU work
        # among the forwards instead, run when the request comes in (`submit`).
        self.frontend_latency_s = 0.0 if self.host else cluster.frontend_latency_s
        self._frontend_work_s = cluster.frontend_latency_s if self.host else 0.0
        self._submitted = 0  # requests past the sources (in flight: those not in `final`)
        self._idle_since = -math.inf  # when the last request in flight ended (idle before the run)
        self._way_in = random.Random(f"{seed}/way-in")  # draws of the jitter_s delays
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
        insts = [self._new_instance(role, kind, i, key_base + i) for i in range(role.instances)]
        self.instances.extend(insts)
        return insts

    def _new_instance(self, role: RoleSpec, kind: str, index: int, key: int) -> SimInstance:
        """Instance `index` of its role; `key` names it on the fabric."""
        holder: list[SimInstance] = []
        notify = lambda: holder[0].notify()  # noqa: E731  (bound once the instance exists)
        make_schedulers = self._schedulers_of(role, kind, index, key, notify)
        on_done = self._prefill_done if kind == "prefill" else self._request_done
        inst = SimInstance(
            self.env, Instance(make_schedulers(), on_done, self.cluster.dp_assignment),
            make_executor(role.cost(), role.pp, lambda: self.env.now,
                          role.host_copy_s_per_page), make_schedulers,
            wakeup_s=role.wakeup_s, cold=role.cold,
            decode_runs=self.decode_runs, host=self.host, host_demand=role.host_demand,
            next_arrival_s=lambda: self.next_arrival_s)
        holder.append(inst)
        return inst

    def add_instance(self, kind: str) -> int:
        """A new instance of role `kind` (prefill or decode) on the fabric, not yet routed to
        (`Router.set_serving`); its index among the role's instances."""
        role, insts = ((self.cluster.prefill, self.prefills) if kind == "prefill"
                       else (self.cluster.decode, self.serving))
        inst = self._new_instance(role, kind, len(insts), len(self.instances))
        insts.append(inst)
        self.instances.append(inst)
        load = self.inflight.prefill_tokens if kind == "prefill" else self.inflight.decode_requests
        load.append(0)
        return len(insts) - 1

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
        if self.autoscaler is not None:
            self.autoscaler.returned("prefill", req.prefill_instance)

    def _request_done(self, req: Request) -> None:
        self.inflight.decode_returned(req.decode_instance)
        if self.autoscaler is not None:
            self.autoscaler.finished(req)
        if (self.faults is not None and req.error and not req.token_times_s
                and not req.rid.endswith(RETRY_SUFFIX) and self.faults.retryable(req.error)):
            # The real router sends a request that failed with a 503 before any token once
            # more, as a new pair and room (runtime/router.py): so does this one, as an event
            # of its own (the instance that failed it is still settling its step).
            i = int(req.rid)
            self.env.timeout(0).callbacks.append(
                lambda _ev: self._route(i, self._sent_s[i], retry=True))
            return
        self.final[req.rid.removesuffix(RETRY_SUFFIX)] = req
        self._idle_since = self.env.now
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

    def submit(self, i: int, sent_s: float) -> None:
        """Request `i`, sent by its client at `sent_s`, is past the sources' front-end delay:
        route it now, or once the front end's work is done on shared host cores; one that
        found the deployment idle (`idle_wakeup_s`) that much later, and either after its
        draw from `jitter_s` (`idle_jitter_s` when it found the deployment idle)."""
        cluster = self.cluster
        idle = self._submitted == len(self.final)
        self._submitted += 1
        woke = idle and sent_s - self._idle_since >= cluster.idle_after_s
        delay = cluster.idle_wakeup_s if woke else 0.0
        draws = cluster.idle_jitter_s if woke and cluster.idle_jitter_s else cluster.jitter_s
        if draws:
            delay += self._way_in.choice(draws)
        if delay:
            self.env.timeout(delay).callbacks.append(lambda _ev: self._admit(i, sent_s))
        else:
            self._admit(i, sent_s)

    def _admit(self, i: int, sent_s: float) -> None:
        if self._frontend_work_s:
            self.host.after_work(self._frontend_work_s, lambda: self._route(i, sent_s))
        else:
            self._route(i, sent_s)

    def _route(self, i: int, sent_s: float, retry: bool = False) -> None:
        """Route request `i`, sent by its client at `sent_s`, to its instances' inboxes (now);
        `retry`: the router's second try after a failed first one (rid `i.retry`)."""
        self._sent_s[i] = sent_s
        rid = str(i) + (RETRY_SUFFIX if retry else "")
        n_in, n_out = self._inputs[i], self._outputs[i]
        if self.autoscaler is not None:
            self.autoscaler.arrived(n_in, n_out)
        keys = () if self._prefix is None else self._prefix.ids_of(i).tolist()  # router: blocks
        inflight = self.inflight
        tries = 1 if retry else 2  # a pair with a dead worker: the router tries once more
        for n in range(tries):
            p, d, room = self.router.route(inflight.prefill_tokens.__getitem__,
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
                           prefill_instance=p,
                           prefix_keys=self._page_keys(self.cluster.prefill, i, n_in))
            pre.post_add(preq)
        dec = self.serving[d]
        # Both instances take it in at their next step boundary; the fault model may need to
        # know where it went before then.
        dreq = Request(rid, n_in, n_out, arrival_s=sent_s, bootstrap_room=room, prefill_instance=p,
                       decode_instance=d,
                       prefix_keys=None if self.prefills else self._page_keys(self.cluster.colocated, i, n_in),
                       token_times_s=TokenTimes())  # compact: views of the step times
        dec.post_add(dreq)
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
        self.router = Router(self.cluster.router_policy, len(self.prefills), len(self.serving),
                             self.router_seed, policy_options=self.cluster.router_options)
        if self.autoscale is not None:
            self.autoscaler = SimAutoscaler(self, self.autoscale, input_tokens, output_tokens)
            self.autoscaler.start()
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
        # instance-seconds of each role: with autoscaling, the time each instance served
        p_span, d_span = ((len(self.prefills) * span, len(self.serving) * span)
                          if self.autoscaler is None else
                          (self.autoscaler.serving_s("prefill", span),
                           self.autoscaler.serving_s("decode", span)))
        return SimResult(
            records, self.env.now, self.instances,
            prefill_busy_frac=_mean_busy(self.prefills, p_span),
            decode_busy_frac=_mean_busy(self.serving, d_span),
            kv_transfer_gb=self.fabric.kv_bytes / 1e9,
            decode_mean_batch=sum(i.decode_req_s for i in self.serving) / d_span,
            retractions=sum(i.instance.retractions for i in self.instances),
            stopped=self.stopped,
            autoscaler=self.autoscaler,
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


def _mean_busy(instances: Sequence[SimInstance], instance_s: float) -> float:
    """Forward time over `instance_s`, the seconds the instances were there, summed."""
    if not instances:
        return math.nan
    return sum(i.busy_s for i in instances) / instance_s


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
             stop: Callable[[Request], str] | None = None,
             autoscale: AutoscaleSetup | None = None) -> SimResult:
    """Serve the workload on the cluster. `decode_runs=False` simulates every decode step as
    its own event (the reference the faster runs of steps must match). `stop`, called with
    each finished request, may end the run early by returning why (unfinished requests then
    fail with that reason: the planner's SLO watch); its `sent` method, if it has one, is
    called the same way with each request (the one that streams its tokens) as it is routed.
    `autoscale` resizes the roles while serving (pdsim/sim/autoscaler.py)."""
    return Simulation(cluster, seed, max_duration_s, decode_runs, stop, autoscale).run(
        np.asarray(arrival_s, dtype=float), np.asarray(input_tokens), np.asarray(output_tokens),
        closed_loop, prefix,
    )
