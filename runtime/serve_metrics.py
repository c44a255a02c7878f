"""Serving metrics in the Prometheus text exposition format (version 0.0.4), without a client
library: counters, gauges and fixed-bucket histograms, updated by the engine thread and rendered
by the HTTP server under one lock.

Metric names start with `pdsim_`; times are seconds, as everywhere in pdsim.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence

from pdsim.core.records import RequestRecord

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    """Cumulative-bucket histogram (`le` upper bounds, then `+Inf`)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class ServeMetrics:
    """Everything `/metrics` shows. The engine calls `observe_*`; the server calls `render`.

    `gauges` names the gauges shown (name -> help), `GAUGES` unless given (the PD workers add
    their transfer queues).
    """

    def __init__(self, gauges: dict[str, str] | None = None) -> None:
        self.gauge_help = dict(GAUGES if gauges is None else gauges)
        self._lock = threading.Lock()
        self.requests: dict[str, int] = defaultdict(int)  # by status
        self.http: dict[tuple[str, int], int] = defaultdict(int)  # by (endpoint, code)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.forwards: dict[str, int] = defaultdict(int)
        self.forward_seconds: dict[str, float] = defaultdict(float)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.gauges: dict[str, float] = {}

    def observe_request(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests[record.status] += 1
            self.prompt_tokens += record.input_tokens
            self.generation_tokens += record.output_tokens
            self.ttft.observe(record.ttft_s)
            self.e2e.observe(record.e2e_s)
            times = record.token_times_s
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)

    def observe_forward(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.forwards[kind] += 1
            self.forward_seconds[kind] += seconds

    def observe_http(self, endpoint: str, code: int) -> None:
        with self._lock:
            self.http[(endpoint, code)] += 1

    def set_gauges(self, values: dict[str, float]) -> None:
        with self._lock:
            self.gauges = dict(values)

    def render(self) -> str:
        with self._lock:
            out: list[str] = []

            def family(name: str, kind: str, help_: str,
                       samples: Iterable[tuple[dict[str, str], float]]) -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")
                out.extend(f"{name}{_labels(lab)} {_num(v)}" for lab, v in samples)

            statuses = {"ok": 0, "failed": 0, **self.requests}
            family("pdsim_requests_total", "counter", "Requests finished, by status.",
                   [({"status": s}, n) for s, n in sorted(statuses.items())])
            family("pdsim_http_responses_total", "counter",
                   "HTTP responses of the API endpoints, by endpoint and status code.",
                   [({"endpoint": e, "code": str(c)}, n)
                    for (e, c), n in sorted(self.http.items())])
            family("pdsim_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [({}, self.prompt_tokens)])
            family("pdsim_generation_tokens_total", "counter",
                   "Tokens generated by finished requests.", [({}, self.generation_tokens)])
            family("pdsim_forwards_total", "counter", "Model forwards, by batch kind.",
                   [({"kind": k}, self.forwards.get(k, 0)) for k in ("decode", "extend")])
            family("pdsim_forward_seconds_total", "counter",
                   "Measured time of the model forwards, by batch kind.",
                   [({"kind": k}, self.forward_seconds.get(k, 0.0)) for k in ("decode", "extend")])
            for name, help_ in self.gauge_help.items():
                family(name, "gauge", help_, [({}, self.gauges.get(name, 0.0))])
            for name, hist, help_ in (
                ("pdsim_time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("pdsim_inter_token_latency_seconds", self.itl, "Gaps between streamed tokens."),
                ("pdsim_e2e_request_latency_seconds", self.e2e, "Arrival to finish."),
            ):
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} histogram")
                out.extend(hist.lines(name))
            return "\n".join(out) + "\n"


GAUGES = {
    "pdsim_num_requests_running": "Requests in the running (decode) batch.",
    "pdsim_num_requests_waiting": "Requests waiting for a prefill (or a recompute).",
    "pdsim_kv_pages_used": "KV cache pages in use (unpinned cached prefix pages count as free).",
    "pdsim_kv_pages_total": "KV cache pages in the pool.",
    "pdsim_kv_usage_ratio": "Fraction of the KV cache pages in use.",
    "pdsim_request_slots_used": "Request slots in use.",
}
