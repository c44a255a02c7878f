"""Model and hardware specs: presets match the published models, HF configs load, errors help."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from pdsim.config import ConfigError
from pdsim.specs import (
    HardwareSpec,
    ModelSpec,
    hardware_preset_names,
    load_hardware_spec,
    load_model_spec,
    model_preset,
    model_preset_names,
    model_spec_from_hf_config,
)
from pdsim.specs.precision import DTYPES, Precision, gemm_peak_tflops

# Published total sizes: the HF model cards (8.03B, 70.6B, 32.8B), DeepSeek-V3's README
# (671B main model, 37B activated; 36.6B of them outside the input embedding),
# Kimi-K2's technical report (1.04T), the Qwen3 and Qwen2.5 model cards (235B, 30.5B, 7.61B,
# 72.7B).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen3-32b": 32.8e9,
    "deepseek-v3": 671e9,
    "kimi-k2": 1.04e12,
    "qwen3-235b-a22b": 235e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
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
        "max_position_embeddings": 131072, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-32b": {
        "max_position_embeddings": 40960, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None,
    },
    "deepseek-v3": {
        "max_position_embeddings": 163840, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
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
    "kimi-k2": {
        "max_position_embeddings": 131072, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "vocab_size": 163840, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    "qwen3-235b-a22b": {
        "max_position_embeddings": 40960, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_attention_heads": 64, "num_key_value_heads": 4, "num_hidden_layers": 94,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-72b": {
        "max_position_embeddings": 32768, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
        "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "vocab_size": 152064, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False,
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


@pytest.mark.parametrize("alias, base", [("deepseek-r1", "deepseek-v3"),
                                         ("deepseek-v3.1", "deepseek-v3"),
                                         ("llama-3.3-70b", "llama-3.1-70b")])
def test_a_checkpoint_of_a_presets_architecture_is_that_preset_renamed(alias, base) -> None:
    spec = load_model_spec(alias)
    assert spec.name == alias and alias in model_preset_names()
    assert spec.model_copy(update={"name": base}) == model_preset(base)


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


HARDWARE_PRESETS = {
    "a10", "a100", "l40s", "h100", "h800", "h200", "h20", "h20-141g", "b200", "b300", "gb200",
    "gb300",
}


def test_hardware_presets_load_and_cite_sources() -> None:
    assert set(hardware_preset_names()) == HARDWARE_PRESETS
    for name in hardware_preset_names():
        hw = load_hardware_spec(name)
        assert hw.name == name
        assert "datasheet" in hw.source or "product brief" in hw.source
        if hw.fp8_tflops is not None:  # FP8 doubles BF16 on every GPU that has it
            assert hw.fp8_tflops == pytest.approx(2 * hw.bf16_tflops, rel=0.02)
        if hw.fp4_tflops is not None:  # and FP4 doubles FP8 or more (Blackwell Ultra: 3x)
            assert 2 * hw.fp8_tflops <= hw.fp4_tflops <= 3 * hw.fp8_tflops
        # A price says whose and when; a missing one says so.
        assert hw.price_source
        assert (hw.usd_per_gpu_hour is None) == hw.price_source.startswith("no public")
        assert hw.usd_per_gpu_hour is None or 0.2 < hw.usd_per_gpu_hour < 20
    # Same Hopper die, more and faster memory.
    h100, h200 = load_hardware_spec("h100"), load_hardware_spec("h200")
    assert h200.bf16_tflops == h100.bf16_tflops and h200.hbm_gb_per_s > h100.hbm_gb_per_s


def test_new_hardware_presets_match_their_datasheets() -> None:
    hw = {name: load_hardware_spec(name) for name in HARDWARE_PRESETS}
    # H800: the H100's compute with NVLink cut to 400 GB/s both ways.
    assert hw["h800"].bf16_tflops == hw["h100"].bf16_tflops and hw["h800"].nvlink_gb_per_s == 200
    # H20 in two memory sizes, the same compute.
    assert (hw["h20"].hbm_gib, hw["h20-141g"].hbm_gib) == (96, 141)
    # Memory is the driver's total, which SGLang's mem_fraction_static is a share of: GDDR6
    # with ECC on keeps 1/16 (A10 23,028 MiB, L40S 46,068 MiB), and Blackwell Ultra's "288GB"
    # is 275,040 MiB (B300) and 284,208 MiB (GB300) in nvidia-smi (aiconfigurator-core 0.12).
    assert {n: hw[n].hbm_gib for n in ("a10", "l40s", "b300", "gb300")} == {
        "a10": 22.49, "l40s": 44.99, "b300": 268.6, "gb300": 277.5}
    assert hw["h20-141g"].fp8_tflops == hw["h20"].fp8_tflops
    # Blackwell: FP4 peaks; the NVL72 racks are one 72-GPU NVLink domain, HGX boards 8.
    assert {n for n, h in hw.items() if h.fp4_tflops} == {"b200", "b300", "gb200", "gb300"}
    assert {n for n, h in hw.items() if h.gpus_per_node == 72} == {"gb200", "gb300"}
    assert hw["gb300"].fp4_tflops == 15000 and hw["b200"].fp4_tflops == 9000
    # PCIe cards without FP8 tensor cores (A10) refuse FP8 weights.
    assert hw["a10"].fp8_tflops is None and hw["l40s"].fp8_tflops == 733
    with pytest.raises(ValueError, match="a10 lacks"):
        gemm_peak_tflops("fp8", hw["a10"])
    assert gemm_peak_tflops("nvfp4", hw["gb200"]) == 10000
    # W8A8 int8 runs on the INT8 peak: FP8's on Hopper, Ada and B200/GB200, its own on Ampere
    # (which has no FP8) and on Blackwell Ultra, which cut INT8 (B300 307, GB300 ~330 TOPS with
    # sparsity; aiconfigurator-core 0.12's system files).
    assert {n: gemm_peak_tflops("int8", hw[n]) for n in
            ("a10", "a100", "l40s", "h100", "b200", "b300", "gb300")} == {
        "a10": 250, "a100": 624, "l40s": 733, "h100": 1979, "b200": 4500, "b300": 153.5,
        "gb300": 165}


def test_unknown_hardware_lists_presets() -> None:
    with pytest.raises(ValueError) as err:
        load_hardware_spec("tpu-v5")
    assert "'tpu-v5'" in str(err.value)
    for preset in hardware_preset_names():
        assert preset in str(err.value)


def test_hardware_from_yaml_and_dict(tmp_path) -> None:
    path = tmp_path / "l40s.yaml"
    path.write_text(
        "bf16_tflops: 362\nhbm_gib: 48\nhbm_gb_per_s: 864\nnvlink_gb_per_s: 32\nrdma_gb_per_s: 25\n"
        "source: my notes\n"
    )
    hw = load_hardware_spec(path)
    assert isinstance(hw, HardwareSpec) and hw.name == "l40s" and hw.fp8_tflops is None
    assert load_hardware_spec(hw.model_dump()) == hw
    path.write_text("bf16_tflops: -1\nhbm_gib: 48\nhbm_gb_per_s: 864\nnvlink_gb_per_s: 32\n"
                    "rdma_gb_per_s: 25\nclock_mhz: 2000\n")
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


def test_moe_presets_activate_their_published_share() -> None:
    # "A22B" / "A3B" / Kimi's 32.6B count the input embedding as activated.
    for name, active in [("qwen3-235b-a22b", 22e9), ("qwen3-30b-a3b", 3.3e9),
                         ("kimi-k2", 32.6e9)]:
        spec = model_preset(name)
        assert spec.active_params_per_token + spec.embedding_params == pytest.approx(
            active, rel=0.03
        )
    qwen = model_preset("qwen3-235b-a22b")
    assert (qwen.num_shared_experts, qwen.num_dense_layers) == (0, 0)
    kimi = model_preset("kimi-k2")
    assert (kimi.num_experts, kimi.num_dense_layers, kimi.precision.moe_experts) == (
        384, 1, "fp8"
    )


@pytest.mark.parametrize(
    ("model", "hardware", "tp"),
    [("kimi-k2", "h200", 16), ("kimi-k2", "gb200", 8), ("deepseek-v3", "h20-141g", 8),
     ("qwen3-235b-a22b", "h100", 8), ("qwen3-30b-a3b", "l40s", 2), ("qwen2.5-72b", "h800", 4),
     ("qwen2.5-7b", "a10", 1)],
)
def test_new_presets_fit_where_they_are_deployed(model: str, hardware: str, tp: int) -> None:
    spec, hw = model_preset(model), load_hardware_spec(hardware)
    ep = tp if spec.is_moe else 1
    per_rank = spec.weight_bytes_per_rank(tp=tp, ep=ep)
    assert 0.1 * hw.hbm_bytes < per_rank < 0.9 * hw.hbm_bytes


# Public config.json fields of MoE architectures with no preset, and their published sizes in
# billions: total, and activated per token (Mixtral's and Qwen's count the input embedding).
MOE_CHECKPOINTS = {
    "glm-4.5": ({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "first_k_dense_replace": 3, "n_routed_experts": 160, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "num_attention_heads": 96, "num_key_value_heads": 8,
        "num_hidden_layers": 92, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
        "use_qk_norm": True, "vocab_size": 151552, "tie_word_embeddings": False,
    }, 355, 32, False),
    "mixtral-8x7b": ({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "sliding_window": None, "tie_word_embeddings": False,
    }, 46.7, 12.9, True),
    "minimax-m2": ({
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "hidden_size": 3072, "intermediate_size": 1536, "head_dim": 128,
        "num_attention_heads": 48, "num_key_value_heads": 8, "num_hidden_layers": 62,
        "num_local_experts": 256, "num_experts_per_tok": 8, "vocab_size": 200064,
        "tie_word_embeddings": False,
    }, 230, 10, False),
    "qwen1.5-moe-a2.7b": ({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60,
        "num_experts_per_tok": 4, "decoder_sparse_step": 1, "vocab_size": 151936,
        "tie_word_embeddings": False,
    }, 14.3, 2.7, True),
}


@pytest.mark.parametrize("name", sorted(MOE_CHECKPOINTS))
def test_moe_checkpoints_without_a_preset_load_at_their_published_size(name: str) -> None:
    config, total, active, with_embedding = MOE_CHECKPOINTS[name]
    spec = model_spec_from_hf_config(config, name=name)
    assert spec.attention == "gqa" and spec.is_moe
    assert spec.num_params / 1e9 == pytest.approx(total, rel=0.02)
    counted = spec.active_params_per_token + with_embedding * spec.embedding_params
    assert counted / 1e9 == pytest.approx(active, rel=0.05)


def test_glm_moe_reads_deepseeks_dense_layers_and_shared_expert() -> None:
    spec = model_spec_from_hf_config(MOE_CHECKPOINTS["glm-4.5"][0], name="glm-4.5")
    assert (spec.num_dense_layers, spec.num_moe_layers, spec.num_shared_experts,
            spec.num_kv_heads, spec.head_dim) == (3, 89, 1, 8, 128)


@pytest.mark.parametrize(("wrapper", "text"), [("KimiK25ForConditionalGeneration", "kimi-k2"),
                                               ("Qwen3VLMoeForConditionalGeneration",
                                                "qwen3-235b-a22b")])
def test_a_vision_language_checkpoint_reads_as_its_text_model(wrapper: str, text: str) -> None:
    """Kimi-K2.5's and Qwen3-VL's config.json nest their text model under `text_config` (its
    quantization at the top level); the spec is that text model's."""
    inner = {k: v for k, v in HF_CONFIGS[text].items()
             if k not in ("architectures", "quantization_config")}
    outer = {k: v for k, v in HF_CONFIGS[text].items() if k == "quantization_config"}
    config = {"architectures": [wrapper], "model_type": "vl", "text_config": inner,
              "vision_config": {"depth": 27, "hidden_size": 1152}, **outer}
    assert model_spec_from_hf_config(config, name=text) == model_spec_from_hf_config(
        HF_CONFIGS[text], name=text)
    with pytest.raises(ValueError, match="text_config"):
        model_spec_from_hf_config({"architectures": [wrapper]}, name=text)


def test_qwen_moe_interleaved_dense_layers_are_counted() -> None:
    config = dict(HF_CONFIGS["qwen3-235b-a22b"], num_hidden_layers=8, decoder_sparse_step=2,
                  mlp_only_layers=[1])
    spec = model_spec_from_hf_config(config, name="x")
    # MoE layers: i + 1 a multiple of 2 -> 1, 3, 5, 7; layer 1 is MLP-only -> 3 MoE, 5 dense.
    assert (spec.num_moe_layers, spec.num_dense_layers) == (3, 5)
    shared = dict(config, shared_expert_intermediate_size=3 * 1536)
    assert model_spec_from_hf_config(shared, name="x").num_shared_experts == 3
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        model_spec_from_hf_config(dict(config, shared_expert_intermediate_size=1000), name="x")


def _with_quant(name: str, quant: dict, **extra) -> ModelSpec:
    return model_spec_from_hf_config(
        dict(HF_CONFIGS[name], quantization_config=quant, **extra), name=name
    )


def test_nvfp4_checkpoints_price_at_the_fp4_peak() -> None:
    modelopt = _with_quant("deepseek-v3", {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
        "group_size": 16, "exclude_modules": ["lm_head", "model.layers.*.self_attn*"],
    })
    assert modelopt.precision == Precision(
        attention="bf16", dense_mlp="nvfp4", moe_experts="nvfp4", lm_head="bf16"
    )
    assert gemm_peak_tflops(modelopt.precision.moe_experts, load_hardware_spec("b200")) == 9000
    with pytest.raises(ValueError, match="FP4 tensor cores, which h100 lacks"):
        gemm_peak_tflops(modelopt.precision.moe_experts, load_hardware_spec("h100"))
    compressed = _with_quant("qwen3-235b-a22b", {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16},
            "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
        }},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    })
    assert compressed.precision == Precision(
        attention="nvfp4", dense_mlp="nvfp4", moe_experts="nvfp4", lm_head="bf16"
    )
    # Expert weights at 4 bits plus one FP8 scale per 16: 0.5625 B each.
    experts = compressed.num_moe_layers * compressed.num_experts * compressed.expert_params
    bf16 = model_preset("qwen3-235b-a22b")
    saved = experts * (2 - 0.5625)
    assert bf16.weight_bytes - compressed.weight_bytes == pytest.approx(
        saved + compressed.num_layers * compressed.attn_params_per_layer * (2 - 0.5625), rel=1e-9
    )


def test_modelopt_hf_quant_config_beside_config_json_is_read(tmp_path) -> None:
    config = dict(HF_CONFIGS["deepseek-v3"])
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                         "group_size": 16, "exclude_modules": ["lm_head"]},
    }))
    assert load_model_spec(tmp_path).precision == Precision(
        attention="nvfp4", dense_mlp="nvfp4", moe_experts="nvfp4"
    )


def test_gptq_and_awq_int4_are_w4a16_not_fp8() -> None:
    gptq = _with_quant("qwen2.5-72b", {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                        "desc_act": False}, torch_dtype="float16")
    awq = _with_quant("qwen2.5-72b", {"quant_method": "awq", "bits": 4, "group_size": 128,
                                       "version": "gemm", "zero_point": True})
    for spec in (gptq, awq):
        assert (spec.precision.attention, spec.precision.dense_mlp) == ("w4a16", "w4a16")
        # Dequantised to 16 bits inside the GEMM: the BF16 peak, a quarter of the bytes.
        assert gemm_peak_tflops(spec.precision.dense_mlp, load_hardware_spec("h100")) == 989
        assert spec.weight_bytes < 0.3 * model_preset("qwen2.5-72b").weight_bytes
    assert gptq.precision.lm_head == "fp16" and awq.precision.lm_head == "bf16"
    with pytest.raises(ValueError, match="gptq with 8 bits"):
        _with_quant("qwen2.5-72b", {"quant_method": "gptq", "bits": 8})


def test_int4_group_32_carries_a_bf16_scale_per_32_weights() -> None:
    # Kimi-K2-Thinking: compressed-tensors int4, group 32, symmetric -> one BF16 scale a group
    group = {"targets": ["Linear"], "input_activations": None,
             "weights": {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group",
                         "symmetric": True}}
    g32 = _with_quant("kimi-k2", {"quant_method": "compressed-tensors",
                                  "config_groups": {"group_0": group}})
    assert g32.precision.moe_experts == "w4a16_g32"
    assert DTYPES["w4a16_g32"].weight_bytes == pytest.approx(0.5625)
    g128 = _with_quant("kimi-k2", {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {**group, "weights": {**group["weights"], "group_size": 128}}}})
    assert g128.precision.moe_experts == "w4a16"
    # 1.01 T routed-expert weights: group 32's scales hold 47 GB more than group 128's
    extra = g32.weight_bytes - g128.weight_bytes
    assert 45e9 < extra < 50e9
    gptq = _with_quant("qwen2.5-72b", {"quant_method": "gptq", "bits": 4, "group_size": 32})
    assert gptq.precision.dense_mlp == "w4a16_g32"
    # Blackwell's int4_wo MoE rows are SGLang's trtllm-gen MxInt4 kernel: group 32 only
    from pdsim.sim.silicon.ops import _moe_table_format
    assert _moe_table_format("int4_wo", load_hardware_spec("gb200")) == "w4a16_g32"
    assert _moe_table_format("int4_wo", load_hardware_spec("h200")) == "w4a16"  # Marlin
    thinking = model_preset("kimi-k2-thinking")
    assert thinking.precision == Precision(moe_experts="w4a16_g32")
    assert (thinking.num_experts, thinking.num_attention_heads) == (384, 64)


def test_ignored_modules_keep_their_blocks_in_the_checkpoint_dtype() -> None:
    # Kimi-K2-Thinking style: int4 routed experts; attention, shared experts, dense MLP BF16.
    spec = _with_quant("kimi-k2", {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group"},
        }},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    })
    assert spec.precision == Precision(
        attention="bf16", dense_mlp="bf16", moe_experts="w4a16_g32", lm_head="bf16"
    )
    fp8 = _with_quant("qwen2.5-72b", {
        "quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
    })
    assert fp8.precision == Precision.uniform("fp8_tensor")  # no weight_block_size


def test_fp8_checkpoints_say_whether_their_scales_are_blocks() -> None:
    """SGLang runs 128x128 block-scaled FP8 on DeepGEMM and per-tensor or per-channel FP8 on
    CUTLASS's fp8_scaled_mm, which the kernel tables time apart."""
    block = _with_quant("qwen2.5-72b", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert block.precision == Precision.uniform("fp8")
    modelopt = _with_quant("llama-3.1-70b", {"quant_method": "modelopt", "quant_algo": "FP8"})
    assert modelopt.precision.attention == "fp8_tensor"
    for strategy, dtype in (("channel", "fp8_tensor"), ("tensor", "fp8_tensor"),
                            ("block", "fp8")):
        ct = _with_quant("llama-3.1-70b", {"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                        "input_activations": {"num_bits": 8, "type": "float"}}}})
        assert ct.precision.dense_mlp == dtype, strategy


def test_unknown_quantization_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError) as err:
        _with_quant("llama-3.1-8b", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    message = str(err.value)
    assert "'bitsandbytes'" in message and "gptq / awq" in message and "modelopt" in message
    with pytest.raises(ValueError, match="modelopt quant_algo 'W4A8_AWQ'"):
        _with_quant("llama-3.1-8b", {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"})
    with pytest.raises(ValueError, match="int W8A16"):
        _with_quant("llama-3.1-8b", {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"num_bits": 8, "type": "int"}}}})


def test_inline_specs_start_from_a_base_and_override_fields() -> None:
    hw = load_hardware_spec({"base": "h100", "hbm_gib": 94, "usd_per_gpu_hour": 2.0})
    assert (hw.name, hw.hbm_gib, hw.bf16_tflops, hw.usd_per_gpu_hour) == ("h100", 94, 989, 2.0)
    assert "overridden: hbm_gib, usd_per_gpu_hour" in hw.source
    model = load_model_spec({"base": "deepseek-v3", "name": "ds-fp4",
                             "precision": {"moe_experts": "nvfp4"}})
    assert model.name == "ds-fp4" and model.num_experts == 256
    assert model.precision == Precision(attention="fp8", dense_mlp="fp8", moe_experts="nvfp4")
    # weight_dtype_bytes over a base replaces the base's per-block precision.
    assert load_model_spec({"base": "deepseek-v3", "weight_dtype_bytes": 2}).weight_bytes == (
        2 * model_preset("deepseek-v3").num_params
    )
    plain = model_preset("tiny-llama").model_dump()
    assert load_model_spec(plain) == model_preset("tiny-llama")
    with pytest.raises(ValueError) as err:
        load_model_spec({"base": "llama-3.1-8b", "num_layer": 4})
    assert "model: num_layer" in str(err.value) and "base, name" in str(err.value)
    # an unknown key inside a nested block names that block's keys
    with pytest.raises(ValueError) as err:
        load_model_spec({"base": "qwen3-235b-a22b", "precision": {"mlp": "fp8"}})
    assert ("precision.mlp: Extra inputs are not permitted (got 'fp8') (allowed in precision: "
            "attention, dense_mlp, moe_experts, lm_head, attention_compute)") in str(err.value)


def test_spec_paths_resolve_against_the_experiment_folder(tmp_path, monkeypatch) -> None:
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "gpu.yaml").write_text("base: h20\nhbm_gib: 141\n")
    (exp / "ckpt").mkdir()
    (exp / "ckpt" / "config.json").write_text(json.dumps(HF_CONFIGS["qwen2.5-72b"]))
    (exp / "small.yaml").write_text("base: ckpt\nnum_layers: 40\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    hw = load_hardware_spec("gpu.yaml", base_dir=exp)
    assert (hw.name, hw.hbm_gib) == ("h20", 141)
    assert load_model_spec("ckpt", base_dir=exp) == model_preset("qwen2.5-72b").model_copy(
        update={"name": "ckpt"}
    )
    assert load_model_spec("small.yaml", base_dir=exp).num_layers == 40  # base: beside it
    with pytest.raises(ValueError) as err:
        load_hardware_spec("gpu.yaml")  # not beside the current directory
    with pytest.raises(ValueError) as err:
        load_model_spec("missing.json", base_dir=exp)
    message = str(err.value)
    assert str(exp / "missing.json") in message and str(elsewhere / "missing.json") in message
    assert "qwen3-235b-a22b" in message


# ----- the experiment YAML: inline specs, paths beside it, KV dtype per role ------------------

EXPERIMENT = {
    "name": "x",
    "workload": {"num_requests": 4, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                 "input_len": {"dist": "fixed", "value": 100},
                 "output_len": {"dist": "fixed", "value": 10}},
}


@pytest.mark.slow
def test_experiment_takes_inline_model_and_hardware() -> None:
    from pdsim.config import parse_experiment
    from pdsim.sim.build import build_cluster

    small_gpu = {"base": "h100", "hbm_gib": 40}
    cfg = parse_experiment({**EXPERIMENT, "model": {"base": "llama-3.1-8b", "num_layers": 8},
                            "hardware": small_gpu})
    cluster = build_cluster(cfg)
    big = build_cluster(parse_experiment({**EXPERIMENT, "model": {"base": "llama-3.1-8b",
                                                                  "num_layers": 8}}))
    # Half the memory, a quarter of the layers: more KV pages than the full model on 80 GB.
    assert cluster.decode.scheduler.num_pages < big.decode.scheduler.num_pages
    full = build_cluster(parse_experiment(EXPERIMENT))
    assert cluster.decode.kv_bytes_per_page == full.decode.kv_bytes_per_page / 4
    with pytest.raises(ConfigError, match="hardware: hbm_gb"):
        build_cluster(parse_experiment({**EXPERIMENT, "hardware": {"base": "h100",
                                                                   "hbm_gb": 40}}))


@pytest.mark.slow
def test_experiment_paths_resolve_beside_the_yaml(tmp_path, monkeypatch) -> None:
    from pdsim.runner import run_experiment

    exp = tmp_path / "exp"
    (exp / "specs").mkdir(parents=True)
    (exp / "specs" / "gpu.yaml").write_text("base: h100\nhbm_gib: 94\n")
    data = {**EXPERIMENT, "model": "tiny-llama", "hardware": "specs/gpu.yaml"}
    (exp / "e.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    summary, _ = run_experiment(exp / "e.yaml", tmp_path / "out", jobs=1, progress=False)
    assert len(summary) == 1
    (exp / "e.yaml").write_text(yaml.safe_dump({**data, "hardware": "specs/gpu2.yaml"}))
    with pytest.raises(ConfigError) as err:
        run_experiment(exp / "e.yaml", tmp_path / "out2", jobs=1, progress=False)
    message = str(err.value)
    assert str(exp / "specs" / "gpu2.yaml") in message
    assert str(tmp_path / "specs" / "gpu2.yaml") in message and "gb300" in message


def test_kv_dtype_per_role_sizes_pool_and_wire() -> None:
    from pdsim.config import parse_experiment
    from pdsim.sim.build import build_cluster

    def cluster(prefill: dict, decode: dict, **top):
        data = {**EXPERIMENT, **top, "cluster": {"prefill": prefill, "decode": decode}}
        return build_cluster(parse_experiment(data))

    bf16 = cluster({}, {})
    fp8 = cluster({"kv_dtype": "fp8"}, {"kv_dtype": "fp8_e4m3"})
    assert fp8.decode.kv_bytes_per_page == bf16.decode.kv_bytes_per_page / 2
    assert fp8.decode.scheduler.num_pages == pytest.approx(2 * bf16.decode.scheduler.num_pages,
                                                           abs=1)
    # The experiment-level default still works, and a role's own dtype wins over it.
    assert cluster({}, {}, kv_dtype_bytes=1).decode.kv_bytes_per_page == (
        fp8.decode.kv_bytes_per_page
    )
    own = cluster({"kv_dtype": "bf16"}, {"kv_dtype": "bf16"}, kv_dtype_bytes=1)
    assert own.decode.kv_bytes_per_page == bf16.decode.kv_bytes_per_page
    with pytest.raises(ConfigError, match=r"prefill.kv_dtype fp8 \(1 B\).*byte for byte"):
        cluster({"kv_dtype": "fp8"}, {})
    with pytest.raises(ConfigError, match="fp8_e4m3.*fp8_e5m2"):
        cluster({"kv_dtype": "fp8_e4m3"}, {"kv_dtype": "fp8_e5m2"})
    with pytest.raises(ConfigError, match="kv_dtype"):
        cluster({"kv_dtype": "int4"}, {})


def test_presets_command_lists_every_preset_with_its_figures() -> None:
    from typer.testing import CliRunner

    from pdsim.cli import app

    result = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in [*model_preset_names(), *hardware_preset_names()]:
        assert name in result.output
    gb300 = next(line for line in result.output.splitlines() if " gb300 " in line)
    assert "15000" in gb300 and "72" in gb300
    kimi = next(line for line in result.output.splitlines() if " kimi-k2 " in line)
    assert "experts fp8" in kimi and "head bf16" in kimi
