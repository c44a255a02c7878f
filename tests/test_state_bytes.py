"""A linear-attention layer's recurrent state as the simulator prices it and as the real backend
keeps it: for the served tiny-hybrid both sides count the same bytes per request and rank (the
real figure read off the real `RecurrentState`), while the public presets keep SGLang's state
dtypes (SSM state float32, convolution state bfloat16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdsim.specs.models import load_model_spec, model_preset, model_spec_from_hf_config
from pdsim.specs.servable import SERVABLE_HF_CONFIGS
from pdsim.validation.validate import load_experiment_for, state_check
from runtime.model import ModelConfig
from runtime.model.hybrid import RecurrentState

pytestmark = [pytest.mark.real]

REPO = Path(__file__).resolve().parents[1]
HYBRID = ModelConfig.preset("tiny-hybrid")


def real_slot_bytes(config: ModelConfig, tp: int) -> int:
    return RecurrentState(config, num_slots=1, tp_size=tp).slot_bytes()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_simulated_state_is_what_a_real_slot_holds(tp):
    real = real_slot_bytes(HYBRID, tp)
    assert load_model_spec("tiny-hybrid").recurrent_state_bytes_per_request_per_rank(tp) == real
    # a checkpoint the real backend saves reads back the same
    saved = model_spec_from_hf_config(HYBRID.to_hf_config(), "saved")
    assert saved.recurrent_state_bytes_per_request_per_rank(tp) == real


def test_the_hybrid_deployment_prices_the_state_the_real_workers_move():
    calibration = REPO / "experiments" / "validation" / "calibration" / "pd_hybrid.yaml"
    exp = load_experiment_for(REPO / "experiments" / "real_pd_hybrid.yaml", calibration)
    window = load_model_spec("tiny-hybrid").swa_window_bytes_per_request_per_rank(
        1, exp.sim_cfg.kv_dtype_bytes)
    for role in (exp.cluster.prefill, exp.cluster.decode):
        assert role.state_bytes_per_request - window == real_slot_bytes(HYBRID, 1)


def test_validate_compares_the_state_each_worker_holds():
    calibration = REPO / "experiments" / "validation" / "calibration" / "pd_hybrid.yaml"
    exp = load_experiment_for(REPO / "experiments" / "real_pd_hybrid.yaml", calibration)
    real = real_slot_bytes(HYBRID, 1)
    same = state_check(exp, {"prefill 0": real, "decode 0": real})
    assert same == (f"recurrent state per request per rank (equal): prefill 0: real {real:,} B, "
                    f"sim {real:,} B; decode 0: real {real:,} B, sim {real:,} B")
    assert "(they differ)" in state_check(exp, {"prefill 0": real, "decode 0": real - 4})
    assert state_check(exp, {}) == ""  # no workers to ask (an endpoint given by URL)


def test_public_presets_keep_sglangs_state_dtypes():
    spec = model_preset("qwen3-next-80b-a3b")
    assert (spec.recurrent_state_dtype_bytes, spec.conv_state_dtype_bytes) == (4, 2)
    # a float32 convolution state adds 2 bytes per convolution element, nothing else
    wide = spec.model_copy(update={"conv_state_dtype_bytes": 4})
    conv_elems = spec.linear_conv_dim * (spec.linear_conv_kernel_dim - 1)
    assert (wide.recurrent_state_bytes_per_layer_per_rank(1)
            - spec.recurrent_state_bytes_per_layer_per_rank(1)) == 2 * conv_elems


def test_state_dtypes_come_from_the_config():
    hf = dict(SERVABLE_HF_CONFIGS["tiny-hybrid"])
    assert load_model_spec("tiny-hybrid").conv_state_dtype_bytes == 4
    del hf["mamba_conv_dtype"], hf["mamba_ssm_dtype"]
    default = model_spec_from_hf_config(hf, "defaults")
    assert (default.recurrent_state_dtype_bytes, default.conv_state_dtype_bytes) == (4, 2)
    with pytest.raises(ValueError, match=r"mamba_conv_dtype 'fp8'; known: float32, bfloat16"):
        model_spec_from_hf_config({**hf, "mamba_conv_dtype": "fp8"}, "bad")


def test_the_real_backend_refuses_a_state_it_does_not_keep():
    hf = {**SERVABLE_HF_CONFIGS["tiny-hybrid"], "mamba_conv_dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"mamba_conv_dtype='bfloat16'; allowed: 'float32'"):
        ModelConfig.from_hf_config(hf)
