"""Chaos soak of the real PD deployment: minutes of steady load while each worker role is killed
and restarted in turn, some KV transfers fail on purpose, thousands of idle connections are held
open and bad requests arrive; every request must end cleanly, and no KV page may leak.

    python benchmarks/soak.py [--minutes 10] [--clients 12] [--seed 0] [--json out.json]
        [--config experiments/real_pd.yaml] [--fail-transfers 0.05] [--idle-connections 2000]
        [--bad-share 0.05] [--restart-after-s 2]

Starts `pdsim serve` (the launcher) on `--config` (default experiments/real_pd.yaml: 1 prefill +
1 decode worker of tiny-llama, Mooncake over TCP, the router, all on loopback) with its router on
a free port and a `faults:` section added: the prefill worker is killed at 30% of the run and the
decode worker at 60%, each restarted `--restart-after-s` later (the router runs in the launcher,
which is not killed), and `--fail-transfers` of the requests' KV transfers fail. Once it serves:

- `--idle-connections` TCP connections that never send a byte, spread over every port the
  deployment's processes listen on (router API, worker APIs, bootstrap, ZMQ, Mooncake's
  handshake and data ports), held for the whole run: every 5 s those a server closed (or that
  died with a killed worker) are opened anew, to the ports listening then;
- `--clients` client loops send requests until the time is up: streamed and whole completions
  and chat completions, prompts of 20-600 bytes, 1-64 new tokens; 15% of them hang up early (a
  stream after a few chunks, a whole answer after a random wait), and `--bad-share` are bad
  requests (a body over security.limits.max_body_bytes, malformed JSON, a field of the wrong
  type, an unknown model, a prompt far too long for the KV pool).

Each request is counted as

- completed: a whole answer, or a stream that ended with a finish reason and `[DONE]`;
- failed: a clean error, i.e. an error status with a JSON `error` body, or an error event in the
  stream followed by `[DONE]` (a bad request answered so counts as `rejected` instead);
- disconnected: the client hung up on purpose;
- unclean: an error answer without a JSON error body, or a stream that ended without `[DONE]`;
- lost: no end at all (no answer, or a stream that stalled) within 90 s: the goal is 0.

`status_500` counts answers with HTTP 500 (goal 0: a failed KV transfer, injected or not, is a
503 that the router retries once). At the end every worker's `GET /pools` must
report all pages, request slots and metadata slots back: `leaked_pages` counts KV pages still in
use (goal 0). Every second the launcher's and each worker's open descriptors and RSS are read
from /proc; the peaks are reported per process, and how many idle connections were opened in
all, closed by the servers and open at the end, by process. The exit
status is 1 when any request was lost or unclean, answered 500, a page leaked
or a role was not restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdsim.deployment import HttpLimits  # noqa: E402
from runtime.security import SECRET_ENV, key_of, listeners, new_secret  # noqa: E402

DEFAULT_CONFIG = REPO / "experiments" / "real_pd.yaml"
KILLS = (("prefill", 0.3), ("decode", 0.6))  # (role, when: a share of the run)


def soak_config(path: Path, duration_s: float, restart_after_s: float, fail_transfers: float,
                seed: int) -> str:
    """The deployment at `path`, its router on a free port, with the soak's faults."""
    config = yaml.safe_load(path.read_text())
    config.setdefault("router", {})["port"] = 0
    config["faults"] = {
        "seed": seed, "fail_transfers": fail_transfers,
        "kill": [{"role": role, "instance": 0, "at_s": round(share * duration_s, 1),
                  "restart_after_s": restart_after_s} for role, share in KILLS]}
    return yaml.safe_dump(config, sort_keys=False)


REQUEST_TIMEOUT_S = 90.0  # a request with no terminal event by then is lost
WORDS = "the KV cache moves from prefill to decode over the transfer engine".split()


class Launcher:
    """`pdsim serve CONFIG` in a subprocess; its output is read on a task."""

    def __init__(self, config: str, secret: str) -> None:
        self.file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        self.file.write(config)
        self.file.close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "2",
               SECRET_ENV: secret}
        self.proc = subprocess.Popen([sys.executable, "-m", "pdsim.cli", "serve", self.file.name],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def wait_for(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while time.monotonic() < deadline and (line := self.proc.stdout.readline()):
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise RuntimeError(f"pdsim serve never printed {pattern!r}:\n" + "".join(self.lines))

    def drain(self) -> None:
        """Keep reading its output (a full pipe would block it)."""
        def read() -> None:
            for line in iter(self.proc.stdout.readline, ""):
                self.lines.append(line)

        threading.Thread(target=read, daemon=True).start()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(90)
        os.unlink(self.file.name)
        return status


def request_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 100)))
    body = {"model": "tiny-llama", "max_tokens": rng.randint(1, 64), "stream": rng.random() < 0.8,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return ("/chat/completions" if chat else "/completions"), body


BAD_KINDS = ("oversized body", "malformed JSON", "wrong type", "unknown model", "huge prompt")


def bad_request(rng: random.Random, max_body_bytes: int) -> tuple[str, bytes]:
    """One bad request: (its kind, its body for /completions)."""
    kind = rng.choice(BAD_KINDS)
    if kind == "oversized body":
        return kind, b'{"prompt": "' + b"x" * max_body_bytes + b'"}'
    if kind == "malformed JSON":
        return kind, b'{"prompt": "unterminated, "max_tokens": 3'
    if kind == "wrong type":
        return kind, json.dumps({"prompt": "hi", "max_tokens": "many"}).encode()
    if kind == "unknown model":
        return kind, json.dumps({"model": "gpt-17", "prompt": "hi"}).encode()
    return kind, json.dumps({"prompt": "y" * (max_body_bytes // 2), "max_tokens": 1}).encode()


class Tally:
    """What the clients saw: outcomes, HTTP statuses, error messages (numbers and addresses left
    out)."""

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.statuses: Counter = Counter()
        self.errors: Counter = Counter()

    def error(self, message: str, status: int | None = None) -> None:
        shape = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"https?://\S+", "URL", message))[:120]
        self.errors[shape if status is None else f"{status} {shape}"] += 1


async def _error_answer(resp: aiohttp.ClientResponse, tally: Tally) -> bool:
    """Whether a non-200 answer is a clean error: a JSON body with error.message."""
    try:
        message = (await resp.json(content_type=None))["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        return False
    if not isinstance(message, str):
        return False
    tally.error(message, resp.status)
    return True


async def send_bad(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally,
                   max_body_bytes: int) -> str:
    kind, body = bad_request(rng, max_body_bytes)
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with session.post(url + "/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                tally.statuses[resp.status] += 1
                if 400 <= resp.status < 500 and await _error_answer(resp, tally):
                    return "rejected"
                tally.error(f"{kind}: answered without a JSON error", resp.status)
                return "unclean"
    except TimeoutError:
        return "lost"
    except aiohttp.ClientError as exc:  # the server may close an oversized upload early
        if kind == "oversized body" and isinstance(exc, (aiohttp.ClientOSError,
                                                         aiohttp.ServerDisconnectedError)):
            tally.error(f"{kind}: connection closed before an answer")
            return "rejected"
        return "lost"


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random,
                      tally: Tally) -> str:
    """Send one request; its outcome: completed, failed, disconnected, unclean or lost."""
    path, body = request_body(rng)
    hang_up = rng.random() < 0.15
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if hang_up and not body["stream"]:
                try:
                    async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                        async with session.post(url + path, json=body) as resp:
                            tally.statuses[resp.status] += 1
                            if resp.status == 200:
                                await resp.read()
                                return "completed"
                            return "failed" if await _error_answer(resp, tally) else "unclean"
                except TimeoutError:
                    return "disconnected"
            async with session.post(url + path, json=body) as resp:
                tally.statuses[resp.status] += 1
                if resp.status != 200:
                    return "failed" if await _error_answer(resp, tally) else "unclean"
                if not body["stream"]:
                    return "completed" if (await resp.json())["choices"] else "unclean"
                leave_after = rng.randint(0, 3) if hang_up else None
                chunks, error, finished = 0, False, False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return "failed" if error else ("completed" if finished else "unclean")
                    event = json.loads(data)
                    if "error" in event:
                        error = True
                        tally.error(event["error"]["message"])
                    finished = finished or any(c.get("finish_reason")
                                               for c in event.get("choices", ()))
                    chunks += 1
                    if leave_after is not None and chunks > leave_after:
                        return "disconnected"  # leaving the block closes the connection
                return "unclean"  # the stream ended without [DONE]
    except TimeoutError:
        return "lost"
    except aiohttp.ClientError:
        return "unclean"


async def load(url: str, clients: int, duration_s: float, seed: int, bad_share: float,
               max_body_bytes: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                if rng.random() < bad_share:
                    outcome = await send_bad(session, url, rng, tally, max_body_bytes)
                else:
                    outcome = await one_request(session, url, rng, tally)
                tally.outcomes[outcome] += 1
                if outcome == "failed":
                    await asyncio.sleep(0.2)  # a client backs off before trying again

        await asyncio.gather(*(client(i) for i in range(clients)))
    return tally


def process_name(pid: int, launcher_pid: int) -> str:
    """"launcher", or a worker's role and instance from its command line."""
    if pid == launcher_pid:
        return "launcher"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            payload = json.loads(f.read().split(b"\0")[-2])
        name = f"{payload['role']} {payload['instance']}"
        return name + (f" rank {payload['tp_rank']}" if payload.get("tp_rank") else "")
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return f"pid {pid}"


def deployment_pids(launcher_pid: int) -> set[int]:
    """The launcher and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [launcher_pid]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


class ProcessWatch:
    """Reads every `interval_s` the open descriptors and RSS of the launcher and its workers from
    /proc, and keeps each process's peaks (by name: a restarted worker keeps its name)."""

    def __init__(self, launcher_pid: int, interval_s: float = 1.0) -> None:
        self.launcher_pid = launcher_pid
        self.interval_s = interval_s
        self.peak_fds: Counter = Counter()
        self.peak_rss_mb: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for pid in deployment_pids(self.launcher_pid):
            name = process_name(pid, self.launcher_pid)
            try:
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                with open(f"/proc/{pid}/status") as f:
                    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                continue  # it exited meanwhile
            self.peak_fds[name] = max(self.peak_fds[name], fds)
            self.peak_rss_mb[name] = max(self.peak_rss_mb[name], rss_kb // 1024)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> ProcessWatch:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def still_open(sock: socket.socket) -> bool:
    """Whether the peer has not closed (nor reset) this idle connection; whatever it sent (a ZMQ
    greeting, say) is read and dropped."""
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):
            pass
        return False  # end of stream
    except BlockingIOError:
        return True
    except OSError:
        return False


class IdleConnections:
    """Holds `n` TCP connections that never send a byte, spread evenly over every port the
    deployment's processes listen on; every `interval_s` the ones a server closed (or that died
    with a killed worker) are opened anew to the listeners there are then."""

    def __init__(self, launcher_pid: int, n: int, interval_s: float = 5.0) -> None:
        self.launcher_pid = launcher_pid
        self.n = n
        self.interval_s = interval_s
        self.held: list[tuple[str, int, socket.socket]] = []  # (process name, port, connection)
        self.opened = 0
        self.closed_by_peer: Counter = Counter()  # by process name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _top_up(self) -> None:
        kept, per_target = [], Counter()
        for name, port, sock in self.held:
            if still_open(sock):
                kept.append((name, port, sock))
                per_target[name, port] += 1
            else:
                self.closed_by_peer[name] += 1
                sock.close()
        targets = {(process_name(pid, self.launcher_pid), x.port):
                   "127.0.0.1" if x.address in ("0.0.0.0", "::") else x.address
                   for pid in deployment_pids(self.launcher_pid) for x in listeners(pid)}
        for _ in range(self.n - len(kept)):
            if not targets or self._stop.is_set():
                break
            name, port = target = min(targets, key=lambda t: (per_target[t], t))
            per_target[target] += 1  # tried, even if it fails: the next goes elsewhere
            try:
                sock = socket.create_connection((targets[target], port), timeout=5)
            except OSError:
                continue
            sock.settimeout(None)  # blocking: a timeout would make still_open's recv wait
            kept.append((name, port, sock))
            self.opened += 1
        self.held = kept

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._top_up()

    def start(self) -> IdleConnections:
        self._top_up()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Close them all; what happened to them."""
        self._stop.set()
        self._thread.join()
        open_now = Counter(name for name, _, sock in self.held if still_open(sock))
        for _, _, sock in self.held:
            sock.close()
        return {"held": self.n, "opened": self.opened, "open_at_end": dict(open_now),
                "closed_by_peer": dict(self.closed_by_peer)}


def leaked_pages(worker_url: str, headers: dict[str, str], wait_s: float = 120.0) -> tuple[int, str]:
    """KV pages a worker still holds once idle (0 when every pool is full), and its detail; a
    restarted worker still loading gets `wait_s` to answer."""
    deadline = time.monotonic() + wait_s
    while True:
        req = urllib.request.Request(worker_url + "/pools", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=40) as resp:
                state = json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{worker_url} did not answer /pools: {exc}") from None
            time.sleep(0.5)
            continue
        if state["full"]:
            return 0, ""
        if time.monotonic() > deadline:
            m = re.search(r"(\d+) of \d+ kv pages in use", state["detail"])
            return int(m.group(1)) if m else 0, state["detail"]
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--restart-after-s", type=float, default=2.0)
    ap.add_argument("--fail-transfers", type=float, default=0.05)
    ap.add_argument("--idle-connections", type=int, default=2000)
    ap.add_argument("--bad-share", type=float, default=0.05)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.minutes <= 0 or args.clients < 1 or args.idle_connections < 0:
        ap.error(f"--minutes {args.minutes}, --clients {args.clients}, --idle-connections "
                 f"{args.idle_connections}: allowed > 0, >= 1, >= 0")
    if not (0 <= args.fail_transfers <= 1 and 0 <= args.bad_share <= 1):
        ap.error(f"--fail-transfers {args.fail_transfers}, --bad-share {args.bad_share}: "
                 "allowed 0..1")
    duration_s = args.minutes * 60
    secret = new_secret()
    config = soak_config(args.config, duration_s, args.restart_after_s, args.fail_transfers,
                         args.seed)
    max_body_bytes = HttpLimits(**((yaml.safe_load(config).get("security") or {})
                                   .get("limits") or {})).max_body_bytes
    launcher = Launcher(config, secret)
    watch, idle, idle_report = None, None, {}
    try:
        pre = launcher.wait_for(r"prefill worker 0 .* at (http://[^\s,]+)").group(1)
        dec = launcher.wait_for(r"decode worker 0 .* at (http://[^\s,]+)").group(1)
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+/v1)").group(1)
        launcher.drain()
        watch = ProcessWatch(launcher.proc.pid).start()
        idle = IdleConnections(launcher.proc.pid, args.idle_connections).start()
        start = time.monotonic()
        tally = asyncio.run(load(url, args.clients, duration_s, args.seed, args.bad_share,
                                 max_body_bytes))
        elapsed = time.monotonic() - start
        headers = key_of(secret).headers()
        leaks = {name: leaked_pages(u, headers) for name, u in (("prefill", pre), ("decode", dec))}
        restarted = {role: any(f"fault injection: restart {role} worker 0" in line
                               for line in launcher.lines) for role, _ in KILLS}
    except BaseException:
        print("".join(line for line in launcher.lines[-40:] if not re.match(r"[IWE]\d{4}", line)))
        raise
    finally:
        if idle is not None:
            idle_report = idle.stop()
        if watch is not None:
            watch.stop()
        status = launcher.stop()
    outcomes = tally.outcomes
    figures = {
        "minutes": round(elapsed / 60, 2), "clients": args.clients,
        "requests": sum(outcomes.values()),
        **{k: outcomes.get(k, 0) for k in ("completed", "failed", "rejected", "disconnected",
                                           "unclean", "lost")},
        "status_500": tally.statuses.get(500, 0),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "leaked_pages": sum(n for n, _ in leaks.values()),
        "idle_connections": idle_report,
        "peak_fds": dict(watch.peak_fds), "peak_rss_mb": dict(watch.peak_rss_mb),
        "restarted": restarted, "launcher_exit": status,
    }
    for message, n in tally.errors.most_common(12):
        print(f"{n:6d} x {message}")
    for name, (n, detail) in leaks.items():
        if detail:
            print(f"{name} worker not idle: {detail}")
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if (figures["lost"] or figures["unclean"] or figures["status_500"]
            or figures["leaked_pages"] or not all(restarted.values())):
        sys.exit(1)


if __name__ == "__main__":
    main()
