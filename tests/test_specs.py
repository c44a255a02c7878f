"""Model and hardware specs: presets match the published models, HF configs load, errors help."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdsim.specs import (
    HardwareSpec,
    ModelSpec,
    hardware_preset_names,
    load_hardware_spec,
    load_model_spec,
    model_preset,
    model_preset_names,
)
from pdsim.specs.precision import Precision

# Published total sizes: the HF model cards (8.03B, 70.6B, 32.8B) and DeepSeek-V3's README
# (671B main model, 37B activated; 36.6B of them outside the input embedding).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen3-32b": 32.8e9,
    "deepseek-v3": 671e9,
}

# The fields of each model's public config.json that the loader reads (plus some it ignores).
HF_CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "rope_theta": 500000.0, "max_position_embeddings": 131072,
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "vocab_size": 129280,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "weight_block_size": [128, 128]},
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_published_size(name: str) -> None:
    spec = load_model_spec(name)
    assert spec.num_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


def test_deepseek_v3_activates_about_37b_per_token() -> None:
    spec = model_preset("deepseek-v3")
    assert spec.active_params_per_token == pytest.approx(36.6e9, rel=0.02)
    assert spec.num_moe_layers == 58 and spec.num_dense_layers == 3
    # FP8 checkpoint: one byte per weight.
    assert spec.weight_bytes == pytest.approx(671e9, rel=0.02)


def test_dense_model_activates_everything_but_the_embedding() -> None:
    spec = model_preset("llama-3.1-8b")
    assert spec.num_params - spec.active_params_per_token == spec.embedding_params


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_saved_hf_config_loads_as_the_preset(tmp_path, name: str) -> None:
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    assert load_model_spec(model_dir) == model_preset(name)
    from_file = load_model_spec(str(model_dir / "config.json"))
    assert from_file == model_preset(name)


def test_hf_config_defaults_kv_heads_and_head_dim(tmp_path) -> None:
    config = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000,
        "head_dim": None, "torch_dtype": "float16",
    }
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(config))
    spec = load_model_spec(path)
    assert spec.name == "mini"
    assert (spec.num_kv_heads, spec.head_dim, spec.weight_dtype_bytes) == (8, 32, 2)


def test_unknown_model_name_lists_presets() -> None:
    with pytest.raises(ValueError) as err:
        load_model_spec("gpt-5")
    message = str(err.value)
    assert "'gpt-5'" in message
    for preset in model_preset_names():
        assert preset in message


def test_unsupported_architecture_is_named(tmp_path) -> None:
    config = dict(HF_CONFIGS["llama-3.1-8b"], architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_spec(tmp_path)


def test_config_missing_a_field_names_file_and_field(tmp_path) -> None:
    config = dict(HF_CONFIGS["llama-3.1-8b"])
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*vocab_size"):
        load_model_spec(tmp_path)


def test_kv_bytes_per_token_llama_8b() -> None:
    spec = model_preset("llama-3.1-8b")
    assert spec.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131072
    assert spec.kv_bytes_per_token(kv_dtype_bytes=1) == 65536
    # Heads split over TP until there are fewer heads than ranks; then each rank keeps one.
    assert spec.kv_heads_per_rank(2) == 4
    assert spec.kv_bytes_per_token_per_rank(2) == 65536
    assert spec.kv_heads_per_rank(16) == 1
    assert spec.kv_bytes_per_token_per_rank(16) == 32 * 2 * 1 * 128 * 2


def test_mla_latent_is_replicated_on_every_rank() -> None:
    spec = model_preset("deepseek-v3")
    per_token = 61 * (512 + 64) * 2
    assert spec.kv_bytes_per_token() == per_token
    assert spec.kv_bytes_per_token_per_rank(8) == per_token
    assert spec.kv_heads_per_rank(8) == 1


def test_weights_split_over_tp_add_up_to_the_model() -> None:
    spec = model_preset("llama-3.1-70b")
    norms = (spec.num_layers * spec.norm_params_per_layer + spec.hidden_size) * 2
    per_rank = spec.weight_bytes_per_rank(tp=8)
    # Everything but the (replicated) norms is sharded.
    assert 8 * per_rank - 7 * norms == pytest.approx(spec.weight_bytes, abs=8)


def test_dp_attention_replicates_attention_weights() -> None:
    spec = model_preset("deepseek-v3")
    plain = spec.weight_bytes_per_rank(tp=8, ep=8)
    dp = spec.weight_bytes_per_rank(tp=8, ep=8, dp_attention=8)
    extra = spec.num_layers * spec.attn_params_per_layer * (1 - 1 / 8) * spec.weight_dtype_bytes
    assert dp - plain == pytest.approx(extra, rel=1e-6)
    # Whole experts over ep or slices over tp: the same bytes per GPU.
    assert spec.weight_bytes_per_rank(tp=8, ep=1) == plain


def test_bad_parallel_sizes_are_rejected() -> None:
    spec = model_preset("llama-3.1-8b")
    with pytest.raises(ValueError, match="dp_attention=3"):
        spec.weight_bytes_per_rank(tp=4, dp_attention=3)
    with pytest.raises(ValueError, match="ep=2"):
        spec.weight_bytes_per_rank(tp=2, ep=2)  # dense model


def test_model_spec_is_strict_and_frozen() -> None:
    fields = dict(name="x", num_layers=1, hidden_size=8, num_attention_heads=2,
                  num_kv_heads=2, head_dim=4, intermediate_size=16, vocab_size=10)
    spec = ModelSpec(**fields)
    with pytest.raises(ValidationError):
        spec.num_layers = 2
    with pytest.raises(ValidationError, match="extra"):
        ModelSpec(**fields, rope_theta=1.0)
    with pytest.raises(ValidationError, match="kv_lora_rank"):
        ModelSpec(**fields | {"attention": "mla"})
    with pytest.raises(ValidationError, match="multiple of num_kv_heads"):
        ModelSpec(**fields | {"num_kv_heads": 3})
    with pytest.raises(ValidationError, match="moe_intermediate_size"):
        ModelSpec(**fields, num_experts=4, experts_per_token=2)


def test_tiny_presets_are_small() -> None:
    for name in ("tiny-llama", "tiny-mla"):
        spec = model_preset(name)
        assert spec.num_params < 2_000_000
    assert model_preset("tiny-mla").is_mla and model_preset("tiny-mla").is_moe


def test_hardware_presets_load_and_cite_sources() -> None:
    assert set(hardware_preset_names()) == {"a100", "h100", "h200", "h20", "b200"}
    for name in hardware_preset_names():
        hw = load_hardware_spec(name)
        assert hw.name == name
        assert "datasheet" in hw.source or "product brief" in hw.source
        if hw.fp8_tflops is not None:
            assert hw.fp8_tflops == pytest.approx(2 * hw.bf16_tflops, rel=0.01)
    # Same Hopper die, more and faster memory.
    h100, h200 = load_hardware_spec("h100"), load_hardware_spec("h200")
    assert h200.bf16_tflops == h100.bf16_tflops and h200.hbm_gbps > h100.hbm_gbps


def test_unknown_hardware_lists_presets() -> None:
    with pytest.raises(ValueError) as err:
        load_hardware_spec("tpu-v5")
    assert "'tpu-v5'" in str(err.value)
    for preset in hardware_preset_names():
        assert preset in str(err.value)


def test_hardware_from_yaml_and_dict(tmp_path) -> None:
    path = tmp_path / "l40s.yaml"
    path.write_text(
        "bf16_tflops: 362\nhbm_gib: 48\nhbm_gbps: 864\nnvlink_gbps: 32\nrdma_gbps: 25\n"
        "source: my notes\n"
    )
    hw = load_hardware_spec(path)
    assert isinstance(hw, HardwareSpec) and hw.name == "l40s" and hw.fp8_tflops is None
    assert load_hardware_spec(hw.model_dump()) == hw
    path.write_text("bf16_tflops: -1\nhbm_gib: 48\nhbm_gbps: 864\nnvlink_gbps: 32\n"
                    "rdma_gbps: 25\nclock_mhz: 2000\n")
    with pytest.raises(ValueError) as err:
        load_hardware_spec(path)
    message = str(err.value)
    assert str(path) in message and "bf16_tflops" in message and "clock_mhz" in message


def test_weight_dtype_bytes_still_sets_one_format_for_every_block() -> None:
    fields = model_preset("llama-3.1-8b").model_dump(exclude={"precision"})
    fp8 = ModelSpec(**fields, weight_dtype_bytes=1)
    assert fp8.precision == Precision(
        attention="fp8", dense_mlp="fp8", moe_experts="fp8", lm_head="fp8"
    )
    assert ModelSpec(**fields, weight_dtype_bytes=0.5).precision.moe_experts == "w4a16"
    norms = fp8.num_layers * fp8.norm_params_per_layer + fp8.hidden_size
    assert fp8.weight_bytes == (fp8.num_params - norms) + 2 * norms  # norms stay BF16
    with pytest.raises(ValidationError, match="weight_dtype_bytes 3"):
        ModelSpec(**fields, weight_dtype_bytes=3)
    with pytest.raises(ValidationError, match="not both"):
        ModelSpec(**fields, weight_dtype_bytes=1, precision=Precision())


def test_weight_bytes_count_each_block_in_its_format() -> None:
    spec = model_preset("deepseek-v3")
    assert spec.precision == Precision(attention="fp8", dense_mlp="fp8", moe_experts="fp8")
    vocab = spec.embedding_params + spec.lm_head_params
    bf16 = vocab + spec.num_layers * spec.norm_params_per_layer + spec.hidden_size
    bf16 += spec.num_moe_layers * spec.router_params
    assert spec.weight_bytes == spec.num_params + bf16  # 1 B per FP8 weight, 2 B for BF16
    nvfp4 = spec.model_copy(update={"precision": Precision(attention="bf16", moe_experts="nvfp4")})
    experts = spec.num_moe_layers * (spec.num_experts + 1) * spec.expert_params
    saved = experts * (1 - (0.5 + 1 / 16))
    added = spec.num_layers * spec.attn_params_per_layer  # attention back to BF16
    added += spec.num_dense_layers * spec.dense_mlp_params
    assert nvfp4.weight_bytes == pytest.approx(spec.weight_bytes - saved + added, abs=2)
