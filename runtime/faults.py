"""The real backend's side of fault injection (the `faults:` section, see pdsim/faults.py).

- **fail_transfers** (`TransferFaults`, in every prefill rank's Mooncake sender): a request whose
  rid `transfer_fails` picks fails when its first chunk reaches a sending thread, before any
  byte is written; the room turns `Failed` and the decode side hears it in a `Status`, the same
  KVPoll path as a failed write. Every rank of an instance picks the same rids.
- **slow_nic** (prefill instances; `TransferFaults.after_write`): after each chunk's writes the
  sending thread sleeps (factor - 1) x the time they took, so the chunk takes `factor` times as
  long, as through a NIC of 1/factor the bandwidth. The prefill side cannot tell which decode
  instance a write goes to, so a decode role's NIC cannot be slowed here (config error).
- **bootstrap_delay_s**: the prefill instance's bootstrap server answers every `GET /route` that
  much later (runtime/transfer/bootstrap_server.py `answer_delay_s`).
- **kill** (`Killer`, run by the launcher): at `at_s` after the router serves, SIGKILL to the
  worker's process group (rank 0 and its rank processes); with `restart_after_s`, the launcher
  starts the same command again then (same HTTP and bootstrap ports; its ranks' ZMQ and Mooncake
  ports are new, registered anew with the new bootstrap server), and the router, which keeps its
  worker list, reaches it once it has loaded. Meanwhile requests get 503 with Retry-After (the
  router tries each once more first); the other role's transfer side notices the lost peer at
  its next frame to it and looks the restarted instance up afresh (runtime/transfer/decode.py),
  so requests succeed as soon as it serves, not after the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from pdsim.faults import TRANSFER_FAULT, FaultsConfig

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """A failure that fault injection caused on purpose."""


def check_serving(faults: FaultsConfig) -> None:
    """ValueError for what the real backend cannot inject."""
    for i, slow in enumerate(faults.slow_nic):
        if slow.role != "prefill":
            raise ValueError(f"faults.slow_nic.{i}.role: {slow.role!r}; allowed when serving: "
                             "prefill (the prefill side writes the KV and cannot tell decode "
                             "instances apart)")


class TransferFaults:
    """One prefill rank's injected transfer faults."""

    def __init__(self, faults: FaultsConfig, nic_factor: float = 1.0) -> None:
        self.faults = faults
        self.nic_factor = nic_factor
        self._lock = threading.Lock()
        self._doomed: set[int] = set()  # rooms whose next write fails

    @classmethod
    def for_instance(cls, faults: FaultsConfig, role: str, instance: int) -> TransferFaults | None:
        """What a rank of this instance injects; None: nothing."""
        factor = faults.nic_factor(role, instance)
        if role != "prefill" or (not faults.fail_transfers and factor == 1.0):
            return None
        return cls(faults, factor)

    def sender_created(self, rid: str, room: int) -> None:
        if self.faults.fails_transfer(rid):
            with self._lock:
                self._doomed.add(room)

    def forget(self, room: int) -> None:
        with self._lock:
            self._doomed.discard(room)

    def before_write(self, room: int) -> None:
        with self._lock:
            doomed = room in self._doomed
            self._doomed.discard(room)
        if doomed:
            raise InjectedFault(TRANSFER_FAULT)

    def after_write(self, elapsed_s: float) -> None:
        if self.nic_factor != 1.0:
            time.sleep((self.nic_factor - 1.0) * elapsed_s)


class Killer:
    """The launcher's kills and restarts. `run(workers)` follows the schedule (times from its
    start); `killed(role, instance)` says whether that worker is down by the fault's doing, so
    the launcher does not take its exit for a crash."""

    def __init__(self, faults: FaultsConfig) -> None:
        self.faults = faults
        self._down: set[tuple[str, int]] = set()

    def killed(self, role: str, instance: int) -> bool:
        return (role, instance) in self._down

    async def run(self, workers: Sequence) -> None:
        """`workers`: the launcher's `WorkerProcess`es (role, instance, proc, command, env)."""
        start = time.monotonic()
        plan = sorted([(k.at_s, "kill", k) for k in self.faults.kill]
                      + [(k.at_s + k.restart_after_s, "restart", k) for k in self.faults.kill
                         if k.restart_after_s is not None], key=lambda e: e[0])
        for at_s, what, k in plan:
            await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
            w = next(w for w in workers if (w.role, w.instance) == (k.role, k.instance))
            if what == "kill":
                self._down.add((k.role, k.instance))
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await asyncio.get_running_loop().run_in_executor(None, w.proc.wait)
            else:
                w.proc = subprocess.Popen(w.command, env=w.env, start_new_session=True)
                self._down.discard((k.role, k.instance))
            log.warning("fault injection: %s %s worker %d", what, k.role, k.instance)
