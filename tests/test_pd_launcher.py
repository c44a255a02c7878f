"""`pdsim serve` with a disaggregated config, as a user runs it: the launcher starts a prefill
instance (two rank processes) and a decode instance, then the router; the OpenAI client talks to
the router; `--role router` starts a second router alone in front of the same workers (it needs
their cluster secret); SIGTERM stops everything, leaving no process behind and every port free.
A role alone refuses to start without a cluster secret unless `--insecure`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from configs import tiny_pd_yaml
from pd_harness import REPO, Proc
from runtime.security import SECRET_ENV, listeners, new_secret
from runtime.transfer import bindshim

pytestmark = [pytest.mark.real, pytest.mark.slow]

CONFIG = tiny_pd_yaml(prefill_tp=2)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_free(port: int) -> bool:
    """Whether a server could listen on `port` again (connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def complete(url: str, api_key: str = "unused") -> list[int]:
    client = OpenAI(base_url=url, api_key=api_key, max_retries=0)
    reply = client.completions.create(model="tiny-llama", prompt="Hello, disaggregated world",
                                      max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 10
    return reply.choices[0].token_ids


def test_launcher_serves_and_stops_cleanly_on_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, new_secret())  # the deployment's, for the second router
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(CONFIG)
    launcher = Proc(str(cfg))
    try:
        prefill = launcher.wait_for(r"prefill worker 0 \(tiny-llama, tp 2\) at (http://\S+), "
                                    r"bootstrap 127\.0\.0\.1:(\d+)")
        decode = launcher.wait_for(r"decode worker 0 \(tiny-llama, tp 1\) at (http://\S+)")
        url = launcher.wait_for(r"tiny-llama \(disaggregated: 1 prefill x tp 2, 1 decode x "
                                r"tp 1\) at (http://\S+/v1)").group(1)
        children = descendants(launcher.proc.pid)
        assert len(children) == 3, children  # prefill ranks 0 and 1, decode rank 0
        tokens = complete(url)
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        # A second router alone, in front of the same workers (multi-machine style).
        router = Proc(str(cfg), "--role", "router", "--port", "0",
                      "--prefill-url", prefill.group(1), "--decode-url", decode.group(1))
        try:
            alone = router.wait_for(r"router for tiny-llama at (http://\S+/v1)").group(1)
            assert complete(alone) == tokens
        finally:
            assert router.stop() == 0
        ports = [int(u.rsplit(":", 1)[1]) for u in (prefill.group(1), decode.group(1))]
        ports += [int(prefill.group(2)), int(url.rsplit(":", 1)[1].split("/")[0])]
        start = time.monotonic()
        assert launcher.stop() == 0
        launcher.wait_for(r"pdsim serve: stopped", timeout_s=5)
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 10
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if alive(p)], "worker processes left behind"
        assert [p for p in ports if not port_free(p)] == []
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()


def test_one_role_alone_and_cli_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(CONFIG)
    worker = Proc(str(cfg), "--role", "decode", "--port", "0", "--insecure")
    try:
        url = worker.wait_for(r"decode worker 0 \(tiny-llama, tp 1\) at (http://\S+)").group(1)
        with urllib.request.urlopen(url + "/health") as resp:
            health = json.loads(resp.read())
        assert (health["role"], health["status"], health["tp"]) == ("decode", "ok", 1)
        assert "INSECURE: decode worker 0 runs without a cluster secret" in "".join(worker.seen)
        if bindshim.build() is not None:  # rank 0 re-executed itself with the bind() wrapper
            assert all(x.loopback for x in listeners(worker.proc.pid))
        assert worker.stop() == 0
        worker.wait_for(r"pdsim serve: stopped", timeout_s=5)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
    colocated = tmp_path / "colo.yaml"
    colocated.write_text("model: tiny-llama\ncluster: {mode: colocated, colocated: "
                         "{instances: 1, scheduler: {num_pages: 64}}}\n")
    for args, message in (
        ([str(colocated), "--role", "prefill"], "only a disaggregated config has roles"),
        ([str(cfg), "--role", "cook"], "--role 'cook'; allowed: prefill, decode, router"),
        ([str(cfg), "--role", "prefill", "--instance", "3"],
         "prefill instance 3; the config has 1"),
        ([str(cfg), "--role", "router"], "needs the prefill workers' URLs"),
        ([str(cfg), "--role", "decode"], f"decode worker 0 needs the deployment's cluster "
                                         f"secret: set {SECRET_ENV}"),
        ([str(cfg), "--role", "router", "--prefill-url", "http://127.0.0.1:1", "--decode-url",
          "http://127.0.0.1:2"], "the router needs the deployment's cluster secret"),
    ):
        out = subprocess.run([sys.executable, "-m", "pdsim.cli", "serve", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode in (1, 2) and message in " ".join(out.stderr.split()), out.stderr



def test_a_configured_port_another_process_holds_ends_the_launch_naming_it(tmp_path,
                                                                          monkeypatch):
    """The worker exits PORT_TAKEN_EXIT, saying which address; its port is the config's, so the
    launcher does not pick another but stops, naming the worker."""
    monkeypatch.setenv(SECRET_ENV, new_secret())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = tmp_path / "pd.yaml"
        cfg.write_text(tiny_pd_yaml().replace("decode: {threads: 1,",
                                              f"decode: {{threads: 1, port: {port},"))
        out = subprocess.run([sys.executable, "-m", "pdsim.cli", "serve", str(cfg)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "decode worker 0: [Errno 98]" in out.stderr and "address already in use" in out.stderr
    assert "decode worker 0 exited with status 98 while starting" in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr
