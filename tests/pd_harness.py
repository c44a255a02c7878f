"""Real PD workers for tests: instances as subprocesses (`python -m runtime.pd.worker`), a
module's cluster of them (`worker_cluster`), a client that talks to them exactly as the router
does (the same request to both sides, the decode side's SSE stream read to its end), and the
check that greedy PD outputs equal colocated serving's (`check_greedy_equals_colocated`)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp

from runtime.distributed import free_port
from runtime.protocol.codec import VERSION
from runtime.pd.worker import child_env, python_command, stop_processes
from runtime.serve_config import PDServeConfig


def pd_config(model: str, *, knobs: dict | None = None, **changes) -> PDServeConfig:
    """A small deployment on CPU: pages of 8 tokens, chunks of 32, fast heartbeats. `knobs`
    change both roles' scheduler; `changes` are merged into the sections they name (`prefill`
    and `decode` into the cluster's roles), mappings key by key."""
    both = {**dict(page_size=8, max_running_requests=8, max_prefill_tokens=64,
                   chunked_prefill_size=32, num_reserved_decode_tokens=8, metadata_slots=16,
                   bootstrap_timeout_s=30.0, waiting_timeout_s=30.0), **(knobs or {})}
    base = dict(
        model=model, seed=3, device="cpu",
        cluster=dict(mode="disaggregated",
                     prefill=dict(threads=1, scheduler=dict(both, num_pages=64)),
                     decode=dict(threads=1, scheduler=dict(both, num_pages=128))),
        transfer=dict(heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0,
                      handshake_timeout_s=30.0),
        security=dict(insecure=True))  # tests/test_security.py covers the cluster secret
    for key, value in changes.items():
        if key in ("prefill", "decode"):
            base["cluster"][key] = _merged(base["cluster"][key], value)
        else:
            base[key] = _merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return PDServeConfig.model_validate(base)


def _merged(base: dict, change: dict) -> dict:
    """`base` with `change` merged in, mappings key by key."""
    out = dict(base)
    for key, value in change.items():
        out[key] = (_merged(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out


@dataclass
class Worker:
    role: str
    tp: int
    url: str
    proc: subprocess.Popen
    bootstrap_port: int = 0

    def get(self, path: str, timeout: float = 10.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def pools(self) -> dict:
        return self.get("/pools")

    def wait_pools_full(self, timeout_s: float = 15.0) -> dict:
        return wait_pools_full(self.url, timeout_s=timeout_s)

    def stop(self) -> None:
        stop_processes([self.proc], timeout_s=20)


def wait_pools_full(url: str, headers: dict | None = None, timeout_s: float = 20.0) -> dict:
    """The `/pools` answer of the worker at `url` once it says full, or the last one after
    `timeout_s` (what is held a moment after a request ends is given back soon after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url + "/pools", headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as resp:
            state = json.loads(resp.read())
        if state["full"] or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def start_worker(config: PDServeConfig, role: str, *, bootstrap_port: int | None = None,
                 instance: int = 0, script: str | None = None,
                 env: dict[str, str] | None = None) -> Worker:
    """`script`: a file run instead of `python -m runtime.pd.worker` (with its arguments);
    `env`: more environment variables."""
    port = free_port()
    bport = free_port() if role == "prefill" and bootstrap_port is None else bootstrap_port
    payload = {"parent_pid": os.getpid(), "config": config.model_dump(mode="json"), "role": role,
               "instance": instance, "port": port, "bootstrap_port": bport}
    env = {**child_env(), "PDSIM_KERNEL_BACKEND": "torch", "GLOG_minloglevel": "2", **(env or {})}
    command = python_command("instance", payload)
    if script is not None:
        command = [sys.executable, script, *command[3:]]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    return Worker(role, config.role(role).tp, f"http://127.0.0.1:{port}", proc, bport or 0)


def stop_workers(workers) -> None:
    """SIGTERM them all at once; each stops its engine, rank processes and bootstrap server."""
    stop_processes([w.proc for w in workers], timeout_s=20)


def wait_healthy(workers: list[Worker], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for w in workers:
        while True:
            assert w.proc.poll() is None, f"{w.role} worker exited with {w.proc.returncode}"
            try:
                if w.get("/health", timeout=2)["status"] == "ok":
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"{w.role} worker not healthy in time"
            time.sleep(0.1)


T = TypeVar("T")


@contextmanager
def worker_cluster(configs: dict[tuple[str, int], PDServeConfig], *,
                   while_starting: Callable[[], T] = lambda: None,
                   timeout_s: float = 120.0) -> Iterator[tuple[dict[tuple[str, int], Worker], T]]:
    """One worker per entry of `configs` (keyed (role, n): the role it serves), all started at
    once; `while_starting()` runs while they start. Yields the workers, all healthy, and what
    `while_starting` returned. On exit every worker is stopped and must have exited with 0."""
    workers: dict[tuple[str, int], Worker] = {}
    try:
        for key, config in configs.items():
            workers[key] = start_worker(config, key[0])
        started = while_starting()
        wait_healthy(list(workers.values()), timeout_s=timeout_s)
        yield workers, started
    finally:
        stop_workers(list(workers.values()))
        codes = {key: w.proc.returncode for key, w in workers.items()}
        assert all(code == 0 for code in codes.values()), codes


@dataclass
class Outcome:
    """Both sides' answers to one request."""

    prefill_status: int
    prefill_body: dict
    decode_status: int
    events: list[dict] = field(default_factory=list)  # the SSE events (decode status 200)
    decode_body: dict | None = None  # the JSON error (decode status != 200)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e["token_ids"]]

    @property
    def last(self) -> dict:
        return self.events[-1]

    @property
    def error(self) -> str | None:
        if self.decode_body is not None:
            return self.decode_body["error"]["message"]
        return self.events[-1]["error"] if self.events else None


def body(rid: str, ids: list[int], max_new: int, prefill: Worker, *, room: int | None = None,
         **extra) -> dict:
    return {"version": VERSION, "rid": rid, "input_ids": ids, "max_new_tokens": max_new,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None},
            "stop_token_ids": [], "top_logprobs": 0, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63) if room is None else room, **extra}


async def post_prefill(session: aiohttp.ClientSession, worker: Worker, b: dict):
    async with session.post(worker.url + "/generate", json=b) as resp:
        return resp.status, await resp.json()


async def post_decode(session: aiohttp.ClientSession, worker: Worker, b: dict):
    async with session.post(worker.url + "/generate", json=b) as resp:
        if resp.status != 200:
            return resp.status, [], await resp.json()
        events, done = [], False
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
        assert done, "the stream ended without [DONE]"
        return 200, events, None


async def generate_many(prefill: Worker, decode: Worker, bodies: list[dict]) -> list[Outcome]:
    """Post every request to both sides at once, like the router; wait for all answers."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(b: dict) -> Outcome:
            (ps, pb), (ds, events, db) = await asyncio.gather(
                post_prefill(session, prefill, b), post_decode(session, decode, b))
            return Outcome(ps, pb, ds, events, db)

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def generate(prefill: Worker, decode: Worker, bodies: list[dict]) -> list[Outcome]:
    return asyncio.run(generate_many(prefill, decode, bodies))


# ---- greedy PD outputs against colocated serving -------------------------------------------

# Page 8, chunks of 32 (`pd_config`): the 70-token prompt is prefilled (and sent) in three chunks.
PROMPT_LENS = (5, 17, 40, 70, 9)
MAX_NEW = (12, 12, 12, 12, 1)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENS]


def colocated_outputs(model: str) -> list[list[int]]:
    """The reference: the colocated engine (the same scheduler knobs as `pd_config`'s decode
    side) on `prompts()`, greedy."""
    from runtime.driver import Engine
    from runtime.executor import ModelExecutor
    from runtime.model.hybrid import with_state_slots
    from runtime.model.loading import load_served_model, load_text_side
    from runtime.serve_config import ServeConfig

    cfg = pd_config(model)
    colo = ServeConfig(model=model, seed=cfg.seed, cluster={
        "mode": "colocated", "colocated": {"instances": 1, "scheduler": cfg.decode.scheduler}})
    net = load_served_model(colo, "cpu")
    text = load_text_side(colo, net.config.vocab_size)
    sched = with_state_slots(colo.scheduler_config(), net.config)
    executor = ModelExecutor(net, num_pages=colo.num_pages, page_size=colo.page_size,
                             seed=colo.seed, vocab_limit=text.vocab_limit(net.config.vocab_size),
                             state_slots=sched.state_slots)
    engine = Engine(executor, sched).start()
    events: queue.Queue = queue.Queue()
    try:
        for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW)):
            engine.submit(ids, n, lambda e, i=i: events.put((i, e)), rid=f"ref{i}")
        out: dict[int, list[int]] = {i: [] for i in range(len(PROMPT_LENS))}
        finished = 0
        while finished < len(PROMPT_LENS):
            i, e = events.get(timeout=60)
            assert e.error is None, e.error
            out[i].extend(e.token_ids)
            finished += e.finished
        engine.check_pools_full()
    finally:
        engine.stop()
    return [out[i] for i in range(len(PROMPT_LENS))]


def check_greedy_equals_colocated(prefill: Worker, decode: Worker, reference: list[list[int]],
                                  tag: str, *, rooms: bool = False) -> None:
    """`prompts()` through `prefill` and `decode` all at once, greedy (`rooms`: bootstrap rooms
    0, 1, ..., so that room % dp spreads them over the DP ranks). Each answer is `reference`'s
    (`colocated_outputs`) token for token, its first event the one token prefill computed, its
    end `length` with the counts; then both workers have every page and slot back."""
    bodies = [body(f"{tag}-{i}", ids, n, prefill, room=i if rooms else None)
              for i, (ids, n) in enumerate(zip(prompts(), MAX_NEW))]
    outcomes = generate(prefill, decode, bodies)
    for i, (o, want) in enumerate(zip(outcomes, reference, strict=True)):
        assert o.prefill_status == 200 and o.prefill_body["status"] == "ok", o.prefill_body
        assert o.decode_status == 200, o.decode_body
        assert o.token_ids == want, f"prompt {i}"
        assert o.events[0]["token_ids"] == [o.prefill_body["token_ids"][0]] == want[:1]
        assert o.last["finished"] and o.last["finish_reason"] == "length"
        assert o.last["completion_tokens"] == len(want) and o.last["error"] is None
        assert o.last["prompt_tokens"] == PROMPT_LENS[i]
    for w in (prefill, decode):
        assert w.wait_pools_full() == {"full": True, "detail": ""}


def post_json(url: str, payload: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


REPO = Path(__file__).resolve().parents[1]


class Proc:
    """A `pdsim serve` subprocess whose output lines are read on a thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PDSIM_KERNEL_BACKEND": "torch", "PYTHONUNBUFFERED": "1",
               "GLOG_minloglevel": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pdsim.cli", "serve", *args],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 90.0) -> re.Match:
        """The first output line (seen already or to come) matching `pattern`."""
        for line in self.seen:
            if m := re.search(pattern, line):
                return m
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no line matching {pattern!r}; output:\n" +
                                     "".join(self.seen))
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m

    def stop(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)
