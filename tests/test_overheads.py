"""Host overheads: eager launches of non-graphed forwards, the scheduler's per-step work."""

from __future__ import annotations

import numpy as np
import pytest

from pdsim.config import parse_experiment
from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim import sglang_defaults
from pdsim.sim.overheads import (
    DEEPEP_MOE_CORE_EAGER_S, DEEPEP_MOE_CORE_LAUNCHES, EAGER_LAUNCH_S, MLA_BLOCK_LAUNCHES,
    MLA_EAGER_BLOCK_S, host_overheads, kernels_per_layer,
)
from pdsim.sim.silicon import tables
from pdsim.specs import load_hardware_spec, model_preset
from pdsim.specs.hardware import GRACE_HOST_TIME_SCALE

LLAMA_8B = model_preset("llama-3.1-8b")
DSV3 = model_preset("deepseek-v3")
H100, H200, B200 = (load_hardware_spec(n) for n in ("h100", "h200", "b200"))
MODELS = ["roofline", pytest.param("silicon", marks=pytest.mark.skipif(
    tables.systems_dir() is None, reason="aiconfigurator-core not installed"))]


def prefill(tokens: int) -> BatchShape:
    return BatchShape(prefill_tokens=tokens, prefill_attn_pairs=extend_attn_pairs(tokens, 0))


def decode(reqs: int) -> BatchShape:
    return BatchShape(decode_reqs=reqs, decode_context_tokens=reqs * 1024)


def cost(name: str, model=LLAMA_8B, hardware=H100, parallel=Parallelism(), **params):
    return make_cost_model(name, model, hardware, parallel, **params)


def test_sglang_graph_sizes_and_kernel_counts() -> None:
    graph_bs = sglang_defaults.cuda_graph_max_bs
    assert graph_bs(H100.hbm_gib, 1) == 256 and graph_bs(H100.hbm_gib, 8) == 512
    assert graph_bs(B200.hbm_gib, 1) == 512
    # Llama: 6 attention kernels + 4 MLP kernels at TP 1; TP 2 adds the two all-reduces.
    assert kernels_per_layer(LLAMA_8B, 1, 1, 1, False, False) == (10, 0)
    assert kernels_per_layer(LLAMA_8B, 2, 2, 1, False, False) == (12, 0)
    host = host_overheads(LLAMA_8B, H100, Parallelism(), EAGER_LAUNCH_S, None)
    assert host.eager_host_s == pytest.approx(32 * 10 * EAGER_LAUNCH_S)
    dense, moe = kernels_per_layer(DSV3, 8, 1, 8, True, True)
    assert moe > dense > 10  # MLA + FP8 quantisation; DeepEP's dispatch and grouped GEMMs


def test_qwen3_normalises_q_and_k_per_head_in_one_kernel_more_a_layer() -> None:
    """SGLang's Qwen3 attention (models/utils.py apply_qk_norm) runs the fused in-place q/k
    RMSNorm before RoPE: one launch more a layer than a Llama-shaped block, known from the
    architecture of a config.json, and GLM-4.5's from its use_qk_norm; its q and k are read
    and written once more in both cost models."""
    from pdsim.sim.overheads import attention_elementwise_kernels
    from pdsim.specs.models import model_spec_from_hf_config

    qwen = model_preset("qwen3-235b-a22b")
    assert qwen.qk_norm and not LLAMA_8B.qk_norm and not DSV3.qk_norm
    assert attention_elementwise_kernels(qwen) == attention_elementwise_kernels(LLAMA_8B) + 1
    config = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_hidden_layers=48, intermediate_size=6144, vocab_size=151936,
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert model_spec_from_hf_config(config, "q").qk_norm
    llama = dict(config, architectures=["LlamaForCausalLM"])
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        llama.pop(key)
    assert not model_spec_from_hf_config(llama, "l").qk_norm
    assert model_spec_from_hf_config(dict(llama, use_qk_norm=True), "g").qk_norm
    without = qwen.model_copy(update={"qk_norm": False})
    one = kernels_per_layer(qwen, 8, 8, 1, False, False)
    assert one[1] == kernels_per_layer(without, 8, 8, 1, False, False)[1] + 1
    shape = prefill(4096)
    for name in ("roofline",) + (("silicon",) if tables.systems_dir() else ()):
        a = make_cost_model(name, qwen, H200, Parallelism(tp=8))
        b = make_cost_model(name, without, H200, Parallelism(tp=8))
        assert a.step_time_s([shape]) > b.step_time_s([shape])


def test_two_batch_overlap_launches_every_kernel_once_per_micro_batch() -> None:
    par = dict(tp=8, dp_attention=8, ep=8, moe_a2a="deepep", moe_dense_tp=1, dp_lm_head=True)
    one = host_overheads(DSV3, H200, Parallelism(**par), EAGER_LAUNCH_S, None)
    two = host_overheads(DSV3, H200, Parallelism(**par, two_batch_overlap=True),
                         EAGER_LAUNCH_S, None)
    assert two.launches == 2 * one.launches
    # a short prompt is launch-bound: its step is twice the launches and the host work
    cost = make_cost_model("roofline", DSV3, H200, Parallelism(**par, two_batch_overlap=True),
                           role="prefill")
    ranks = [prefill(16)] + [BatchShape()] * 7
    assert kernels_and_host(cost, ranks)[0] < two.eager_host_s
    assert cost.step_time_s(ranks) == pytest.approx(
        two.eager_host_s + cost.params.step_overhead_s + cost.params.extend_overhead_s)


def test_eager_mla_attention_and_deepep_moe_cores_take_their_measured_host_time() -> None:
    """In an eager forward each MLA attention block costs MLA_EAGER_BLOCK_S of host time and,
    under DeepEP, each MoE core DEEPEP_MOE_CORE_EAGER_S (their launches and what SGLang's Python
    does around them), in proportion to the launch cost; without DeepEP the MoE layers' experts
    cost their launches, and a GQA model's layers cost their launches alone."""
    par = dict(tp=8, dp_attention=8, ep=8, moe_dense_tp=1)
    host = host_overheads(DSV3, H200, Parallelism(**par, moe_a2a="deepep"), EAGER_LAUNCH_S, None)
    attention = MLA_EAGER_BLOCK_S - MLA_BLOCK_LAUNCHES * EAGER_LAUNCH_S
    experts = DEEPEP_MOE_CORE_EAGER_S - DEEPEP_MOE_CORE_LAUNCHES * EAGER_LAUNCH_S
    assert attention > 0 and experts > 0
    assert host.eager_host_s == pytest.approx(host.launches * EAGER_LAUNCH_S
                                              + DSV3.num_layers * attention
                                              + DSV3.num_moe_layers * experts)
    faster = host_overheads(DSV3, H200, Parallelism(**par, moe_a2a="deepep"),
                            EAGER_LAUNCH_S / 2, None)
    assert faster.eager_host_s == pytest.approx(host.eager_host_s / 2)
    fused = host_overheads(DSV3, H200, Parallelism(**par), EAGER_LAUNCH_S, None)
    assert fused.eager_host_s == pytest.approx(fused.launches * EAGER_LAUNCH_S
                                               + DSV3.num_layers * attention)
    gqa = host_overheads(LLAMA_8B, H100, Parallelism(), EAGER_LAUNCH_S, None)
    assert gqa.eager_host_s == pytest.approx(gqa.launches * EAGER_LAUNCH_S)


X86_SYSTEMS = (("h100_sxm", "h100"), ("h200_sxm", "h200"), ("b200_sxm", "b200"))
GRACE_SYSTEMS = (("gb200", "gb200"), ("gb300", "gb300"))


def host_tables(op: str, file: str, systems=X86_SYSTEMS):
    """(system, table) of the newest SGLang `op` table `file` of `systems` (x86-hosted by
    default)."""
    from pdsim.sim.silicon.ops import OpTables

    for system, preset in systems:
        yield system, OpTables(system, "sglang", "current",
                               load_hardware_spec(preset))._table(op, file)


def mla_block_host_s(t) -> tuple[float, object]:
    """The median of an MLA module table's eager rows at 1-256 tokens (one sequence, 128
    heads), and the rows."""
    small = t[(t.num_heads == 128) & (t.batch_size == 1) & (t.isl <= 256)]
    return float(small.latency.median()) * 1e-3, small.latency


def moe_core_host_s(t) -> tuple[float, object]:
    """The median of a wide-EP MoE table's eager rows at 32-256 tokens (uniform routing,
    DeepSeek-V3's experts), one row per (tokens, EP size), and the rows."""
    small = t[(t.distribution == "uniform") & (t.hidden_size == 7168)
              & (t.num_experts == 256) & (t.num_tokens <= 256)]
    rows = small.groupby(["num_tokens", "moe_ep_size"]).latency.min()
    return float(rows.median()) * 1e-3, rows


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core not installed")
def test_the_mla_block_host_time_is_what_the_eager_module_tables_measure() -> None:
    """aiconfigurator's wide-EP MLA context module tables time the block eagerly; at 1-256
    tokens the GPU waits for the host, so a call is its host time: MLA_EAGER_BLOCK_S plus the
    module's random latent (one launch), within 15% on the x86-hosted systems."""
    for system, t in host_tables("mla", "wideep_context_mla_perf.parquet"):
        measured_s, rows = mla_block_host_s(t)
        assert len(rows) >= 8 and rows.max() < 2 * rows.min()  # flat: host-bound
        assert measured_s == pytest.approx(MLA_EAGER_BLOCK_S + EAGER_LAUNCH_S, rel=0.15), system


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core not installed")
def test_the_deepep_moe_core_host_time_is_what_the_eager_moe_tables_measure() -> None:
    """aiconfigurator's wide-EP MoE context tables time DeepEPMoE.run_moe_core eagerly, after
    a synchronisation; at 32-256 tokens (uniform routing) a row is its host time, flat in the
    tokens and the EP size: DEEPEP_MOE_CORE_EAGER_S within 20% on the x86-hosted systems."""
    for system, t in host_tables("moe", "wideep_context_moe_perf.parquet"):
        measured_s, rows = moe_core_host_s(t)
        assert len(rows) >= 8 and rows.max() < 1.5 * rows.min(), system  # flat: host-bound
        assert measured_s == pytest.approx(DEEPEP_MOE_CORE_EAGER_S, rel=0.2)


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core not installed")
def test_grace_hosts_take_the_measured_share_longer_over_both_eager_blocks() -> None:
    """GB200/GB300's Grace hosts over the x86 hosts: the median of the two systems' eager MLA
    block and DeepEP MoE core rows against the median of the x86 systems' is
    GRACE_HOST_TIME_SCALE within 10% for each block."""
    for op, file, host_s in (("mla", "wideep_context_mla_perf.parquet", mla_block_host_s),
                             ("moe", "wideep_context_moe_perf.parquet", moe_core_host_s)):
        x86, grace = ([host_s(t)[0] for _, t in host_tables(op, file, systems)]
                      for systems in (X86_SYSTEMS, GRACE_SYSTEMS))
        assert len(grace) == 2
        assert np.median(grace) / np.median(x86) == pytest.approx(GRACE_HOST_TIME_SCALE,
                                                                  rel=0.1), op


def test_a_grace_hosted_gpu_runs_its_eager_forwards_at_the_host_scale() -> None:
    """Without an eager_launch_s, an eager forward's host time on GB200 is B200's times its
    Grace host's scale, launches and host blocks alike; a given eager_launch_s stands as
    given, on either host."""
    gb200 = load_hardware_spec("gb200")
    assert gb200.host_time_scale == GRACE_HOST_TIME_SCALE and B200.host_time_scale == 1
    par = dict(tp=8, dp_attention=8, ep=8, moe_dense_tp=1, moe_a2a="deepep")
    x86, grace = (cost("roofline", DSV3, hw, Parallelism(**par), role="prefill")._host
                  for hw in (B200, gb200))
    assert x86.eager_host_s == pytest.approx(
        host_overheads(DSV3, B200, Parallelism(**par), EAGER_LAUNCH_S, None).eager_host_s)
    assert grace.eager_host_s == pytest.approx(GRACE_HOST_TIME_SCALE * x86.eager_host_s)
    given = cost("roofline", DSV3, gb200, Parallelism(**par), role="prefill",
                 eager_launch_s=EAGER_LAUNCH_S)._host
    assert given.eager_host_s == pytest.approx(x86.eager_host_s)
    slow, fast = (cost("roofline", DSV3, hw, Parallelism(**par), role="prefill")
                  .step_time_s([prefill(16)]) for hw in (gb200, B200))
    assert slow > fast  # a short prompt is host-bound: the slower host sets its step


def kernels_and_host(cost_model, shapes) -> tuple[float, float]:
    """A step's kernels (every part but the host's) and its host work, without launches."""
    parts = cost_model.step_breakdown_s(shapes)
    return sum(parts.values()) - parts["overhead"], parts["overhead"]


@pytest.mark.parametrize("name", MODELS)
def test_an_eager_step_takes_the_longer_of_its_kernels_and_launches(name: str) -> None:
    on, off = cost(name), cost(name, eager_overhead=False)
    launches = on._host.eager_host_s
    assert launches == pytest.approx(32 * 10 * EAGER_LAUNCH_S)
    for tokens in (16, 1024, 8192):
        kernels, host = kernels_and_host(off, [prefill(tokens)])
        assert on.step_time_s([prefill(tokens)]) == pytest.approx(
            host + max(kernels, launches), rel=1e-12)
        parts = on.step_breakdown_s([prefill(tokens)])
        assert parts["overhead"] == pytest.approx(host + max(0.0, launches - kernels), rel=1e-12)
        assert sum(parts.values()) == pytest.approx(on.step_time_s([prefill(tokens)]), rel=1e-12)
    # A 16-token prefill of an 8B model is host-bound; 8,192 tokens hide every launch.
    assert kernels_and_host(off, [prefill(16)])[0] < launches
    assert on.step_time_s([prefill(8192)]) == off.step_time_s([prefill(8192)])


@pytest.mark.parametrize("name", MODELS)
def test_graphed_decode_pays_no_launches_and_larger_batches_do(name: str) -> None:
    on = cost(name, cuda_graph_max_bs=8, eager_launch_s=40e-6)
    off = cost(name, cuda_graph_max_bs=8, eager_overhead=False)
    assert on.step_time_s([decode(8)]) == off.step_time_s([decode(8)])
    kernels, host = kernels_and_host(off, [decode(9)])
    assert kernels < 32 * 10 * 40e-6
    assert on.step_time_s([decode(9)]) == pytest.approx(host + 32 * 10 * 40e-6, rel=1e-12)
    # SGLang's default on an H100 at TP 1: 256 requests a rank run as a graph, 257 do not.
    # Kernels that long hide the launches: 257 eager requests cost what their kernels do.
    default = cost(name)
    assert default._host.cuda_graph_max_bs == 256
    assert default._host.eager(False, 257) and not default._host.eager(False, 256)
    assert default.step_breakdown_s([decode(257)])["overhead"] == default.params.step_overhead_s
    assert sum(on.step_breakdown_s([decode(9)]).values()) == pytest.approx(
        on.step_time_s([decode(9)]), rel=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_eager_decode_of_one_request_is_as_slow_as_sglang_measured(name: str) -> None:
    """SGLang's bench_latency of Llama-3-8B on an H100 at batch 1 (sglang PR #1401): eager
    decode took 1.12x (FlashInfer) to 1.31x (Triton attention) the CUDA-graph step
    (docs/cost_model.md, "Host overheads"). A launch-bound forward lands inside that range."""
    graphed = cost(name).step_time_s([decode(1)])
    eager = cost(name, cuda_graph_max_bs=0).step_time_s([decode(1)])
    assert 1.10 <= eager / graphed <= 1.35


@pytest.mark.parametrize("name", MODELS)
def test_scheduler_overhead_switch(name: str) -> None:
    on = cost(name, eager_overhead=False)
    off = cost(name, eager_overhead=False, scheduler_overhead=False)
    p = on.params
    assert on.step_time_s([decode(4)]) == pytest.approx(
        off.step_time_s([decode(4)]) + p.step_overhead_s, rel=1e-12)
    assert on.step_time_s([prefill(512)]) == pytest.approx(
        off.step_time_s([prefill(512)]) + p.step_overhead_s + p.extend_overhead_s, rel=1e-12)
    assert off.step_breakdown_s([decode(4)])["overhead"] == 0.0


@pytest.mark.parametrize("name", MODELS)
def test_a_piecewise_graphed_extend_launches_three_kernels_a_layer(name: str) -> None:
    """SGLang's piecewise CUDA graphs (a colocated server's default from v0.5.10): per layer one graph up to
    the next attention call and that call's KV store and kernel, eager; above the max tokens
    the extend runs eagerly as before."""
    llama_70b = model_preset("llama-3.1-70b")
    eager, graphed, capped = (
        cost(name, llama_70b, H100, Parallelism(tp=8), role="prefill", **params)
        for params in ({}, {"piecewise_cuda_graph": True},
                       {"piecewise_cuda_graph": True, "piecewise_cuda_graph_max_tokens": 64}))
    assert graphed._host.piecewise_launches == 3 * 80 + 1
    kernels, host = kernels_and_host(cost(name, llama_70b, H100, Parallelism(tp=8),
                                          role="prefill", eager_overhead=False), [prefill(128)])
    launch_bound = graphed._host.piecewise_host_s
    assert graphed.step_time_s([prefill(128)]) == pytest.approx(
        host + max(kernels, launch_bound), rel=1e-12)
    assert graphed.step_time_s([prefill(128)]) < 0.7 * eager.step_time_s([prefill(128)])
    assert capped.step_time_s([prefill(128)]) == eager.step_time_s([prefill(128)])
    assert capped.step_time_s([prefill(64)]) == graphed.step_time_s([prefill(64)])
    # decode steps keep their full graphs; long prefills hide the launches either way
    assert graphed.step_time_s([decode(8)]) == eager.step_time_s([decode(8)])
    assert graphed.step_time_s([prefill(8192)]) == eager.step_time_s([prefill(8192)])


def test_piecewise_graphs_default_to_sglangs_max_tokens_and_drop_where_sglang_drops_them(
        ) -> None:
    def host(model, rules="v0.5.10", role="colocated", **par):
        return cost("roofline", model, H200, Parallelism(**par), role=role,
                    piecewise_cuda_graph=True, piecewise_cuda_graph_rules=rules)._host
    # MLA models 2,048 tokens under v0.5.10, the chunk up to 8,192 under v0.5.23; the others
    # SGLang's chunk for the GPU (an experiment passes its role's chunked_prefill_size)
    assert host(DSV3, tp=8).piecewise_max_tokens == 2048
    assert host(DSV3, "v0.5.23", tp=8).piecewise_max_tokens == 8192
    assert sglang_defaults.piecewise_cuda_graph_max_tokens(True, 16384, "v0.5.23") == 8192
    assert host(LLAMA_8B).piecewise_max_tokens == sglang_defaults.chunked_prefill_size(
        H200.hbm_gib) == 8192
    for par in (dict(tp=8, dp_attention=8, ep=8), dict(tp=8, dp_attention=8, ep=8,
                                                         moe_a2a="deepep"), dict(tp=8, pp=2)):
        assert host(DSV3, **par).piecewise_max_tokens is None, par
    for rules in ("v0.5.10", "v0.5.23"):
        assert host(model_preset("qwen3-next-80b-a3b"), rules, tp=4).piecewise_max_tokens is None
        assert host(DSV3, rules, tp=8, pp=2).piecewise_max_tokens is None


def test_a_pd_server_graphs_extends_under_v0523_rules_only() -> None:
    """v0.5.10's `_handle_piecewise_cuda_graph` turns the piecewise graphs off on any PD server
    (`disaggregation_mode` not "null"); v0.5.23's breakable prefill graphs (the default on
    CUDA) stay on for a PD prefill server, with DP attention and with DeepEP, whose MoE forward
    runs eagerly between graph segments, and are off with two-batch overlap."""
    def host(rules, role="prefill", **par):
        return cost("roofline", DSV3, H200, Parallelism(**par), role=role,
                    piecewise_cuda_graph=True, piecewise_cuda_graph_rules=rules)._host
    assert host("v0.5.10", tp=8).piecewise_max_tokens is None
    assert host("v0.5.10", "colocated", tp=8).piecewise_max_tokens == 2048
    assert host("v0.5.23", tp=8).piecewise_max_tokens == 8192
    dp = host("v0.5.23", tp=8, dp_attention=8, ep=8)
    assert dp.piecewise_max_tokens == 8192 and dp.piecewise_launches == 3 * 61 + 1
    deepep = host("v0.5.23", tp=8, dp_attention=8, ep=8, moe_a2a="deepep", moe_dense_tp=1)
    assert deepep.piecewise_max_tokens == 8192
    core_excess = DEEPEP_MOE_CORE_EAGER_S / EAGER_LAUNCH_S - DEEPEP_MOE_CORE_LAUNCHES
    assert deepep.piecewise_launches == pytest.approx(3 * 61 + 1 + 58 * (7 + core_excess + 1))
    assert deepep.piecewise_host_s < 0.5 * deepep.eager_host_s
    assert host("v0.5.23", tp=8, dp_attention=8, ep=8, moe_a2a="deepep", moe_dense_tp=1,
                two_batch_overlap=True).piecewise_max_tokens is None


def test_an_experiment_graphs_extends_up_to_its_roles_chunk() -> None:
    cfg = parse_experiment({
        "name": "piecewise", "model": "llama-3.1-8b", "hardware": "h100",
        "cost_model": {"name": "roofline", "params": {"piecewise_cuda_graph": True}},
        "cluster": {"mode": "disaggregated",
                    "prefill": {"tp": 1, "scheduler": {"chunked_prefill_size": 4096}},
                    "decode": {"tp": 1}},
        "workload": {"num_requests": 4, "arrival": {"process": "poisson", "rate_rps": 1},
                     "input_len": {"dist": "fixed", "value": 64},
                     "output_len": {"dist": "fixed", "value": 4}}})
    cluster = build_cluster(cfg)
    assert cluster.prefill.cost()._host.piecewise_max_tokens == 4096
    assert cluster.decode.cost()._host.piecewise_max_tokens == 8192  # H100's default chunk
