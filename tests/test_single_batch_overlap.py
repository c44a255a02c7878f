"""Single-batch overlap (SGLang's --enable-single-batch-overlap): a decode step's DeepEP
low-latency calls beside its own experts, as `SboFlags` arranges them per GPU generation."""

from __future__ import annotations

import pytest

from pdsim.config import parse_experiment
from pdsim.core.batch import BatchShape, extend_shape
from pdsim.planning.import_sglang import import_sglang
from pdsim.sim.cost import (
    EXPERT_DOWN_SHARE, Parallelism, make_cost_model, single_batch_overlap_s,
)
from pdsim.sim.silicon import tables
from pdsim.specs import load_hardware_spec, load_model_spec


def _sbo(n: int, on: bool = True) -> Parallelism:
    return Parallelism(tp=n, dp_attention=n, ep=n, moe_a2a="deepep", dp_lm_head=True,
                       single_batch_overlap=on)


def test_each_generation_overlaps_what_sglang_overlaps():
    d, c, s, r = 0.10, 0.20, 0.03, 0.30
    down = r * EXPERT_DOWN_SHARE
    h200 = load_hardware_spec("h200")  # 132 SMs, 3 of them send the combine
    compute, comm = single_batch_overlap_s(d, c, s, r, h200, "fp8")
    pace = 132 / 129
    assert compute == pytest.approx(r + s + down * (pace - 1))
    assert compute + comm == pytest.approx(max(d, s) + (r - down) + max(c, down * pace))
    b200 = load_hardware_spec("b200")  # 148 SMs, 32 of them send the combine
    pace = 148 / 116
    compute, comm = single_batch_overlap_s(d, c, s, r, b200, "nvfp4")
    assert compute + comm == pytest.approx(d + (r - down) + max(c, (down + s) * pace))
    compute, comm = single_batch_overlap_s(d, c, s, r, b200, "fp8")
    assert compute == pytest.approx(r + s * pace)
    assert compute + comm == pytest.approx(d + r + max(c, s * pace))
    # compute longer than the combine: nothing of it is exposed, the slowdown stays
    compute, comm = single_batch_overlap_s(d, 0.01, s, r, h200, "fp8")
    assert comm == pytest.approx(max(d, s) - s) and compute > r + s


def test_the_rules():
    with pytest.raises(ValueError, match="single_batch_overlap.*needs moe_a2a='deepep'"):
        Parallelism(tp=8, ep=8, single_batch_overlap=True)
    with pytest.raises(ValueError, match="one overlap.*choose one"):
        Parallelism(tp=8, ep=8, moe_a2a="deepep", two_batch_overlap=True,
                    single_batch_overlap=True)
    with pytest.raises(ValueError, match="cluster.decode.*single_batch_overlap.*needs moe_a2a"):
        parse_experiment({"name": "x", "cluster": {"decode": {
            "tp": 2, "ep": 2, "single_batch_overlap": True}}, "workload": {
            "num_requests": 1, "arrival": {"process": "poisson", "rate_rps": 1},
            "input_len": {"dist": "fixed", "value": 16},
            "output_len": {"dist": "fixed", "value": 4}}})


def test_sglangs_flag_imports():
    script = "\n".join([
        "python -m sglang.launch_server --model-path deepseek-v3 --tp-size 8 --dp-size 8 "
        "--enable-dp-attention --moe-a2a-backend deepep --enable-single-batch-overlap",
        "python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30000"])
    base = {"name": "base", "model": "deepseek-v3", "hardware": "h200", "workload": {
        "num_requests": 1, "arrival": {"process": "poisson", "rate_rps": 1},
        "input_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": 4}}}
    imported, _ = import_sglang(script, base)
    assert imported["cluster"]["colocated"]["single_batch_overlap"] is True
    assert parse_experiment(imported).cluster.colocated.single_batch_overlap


def _decode_and_prefill_s(cost_model: str, hardware: str, on: bool) -> tuple[dict, float]:
    model, hw = load_model_spec("deepseek-v3"), load_hardware_spec(hardware)
    decode = make_cost_model(cost_model, model, hw, _sbo(16, on), role="decode")
    prefill = make_cost_model(cost_model, model, hw, _sbo(16, on), role="prefill")
    steps = [BatchShape(decode_reqs=64, decode_context_tokens=64 * 2048)] * 16
    parts = decode.step_breakdown_s(steps)
    assert sum(parts.values()) == pytest.approx(decode.step_time_s(steps), rel=1e-12)
    return parts, prefill.step_time_s([extend_shape(2048)] * 16)


@pytest.mark.parametrize("cost_model", [
    "roofline",
    pytest.param("silicon", marks=[pytest.mark.slow, pytest.mark.skipif(
        tables.systems_dir() is None, reason="aiconfigurator-core not installed")])])
def test_decode_hides_communication_and_prefill_is_untouched(cost_model):
    """DeepSeek-V3, DEP16 on H200s, 64 requests a rank at 2,048 tokens: the overlap hides
    part of DeepEP's time, slows the down projection by the 3 SMs the combine holds, and
    leaves prefill (normal mode, no overlap) as it was."""
    off, prefill_off = _decode_and_prefill_s(cost_model, "h200", False)
    on, prefill_on = _decode_and_prefill_s(cost_model, "h200", True)
    assert on["moe_comm"] < 0.8 * off["moe_comm"]
    assert off["moe_experts"] < on["moe_experts"] < 1.02 * off["moe_experts"] + 1e-3
    assert sum(on.values()) < sum(off.values())
    assert prefill_on == prefill_off
