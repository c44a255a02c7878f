"""State beyond the KV cache: sliding-window layers and recurrent (linear-attention) state, in
the specs, the simulator's pool sizing and transfers, and the core's state slots. Every figure
is computed by hand from the models' public config.json shapes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from configs import scheduler_config
from core_harness import Driver, FixedExecutor
from test_core_pd import submit
from test_transfer_contract import BACKENDS, Watch

from pdsim import sglang_defaults
from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchShape
from pdsim.core.decode import DecodeScheduler
from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.kvpoll import KVPoll
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.runner import run_point
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import Parallelism, pool_sizes, weight_bytes_per_gpu
from pdsim.sim.silicon import tables
from pdsim.specs.hardware import load_hardware_spec
from pdsim.specs.models import ModelSpec, model_preset, model_spec_from_hf_config
from pdsim.specs.pipeline import stage_model

# ----- specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, total, active", [
    ("gpt-oss-120b", 116.83e9, 5.13e9),  # OpenAI's model card
    ("gpt-oss-20b", 20.91e9, 3.61e9),
    # Safetensors total; active: 3.87e9 published counts the embedding (0.31e9) too
    ("qwen3-next-80b-a3b", 79.67e9, 3.87e9 - 151936 * 2048),
])
def test_hybrid_presets_match_their_published_sizes(name, total, active):
    spec = model_preset(name)
    assert spec.num_params == pytest.approx(total, rel=0.005)
    assert spec.active_params_per_token == pytest.approx(active, rel=0.04)


HF_CONFIGS = {
    # openai/gpt-oss-120b config.json (the fields pdsim reads)
    "gpt-oss-120b": {
        "max_position_embeddings": 131072, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
        "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 36, "num_local_experts": 128,
        "num_experts_per_tok": 4, "sliding_window": 128, "vocab_size": 201088,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]},
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (no layer_types: full_attention_interval)
    "qwen3-next-80b-a3b": {
        "max_position_embeddings": 262144, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "head_dim": 256,
        "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 48, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_configs_load_as_the_hybrid_presets(name):
    assert model_spec_from_hf_config(HF_CONFIGS[name], name) == model_preset(name)


def test_hf_layer_types_that_pdsim_does_not_model_are_named():
    config = {**HF_CONFIGS["gpt-oss-120b"], "layer_types": ["chunked_attention"] * 36}
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not modelled"):
        model_spec_from_hf_config(config, "x")


def test_layer_pattern_counts_each_kind():
    oss = model_preset("gpt-oss-120b")
    kinds = ("num_full_attention_layers", "num_sliding_layers", "num_linear_layers")
    assert tuple(getattr(oss, k) for k in kinds) == (18, 18, 0)
    nxt = model_preset("qwen3-next-80b-a3b")
    assert tuple(getattr(nxt, k) for k in kinds) == (12, 0, 36)
    # 5 layers of (linear, linear, full): the pattern repeats, its start cut short at the end
    odd = nxt.model_copy(update={"num_layers": 5,
                                 "layer_pattern": ("linear_attention",) * 2 + ("full_attention",)})
    assert (odd.num_linear_layers, odd.num_full_attention_layers) == (4, 1)


def test_sliding_window_kv_is_a_window_per_request():
    spec = model_preset("gpt-oss-120b")
    per_layer = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16
    assert spec.kv_bytes_per_token() == 18 * per_layer == 36_864
    assert spec.swa_bytes_per_token_per_rank(1) == 18 * per_layer
    assert spec.swa_window_bytes_per_request_per_rank(1) == 128 * 18 * per_layer
    # tp 8: one KV head per rank
    assert spec.kv_bytes_per_token_per_rank(8) == 18 * 2 * 64 * 2
    assert spec.swa_window_bytes_per_request_per_rank(8) == 128 * 18 * 2 * 64 * 2


def test_recurrent_state_is_fixed_per_request_and_split_by_heads():
    spec = model_preset("qwen3-next-80b-a3b")
    ssm = 32 * 128 * 128 * 4  # value heads x key dim x value dim, fp32
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2  # q, k, v channels x (kernel - 1), bf16
    assert spec.recurrent_state_bytes_per_layer_per_rank(1) == ssm + conv == 2_146_304
    assert spec.recurrent_state_bytes_per_request_per_rank(1) == 36 * (ssm + conv)
    assert spec.recurrent_state_bytes_per_layer_per_rank(4) == (ssm + conv) // 4
    assert spec.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    with pytest.raises(ValueError, match=r"tp=3 must divide linear_num_key_heads \(16\)"):
        spec.recurrent_state_bytes_per_layer_per_rank(3)


def test_bad_hybrid_specs_say_what_is_missing():
    base = model_preset("llama-3.1-8b").model_dump()
    with pytest.raises(ValueError, match="no full_attention layer"):
        ModelSpec(**{**base, "layer_pattern": ("sliding_attention",), "sliding_window": 64})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec(**{**base, "layer_pattern": ("sliding_attention", "full_attention")})
    with pytest.raises(ValueError, match="needs linear_num_key_heads"):
        ModelSpec(**{**base, "layer_pattern": ("linear_attention", "full_attention")})
    with pytest.raises(ValueError, match="only apply with a linear_attention"):
        ModelSpec(**{**base, "linear_num_key_heads": 4})


def test_a_pipeline_stage_keeps_its_own_layers_kinds():
    spec = model_preset("qwen3-next-80b-a3b")
    last = stage_model(spec, 3)  # layers 32..47: starts on a linear layer, 4 | 32
    assert (last.num_linear_layers, last.num_full_attention_layers) == (12, 4)
    oss = model_preset("gpt-oss-20b")  # 24 layers over 5 stages: the last holds 19..23
    last = stage_model(oss, 5)
    assert last.num_layers == 5
    assert (last.num_sliding_layers, last.num_full_attention_layers) == (2, 3)


# ----- pool sizing -----------------------------------------------------------------------------


def _free_bytes(model, hw, par, mem_fraction=0.88):
    return hw.hbm_bytes * mem_fraction - weight_bytes_per_gpu(model, par)


def test_sliding_window_pool_is_a_share_of_the_full_pool():
    model, hw, par = model_preset("gpt-oss-120b"), load_hardware_spec("h200"), Parallelism(tp=2)
    free = _free_bytes(model, hw, par)
    full = 18 * 2 * 4 * 64 * 2  # 4 KV heads per rank
    sizes = pool_sizes(model, hw, par)
    assert sizes == (int(free // (full + 0.8 * full)), 0)
    assert pool_sizes(model, hw, par, swa_full_tokens_ratio=0.5).kv_tokens == int(
        free // (1.5 * full))


def test_recurrent_state_takes_its_share_of_memory_as_slots():
    model, hw = model_preset("qwen3-next-80b-a3b"), load_hardware_spec("h200")
    par = Parallelism(tp=4)
    free = _free_bytes(model, hw, par)
    state = 36 * 2_146_304 // 4
    per_token = 12 * 2 * 1 * 256 * 2  # 2 KV heads over tp 4: one per rank (replicated)
    slots = int(free * 0.9 / 1.9 // state)
    assert pool_sizes(model, hw, par) == (int((free - slots * state) // per_token), slots)
    fixed = pool_sizes(model, hw, par, max_mamba_cache_size=100)
    assert fixed == (int((free - 100 * state) // per_token), 100)
    with pytest.raises(ValueError, match="leave no room for a KV pool"):
        pool_sizes(model, hw, par, max_mamba_cache_size=10**6)


def _experiment(model: str, tp: int = 1, **scheduler) -> dict:
    return {
        "name": "hybrid", "seed": 1, "model": model, "hardware": "h200",
        "cluster": {"prefill": {"instances": 1, "tp": tp, "scheduler": scheduler},
                    "decode": {"instances": 1, "tp": tp, "scheduler": scheduler}},
        "workload": {"num_requests": 40, "seed": 2,
                     "arrival": {"process": "poisson", "rate_rps": 20},
                     "input_len": {"dist": "uniform", "low": 200, "high": 3000},
                     "output_len": {"dist": "uniform", "low": 4, "high": 40}},
    }


def test_cluster_sizes_state_slots_and_prices_the_state_on_the_wire():
    cluster = build_cluster(parse_experiment(_experiment("qwen3-next-80b-a3b", tp=4)))
    decode = cluster.decode
    model, hw = model_preset("qwen3-next-80b-a3b"), load_hardware_spec("h200")
    # the share of memory SGLang derives for tp 4 on an H200 (pdsim.sglang_defaults)
    fraction = sglang_defaults.mem_fraction_static(141, chunk=8192, max_prefill_tokens=16384,
                                                   graph_bs=512, tp=4)
    sizes = pool_sizes(model, hw, Parallelism(tp=4), fraction)
    assert decode.scheduler.state_slots == sizes.state_slots > 0
    assert decode.scheduler.num_pages == sizes.kv_tokens // 16
    assert decode.kv_bytes_per_page == 16 * 12 * 2 * 256 * 2 * 4  # each of 4 ranks its own copy
    assert decode.state_bytes_per_request == 36 * 2_146_304  # the whole state, split 4 ways

    data = _experiment("gpt-oss-20b")
    data["hardware"] = "b200"  # MXFP4 experts need FP4 tensor cores
    oss = build_cluster(parse_experiment(data)).decode
    assert oss.scheduler.state_slots == 0  # a window is pooled by tokens, not slots
    assert oss.state_bytes_per_request == 128 * 12 * 2 * 8 * 64 * 2


def test_transfer_moves_kv_pages_plus_each_requests_state():
    data = _experiment("qwen3-next-80b-a3b", tp=4, max_mamba_cache_size=8)
    cfg = parse_experiment(data)
    point = run_point(0, cfg, {}, None)  # checks every page and state slot came back
    frame = point.requests
    assert (frame["status"] == "ok").all() and len(frame) == 40
    pages = sum(-(-n // 16) for n in frame["input_tokens"])
    expected = pages * 16 * 12 * 2 * 256 * 2 * 4 + 40 * 36 * 2_146_304
    assert point.summary["kv_transfer_gb"] == pytest.approx(expected / 1e9, rel=1e-9)


def test_state_slot_count_must_fit_the_memory():
    data = _experiment("qwen3-next-80b-a3b", tp=4, max_mamba_cache_size=10**6)
    with pytest.raises(ConfigError, match="cluster.prefill: .*leave no room for a KV pool"):
        build_cluster(parse_experiment(data))


# ----- core: the state pool --------------------------------------------------------------------


def _run_sampling(drv, sample, step_s=0.25, until_s=200.0):
    """Run the driver to the end, calling `sample()` every `step_s` of its clock."""
    t = 0.0
    while t < until_s:
        drv.run(until_s=t)
        sample()
        t += step_s
    drv.run()


def test_state_slots_cap_how_many_requests_run_and_come_back():
    config = replace(scheduler_config(64, page_size=4, max_running_requests=8), state_slots=2)
    sched = ColocatedScheduler(config)
    drv = Driver(FixedExecutor(extend_s=1.0, decode_s=0.25))
    drv.add_instance("C", sched)
    reqs = [Request(f"r{i}", 4, 6, arrival_s=0.0) for i in range(5)]
    for req in reqs:
        drv.submit(0.0, "C", req)
    used = []

    def sample():
        assert sched.state_slots.num_used == sched.req_slots.num_used
        used.append(sched.state_slots.num_used)
    _run_sampling(drv, sample, until_s=30.0)
    assert max(used) == 2
    assert all(r.finished and not r.error for r in reqs)
    sched.check_pools_full()
    sched.state_slots.alloc()  # a slot nobody gives back is a leak the check names
    with pytest.raises(AssertionError, match="state slot pool leaked 1"):
        sched.check_pools_full()


def _pd(prefill_slots: int, decode_slots: int):
    wire = FakeWire()
    pre = replace(scheduler_config(32, page_size=4), state_slots=prefill_slots)
    dec = replace(scheduler_config(32, page_size=4), state_slots=decode_slots)
    p = PrefillScheduler(pre, FakeKVManager(wire), instance_id=0)
    d = DecodeScheduler(dec, FakeKVManager(wire), instance_id=1)
    drv = Driver(FixedExecutor(extend_s=1.0, decode_s=0.25))
    drv.add_instance("P", p)
    drv.add_instance("D", d)
    return drv, p, d, wire


def test_pd_transfer_carries_state_indices_beside_the_pages():
    drv, p, d, wire = _pd(prefill_slots=1, decode_slots=2)
    pairs = [submit(drv, 0.0, f"r{i}", 6, 3) for i in range(3)]
    used = []
    _run_sampling(drv, lambda: used.append(p.state_slots.num_used), until_s=30.0)
    assert all(r.finished and not r.error for pair in pairs for r in pair)
    assert max(used) == 1  # one prefill state slot: one request prefills at a time
    for pre, _ in pairs:
        # the prefill side's only slot, written into a decode slot, beside 2 pages of 4 tokens
        (src, dst), = wire.sent_states[pre.bootstrap_room]
        assert src == 0 and dst in (0, 1)
        assert len(wire.sent_pages[pre.bootstrap_room]) == 2
    p.check_pools_full()
    d.check_pools_full()


def test_a_side_without_state_fails_the_request_and_leaks_nothing():
    drv, p, d, wire = _pd(prefill_slots=2, decode_slots=0)
    pre, dec = submit(drv, 0.0, "r0", 6, 3)
    drv.run()
    assert "sends 1 state slots, the decode side expects 0" in pre.error
    assert dec.finished and dec.error
    p.check_pools_full()
    d.check_pools_full()


def test_abort_returns_the_state_slot():
    drv, p, d, wire = _pd(prefill_slots=2, decode_slots=2)
    pre, dec = submit(drv, 0.0, "r0", 6, 50)
    drv.run(until_s=2.0)
    assert d.state_slots.num_used == 1
    assert d.abort("r0", "client went away", 2.0)
    assert d.state_slots.num_used == 0
    d.check_pools_full()


# ----- cost ------------------------------------------------------------------------------------


def test_only_full_attention_layers_attend_over_the_whole_context():
    """A decode step over long contexts: gpt-oss's sliding-window half of the layers reads no
    context-long KV, so its attention costs about half of the same model with every layer full."""
    from pdsim.core.batch import BatchShape
    from pdsim.sim.cost import make_cost_model

    hybrid = model_preset("gpt-oss-120b")
    full = hybrid.model_copy(update={"layer_pattern": ("full_attention",), "sliding_window": None})
    hw = load_hardware_spec("b200")
    shape = BatchShape(decode_reqs=64, decode_context_tokens=64 * 32768)
    kernels = [make_cost_model("roofline", m, hw, Parallelism(tp=2)).attention_kernels_s(shape)
               for m in (hybrid, full)]
    assert kernels[0] < 0.6 * kernels[1]


def _gdn_table(kernel: str, k_heads: int, v_heads: int):
    """The H200 SGLang GDN table's fastest latency (s) per (batch, sequence) of `kernel`."""
    import pandas as pd
    from pdsim.sim.silicon.tables import current_version, table_path

    path = table_path("h200_sxm", "linear_attention", "sglang",
                      current_version("h200_sxm", "sglang"), "gdn_perf.parquet")
    t = pd.read_parquet(path)
    t = t[(t["kernel_source"] == kernel) & (t["num_k_heads"] == k_heads)
          & (t["num_v_heads"] == v_heads) & (t["head_k_dim"] == 128)]
    return t.groupby(["batch_size", "seq_len"])["latency"].min() * 1e-3


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core not installed")
def test_silicon_prices_gated_deltanet_layers_from_the_gdn_tables():
    """Qwen3-Next at tp 2 on an H200 (8 key and 16 value heads a GPU, a shape the tables
    measured): its 36 Gated DeltaNet layers decode and prefill at the tables' kernel times,
    its 12 full-attention layers at the attention tables'; a decode step's GDN cost does not
    grow with the context."""
    from pdsim.explain import _silicon_rows
    from pdsim.sim.cost import make_cost_model
    from pdsim.sim.silicon import SiliconCostModel

    qn, h200 = model_preset("qwen3-next-80b-a3b"), load_hardware_spec("h200")
    cost = make_cost_model("auto", qn, h200, Parallelism(tp=2))
    assert isinstance(cost, SiliconCostModel)  # no longer the roofline for the whole model
    decode = _gdn_table("fused_recurrent_gated_delta_rule_packed_decode", 8, 16)
    conv = _gdn_table("causal_conv1d_update", 8, 16)
    shape = BatchShape(decode_reqs=256, decode_context_tokens=256 * 4096)
    rows = {r.name: r for r in _silicon_rows(cost, [shape])}
    gdn = rows["gdn recurrent step"]
    assert gdn.count == 36 and rows["decode attention"].count == 12
    assert gdn.how == "interpolated"
    assert gdn.total_s == pytest.approx(36 * decode[(256, 1)], rel=1e-6)
    assert rows["gdn conv1d update"].total_s == pytest.approx(36 * conv[(256, 1)], rel=1e-6)
    # only the 12 full layers read a longer context
    near = cost.step_time_s([BatchShape(decode_reqs=256, decode_context_tokens=256 * 512)])
    far = cost.step_time_s([BatchShape(decode_reqs=256, decode_context_tokens=256 * 8192)])
    attn = cost._plan.generation_attn
    full_growth = 12 * (attn.at(256, 8192)[0] - attn.at(256, 512)[0])
    assert far - near == pytest.approx(full_growth, rel=1e-6)

    scan = _gdn_table("chunk_gated_delta_rule", 8, 16)
    prompt = BatchShape(prefill_tokens=8192, prefill_attn_pairs=8192 * 8193 // 2)
    prefill = {r.name: r for r in _silicon_rows(cost, [prompt])}
    assert prefill["prefill gdn scan"].total_s == pytest.approx(36 * scan[(1, 8192)], rel=1e-6)
    assert prefill["in_proj_qkvz"].count == 36 and prefill["qkv_proj"].count == 12


def test_roofline_decode_reads_and_writes_each_recurrent_state():
    """The roofline's Gated DeltaNet decode is bound by each request's state, read and written
    once a step: halving the state's element (SGLang's --mamba-ssm-dtype bfloat16) saves
    exactly that traffic, 36 of 48 layers' worth."""
    from pdsim.sim.cost import make_cost_model

    fp32 = model_preset("qwen3-next-80b-a3b")
    bf16 = fp32.model_copy(update={"recurrent_state_dtype_bytes": 2})
    hw = load_hardware_spec("h200")
    shape = BatchShape(decode_reqs=256, decode_context_tokens=256 * 4096)
    costs = [make_cost_model("roofline", m, hw, Parallelism(tp=2)) for m in (fp32, bf16)]
    saved = costs[0].attention_kernels_s(shape) - costs[1].attention_kernels_s(shape)
    state = 16 * 128 * 128 * 2  # a GPU's 16 value heads, 2 bytes saved an element
    mem_rate = hw.stream_gb_per_s * 1e9 * 0.8  # the roofline's default bw_efficiency
    assert saved == pytest.approx(36 / 48 * 256 * 2 * state / mem_rate, rel=1e-9)
    # A lone one-token request is kernel floors, the softmax attention kernel's in the 12
    # full layers and the Gated DeltaNet kernels' in the other 36, and its FP32 state.
    p = costs[0].params
    lone = costs[0].attention_kernels_s(BatchShape(decode_reqs=1, decode_context_tokens=1))
    floors = 12 / 48 * p.attn_floor_s + 36 / 48 * p.gdn_decode_floor_s
    assert lone == pytest.approx(floors + 36 / 48 * 2 * (2 * state) / mem_rate, rel=0.02)


def test_eager_launches_count_gated_deltanet_blocks():
    """SGLang's Gated DeltaNet block launches 17 kernels (docs/cost_model.md, "Host
    overheads"), Qwen3-Next's GQA block 7 (6, and its per-head q/k RMSNorm): its 36 linear and
    12 full layers at tp 1 launch (36 * 17 + 12 * 7) / 48 attention kernels a layer."""
    from pdsim.sim.overheads import kernels_per_layer

    qn = model_preset("qwen3-next-80b-a3b")
    full = ModelSpec(**{**qn.model_dump(), "layer_pattern": ("full_attention",),
                        **{f: None for f in ("linear_num_key_heads", "linear_num_value_heads",
                                             "linear_key_head_dim", "linear_value_head_dim",
                                             "linear_conv_kernel_dim")}})
    hybrid_moe = kernels_per_layer(qn, 1, 1, 1, False, False)[1]
    full_moe = kernels_per_layer(full, 1, 1, 1, False, False)[1]
    assert hybrid_moe - full_moe == pytest.approx(36 / 48 * (17 - 7))


@pytest.mark.skipif(tables.systems_dir() is None, reason="aiconfigurator-core not installed")
def test_silicon_prices_sliding_window_layers_from_the_window_tables():
    """gpt-oss's 128-token window layers read the tables' window-128 rows (SGLang's kernels
    with the window, measured for its head shapes); full layers the full-attention rows."""
    from pdsim.sim.cost import make_cost_model
    from pdsim.sim.silicon import SiliconCostModel
    from pdsim.sim.silicon.ops import OpTables

    oss, h100 = model_preset("gpt-oss-120b"), load_hardware_spec("h100")
    cost = make_cost_model("auto", oss, h100, Parallelism())
    assert isinstance(cost, SiliconCostModel)
    ops = OpTables("h100_sxm", "sglang", "current", h100)
    full = ops.generation_attention(64, 8, 64, 2)
    window = ops.generation_attention(64, 8, 64, 2, window=128)
    assert not window.transferred
    # a window reads 128 keys whatever the context: its time barely grows with the context
    assert window.at(64, 16384)[0] < 1.5 * window.at(64, 512)[0]
    assert full.at(64, 16384)[0] > 10 * window.at(64, 16384)[0]
    shape = BatchShape(decode_reqs=64, decode_context_tokens=64 * 16384)
    without = cost.step_time_s([shape]) - cost.step_time_s(
        [BatchShape(decode_reqs=64, decode_context_tokens=64)])
    # the context's cost: the 18 full layers' read of it; the 18 window layers add ~nothing
    per_layer = full.at(64, 16384)[0] - full.at(64, 1)[0]
    assert without == pytest.approx(18 * per_layer, rel=0.1)
    assert cost.transferred_frac == 0.0
    with pytest.raises(ValueError, match="no rows for a 100-token sliding window"):
        ops.context_attention(64, 8, 64, 2, False, window=100)


# ----- the transfer contract: state_indices ----------------------------------------------------


@pytest.mark.parametrize("backend", ["fake", "sim",
                                     pytest.param("mooncake", marks=pytest.mark.real)])
@pytest.mark.parametrize("src_states, dst_states, ok", [
    ([0], [3], True), ([], [], True), ([], [3], False), ([0], [], False)])
def test_state_indices_ride_with_the_last_chunk(backend, src_states, dst_states, ok):
    pair = BACKENDS[backend]()
    try:
        if backend == "mooncake":  # its managers own a recurrent-state buffer (owners[2])
            src, dst = (m.args.owners[2] for m in (pair.prefill, pair.decode))
            src[...] = np.arange(src.size, dtype=src.dtype).reshape(src.shape)
        w = handshake_with_state(pair, dst_states)
        sender = w.endpoints["sender"]
        sender.init(num_pages=2, metadata_slot=0)
        sender.send([0, 1], last=True, state_indices=src_states)
        for side in ("sender", "receiver"):
            final = w.until(side, lambda s: s in (KVPoll.Success, KVPoll.Failed))
            assert final is (KVPoll.Success if ok else KVPoll.Failed)
        if not ok:
            assert (f"sends {len(src_states)} state slots, the decode side expects "
                    f"{len(dst_states)}") in w.endpoints["receiver"].failure_reason()
        elif backend == "fake":
            assert pair.prefill.wire.sent_states[w.room] == list(zip(src_states, dst_states))
        elif backend == "mooncake":  # the slot's bytes arrived, and only it
            moved = {d: s for s, d in zip(src_states, dst_states)}
            for slot in range(len(dst)):
                want = src[moved[slot]] if slot in moved else 0
                assert np.array_equal(dst[slot], np.broadcast_to(want, dst[slot].shape))
    finally:
        pair.close()


def handshake_with_state(pair, dst_states):
    """The contract's handshake, the receiver also naming its state slots."""
    room = next(_ROOMS)
    sender = pair.prefill.create_sender(pair.request(room))
    receiver = pair.decode.create_receiver(pair.request(room))
    w = Watch(pair, sender=sender, receiver=receiver)
    w.room = room
    w.until("receiver", lambda s: s >= KVPoll.WaitingForInput)
    receiver.send_metadata([4, 5], 0, state_indices=dst_states)
    w.until("sender", lambda s: s >= KVPoll.WaitingForInput)
    return w


_ROOMS = iter(range(5000, 6000))
