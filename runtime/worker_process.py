"""A worker process of a served PD deployment, as the launcher started it (or was told of it)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# A worker's exit status when a port it was given (HTTP or bootstrap) was taken before it could
# bind it: the launcher picked a free one a moment earlier, and another process got there
# first. The launcher then starts it again on other ports, where it picked them.
PORT_TAKEN_EXIT = 98


@dataclass
class WorkerProcess:
    role: str
    instance: int
    url: str
    proc: subprocess.Popen | None  # None: started elsewhere (`--role router`)
    command: list[str] | None = None  # how it was started: a restart (runtime/faults.py) reuses
    env: dict[str, str] | None = None

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.instance}"
