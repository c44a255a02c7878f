"""A worker whose port another process took between the launcher's pick and its bind is started
again on other ports (runtime/launcher.py `wait_healthy`), where the launcher picked them."""

from __future__ import annotations

import asyncio

import pytest

from runtime import launcher
from runtime.launcher import LaunchError, PORT_RETRIES, wait_healthy
from runtime.worker_process import PORT_TAKEN_EXIT, WorkerProcess

pytestmark = pytest.mark.real  # the launcher's module, though nothing here starts a process


class Exited:
    """A worker process that has already exited with `returncode`."""

    def __init__(self, returncode: int):
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode


def healthy_at(monkeypatch, urls: set[str]) -> None:
    monkeypatch.setattr(launcher, "fetch_health",
                        lambda url, timeout_s=2.0: {"role": "decode"} if url in urls else None)


def test_a_worker_whose_port_was_taken_is_started_on_new_ports(monkeypatch):
    taken = WorkerProcess("decode", 0, "http://127.0.0.1:1", Exited(PORT_TAKEN_EXIT))
    fresh = WorkerProcess("decode", 0, "http://127.0.0.1:2", None)
    ok = WorkerProcess("prefill", 0, "http://127.0.0.1:3", None)
    healthy_at(monkeypatch, {fresh.url, ok.url})
    workers, asked = [ok, taken], []
    health = asyncio.run(wait_healthy(workers, asyncio.Event(), 5.0,
                                      respawn=lambda w: asked.append(w) or fresh))
    assert asked == [taken] and workers == [ok, fresh] and set(health) == {ok.url, fresh.url}


@pytest.mark.parametrize("status, respawn", [
    (PORT_TAKEN_EXIT, lambda w: None),  # its ports were the config's: nothing to retry
    (1, lambda w: WorkerProcess("decode", 0, "http://127.0.0.1:2", None)),  # another failure
])
def test_a_worker_that_cannot_be_started_again_ends_the_launch(monkeypatch, status, respawn):
    healthy_at(monkeypatch, {"http://127.0.0.1:2"})
    worker = WorkerProcess("decode", 0, "http://127.0.0.1:1", Exited(status))
    with pytest.raises(LaunchError, match=f"decode worker 0 exited with status {status}"):
        asyncio.run(wait_healthy([worker], asyncio.Event(), 5.0, respawn=respawn))


def test_ports_taken_again_and_again_end_the_launch(monkeypatch):
    healthy_at(monkeypatch, set())
    spawned = []

    def respawn(w: WorkerProcess) -> WorkerProcess:
        spawned.append(w)
        return WorkerProcess("decode", 0, f"http://127.0.0.1:{10 + len(spawned)}",
                             Exited(PORT_TAKEN_EXIT))

    worker = WorkerProcess("decode", 0, "http://127.0.0.1:1", Exited(PORT_TAKEN_EXIT))
    with pytest.raises(LaunchError, match=f"exited with status {PORT_TAKEN_EXIT}"):
        asyncio.run(wait_healthy([worker], asyncio.Event(), 5.0, respawn=respawn))
    assert len(spawned) == PORT_RETRIES
