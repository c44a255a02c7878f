"""Serving metrics under SGLang's Prometheus names and labels, so SGLang's Grafana dashboard
reads a pdsim deployment as it reads SGLang; pdsim's extras are prefixed `pdsim_`. Times are
seconds; histogram buckets are SGLang's.

Who exports what (one `ServeMetrics`, one `CollectorRegistry`, per server):

- The server clients talk to (the colocated server, the PD router) observes each request once,
  as the client sees it: `sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`,
  `sglang:e2e_request_latency_seconds`, `sglang:prompt_tokens_total`,
  `sglang:generation_tokens_total`, `sglang:num_requests_total` (label `model_name`). A PD
  worker's own view of its part of a request goes under the same names prefixed `pdsim_`
  instead (`pdsim_time_to_first_token_seconds`, ...): under SGLang's names the dashboard's
  quantiles would mix the router's, the prefill side's and the decode side's times of one
  request.
- An engine (colocated, prefill or decode worker) exports its scheduler's state
  (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens`,
  `sglang:token_usage`, `sglang:max_total_num_tokens`, the PD queues), `sglang:gen_throughput`
  (decode engines), `sglang:cache_hit_rate` (engines that prefill) and
  `sglang:queue_time_seconds`, labelled as SGLang's scheduler labels them: `model_name`,
  `engine_type` (`unified`, `prefill`, `decode`), `tp_rank`, `pp_rank`.

One process, no multiprocess mode: a PD instance's tensor-parallel ranks run one scheduler in
lockstep (rank 0 broadcasts every input), so rank 0 -- the process that serves `/metrics` --
already holds every value, as SGLang's scheduler metrics come from its first TP rank. The
engine thread observes; the HTTP thread renders; prometheus_client's metrics are thread-safe
and the gauges are one snapshot the engine replaces after every step.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from pdsim.core.records import RequestRecord

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

ENGINE_TYPES = ("unified", "prefill", "decode")

# SGLang's default buckets (seconds).
TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS_S = TTFT_BUCKETS_S + (600, 1200, 1800, 2400)
ITL_BUCKETS_S = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
QUEUE_BUCKETS_S = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90,
                   100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                   2000, 2500, 3000)

# Decode forwards per `sglang:gen_throughput` window (SGLang's default decode log interval).
GEN_THROUGHPUT_STEPS = 40

# The gauges an engine's snapshot (`set_gauges`) may hold, with their help.
GAUGE_HELP = {
    "sglang:num_running_reqs": "Requests in the running (decode) batch.",
    "sglang:num_queue_reqs": "Requests waiting to run (for a prefill, a recompute or, decode "
                             "side, a place in the running batch).",
    "sglang:num_used_tokens": "KV cache token slots in use (pages held or pinned times page "
                              "size; unpinned cached prefix pages count as free).",
    "sglang:token_usage": "Fraction of the KV cache in use.",
    "sglang:max_total_num_tokens": "KV cache token slots in the pool.",
    "sglang:num_prefill_prealloc_queue_reqs": "Prefill: requests waiting for the decode side "
                                              "(bootstrap).",
    "sglang:num_prefill_inflight_queue_reqs": "Prefill: requests whose KV is being sent.",
    "sglang:num_decode_prealloc_queue_reqs": "Decode: requests waiting for KV pages (prealloc).",
    "sglang:num_decode_transfer_queue_reqs": "Decode: requests whose KV is on its way.",
    "pdsim_request_slots_used": "Request slots in use.",
    "pdsim_metadata_slots_used": "First-token metadata slots in use.",
    "pdsim_transfers_pending": "Transfers not yet finished on every TP rank.",
    "sglang:spec_accept_length": "Speculative decoding: tokens per verify step (accepted "
                                 "drafts + 1), mean since the engine started.",
}

DERIVED_HELP = {
    "sglang:gen_throughput": "Generated tokens per second over the last decode steps.",
    "sglang:cache_hit_rate": "Prefix cache hit rate of the last prefill forward's requests.",
}


class ServeMetrics:
    """Everything one server's `/metrics` shows. The engine (or the router) calls `observe_*`
    and `set_gauges`; the HTTP server calls `observe_http`, names the model (`name_model`,
    before serving) and `render`s.

    engine_type: the engine behind these metrics (`ENGINE_TYPES`), or None where there is none
    (the PD router). A prefill or decode engine's per-request figures are its own part of the
    request, exported with the `pdsim_` prefix (module docstring).
    """

    def __init__(self, engine_type: str | None = "unified") -> None:
        if engine_type is not None and engine_type not in ENGINE_TYPES:
            raise ValueError(f"engine_type {engine_type!r}; allowed: {', '.join(ENGINE_TYPES)} "
                             "or None (no engine)")
        self.engine_type = engine_type
        self.model_name = ""
        self.registry = CollectorRegistry()
        self.registry.register(self)  # a collector: `collect`
        self._inner = CollectorRegistry()
        self._engine_families: set[str] = set()
        self._lock = threading.Lock()
        self._gauges: dict[str, float] = {}
        self._cache_hit_rate = 0.0
        self._gen_throughput = 0.0
        self._window: tuple[float, int, int] | None = None  # (start, steps, tokens)

        prefix = "sglang:" if engine_type in (None, "unified") else "pdsim_"
        inner = self._inner
        self.ttft = Histogram(prefix + "time_to_first_token_seconds",
                              "Time to first token.", buckets=TTFT_BUCKETS_S, registry=inner)
        self.itl = Histogram(prefix + "inter_token_latency_seconds",
                             "Gaps between streamed tokens.", buckets=ITL_BUCKETS_S,
                             registry=inner)
        self.e2e = Histogram(prefix + "e2e_request_latency_seconds",
                             "Arrival to finish.", buckets=E2E_BUCKETS_S, registry=inner)
        self.prompt_tokens = Counter(prefix + "prompt_tokens_total",
                                     "Prompt tokens of finished requests.", registry=inner)
        self.generation_tokens = Counter(prefix + "generation_tokens_total",
                                         "Tokens generated by finished requests.",
                                         registry=inner)
        self.num_requests = Counter(prefix + "num_requests_total",
                                    "Requests finished (ok or failed).", registry=inner)
        self.requests = Counter("pdsim_requests_total", "Requests finished, by status.",
                                ["status"], registry=inner)
        for status in ("ok", "failed"):
            self.requests.labels(status)
        self.http = Counter("pdsim_http_responses_total",
                            "HTTP responses of the API endpoints, by endpoint and status code.",
                            ["endpoint", "code"], registry=inner)
        if engine_type is None:
            return
        self.queue_time = Histogram(
            "sglang:queue_time_seconds", "Time in the waiting queue before the first forward "
            "(prefill side: after the bootstrap; decode side: after the KV landed).",
            buckets=QUEUE_BUCKETS_S, registry=inner)
        self.forwards = Counter("pdsim_forwards_total", "Model forwards, by batch kind.",
                                ["kind"], registry=inner)
        self.forward_seconds = Counter("pdsim_forward_seconds_total",
                                       "Measured time of the model forwards, by batch kind.",
                                       ["kind"], registry=inner)
        for kind in ("decode", "extend"):
            self.forwards.labels(kind)
            self.forward_seconds.labels(kind)
        self._engine_families = {"sglang:queue_time_seconds", "pdsim_forwards",
                                 "pdsim_forward_seconds"}

    def name_model(self, model_name: str) -> None:
        """The `model_name` label of every sample (the served model's name)."""
        self.model_name = model_name

    def labels(self, engine: bool) -> dict[str, str]:
        """The labels every sample of a family carries: the model's name, and SGLang's
        scheduler labels on an engine's families (one TP and one pipeline rank report)."""
        if not engine:
            return {"model_name": self.model_name}
        return {"model_name": self.model_name, "engine_type": self.engine_type or "",
                "tp_rank": "0", "pp_rank": "0"}

    # ---- observations -------------------------------------------------------------------------

    def observe_request(self, record: RequestRecord) -> None:
        """A finished request (ok or failed): its tokens and times."""
        self.requests.labels(record.status).inc()
        self.num_requests.inc()
        self.prompt_tokens.inc(record.input_tokens)
        self.generation_tokens.inc(record.output_tokens)
        _observe(self.ttft, record.ttft_s)
        _observe(self.e2e, record.e2e_s)
        times = record.token_times_s
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if self.engine_type is not None:
            _observe(self.queue_time, self._queue_time_s(record))

    def _queue_time_s(self, record: RequestRecord) -> float:
        if self.engine_type == "prefill":
            return record.prefill_start_s - record.bootstrap_done_s
        if self.engine_type == "decode":
            return record.decode_join_s - record.transfer_done_s
        return record.prefill_start_s - record.arrival_s

    def observe_forward(self, batch, seconds: float, produced) -> None:
        """A model forward of `batch` (an `ExtendBatch` or a `DecodeBatch`) that took `seconds`
        and gave the requests `produced` a token: a decode step's tokens count towards
        `sglang:gen_throughput` (generated tokens over the wall time of the last
        `GEN_THROUGHPUT_STEPS` decode steps, as SGLang's decode log computes it); an extend
        sets `sglang:cache_hit_rate` (prompt tokens found in the prefix cache over prompt
        tokens, of the requests whose prompt this forward completed)."""
        self.forwards.labels(batch.kind).inc()
        self.forward_seconds.labels(batch.kind).inc(seconds)
        if batch.kind == "decode":  # a token per request (speculation too: runtime/speculative.py)
            self._decoded(batch.shape.decode_reqs, seconds)
            return
        prompt = sum(r.input_len for r in produced)
        if prompt:
            with self._lock:
                self._cache_hit_rate = sum(r.cached_tokens for r in produced) / prompt

    def _decoded(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            start, steps, total = self._window or (now - seconds, 0, 0)
            steps, total = steps + 1, total + tokens
            if steps < GEN_THROUGHPUT_STEPS:
                self._window = (start, steps, total)
                return
            self._window = None
            self._gen_throughput = total / max(now - start, 1e-9)

    def observe_http(self, endpoint: str, code: int) -> None:
        self.http.labels(endpoint, str(code)).inc()

    def set_gauges(self, values: dict[str, float]) -> None:
        """The engine's scheduler state now (names from `GAUGE_HELP`)."""
        unknown = sorted(set(values) - set(GAUGE_HELP))
        if unknown:
            raise ValueError(f"unknown gauges {unknown}; allowed: {sorted(GAUGE_HELP)}")
        with self._lock:
            self._gauges = dict(values)

    # ---- exposition ---------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """What `/metrics` shows: the observed families, labelled, and the engine's gauges."""
        yield from self._families()
        if self.engine_type is not None:
            yield from self._engine_gauges()

    def _engine_gauges(self) -> Iterator[GaugeMetricFamily]:
        """The scheduler's gauges, plus generation throughput (engines that decode) and the
        prefix cache hit rate (engines that prefill)."""
        with self._lock:
            values = dict(self._gauges)
            if self.engine_type in ("unified", "decode"):
                values["sglang:gen_throughput"] = self._gen_throughput
            if self.engine_type in ("unified", "prefill"):
                values["sglang:cache_hit_rate"] = self._cache_hit_rate
        labels = self.labels(engine=True)
        for name, value in values.items():
            family = GaugeMetricFamily(name, DERIVED_HELP.get(name) or GAUGE_HELP[name],
                                       labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family

    def _families(self) -> Iterator[Metric]:
        """The observed families with their labels (`labels`) added."""
        for family in self._inner.collect():
            labels = self.labels(engine=family.name in self._engine_families)
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**labels, **s.labels}, s.value, s.timestamp, s.exemplar)
            yield out


def _observe(histogram: Histogram, value: float) -> None:
    if not math.isnan(value):
        histogram.observe(value)
