"""`/metrics` under SGLang's names, read as Prometheus reads it, after real requests through
`pdsim serve` (colocated, and disaggregated via the launcher): the families SGLang's Grafana
dashboard queries exist with `model_name` and SGLang's buckets, and their values are what
happened -- prompt tokens sent, one TTFT per request (each no longer than the client waited),
the gaps between tokens, engines idle afterwards, generation throughput matching the gaps, the
prefix cache hit rate of a repeated prompt. Each PD worker reports its engine's state; only the
router, which clients talk to, reports request latencies under SGLang's names."""

from __future__ import annotations

import random
import time

import pytest
from openai import OpenAI

from configs import tiny_pd_yaml
from pdsim.validation.deployment import RealDeployment
from prom import Scrape
from runtime.security import ClusterKey, new_secret
from runtime.serve_metrics import GEN_THROUGHPUT_STEPS, TTFT_BUCKETS_S

pytestmark = [pytest.mark.real, pytest.mark.slow]  # real servers, in a `pdsim serve` child

MODEL = "tiny-llama"
COLOCATED = ("model: tiny-llama\nseed: 0\ndevice: cpu\ncluster:\n  mode: colocated\n"
             "  colocated: {instances: 1, scheduler: {page_size: 8, num_pages: 64}}\n"
             "router: {port: 0}\n")
PAGE_SIZE, NUM_PAGES = 8, 64  # both configs' (the PD decode worker has 128 pages)
# One long request (one full gen_throughput window of decode steps), then single-token ones;
# the last repeats the first prompt (a prefix cache hit).
LONG = GEN_THROUGHPUT_STEPS + 1
PROMPT_LENS = (40, 13, 27, 40)
MAX_TOKENS = (LONG, 1, 1, 1)
REQUEST_FAMILIES = ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                    "sglang:e2e_request_latency_seconds", "sglang:prompt_tokens",
                    "sglang:generation_tokens", "sglang:num_requests")


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    out = [[rng.randrange(1, 250) for _ in range(n)] for n in PROMPT_LENS[:-1]]
    return out + [list(out[0])]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def served(request, tmp_path_factory):
    """The deployment, what the client saw of each request, and a scrape of the front after
    each request (the first before any)."""
    path = tmp_path_factory.mktemp(request.param) / "serve.yaml"
    path.write_text(COLOCATED if request.param == "colocated" else tiny_pd_yaml())
    with RealDeployment(path, secret=new_secret()) as real:
        client = OpenAI(base_url=real.url + "/v1", api_key="x", max_retries=0, timeout=120)
        scrapes, seen = [Scrape.of(real.url)], []
        for ids, n in zip(prompts(), MAX_TOKENS):
            start, first, usage = time.monotonic(), None, None
            for chunk in client.completions.create(
                    model=MODEL, prompt=ids, max_tokens=n, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True}):
                if first is None and chunk.choices and chunk.choices[0].token_ids:
                    first = time.monotonic() - start
                usage = chunk.usage or usage
            seen.append((first, usage))
            scrapes.append(Scrape.of(real.url))
        engines = ({"unified": real.url} if request.param == "colocated" else
                   {role: url for (role, _), url in real.workers.items()})
        headers = ClusterKey.from_secret(real.secret).headers()
        yield {"mode": request.param, "scrapes": scrapes, "seen": seen,
               "engines": {kind: Scrape.of(url, headers) for kind, url in engines.items()}}


def test_request_families_are_sglangs_with_model_name_and_buckets(served):
    front = served["scrapes"][-1]
    for name in REQUEST_FAMILIES:
        family = front.families[name]
        assert family.samples and all(s.labels["model_name"] == MODEL for s in family.samples)
    bounds = [float(s.labels["le"]) for s in front.samples(
        "sglang:time_to_first_token_seconds_bucket")]
    assert bounds == [*map(float, TTFT_BUCKETS_S), float("inf")]


def test_counts_are_what_was_sent(served):
    front = served["scrapes"][-1]
    assert front.value("sglang:prompt_tokens_total", model_name=MODEL) == sum(PROMPT_LENS)
    assert front.value("sglang:generation_tokens_total", model_name=MODEL) == sum(MAX_TOKENS)
    assert front.value("sglang:num_requests_total", model_name=MODEL) == len(PROMPT_LENS)
    assert front.value("sglang:time_to_first_token_seconds_count") == len(PROMPT_LENS)
    assert front.value("sglang:e2e_request_latency_seconds_count") == len(PROMPT_LENS)
    assert front.value("sglang:inter_token_latency_seconds_count") == \
        sum(n - 1 for n in MAX_TOKENS)
    assert front.value("pdsim_requests_total", status="ok") == len(PROMPT_LENS)


def test_each_ttft_is_within_what_the_client_waited(served):
    scrapes = served["scrapes"]
    for before, after, (client_ttft, _) in zip(scrapes, scrapes[1:], served["seen"]):
        ttft = (after.value("sglang:time_to_first_token_seconds_sum")
                - before.value("sglang:time_to_first_token_seconds_sum"))
        assert 0 < ttft <= client_ttft


def test_engines_report_their_state_idle_afterwards(served):
    for kind, scrape in served["engines"].items():
        engine = {"model_name": MODEL, "engine_type": kind, "tp_rank": "0", "pp_rank": "0"}
        pages = 128 if kind == "decode" else NUM_PAGES
        assert scrape.value("sglang:num_running_reqs", **engine) == 0
        assert scrape.value("sglang:num_queue_reqs", **engine) == 0
        assert scrape.value("sglang:num_used_tokens", **engine) == 0
        assert scrape.value("sglang:token_usage", **engine) == 0
        assert scrape.value("sglang:max_total_num_tokens", **engine) == pages * PAGE_SIZE
        assert scrape.value("sglang:queue_time_seconds_count", **engine) == len(PROMPT_LENS)
        if kind == "prefill":
            assert scrape.value("sglang:num_prefill_prealloc_queue_reqs", **engine) == 0
            assert scrape.value("sglang:num_prefill_inflight_queue_reqs", **engine) == 0
            assert not scrape.samples("sglang:gen_throughput")
        if kind == "decode":
            assert scrape.value("sglang:num_decode_prealloc_queue_reqs", **engine) == 0
            assert scrape.value("sglang:num_decode_transfer_queue_reqs", **engine) == 0
            assert not scrape.samples("sglang:cache_hit_rate")


def test_gen_throughput_is_the_long_requests_pace(served):
    """Only the long request has gaps between tokens; its decode steps are the one complete
    window, so the throughput is its gaps' count over their time (the window starts at the
    first decode forward, a little after the first token: up to somewhat faster)."""
    for kind, scrape in served["engines"].items():
        if kind == "prefill":
            continue
        prefix = "sglang:" if kind == "unified" else "pdsim_"
        gaps = scrape.value(prefix + "inter_token_latency_seconds_count")
        assert gaps == LONG - 1 == GEN_THROUGHPUT_STEPS
        pace = gaps / scrape.value(prefix + "inter_token_latency_seconds_sum")
        assert 0.9 * pace <= scrape.value("sglang:gen_throughput", engine_type=kind) <= 1.5 * pace


def test_cache_hit_rate_is_the_repeated_prompts(served):
    _, usage = served["seen"][-1]
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= PAGE_SIZE  # the repeated prompt's full pages, found
    kind = "unified" if served["mode"] == "colocated" else "prefill"
    rate = served["engines"][kind].value("sglang:cache_hit_rate", engine_type=kind)
    assert rate == pytest.approx(cached / PROMPT_LENS[-1])


def test_request_times_are_reported_once_by_the_front(served):
    """Colocated, the front is the engine; disaggregated, the router runs none, and each
    worker's own view of its part of a request is `pdsim_`-prefixed."""
    front = served["scrapes"][-1]
    if served["mode"] == "colocated":
        assert front.value("sglang:num_running_reqs", engine_type="unified") == 0
        assert not front.samples("pdsim_time_to_first_token_seconds_count")
        return
    assert not front.samples("sglang:num_running_reqs")
    assert set(served["engines"]) == {"prefill", "decode"}
    for scrape in served["engines"].values():
        assert not scrape.samples("sglang:time_to_first_token_seconds_count")
        assert scrape.value("pdsim_time_to_first_token_seconds_count",
                            model_name=MODEL) == len(PROMPT_LENS)
        assert scrape.value("pdsim_prompt_tokens_total", model_name=MODEL) == sum(PROMPT_LENS)
