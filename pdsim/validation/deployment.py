"""A real deployment started from its YAML the way a user starts it: `pdsim serve CONFIG`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Colocated: "... at URL/v1"; disaggregated: "... (disaggregated: ...) at URL/v1".
READY = re.compile(r"^pdsim serve: .* at (http://\S+)/v1$")
# Anywhere in a line: the workers print from processes of their own, so two ready lines may
# share one (a line's text and its newline are separate writes to the pipe).
WORKER = re.compile(r"pdsim serve: (prefill|decode) worker (\d+) \([^)]*\) at (http://[^\s,/]+:\d+)")


class ServeError(RuntimeError):
    """The deployment did not come up; the message holds what it printed."""


class RealDeployment:
    """`pdsim serve CONFIG --port 0` as a child process; `url` is its OpenAI API root.

    The cluster secret is handed over in the environment (`secret`), so this process may call
    the workers' internal endpoints (`/records`) too; `workers` maps (role, instance) to URL.
    """

    def __init__(self, config: str | Path, *, secret: str, startup_timeout_s: float = 300.0):
        from runtime.security import SECRET_ENV

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "2",
               SECRET_ENV: secret}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdsim.cli", "serve", str(Path(config).resolve()), "--port",
             "0"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.secret = secret
        self.lines: list[str] = []
        self.workers: dict[tuple[str, int], str] = {}
        self.url = self._wait_ready(startup_timeout_s)
        # Keep draining its output so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            for m in WORKER.finditer(line):
                self.workers[(m.group(1), int(m.group(2)))] = m.group(3)
            if m := READY.match(line.strip()):
                return m.group(1)
        self.stop()
        raise ServeError("pdsim serve did not come up:\n" + "".join(self.lines[-40:]))

    def worker_records(self, role: str) -> list[list[dict]]:
        """Every `role` ("prefill" or "decode") worker's `/records` rows, one list per worker
        in instance order; each worker's times are on its own clock (NaN as None)."""
        return [self._get(url, "/records") for (r, _), url in sorted(self.workers.items())
                if r == role]

    def worker_pools(self, timeout_s: float = 15.0) -> dict[str, str]:
        """Each worker's leftovers once the replay is over, "" where every page and slot came
        back, keyed "prefill 0", "decode 0", ...; a worker still releasing its last transfers
        is asked again until `timeout_s`."""
        out = {}
        deadline = time.monotonic() + timeout_s
        for (role, i), url in sorted(self.workers.items()):
            while not (state := self._get(url, "/pools"))["full"] and time.monotonic() < deadline:
                time.sleep(0.05)
            out[f"{role} {i}"] = "" if state["full"] else state["detail"]
        return out

    def worker_state_bytes(self) -> dict[str, int]:
        """Each worker's recurrent-state bytes per request on one rank (its `/health`), keyed
        "prefill 0", "decode 0", ...; 0 for a model that keeps none."""
        return {f"{role} {i}": int(self._get(url, "/health").get("state_bytes_per_slot", 0))
                for (role, i), url in sorted(self.workers.items())}

    def _get(self, url: str, path: str):
        """A worker's internal endpoint's JSON (with the cluster key)."""
        from runtime.security import ClusterKey

        headers = ClusterKey.from_secret(self.secret).headers()
        req = urllib.request.Request(f"{url}{path}", headers=headers)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> RealDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
