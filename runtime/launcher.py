"""`pdsim serve` for a disaggregated config: the prefill and decode workers and the router.

    pdsim serve experiments/real_pd.yaml                    # everything on this machine
    pdsim serve CONFIG --role prefill --instance 0          # one instance alone (its tp ranks)
    pdsim serve CONFIG --role decode --instance 1
    pdsim serve CONFIG --role router --prefill-url URL --decode-url URL

`launch(config)` starts every instance as a child process (`python -m runtime.pd.worker
--instance ...`, each in its own session, so a Ctrl-C reaches the launcher alone), waits until
each answers `GET /health` (a prefill worker's answer names its bootstrap server), starts the
router (runtime/router.py) in this process and prints its endpoint. On SIGINT or SIGTERM -- or
when a worker exits on its own -- it closes the router, sends every worker SIGTERM (each stops
its engine, its rank processes and its bootstrap server) and waits for them; a worker that has
not exited after `stop_timeout_s` is killed. The workers also die with the launcher
(PR_SET_PDEATHSIG), so none is left behind if it is killed outright.

Ports: a role's `port` (and prefill's `bootstrap_port`) is instance 0's, instance i adds i; 0
means a free port, picked here and handed to the worker.

Scaling (runtime/scaling.py, pdsim's router only): `POST /scale {"role", "instances"}` on the
router starts or drains and stops instances of a role while it serves; with an `autoscaling:`
section the configured policy does so every `interval_s` (`GET /autoscaling` shows its
decisions). An instance the launcher stopped after its drain is not a crash.

Security: `launch` uses the configured cluster secret (`PDSIM_CLUSTER_SECRET`, else
`security.cluster_secret`) or generates a fresh one for this deployment, and hands it to every
worker in its environment (never on its command line); the router sends the derived token on
every call to a worker. `--role router` alone needs the secret the workers were given (or
`security.insecure`). The router's public API requires `security.api_key` (or `PDSIM_API_KEY`)
when one is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from runtime.security import (
    API_KEY_ENV, api_key, deployment_secret, key_of, resolve_secret, secret_env,
)
from runtime.faults import Killer
from runtime.serve_config import ROLES, PDServeConfig
from runtime.transfer.bindshim import preload_env
from runtime.worker_process import PORT_TAKEN_EXIT, WorkerProcess

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A worker did not come up."""


def spawn_workers(config: PDServeConfig, secret: str | None = None) -> list[WorkerProcess]:
    """Start every prefill and decode instance of `config` (not waiting for them), `secret` in
    their environment (and, behind SGLang's router, the API key it sends them)."""
    workers: list[WorkerProcess] = []
    try:
        for role in ROLES:
            for i in range(config.role(role).instances):
                workers.append(spawn_worker(config, role, i, secret))
    except BaseException:
        from runtime.pd.worker import stop_processes

        stop_processes([w.proc for w in workers])
        raise
    return workers


def spawn_worker(config: PDServeConfig, role: str, instance: int,
                 secret: str | None = None) -> WorkerProcess:
    """Start instance `instance` of `role` (not waiting for it); one past the config's
    `instances` is one scaling added."""
    from runtime.distributed import free_port
    from runtime.pd.worker import child_env, python_command

    spec = config.role(role)
    port = config.worker_port(role, instance) or free_port(spec.host)
    dumped = config.model_dump(mode="json")
    dumped["cluster"][role]["instances"] = max(spec.instances, instance + 1)
    if dumped.get("autoscaling") is not None:  # the worker does not scale; its count may exceed
        dumped["autoscaling"] = None           # the bounds' starting count now
    payload = {"parent_pid": os.getpid(), "config": dumped, "role": role, "instance": instance,
               "port": port, "bootstrap_port": None}
    if role == "prefill":
        payload["bootstrap_port"] = (config.bootstrap_port(instance)
                                     or free_port(config.transfer.host))
    command = python_command("instance", payload)
    env = {**child_env(), **secret_env(secret), **router_key_env(config),
           **preload_env(config.transfer.host)}  # Mooncake's ports: see bindshim
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    return WorkerProcess(role, instance, f"http://{spec.host}:{port}", proc, command, env)


def respawn_on_new_ports(config: PDServeConfig, worker: WorkerProcess,
                         secret: str | None) -> WorkerProcess | None:
    """`worker` started again on freshly picked ports, or None where the config fixes its
    ports (then another process holds one of them: an error for the user)."""
    fixed = config.worker_port(worker.role, worker.instance) or (
        worker.role == "prefill" and config.bootstrap_port(worker.instance))
    return None if fixed else spawn_worker(config, worker.role, worker.instance, secret)


def router_key_env(config: PDServeConfig) -> dict[str, str]:
    """Behind SGLang's router, the API key it sends the workers (they accept it on their SGLang
    routes), in their environment."""
    key = api_key(config.security.api_key) if config.router.impl == "sglang" else None
    return {API_KEY_ENV: key} if key else {}


def fetch_health(url: str, timeout_s: float = 2.0) -> dict | None:
    """A worker's `/health` JSON, or None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


async def wait_healthy(workers: list[WorkerProcess], stop: asyncio.Event,
                       timeout_s: float,
                       respawn: Callable[[WorkerProcess], WorkerProcess | None] | None = None,
                       ) -> dict[str, dict] | None:
    """Every worker's `/health` once all answer (by URL); None if `stop` was set first.
    Raises `LaunchError` when a worker exits or `timeout_s` passes. A worker that exits
    because a port it was given was taken (PORT_TAKEN_EXIT) is replaced in `workers` (a list)
    by `respawn(worker)`, up to PORT_RETRIES times, where that gives one (the launcher picked
    its ports). A spinner names the workers still starting (pdsim.progress)."""
    from pdsim.progress import phase

    with phase(_waiting_for(workers)) as show:
        return await _wait_healthy(workers, stop, timeout_s, show, respawn)


PORT_RETRIES = 3  # new ports a worker whose port was taken gets


def _waiting_for(workers: Sequence[WorkerProcess]) -> str:
    return f"waiting for {', '.join(w.name for w in workers)} to be healthy"


async def _wait_healthy(workers: list[WorkerProcess], stop: asyncio.Event, timeout_s: float,
                        show: Callable[[str], None],
                        respawn: Callable[[WorkerProcess], WorkerProcess | None] | None
                        ) -> dict[str, dict] | None:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    health: dict[str, dict] = {}
    retries: dict[str, int] = {}  # by worker name
    while len(health) < len(workers):
        show(_waiting_for([w for w in workers if w.url not in health]))
        for i, w in enumerate(workers):
            if w.url in health:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                again = None
                if (w.proc.returncode == PORT_TAKEN_EXIT and respawn is not None
                        and retries.get(w.name, 0) < PORT_RETRIES):
                    again = respawn(w)
                if again is None:
                    raise LaunchError(f"{w.name} exited with status {w.proc.returncode} while "
                                      "starting (see its output above)")
                retries[w.name] = retries.get(w.name, 0) + 1
                log.warning("%s: a port it was given was taken; starting it on others",
                            w.name)
                workers[i] = w = again
                continue
            info = await loop.run_in_executor(None, fetch_health, w.url)
            if info is not None:
                health[w.url] = info
        if stop.is_set():
            return None
        if time.monotonic() > deadline:
            late = [w.name for w in workers if w.url not in health]
            raise LaunchError(f"{', '.join(late)} not healthy within {timeout_s:g} s")
        if len(health) < len(workers):
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
    return health


def make_router(config: PDServeConfig, prefill: Sequence[str], decode: Sequence[str],
                health: dict[str, dict], secret: str | None = None):
    """The router `router.impl` names in front of the given workers; `health` holds each
    prefill worker's `/health` (its bootstrap server). pdsim's `PDRouter` (runtime/router.py)
    reads the deployment's settings itself (its `router` section, seed, page size, limits of
    its server); its bootstrap rooms always come from the OS. `secret`: the workers' cluster
    secret; the config's API key (if any) guards the router's API. SGLang's router
    (runtime/sglang_router.py) gets the API key alone, for both."""
    if config.router.impl == "sglang":
        from runtime.sglang_router import SGLangRouter

        return SGLangRouter(config, [(u, health[u]["bootstrap_port"]) for u in prefill],
                            list(decode), api_key=api_key(config.security.api_key))
    from runtime.router import PDRouter, WorkerAddress
    from runtime.model.loading import load_text_side, model_config_of

    mcfg = model_config_of(config)
    text = load_text_side(config, mcfg.vocab_size)
    limits = config.request_limits(mcfg.vocab_size, mcfg.max_position)
    pre = [WorkerAddress(url=u, bootstrap_host=health[u]["bootstrap_host"],
                         bootstrap_port=health[u]["bootstrap_port"]) for u in prefill]
    dec = [WorkerAddress(url=u) for u in decode]
    return PDRouter(pre, dec, config, tokenizer=text.tokenizer, model_name=config.model_name,
                    limits=limits, chat_template=text.chat_template, eos_ids=text.eos_ids,
                    cluster_key=key_of(secret))


def protect_router(router, config: PDServeConfig) -> None:
    """pdsim's router: the API key on its public API, the security limits on all of it; after
    its last internal route (SGLang's router takes its key when made)."""
    if config.router.impl != "sglang":
        router.protect(api_key=api_key(config.security.api_key), limits=config.security.limits)


async def start_router(router, config: PDServeConfig) -> None:
    """Start `router` (`make_router`'s) at the config's address, protected
    (`protect_router`); SGLang's router failing to come up is a `LaunchError` too."""
    from runtime.sglang_router import SGLangRouterError

    protect_router(router, config)
    try:
        await router.start(config.router.host, config.router.port)
    except SGLangRouterError as exc:
        raise LaunchError(str(exc)) from None


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def launch(config: PDServeConfig, *, on_ready: Callable[[str], None] | None = None,
           startup_timeout_s: float = 300.0, stop_timeout_s: float = 30.0) -> int:
    """Run the whole deployment until SIGINT or SIGTERM; returns the exit status (0 after a
    signal, 1 when a worker failed). `on_ready(router_url)` is called once it serves."""
    return asyncio.run(_launch(config, on_ready, startup_timeout_s, stop_timeout_s))


async def _launch(config: PDServeConfig, on_ready, startup_timeout_s: float,
                  stop_timeout_s: float) -> int:
    from runtime.pd.worker import stop_processes

    if config.router.impl == "sglang":
        from runtime.sglang_router import preflight

        preflight(config, api_key(config.security.api_key))
    stop = _stop_event()
    secret = deployment_secret(config.security.cluster_secret)
    workers = spawn_workers(config, secret)
    router = None
    status = 0
    killer = Killer(config.faults)  # fault injection: kills and restarts
    tasks: list[asyncio.Task] = []  # the kills, the autoscaler
    try:
        health = await wait_healthy(workers, stop, startup_timeout_s,
                                    respawn=lambda w: respawn_on_new_ports(config, w, secret))
        if health is None:
            return 0
        prefill = [w.url for w in workers if w.role == "prefill"]
        decode = [w.url for w in workers if w.role == "decode"]
        router = make_router(config, prefill, decode, health, secret=secret)
        autoscaler = None
        if config.router.impl == "pdsim":
            scaler = make_scaler(config, router, workers, secret, stop, startup_timeout_s,
                                 stop_timeout_s)
            router.add_internal(("POST", "/scale", scaler.handle))
            if config.autoscaling is not None:
                autoscaler = make_autoscaler(config, scaler, secret)
                router.add_internal(("GET", "/autoscaling", autoscaler.handle))
        await start_router(router, config)
        if on_ready is not None:
            on_ready(router.url)
        tasks.append(asyncio.create_task(killer.run(workers)))
        if autoscaler is not None:
            tasks.append(asyncio.create_task(autoscaler.run()))
        while not stop.is_set():
            await _wait(stop, 1.0)
            dead = [w for w in workers
                    if w.proc.poll() is not None and not killer.killed(w.role, w.instance)]
            if dead:
                log.error("%s exited with status %s; shutting down", dead[0].name,
                          dead[0].proc.returncode)
                status = 1
                break
            if config.router.impl == "sglang" and not router.running:  # its own process
                log.error("the router exited; shutting down")
                status = 1
                break
        return status
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if router is not None:
            await router.close()
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: stop_processes([w.proc for w in workers], timeout_s=stop_timeout_s))


def make_scaler(config: PDServeConfig, router, workers: list[WorkerProcess], secret: str | None,
                stop: asyncio.Event, startup_timeout_s: float, stop_timeout_s: float):
    """The `Scaler` (runtime/scaling.py) of this launcher's workers behind pdsim's `router`."""
    from runtime.pd.worker import stop_processes
    from runtime.scaling import Scaler

    async def healthy(worker: WorkerProcess) -> dict:
        health = await wait_healthy([worker], stop, startup_timeout_s)
        if health is None:
            raise LaunchError("the launcher is stopping")
        return health[worker.url]

    key = key_of(secret)
    return Scaler(router, workers,
                  spawn=lambda role, i: spawn_worker(config, role, i, secret),
                  wait_healthy=healthy,
                  stop=lambda w: stop_processes([w.proc], timeout_s=stop_timeout_s),
                  headers=None if key is None else key.headers(),
                  bounds=None if config.autoscaling is None else config.autoscaling.bounds)


def make_autoscaler(config: PDServeConfig, scaler, secret: str | None):
    """The `autoscaling:` section's policy driving `scaler`, reading the workers with the
    cluster token."""
    from runtime.scaling import Autoscaler

    key = key_of(secret)
    return Autoscaler(config.autoscaling.make_policy(), scaler,
                      headers=None if key is None else key.headers())


def serve_router(config: PDServeConfig, prefill_urls: Sequence[str] = (),
                 decode_urls: Sequence[str] = (), *,
                 on_ready: Callable[[str], None] | None = None,
                 startup_timeout_s: float = 300.0) -> int:
    """`--role router`: the router alone, in front of workers started elsewhere (URLs from the
    arguments, else `router.prefill_urls` / `decode_urls`, else the roles' host and ports).
    Its bootstrap rooms come from the OS (runtime/router.py), so routers sharing workers never
    draw the same ones."""

    def urls(given: Sequence[str], configured: Sequence[str], role: str) -> list[str]:
        if given or configured:
            return [u.rstrip("/") for u in (given or configured)]
        spec = config.role(role)
        if not spec.port:
            raise ValueError(f"--role router needs the {role} workers' URLs: give "
                             f"--{role}-url, router.{role}_urls, or a fixed {role}.port")
        return [f"http://{spec.host}:{spec.port + i}" for i in range(spec.instances)]

    prefill = urls(prefill_urls, config.router.prefill_urls, "prefill")
    decode = urls(decode_urls, config.router.decode_urls, "decode")
    secret = resolve_secret(config.security.cluster_secret, insecure=config.security.insecure,
                            what="the router")

    async def main() -> int:
        stop = _stop_event()
        pending = [WorkerProcess("prefill", i, u, None) for i, u in enumerate(prefill)]
        pending += [WorkerProcess("decode", i, u, None) for i, u in enumerate(decode)]
        health = await wait_healthy(pending, stop, startup_timeout_s)
        if health is None:
            return 0
        for u in prefill:
            if health[u].get("role") != "prefill" or not health[u].get("bootstrap_port"):
                raise LaunchError(f"{u} is not a prefill worker (its /health: {health[u]})")
        router = make_router(config, prefill, decode, health, secret=secret)
        await start_router(router, config)
        try:
            if on_ready is not None:
                on_ready(router.url)
            await stop.wait()
        finally:
            await router.close()
        return 0

    return asyncio.run(main())
