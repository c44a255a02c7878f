"""Speculative decoding in the real executor (runtime/speculative.py, runtime/model/draft.py):
through the core scheduler, greedy output is identical with and without speculation, whether
the drafts are accepted or rejected, and the page pool comes back full."""

import json
import urllib.request

import pytest
import torch
from configs import scheduler_config
from core_loop import drive

from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from runtime.executor import ModelExecutor
from runtime.model import PRESETS, build_model
from runtime.model.draft import build_draft
from runtime.sampling import SamplingParams
from runtime.speculative import with_draft_slots

pytestmark = pytest.mark.real

VOCAB = 300
NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("PDSIM_KERNEL_BACKEND", "torch")


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, *, draft=None, k=3, num_pages=40, sampled=()):
    """Six requests through the colocated scheduler; (requests, executor, scheduler)."""
    cfg = scheduler_config(num_pages, page_size=4, max_running_requests=8,
                           max_prefill_tokens=48, chunked_prefill_size=8,
                           num_reserved_decode_tokens=2)
    if draft is not None:
        cfg = with_draft_slots(cfg)
    sched = ColocatedScheduler(cfg)
    executor = ModelExecutor(model, num_pages=cfg.num_pages, page_size=cfg.page_size,
                             vocab_limit=VOCAB, state_slots=cfg.state_slots)
    if draft is not None:
        executor.speculate(draft, k)
    reqs = [Request(f"r{i}", 5 + 3 * i, NEW_TOKENS, arrival_s=0.0, prompt_ids=prompt(5 + 3 * i, i),
                    sampling=SamplingParams(temperature=1.0, seed=i) if i in sampled else None)
            for i in range(6)]
    drive(sched, executor, reqs, gap_s=1e-3)
    sched.check_pools_full()
    assert not any(r.error for r in reqs)
    return reqs, executor


class OracleDraft:
    """Proposes the reference continuation, wrong at every third output index, so verify
    steps accept anything from 0 to k drafts. It keeps no KV."""

    def __init__(self, reference):
        self.reference = reference  # (pending token, position) -> what follows, per request

    def make_cache(self, target_kv):
        return None

    def extend(self, tokens, prev_hidden, meta, kv):
        return None

    def propose(self, tokens, hidden, kv_lens, page_tables, ks, kv, vocab_limit=None):
        return [oracle_drafts(self.reference[(token, pos)], pos, k)
                for token, pos, k in zip(tokens.tolist(), kv_lens, ks)]


def oracle_drafts(follow, position, k):
    """The first `k` tokens of `follow` (what follows the pending token at `position`), each
    made wrong where its position is a multiple of 3."""
    return [(t + 1) % VOCAB if (position + j) % 3 == 0 else t
            for j, t in enumerate((follow + [0] * k)[:k])]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mla"])
def test_mtp_speculation_keeps_greedy_output(preset):
    model = build_model(PRESETS[preset], seed=3)
    plain, _ = run(model)
    spec, executor = run(model, draft=build_draft(model, seed=5), k=3)
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids, a.rid
        assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
    stats = executor.speculation.stats
    assert stats.verify_steps > 0 and 0 <= stats.accepted_drafts <= stats.proposed_drafts
    print(f"{preset}: random MTP head, {stats.mean_accepted_drafts:.3f} drafts accepted per "
          f"verify step ({stats.accepted_drafts}/{stats.proposed_drafts})")


@pytest.mark.parametrize("num_pages", [40, 12])  # 12: retractions and recomputes
def test_accepted_and_rejected_drafts_keep_output_and_pages(num_pages):
    model = build_model(PRESETS["tiny-llama"], seed=3)
    sampled = {2} if num_pages == 12 else set()  # a sampled request decodes plainly
    plain, _ = run(model, num_pages=num_pages, sampled=sampled)
    reference = {}
    for r in plain:
        seq = r.prompt_ids + r.output_ids
        for pos in range(len(r.prompt_ids), len(seq)):
            reference[(seq[pos], pos)] = seq[pos + 1:]
    spec, executor = run(model, draft=OracleDraft(reference), k=3, num_pages=num_pages,
                         sampled=sampled)
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids, a.rid
    stats = executor.speculation.stats
    assert 0 < stats.accepted_drafts < stats.proposed_drafts
    print(f"oracle draft, {num_pages} pages: {stats.mean_accepted_drafts:.2f} drafts accepted per "
          f"verify step")


def test_refused_where_it_cannot_roll_back():
    model = build_model(PRESETS["tiny-hybrid"], seed=0)
    executor = ModelExecutor(model, num_pages=8, page_size=4, state_slots=2)
    with pytest.raises(ValueError, match="recurrent state"):
        executor.speculate(None, 2)
    llama = build_model(PRESETS["tiny-llama"], seed=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ModelExecutor(llama, num_pages=8, page_size=4, state_slots=2).speculate(
            build_draft(llama), 0)
    with pytest.raises(ValueError, match="state_slots=0; must be >= 1"):
        ModelExecutor(llama, num_pages=8, page_size=4).speculate(build_draft(llama), 2)


SPEC = {"method": "mtp", "num_draft_tokens": 2, "acceptance": {"mean_accept_len": 1.5}}


def complete(url, prompt_ids):
    body = json.dumps({"model": "tiny-llama", "prompt": prompt_ids, "max_tokens": NEW_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)["choices"][0]["text"]


def test_colocated_server_speculates_the_same_text_and_reports_acceptance():
    from configs import colocated_config

    from runtime.colocated import BackgroundServer

    prompts = [prompt(6 + i, 20 + i) for i in range(3)]
    texts = {}
    for spec in ({}, {"speculative": SPEC}):
        cfg = colocated_config(num_pages=32, page_size=4, seed=1, device="cpu", **spec)
        with BackgroundServer(cfg) as srv:
            texts[bool(spec)] = [complete(srv.url, p) for p in prompts]
            with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
            speculation = srv.engine.executor.speculation
    assert texts[True] == texts[False]
    assert speculation.stats.verify_steps > 0
    line = next(x for x in metrics.splitlines() if x.startswith("sglang:spec_accept_length"))
    assert float(line.split()[-1]) == pytest.approx(speculation.stats.mean_accept_len)


def test_refused_outside_mtp_at_tp1():
    import yaml
    from configs import colocated_config, tiny_pd_yaml

    from runtime.serve_config import PDServeConfig

    with pytest.raises(ValueError, match="real backend serves method 'mtp'"):
        colocated_config(num_pages=32, page_size=4, speculative={**SPEC, "method": "eagle"})
    with pytest.raises(ValueError, match="tp 1 -> tp 1 without attention DP; got prefill tp 2"):
        PDServeConfig(**yaml.safe_load(tiny_pd_yaml(prefill_tp=2)), speculative=SPEC)
    with pytest.raises(ValueError, match="real backend serves method 'mtp'"):
        PDServeConfig(**yaml.safe_load(tiny_pd_yaml()), speculative={**SPEC, "method": "eagle"})
    PDServeConfig(**yaml.safe_load(tiny_pd_yaml()), speculative=SPEC)  # tp 1 -> tp 1 is served


def test_calibration_writes_the_served_acceptance_for_the_simulator(tmp_path):
    """`pdsim calibrate`'s acceptance: the served engine's `sglang:spec_accept_length` becomes
    the overlay's `speculative.acceptance`, which replaces the configured one (rates here) in
    what `pdsim validate --calibration` simulates."""
    import yaml
    from configs import colocated_config

    from pdsim.sim.build import _speculation
    from pdsim.validation.validate import calibrated
    from runtime.calibration import ACCEPT_METRIC, acceptance_overlay, read_gauge
    from runtime.colocated import BackgroundServer

    spec = {**SPEC, "num_draft_tokens": 3}
    cfg = colocated_config(num_pages=32, page_size=4, seed=1, device="cpu", speculative=spec)
    with BackgroundServer(cfg) as srv:
        for i in range(3):
            complete(srv.url, prompt(6 + i, 40 + i))
        measured = read_gauge(srv.url, {}, ACCEPT_METRIC)
        stats = srv.engine.executor.speculation.stats
    assert stats.verify_steps > 0
    assert measured == pytest.approx(stats.mean_accept_len, abs=1e-9)
    overlay = tmp_path / "calibration.yaml"
    overlay.write_text(yaml.safe_dump({"speculative": acceptance_overlay(cfg, measured)}))
    raw = {**cfg.model_dump(mode="json", exclude_none=True),
           "workload": {"num_requests": 4, "seed": 0, "arrival": {"process": "poisson",
                                                                   "rate_rps": 1.0},
                        "input_len": {"dist": "fixed", "value": 16},
                        "output_len": {"dist": "fixed", "value": 16}}}
    raw["speculative"]["acceptance"] = {"rates": [0.9]}  # configured: replaced, not merged
    sim_cfg = calibrated(raw, "deployment", overlay)
    assert sim_cfg.speculative.acceptance.rates is None
    assert sim_cfg.speculative.acceptance.mean_accept_len == pytest.approx(measured, abs=1e-6)
    probs = _speculation(sim_cfg).accept_len_probs
    assert sum((n + 1) * p for n, p in enumerate(probs)) == pytest.approx(measured, abs=1e-6)
    with pytest.raises(RuntimeError, match="outside"):
        acceptance_overlay(cfg, 4.5)


def test_transfer_registers_the_draft_and_refuses_a_decode_rank_that_does_not_speculate():
    """A speculating rank's `KVArgs`: the draft layer's KV buffers after the target's, its
    hidden-state rows one per state slot; a prefill rank refuses a decode rank without them."""
    from dataclasses import fields

    from runtime.protocol.transfer import RegisterDecode
    from runtime.transfer.layout import KVArgs
    from runtime.transfer.metadata import MetadataBuffer
    from runtime.transfer.prefill import plan_peer

    model = build_model(PRESETS["tiny-llama"], seed=0)
    config = model.config

    def args(speculating: bool) -> KVArgs:
        executor = ModelExecutor(model, num_pages=8, page_size=4, state_slots=3)
        if speculating:
            executor.speculate(build_draft(model), 2)
        return KVArgs.for_cache(executor.kv, MetadataBuffer.allocate(2),
                                total_kv_heads=config.num_kv_heads,
                                speculation=executor.speculation)

    prefill, plain = args(True), args(False)
    assert len(prefill.kv_data_ptrs) == len(plain.kv_data_ptrs) + 2  # the draft's K and V
    assert prefill.hidden_slot_len == config.hidden_size * 4 and prefill.num_state_slots == 3
    names = {f.name for f in fields(RegisterDecode)} - {"session_id", "endpoint"}
    reg = RegisterDecode(session_id="d", endpoint="tcp://127.0.0.1:1",
                         **{n: (list(getattr(plain, n)) if n.startswith("kv_data")
                                or n == "kv_item_lens" else getattr(plain, n)) for n in names})
    with pytest.raises(ValueError, match=f"draft hidden state: prefill "
                                         f"{config.hidden_size * 4} bytes per request, decode 0"):
        plan_peer(prefill, reg)
