"""An MLA extend after a cached prefix runs as SGLang's attention backends dispatch it: MHA over
the prefix re-projected by kv_b from `chunked_prefix_cache_threshold` cached tokens on (and on
Blackwell's trtllm_mla for any prefix), the absorbed form below it."""

from __future__ import annotations

import pytest

from pdsim.core.batch import extend_shape
from pdsim.sim.cost import (
    MLA_CHUNKED_PREFIX_THRESHOLD, Parallelism, RooflineParams, make_cost_model,
    mla_extend_form, mla_prefix_threshold,
)
from pdsim.sim.silicon import tables
from pdsim.specs import load_hardware_spec, load_model_spec
from pdsim.specs.precision import gemm_peak_tflops

TP8 = Parallelism(tp=8, ep=8)


def _attention_s(cost, new: int, cached: int, prefix: int | None = None) -> float:
    shape = extend_shape(new, cached)
    if prefix is not None:
        shape = shape._replace(prefill_prefix_tokens=prefix)
    return cost.step_breakdown_s([shape])["attention"]


def test_the_form_follows_sglangs_dispatch():
    h200, b200 = load_hardware_spec("h200"), load_hardware_spec("b200")
    p = RooflineParams()
    assert mla_prefix_threshold(h200, p) == MLA_CHUNKED_PREFIX_THRESHOLD == 8192
    assert mla_prefix_threshold(b200, p) == 1  # trtllm_mla: any prefix goes MHA
    assert mla_prefix_threshold(h200, RooflineParams(chunked_prefix_cache_threshold=2)) == 2
    assert [mla_extend_form(n, 8192) for n in (0, 1, 8191, 8192, 10**6)] == [
        "mha", "absorbed", "absorbed", "mha", "mha"]
    assert mla_extend_form(5, 1) == "mha"


def test_roofline_prices_the_absorbed_form_at_its_flops_a_pair():
    """DeepSeek-V3, TP8 on an H200 (16 heads a GPU): 2,048 new tokens after 4,096 cached run
    absorbed, q·k over 512 + 64 dims and values of 512 a pair (1,088 FLOPs a head x 2) where
    the MHA form computes 192 + 128: the attention kernels' part grows by the difference."""
    model, h200 = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    cost = make_cost_model("roofline", model, h200, TP8, role="prefill")
    absorbed = _attention_s(cost, 2048, 4096)
    mha = _attention_s(cost, 2048, 4096, prefix=0)
    p = RooflineParams()
    shape = extend_shape(2048, 4096)
    pairs = shape.prefill_attn_pairs + 2048 * p.prefill_attn_extra_keys
    rate = h200.bf16_tflops * 1e12 * p.attn_mfu
    extra_flops = 2 * 16 * ((2 * 512 + 64) - (192 + 128)) * pairs
    assert absorbed - mha == pytest.approx(model.num_layers * extra_flops / rate, rel=1e-6)


def test_roofline_reprojects_a_long_prefix_by_its_flop_count():
    """From 8,192 cached tokens on, kv_b (512 -> 16 heads x (128 + 128)) re-projects the
    prefix every forward: 2 x 65,536 x 512 x 4,096 FLOPs a layer at the FP8 GEMM rate."""
    model, h200 = load_model_spec("deepseek-v3"), load_hardware_spec("h200")
    cost = make_cost_model("roofline", model, h200, TP8, role="prefill")
    p = RooflineParams()
    reproject = _attention_s(cost, 2048, 65536) - _attention_s(cost, 2048, 65536, prefix=0)
    flops = 2 * 65536 * 512 * 16 * (128 + 128)
    rate = gemm_peak_tflops(model.precision.attention, h200) * 1e12 * p.fp8_gemm_mfu
    assert reproject == pytest.approx(model.num_layers * (flops / rate + p.gemm_floor_s),
                                      rel=1e-6)


def test_a_model_without_mla_ignores_the_prefix():
    model, h100 = load_model_spec("llama-3.1-8b"), load_hardware_spec("h100")
    cost = make_cost_model("roofline", model, h100, Parallelism(tp=1), role="prefill")
    assert _attention_s(cost, 2048, 4096) == _attention_s(cost, 2048, 4096, prefix=0)


needs_tables = pytest.mark.skipif(tables.systems_dir() is None,
                                  reason="aiconfigurator-core not installed")


@pytest.mark.slow
@needs_tables
def test_silicon_reads_the_hopper_absorbed_rows_and_blackwell_reprojects():
    """On an H200 the absorbed extend reads the context table's own rows (FlashAttention-3 in
    the absorbed form) where the MHA form moves them by its 3.4x fewer FLOPs; on a B200
    trtllm_mla re-projects even a short prefix with kv_b, an op the trace names."""
    model = load_model_spec("deepseek-v3")
    h200 = make_cost_model("silicon", model, load_hardware_spec("h200"), TP8, role="prefill")
    absorbed, mha = _attention_s(h200, 2048, 4096), _attention_s(h200, 2048, 4096, prefix=0)
    assert 1.4 < absorbed / mha < 3.4
    assert _attention_s(h200, 2048, 8192) < absorbed  # from the threshold on, MHA again
    b200 = make_cost_model("silicon", model, load_hardware_spec("b200"), TP8, role="prefill")
    b200.trace = []
    b200.step_breakdown_s([extend_shape(2048, 4096)])
    names = {op.name for op in b200.trace}
    assert "kv_b_proj (prefix)" in names and "prefill attention (absorbed)" not in names
    reproject = [op for op in b200.trace if op.name == "kv_b_proj (prefix)"]
    assert reproject[0].seconds > 0
