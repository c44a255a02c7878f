"""The simulator's side of fault injection (the `faults:` section, see pdsim/faults.py).

- **fail_transfers**: a sender whose rid `transfer_fails` picks fails at its first `send`,
  before any byte moves: `KVPoll.Failed` on both sides, as the real Mooncake sender reports it.
  The real router gets a 503 before any token and sends the request once more (rid
  `<rid>.retry`, a new pair and room, its arrival unchanged), and so does the simulated one: a
  request fails only when its retry's transfer fails too.
- **slow_nic**: the instance's link bandwidth is divided by the factor.
- **bootstrap_delay_s**: a decode instance's first contact with a prefill instance waits for two
  bootstrap answers (the parallel info, then the rank's address), so it takes twice the delay
  longer; later handshakes reuse the cached answers, as the real decode side does.
- **kill**: at `at_s` the instance stops; a forward in progress is lost. What clients see follows
  the real router (runtime/router.py), which holds an HTTP connection to both workers of every
  request and notices at once when one closes:
  - decode worker killed: each of its requests loses its stream now (error at the kill time);
    the router aborts the prefill side, which frees the request between two forwards;
  - prefill worker killed: each request it has not finished and whose first token has not
    reached the client fails, as the router aborts its decode side (between two of its
    forwards); requests already streaming go on decoding;
  - later requests routed to a dead worker are refused (connection refused, a 503); the router
    keeps its worker list and policy as configured and routes a refused request once more (the
    policy may pick a live pair; when the dead worker is its role's only one, the second try
    is refused too and the request fails on arrival: "prefill worker 0 is unreachable").
  A request killed so before its first token is sent once more, as for a failed transfer.
  With `restart_after_s` the instance serves again that much later, with empty queues and
  full pools (a new process), and takes requests at once: the real decode side notices a
  restarted prefill at its first frame to it (a lost connection), not after the heartbeat
  timeout, so no request after the restart waits for one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import simpy

from pdsim.core.request import Request
from pdsim.faults import TRANSFER_FAULT, FaultsConfig, KillFault
from pdsim.sim.instance import SimInstance
from pdsim.sim.network import SimFabric


RETRY_SUFFIX = ".retry"  # the router's second try of a request (runtime/router.py's rid)


class SimFaults:
    """The faults of one run over its instances; `end_request(req)` ends a client's request
    (failed) as the simulation's own done hand-off does; `prefill_lost(i)` tells the router
    that every call to prefill instance i returned (its worker died)."""

    def __init__(self, env: simpy.Environment, fabric: SimFabric, prefills: Sequence[SimInstance],
                 decodes: Sequence[SimInstance], config: FaultsConfig,
                 end_request: Callable[[Request], None], prefill_lost: Callable[[int], None]):
        self.env = env
        self.prefills, self.decodes = prefills, decodes
        self.config = config
        self.end_request = end_request
        self.prefill_lost = prefill_lost
        self._doomed: set = set()  # rooms (`_Room` objects) whose first send fails
        self._routes: dict[str, tuple[Request, Request]] = {}  # rid → (prefill, decode) request
        fabric.faults = self
        if config.bootstrap_delay_s:
            fabric.model = dataclasses.replace(
                fabric.model,
                first_contact_s=fabric.model.first_contact_s + 2 * config.bootstrap_delay_s)
        for slow in config.slow_nic:
            inst = self._instance(slow.role, slow.instance)
            for sched in inst.schedulers:  # one link per DP rank
                sched.kv.link.bytes_per_s /= slow.factor
        for kill in config.kill:
            env.timeout(kill.at_s).callbacks.append(lambda _ev, k=kill: self._kill(k))

    def _instance(self, role: str, index: int) -> SimInstance:
        return (self.prefills if role == "prefill" else self.decodes)[index]

    # ---- transfers -----------------------------------------------------------------------------

    def sender_created(self, req: Request, room) -> None:
        if self.config.fails_transfer(req.rid):
            self._doomed.add(room)

    def drops(self, room) -> str:
        """Why this send fails ("" if it does not)."""
        if room in self._doomed:
            self._doomed.discard(room)
            return TRANSFER_FAULT
        return ""

    # ---- routing -------------------------------------------------------------------------------

    @staticmethod
    def retryable(error: str) -> bool:
        """Whether the real backend answers a request that failed so, before any token, with a
        503 that its router retries once: a failed KV transfer, a worker that died under it."""
        return TRANSFER_FAULT in error or error.endswith(" died")

    def dead(self, p: int, d: int) -> str:
        """The first dead worker of a (prefill, decode) pair ("prefill worker 0"), or ""."""
        for role, i in (("prefill", p), ("decode", d)):
            if not self._instance(role, i).alive:
                return f"{role} worker {i}"
        return ""

    def refuse(self, rid: str, input_len: int, max_new_tokens: int, sent_s: float, p: int,
               d: int, dead: str) -> None:
        """Fail a request whose second pair too had a dead worker, at once, as the real router
        does when the worker's port refuses the connection (503)."""
        req = Request(rid, input_len, max_new_tokens, arrival_s=sent_s, prefill_instance=p,
                      decode_instance=d)
        self._end(req, f"{dead} is unreachable")

    def track(self, preq: Request, dreq: Request) -> None:
        if self.config.kill:
            self._routes[dreq.rid] = (preq, dreq)

    # ---- kills ---------------------------------------------------------------------------------

    def _end(self, dreq: Request, reason: str) -> None:
        dreq.error = reason
        dreq.finish_s = self.env.now
        dreq.finished = True
        self.end_request(dreq)

    def _kill(self, kill: KillFault) -> None:
        inst = self._instance(kill.role, kill.instance)
        inst.kill()  # it holds nothing now
        if kill.role == "prefill":
            self.prefill_lost(kill.instance)  # the router's calls to it fail at once
        reason = f"{kill.role} worker {kill.instance} died"
        for rid, (preq, dreq) in list(self._routes.items()):
            if dreq.finished:
                del self._routes[rid]
            elif kill.role == "decode" and dreq.decode_instance == kill.instance:
                self._end(dreq, reason)  # the stream to the client breaks now
                if not preq.finished:
                    self.prefills[preq.prefill_instance].post_abort(rid, reason)
                del self._routes[rid]
            elif kill.role == "prefill" and preq.prefill_instance == kill.instance \
                    and not preq.finished and dreq.num_output == 0:
                preq.finished = True  # gone with its instance
                self.decodes[dreq.decode_instance].post_abort(rid, reason)
        if kill.restart_after_s is not None:
            self.env.timeout(kill.restart_after_s).callbacks.append(lambda _ev: inst.restart())
