"""TTFT of disaggregated serving against colocated serving at low load, and where PD's extra
time goes: handshake, prefill queueing (scheduling), prefill compute, KV transfer, HTTP/router.

    python benchmarks/pd_overhead.py [--requests 30] [--prompt-tokens 256] [--model tiny-llama]

Starts `pdsim serve` twice on this machine (colocated, then 1 prefill + 1 decode behind the
router, Mooncake over TCP), sends requests one at a time, and reads the workers' records. A
request reaches both PD workers at the same moment, so durations on the two workers' clocks
line up by their arrival times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.security import SECRET_ENV, ClusterKey, new_secret  # noqa: E402

SECRET = new_secret()
COMMON = """\
model: {model}
seed: 0
device: cpu
"""
KNOBS = ("{page_size: 16, num_pages: 1024, max_running_requests: 16, max_prefill_tokens: 4096, "
         "chunked_prefill_size: 1024}")
COLOCATED = f"""\
cluster: {{mode: colocated, colocated: {{instances: 1, scheduler: {KNOBS}}}}}
router: {{port: 0}}
"""
PD = f"""\
cluster: {{mode: disaggregated, prefill: {{scheduler: {KNOBS}}}, decode: {{scheduler: {KNOBS}}}}}
router: {{port: 0}}
"""


class Server:
    """A `pdsim serve` subprocess; `lines` is what it printed so far."""

    def __init__(self, config: str):
        self.file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        self.file.write(config)
        self.file.close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "2",
               SECRET_ENV: SECRET}  # the deployment's: the workers' /records need its token
        self.proc = subprocess.Popen([sys.executable, "-m", "pdsim.cli", "serve", self.file.name],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def wait_for(self, pattern: str, timeout_s: float = 120.0) -> re.Match:
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise RuntimeError(f"pdsim serve never printed {pattern!r}:\n" + "".join(self.lines))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        os.unlink(self.file.name)


def measure(url: str, model: str, n: int, prompt_tokens: int) -> dict[str, tuple[float, float]]:
    """rid → (client TTFT, client mean ITL) for `n` sequential streaming requests."""
    client = OpenAI(base_url=url, api_key="unused", max_retries=0)
    prompt = list(range(1, prompt_tokens + 1))
    out = {}
    for i in range(n + 2):
        start = time.perf_counter()
        times, rid = [], None
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True,
                                                           "return_token_ids": True}):
            rid = chunk.id
            times.extend([time.perf_counter()] * len(chunk.choices[0].token_ids or []))
        if i >= 2:  # the first two warm the workers up
            out[rid] = (times[0] - start, float(np.mean(np.diff(times))))
    return out


def records(url: str) -> dict[str, dict]:
    request = urllib.request.Request(url + "/records",
                                     headers=ClusterKey.from_secret(SECRET).headers())
    with urllib.request.urlopen(request, timeout=10) as resp:
        return {r["rid"]: r for r in json.loads(resp.read())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--model", default="tiny-llama")
    args = ap.parse_args()
    common = COMMON.format(model=args.model)

    colo = Server(common + COLOCATED)
    try:
        url = colo.wait_for(r"at (http://\S+/v1)").group(1)
        colocated = measure(url, args.model, args.requests, args.prompt_tokens)
    finally:
        colo.stop()

    pd = Server(common + PD)
    try:
        pre = pd.wait_for(r"prefill worker 0 \S+ \S+ \S+ at (http://[^\s,]+)").group(1)
        dec = pd.wait_for(r"decode worker 0 \S+ \S+ \S+ at (http://[^\s,]+)").group(1)
        url = pd.wait_for(r"\) at (http://\S+/v1)$").group(1)
        disagg = measure(url, args.model, args.requests, args.prompt_tokens)
        p_rec, d_rec = records(pre), records(dec)
    finally:
        pd.stop()

    parts: dict[str, list[float]] = {k: [] for k in (
        "handshake", "prefill queue", "prefill compute", "KV transfer + status", "router/HTTP")}
    for rid, (ttft, _) in disagg.items():
        p, d = p_rec[rid], d_rec[rid]
        prefill_done = p["prefill_end_s"] - p["arrival_s"]
        first_token = d["first_token_s"] - d["arrival_s"]
        parts["handshake"].append(p["bootstrap_done_s"] - p["arrival_s"])
        parts["prefill queue"].append(p["prefill_start_s"] - p["bootstrap_done_s"])
        parts["prefill compute"].append(p["prefill_end_s"] - p["prefill_start_s"])
        parts["KV transfer + status"].append(first_token - prefill_done)
        parts["router/HTTP"].append(ttft - first_token)

    def ms(values) -> str:
        return f"{np.median(values) * 1e3:8.2f} ms"

    c_ttft = [t for t, _ in colocated.values()]
    d_ttft = [t for t, _ in disagg.values()]
    print(f"{args.model}, {args.prompt_tokens}-token prompts, 8 output tokens, "
          f"{args.requests} sequential requests, medians")
    print(f"  colocated TTFT           {ms(c_ttft)}   ITL {ms([i for _, i in colocated.values()])}")
    print(f"  disaggregated TTFT       {ms(d_ttft)}   ITL {ms([i for _, i in disagg.values()])}")
    print(f"  PD overhead              {np.median(d_ttft) * 1e3 - np.median(c_ttft) * 1e3:8.2f} ms")
    print("  PD TTFT split:")
    for name, values in parts.items():
        print(f"    {name:<22} {ms(values)}")


if __name__ == "__main__":
    main()
