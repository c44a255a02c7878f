"""SGLang's own router in front of pdsim's workers (`router.impl: sglang`).

`SGLangRouter(config, prefill, decode)` runs sglang-router (the `sglang-router` package,
unchanged) as a child process with the command line of `router_args`:

    python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill http://127.0.0.1:PORT BOOTSTRAP_PORT --decode http://127.0.0.1:PORT \\
        --host 127.0.0.1 --port 30000 --policy cache_aware [--cache-threshold ...]

started through `python -m runtime.sglang_router ARGS` so that the API key (`--api-key`: what
its clients must send, and the bearer token it sends the workers) comes from the environment
(`PDSIM_API_KEY`) and never shows on a command line. Each prefill worker's bootstrap port is
its pdsim bootstrap server's (its `/health` names it); SGLang's router tells the decode side the
prefill URL's host as the bootstrap host, so that must be where the bootstrap server listens.

The policy is the config's (the four both routers have: pdsim.deployment.SGLANG_POLICIES),
for prefill and decode alike as SGLang's `--policy` does; `cache_aware`'s options go to the
flags of the same names (`SGLANG_OPTION_FLAGS`), in SGLang's units (its match ratio counts
characters of the request text, its load requests).

Without an API key the router sends the workers no credentials, so their SGLang routes are
open: `check_exposure` then refuses workers that listen anywhere but loopback.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from pdsim.deployment import SGLANG_OPTION_FLAGS
from runtime.security import API_KEY_ENV

log = logging.getLogger(__name__)

INTEGER_OPTIONS = ("balance_abs_threshold",)  # SGLang's flag takes an integer
SHUTDOWN_GRACE_S = 5
PARENT_ENV = "PDSIM_ROUTER_PARENT_PID"


def router_args(config, prefill: Sequence[tuple[str, int]], decode: Sequence[str], *,
                port: int, metrics_port: int) -> list[str]:
    """sglang-router's arguments for `config`'s router section in front of these workers
    (`prefill`: (URL, bootstrap port) each). Its Prometheus exporter (by default on
    0.0.0.0:29000, which a second router on the machine cannot have) goes to the router's host
    and `metrics_port`. Its body limit is the workers' (`security.limits.max_body_bytes`): it
    answers 413 itself, where a body it forwarded (its default allows 512 MiB) would come back
    refused and count against the workers' circuit breakers."""
    r = config.router
    args = ["--pd-disaggregation"]
    for url, bootstrap_port in prefill:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decode:
        args += ["--decode", url]
    args += ["--host", r.host, "--port", str(port), "--prometheus-host", r.host,
             "--prometheus-port", str(metrics_port), "--policy", r.policy,
             "--max-payload-size", str(config.security.limits.max_body_bytes)]
    for name, value in sorted(r.policy_options.items()):
        if name in INTEGER_OPTIONS:
            if value != int(value):
                raise ValueError(f"router.policy_options.{name}: {value}; SGLang's router takes "
                                 "an integer")
            value = int(value)
        args += [SGLANG_OPTION_FLAGS[name], str(value)]
    return args + ["--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), "--log-level", "warn"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config, api_key: str | None) -> None:
    """Without an API key SGLang's router sends the workers no credentials and their SGLang
    routes take anyone's call: only on loopback."""
    if api_key:
        return
    for role in ("prefill", "decode"):
        host = config.role(role).host
        if not is_loopback(host):
            raise ValueError(
                f"cluster.{role}.host: {host}, with router.impl sglang and no API key: SGLang's "
                "router cannot send pdsim's cluster token, so the workers' SGLang routes would "
                "be open to anyone who reaches them; allowed: a loopback address (127.0.0.1, "
                "::1, localhost), or set security.api_key (PDSIM_API_KEY), which the router "
                "then sends the workers as a bearer token")


def preflight(config, api_key: str | None) -> None:
    """What can be refused before any worker starts: no sglang-router installed, open workers
    off loopback (`check_exposure`)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("router.impl sglang runs SGLang's router, which is not installed: "
                         "pip install sglang-router (or set router.impl: pdsim)")
    check_exposure(config, api_key)


class SGLangRouterError(RuntimeError):
    """SGLang's router exited, or did not register the workers in time."""


def _readiness(url: str, timeout_s: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


class SGLangRouter:
    """The router process; `await start(host, port)`, `url`, `await close()` like `PDRouter`.
    `prefill`: (URL, bootstrap port) per prefill worker."""

    def __init__(self, config, prefill: Sequence[tuple[str, int]], decode: Sequence[str], *,
                 api_key: str | None = None, startup_timeout_s: float = 60.0) -> None:
        preflight(config, api_key)
        for url, _ in prefill:
            host = urllib.parse.urlsplit(url).hostname
            if host != config.transfer.host:
                raise ValueError(
                    f"prefill worker {url}: SGLang's router names its host ({host}) as the "
                    f"bootstrap host, but the bootstrap server listens on transfer.host "
                    f"({config.transfer.host}); set both to the same address")
        self.config = config
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.metrics_port = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, port: int, metrics_port: int) -> list[str]:
        args = router_args(self.config, self.prefill, self.decode, port=port,
                           metrics_port=metrics_port)
        return [sys.executable, "-m", "runtime.sglang_router", *args]

    async def start(self, host: str, port: int = 0) -> int:
        """Start the router and wait until it has registered every worker as healthy."""
        from runtime.distributed import free_port
        from runtime.pd.worker import child_env

        port = port or free_port(host)
        self.metrics_port = free_port(host)
        env = {k: v for k, v in child_env().items() if k != API_KEY_ENV}
        env[PARENT_ENV] = str(os.getpid())
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        self.proc = subprocess.Popen(self.command(port, self.metrics_port), env=env,
                                     start_new_session=True)
        self.url = f"http://{host}:{port}"
        try:
            await self._wait_ready()
        except BaseException:
            await self.close()
            raise
        return port

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        expected = len(self.prefill) + len(self.decode)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SGLangRouterError(f"SGLang's router exited with status "
                                        f"{self.proc.returncode} while starting (see its output "
                                        "above)")
            state = await loop.run_in_executor(None, _readiness, self.url)
            if state and state.get("healthy_workers") == expected:
                return
            if time.monotonic() > deadline:
                raise SGLangRouterError(f"SGLang's router did not register the {expected} "
                                        f"workers within {self.startup_timeout_s:g} s (its "
                                        f"/readiness: {state})")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        from runtime.pd.worker import stop_processes

        if self.proc is not None:
            proc, self.proc = self.proc, None
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: stop_processes([proc], timeout_s=SHUTDOWN_GRACE_S + 5))


def main(argv: list[str] | None = None) -> int:
    """sglang-router with these arguments, its API key from `PDSIM_API_KEY`; it dies with the
    process that started it (`PARENT_ENV`), as the workers do."""
    from sglang_router.launch_router import launch_router, parse_router_args

    from runtime.pd.worker import die_with_parent

    if PARENT_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_ENV]))
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = os.environ.get(API_KEY_ENV) or None
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
