"""Soak test of the real PD deployment: minutes of mixed load, random client disconnects and one
worker restart; every request must end, and no KV page may leak.

    python benchmarks/soak.py [--minutes 2] [--clients 12] [--seed 0] [--json out.json]

Starts `pdsim serve` (the launcher: 1 prefill + 1 decode worker of tiny-llama on CPU, Mooncake
over TCP, the router, all on loopback) with a `faults:` section that kills the decode worker
halfway through and restarts it 2 s later. `--clients` client loops then send requests until the
time is up: streamed and whole completions and chat completions, prompts of 20-600 bytes,
1-64 new tokens. A share of them hang up early (a stream after a few chunks, a whole answer
after a random wait). Each request is counted as

- completed: a whole answer, or a stream that ended with a finish reason and `[DONE]`;
- failed: an error answer, or an error event in the stream;
- disconnected: the client hung up on purpose;
- lost: none of those (the stream broke or stalled with no terminal event): the goal is 0.

At the end every worker's `GET /pools` must report all pages, request slots and metadata slots
back: `leaked_pages` counts KV pages still in use (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.security import SECRET_ENV, key_of, new_secret  # noqa: E402

CONFIG = """\
model: tiny-llama
seed: 0
device: cpu
cluster:
  mode: disaggregated
  prefill:
    threads: 1
    scheduler: &knobs {{page_size: 16, num_pages: 512, max_running_requests: 32,
                        max_prefill_tokens: 2048, chunked_prefill_size: 512,
                        bootstrap_timeout_s: 10.0, waiting_timeout_s: 20.0}}
  decode: {{threads: 1, scheduler: {{<<: *knobs, num_pages: 1024}}}}
router: {{port: 0}}
transfer: {{heartbeat_interval_s: 1.0, heartbeat_timeout_s: 5.0, handshake_timeout_s: 10.0}}
faults:
  kill: [{{role: decode, instance: 0, at_s: {kill_s}, restart_after_s: {restart_s}}}]
"""

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


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random,
                      errors: Counter) -> str:
    """Send one request; its outcome: completed, failed, disconnected or lost (`errors` counts
    the failures' messages, numbers and addresses left out)."""
    path, body = request_body(rng)
    hang_up = rng.random() < 0.15
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if hang_up and not body["stream"]:
                try:
                    async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                        async with session.post(url + path, json=body) as resp:
                            answer = await resp.json(content_type=None)
                            if resp.status == 200:
                                return "completed"
                            errors[_shape(answer["error"]["message"])] += 1
                            return "failed"
                except TimeoutError:
                    return "disconnected"
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    error = (await resp.json(content_type=None)).get("error")
                    if error:
                        errors[_shape(error["message"])] += 1
                    return "failed" if error else "lost"
                if not body["stream"]:
                    return "completed" if (await resp.json())["choices"] else "lost"
                leave_after = rng.randint(0, 3) if hang_up else None
                chunks, error, finished = 0, False, False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return "failed" if error else ("completed" if finished else "lost")
                    event = json.loads(data)
                    if "error" in event:
                        error = True
                        errors[_shape(event["error"]["message"])] += 1
                    finished = finished or any(c.get("finish_reason")
                                               for c in event.get("choices", ()))
                    chunks += 1
                    if leave_after is not None and chunks > leave_after:
                        return "disconnected"  # leaving the block closes the connection
                return "failed" if error else "lost"
    except TimeoutError:
        return "lost"
    except aiohttp.ClientError:
        return "lost"


def _shape(message: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"https?://\S+", "URL", message))[:120]


async def load(url: str, clients: int, duration_s: float, seed: int) -> tuple[Counter, Counter]:
    outcomes: Counter = Counter()
    errors: Counter = Counter()
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                outcome = await one_request(session, url, rng, errors)
                outcomes[outcome] += 1
                if outcome == "failed":
                    await asyncio.sleep(0.2)  # a client backs off before trying again

        await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes, errors


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
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-after-s", type=float, default=2.0)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.minutes <= 0 or args.clients < 1:
        ap.error(f"--minutes {args.minutes} and --clients {args.clients}: allowed > 0 and >= 1")
    duration_s = args.minutes * 60
    secret = new_secret()
    launcher = Launcher(CONFIG.format(kill_s=duration_s / 2, restart_s=args.restart_after_s),
                        secret)
    try:
        pre = launcher.wait_for(r"prefill worker 0 .* at (http://[^\s,]+)").group(1)
        dec = launcher.wait_for(r"decode worker 0 .* at (http://[^\s,]+)").group(1)
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+/v1)").group(1)
        launcher.drain()
        start = time.monotonic()
        outcomes, errors = asyncio.run(load(url, args.clients, duration_s, args.seed))
        elapsed = time.monotonic() - start
        headers = key_of(secret).headers()
        leaks = {name: leaked_pages(u, headers) for name, u in (("prefill", pre), ("decode", dec))}
        restarted = any("fault injection: restart decode worker 0" in line
                        for line in launcher.lines)
    except BaseException:
        print("".join(line for line in launcher.lines[-40:] if not re.match(r"[IWE]\d{4}", line)))
        raise
    finally:
        status = launcher.stop()
    figures = {
        "minutes": round(elapsed / 60, 2), "clients": args.clients,
        "requests": sum(outcomes.values()),
        **{k: outcomes.get(k, 0) for k in ("completed", "failed", "disconnected", "lost")},
        "leaked_pages": sum(n for n, _ in leaks.values()),
        "decode_restarted": restarted, "launcher_exit": status,
    }
    for message, n in errors.most_common(5):
        print(f"{n:6d} x {message}")
    for name, (n, detail) in leaks.items():
        if detail:
            print(f"{name} worker not idle: {detail}")
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if figures["lost"] or figures["leaked_pages"] or not restarted:
        sys.exit(1)


if __name__ == "__main__":
    main()
