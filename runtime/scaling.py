"""Scaling a served PD deployment while it serves: the launcher's worker processes and the
router's membership moved together, on command or by the shared autoscaling policy.

`Scaler.scale(role, instances)` starts new instances of `role` (the next instance numbers;
each joins the router once it answers `/health`) or removes the newest ones: the router drains
each (no new requests; its calls in flight finish), reads whether the worker got every page
and slot back (its `/pools`; a warning if not), then stops its process. One change of a role
runs at a time; the two roles change at once. `POST /scale {"role", "instances"}` on the
router (its internal plane: the cluster token) does the same over HTTP and answers with the
instances and workers after the change and the `/pools` of each worker removed.

`Autoscaler` runs the deployment's `autoscaling:` policy (pdsim/core/autoscale.py, the same
the simulator runs) every `interval_s`: it builds a `ScaleObservation` of the interval that
ended from the workers' `/load` and `/metrics` (queue lengths, KV usage) and the router's
records (arrivals, lengths, TTFT and ITL), and scales each role to the target. `GET
/autoscaling` on the router (cluster token) shows its recent observations and targets.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import asdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from pdsim.core.autoscale import ROLES, AutoscalePolicy, Bounds, RoleState, ScaleObservation
from pdsim.core.records import RequestRecord
from runtime.checks import BadRequest
from runtime.http_app import error_json
from runtime.router_control import MembershipError, read_object

if TYPE_CHECKING:
    from runtime.worker_process import WorkerProcess
    from runtime.router import PDRouter

log = logging.getLogger(__name__)


class ScaleError(RuntimeError):
    """A scaling step failed: `status` 400 (bad input), 409 (not possible now) or 503 (a new
    worker did not come up)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Scaler:
    """`workers` is the launcher's list of running worker processes: new ones join it once
    they serve, removed ones leave it before they are stopped (so the launcher does not take
    their exit for a crash). `wait_healthy(worker)` returns a started worker's `/health` JSON
    (raising when it exits or takes too long). `headers`: the cluster token, for the workers'
    `/pools`; `pools_timeout_s`: how long a drained worker may take to show them full.
    `bounds`: the fewest and most instances of each role (the `autoscaling:` section's);
    default 1 or more."""

    def __init__(self, router: PDRouter, workers: list[WorkerProcess],
                 *, spawn: Callable[[str, int], WorkerProcess],
                 wait_healthy: Callable[[WorkerProcess], object],
                 stop: Callable[[WorkerProcess], None], headers: dict[str, str] | None = None,
                 pools_timeout_s: float = 10.0, bounds: Bounds | None = None) -> None:
        self.router = router
        self.bounds = bounds
        self.headers = headers or {}
        self.pools_timeout_s = pools_timeout_s
        self.workers = workers
        self._spawn = spawn
        self._wait_healthy = wait_healthy
        self._stop = stop
        self.starting: dict[str, int] = {role: 0 for role in ROLES}
        self._next = {role: 1 + max((w.instance for w in workers if w.role == role), default=-1)
                      for role in ROLES}
        self._locks = {role: asyncio.Lock() for role in ROLES}

    def serving(self, role: str) -> list[WorkerProcess]:
        urls = {m.address.url for m in self._group(role)}
        return [w for w in self.workers if w.role == role and w.url in urls]

    def _group(self, role: str):
        client = self.router.client
        return client.prefill if role == "prefill" else client.decode

    async def scale(self, role: str, instances: int) -> list[dict]:
        """Add or remove `role` instances until `instances` serve; returns, for each worker
        removed, its name, URL, the router's calls on it when its drain began and its `/pools`
        once drained (`{"full", "detail"}`)."""
        if role not in ROLES:
            raise ScaleError(400, f"role: {role!r}; allowed: {', '.join(ROLES)}")
        if self.bounds is not None:
            low, high = self.bounds.limits(role)
            if not low <= instances <= high:
                raise ScaleError(400, f"instances: {instances}; allowed: {low} to {high} "
                                      f"(autoscaling.{role})")
        elif instances < 1:
            raise ScaleError(400, f"instances: {instances}; allowed: 1 or more (a router needs "
                                  "one worker of each role)")
        drained = []
        async with self._locks[role]:
            while len(self.serving(role)) < instances:
                await self._add(role)
            while len(self.serving(role)) > instances:
                drained.append(await self._remove(role))
        return drained

    async def _add(self, role: str) -> None:
        instance = self._next[role]
        self._next[role] += 1
        worker = self._spawn(role, instance)
        log.info("scaling: starting %s", worker.name)
        self.starting[role] += 1
        try:
            health = await self._wait_healthy(worker)
            bootstrap = ((str(health.get("bootstrap_host") or ""),
                          int(health.get("bootstrap_port") or 0)) if role == "prefill" else ())
            await self.router.client.add_worker(role, worker.url, *bootstrap)
        except BaseException as exc:
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(
                None, self._stop, worker))
            if isinstance(exc, MembershipError):
                raise ScaleError(503, f"{worker.name} did not join: {exc.message}") from None
            if isinstance(exc, Exception) and not isinstance(exc, ScaleError):
                raise ScaleError(503, f"{worker.name} did not come up: {exc}") from None
            raise
        finally:
            self.starting[role] -= 1
        self.workers.append(worker)
        log.info("scaling: %s serves", worker.name)

    async def _remove(self, role: str) -> dict:
        worker = max(self.serving(role), key=lambda w: w.instance)
        in_flight = next(m.calls for m in self._group(role) if m.address.url == worker.url)
        log.info("scaling: draining %s (%d calls in flight)", worker.name, in_flight)
        try:
            await self.router.client.remove_worker(worker.url)
        except MembershipError as exc:
            raise ScaleError(409, exc.message) from None
        self.workers.remove(worker)
        pools = await self._pools(worker)
        await asyncio.get_running_loop().run_in_executor(None, self._stop, worker)
        log.info("scaling: %s stopped", worker.name)
        return {"name": worker.name, "url": worker.url, "in_flight_at_drain": in_flight,
                "pools": pools}

    async def _pools(self, worker: WorkerProcess) -> dict:
        """Whether the drained `worker` has every page, request slot and metadata slot back
        and its transfers released: its `/pools`, polled until full, up to `pools_timeout_s`
        (then a warning)."""
        deadline = asyncio.get_running_loop().time() + self.pools_timeout_s
        state: dict = {}
        async with aiohttp.ClientSession(headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as session:
            while asyncio.get_running_loop().time() < deadline:
                try:
                    async with session.get(f"{worker.url}/pools") as resp:
                        state = await resp.json()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                    state = {"full": False, "detail": f"/pools failed: {type(exc).__name__}"}
                if state.get("full"):
                    return state
                await asyncio.sleep(0.1)
        log.warning("scaling: %s drained but not every page and slot is back: %s", worker.name,
                    state.get("detail"))
        return state

    def counts(self) -> dict[str, int]:
        return {role: len(self.serving(role)) for role in ROLES}

    async def handle(self, request: web.Request) -> web.Response:
        """`POST /scale {"role", "instances"}`: answers once the change is done."""
        try:
            body = await read_object(request, {"role": str, "instances": int},
                                     ("role", "instances"))
            drained = await self.scale(body["role"], body["instances"])
        except BadRequest as exc:
            return error_json(400, exc.message)
        except ScaleError as exc:
            return error_json(exc.status, exc.message)
        return web.json_response({"instances": self.counts(), "workers": [
            m.describe() for m in self.router.client.members()], "drained": drained})


# ---- the autoscaling loop ------------------------------------------------------------------


class Autoscaler:
    """Every `policy.interval_s`: observe, decide, scale (both roles; a decision's changes
    done before the next interval starts). `decisions` keeps the last `max_decisions`
    (observation, target); `GET /autoscaling` shows them."""

    def __init__(self, policy: AutoscalePolicy, scaler: Scaler, *,
                 headers: dict[str, str] | None = None, timeout_s: float = 5.0,
                 max_decisions: int = 100) -> None:
        self.policy = policy
        self.scaler = scaler
        self.headers = headers or {}
        self.timeout_s = timeout_s
        self.decisions: deque[tuple[ScaleObservation, dict[str, int]]] = deque(
            maxlen=max_decisions)

    async def handle(self, request: web.Request) -> web.Response:
        """`GET /autoscaling`: the policy's interval and its recent decisions."""
        return web.json_response({
            "policy": type(self.policy).__name__, "interval_s": self.policy.interval_s,
            "decisions": [{"observation": asdict(obs), "target": want}
                          for obs, want in self.decisions]})

    async def run(self) -> None:
        client = self.scaler.router.client
        async with aiohttp.ClientSession(headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s:
            while True:
                start_s = client.now()
                await asyncio.sleep(self.policy.interval_s)
                obs = await self.observe(s, start_s, client.now())
                target = self.policy.decide(obs)
                want = {role: target.of(role) for role in ROLES}
                self.decisions.append((obs, want))
                changes = [self.scaler.scale(role, n) for role, n in want.items()
                           if n != obs.role(role).provisioned]
                if changes:
                    log.info("autoscaling: %s -> %s", self.scaler.counts(), want)
                for result in await asyncio.gather(*changes, return_exceptions=True):
                    if isinstance(result, BaseException):
                        log.warning("autoscaling: %s", result)

    async def observe(self, session: aiohttp.ClientSession, start_s: float,
                      end_s: float) -> ScaleObservation:
        client = self.scaler.router.client
        states = {}
        for role in ROLES:
            group = client.prefill if role == "prefill" else client.decode
            loads = await asyncio.gather(*(_worker_load(session, m.address.url, role)
                                           for m in group))
            usage = [u for _, u in loads if u is not None]
            states[role] = RoleState(
                running=len(group), starting=self.scaler.starting[role],
                draining=sum(m.role == role for m in client.draining),
                queue_len=sum(q for q, _ in loads),
                kv_usage=sum(usage) / len(usage) if usage else 0.0)
        return window_observation(list(client.arrivals), list(client.records), start_s, end_s,
                                  states["prefill"], states["decode"])


async def _worker_load(session: aiohttp.ClientSession, url: str,
                       role: str) -> tuple[int, float | None]:
    """A worker's queue (prefill: requests waiting, bootstrapping included; decode: waiting
    or pre-allocating) and KV usage (its `sglang:token_usage`); (0, None) if it does not
    answer (it is then left out of the mean)."""
    try:
        async with session.get(f"{url}/load") as resp:
            queues = (await resp.json())["queues"]
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
            TypeError) as exc:
        log.info("autoscaling: no load from %s: %s", url, type(exc).__name__)
        return 0, None
    names = ("waiting", "bootstrap") if role == "prefill" else ("waiting", "prebuilt",
                                                                  "prealloc")
    usage = next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "sglang:token_usage"), None)
    return sum(int(queues.get(n, 0)) for n in names), usage


def window_observation(arrivals: Sequence[tuple[float, int]], records: Sequence[RequestRecord],
                       start_s: float, end_s: float, prefill: RoleState,
                       decode: RoleState) -> ScaleObservation:
    """The window (start_s, end_s] as the router saw it: the requests that arrived in it
    (`arrivals`: (arrival_s, prompt tokens)) and their mean prompt; of the requests that
    finished in it (`records`) and succeeded, the mean output, the p90 TTFT and the p90 of each
    one's mean inter-token gap (the simulator's autoscaler reads the same; its mean output is
    of the arrivals, whose lengths it knows in advance)."""
    arrived = [n for t, n in arrivals if start_s < t <= end_s]
    finished = [r for r in records if r.ok and start_s < r.finish_s <= end_s]
    first = [r.ttft_s for r in finished if r.token_times_s]
    gaps = [(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
            for r in finished if len(r.token_times_s) > 1]
    return ScaleObservation(
        now_s=end_s, window_s=end_s - start_s, prefill=prefill, decode=decode,
        arrivals=len(arrived),
        mean_input_tokens=_mean(arrived),
        mean_output_tokens=_mean([r.output_tokens for r in finished]),
        ttft_p90_s=_p90(first), itl_p90_s=_p90(gaps))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _p90(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None
