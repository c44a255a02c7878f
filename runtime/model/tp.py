"""Tensor parallelism added to a built model from outside, gpt-fast style: `apply_tp(model, group)`.

Every rank builds the same full model (same seed or checkpoint); `apply_tp` then keeps only this
rank's slice of each split weight, rewrites the attention modules' head counts (the model reads
them from those attributes) and adds one all-reduce after each attention and each MLP/MoE block.
With tp ranks, rank r:

- GQA attention: q/k/v column-parallel by heads, o_proj row-parallel. Rank r holds query heads
  `[r*H/tp, (r+1)*H/tp)` and the KV heads `kv_head_range` gives: `KVH/tp` of them when
  tp <= KVH; when tp > KVH one head, *replicated* on tp/KVH neighbouring ranks (rank r holds head
  `r // (tp/KVH)`, the one its query heads read), as SGLang does. So a rank's cache holds
  `max(1, KVH // tp)` heads, which is what `PagedKVCache.for_model(config, tp_size=tp)` allocates.
- MLA attention: q_a_proj / q_a_layernorm and kv_a_proj_with_mqa / kv_a_layernorm are replicated,
  so every rank computes and caches the same full latent; q_b_proj (or q_proj), kv_b_proj and
  o_proj are split by heads.
- Linear-attention layers (hybrid models): split by heads, like GQA: qkv_proj, conv_weight and
  gate_proj keep this rank's `linear_num_heads / tp` heads, o_proj is row-parallel; each rank's
  recurrent state holds its heads (`RecurrentState(tp_size=tp)`).
- Dense MLP and every MoE expert, shared experts too: gate/up column-parallel and down row-parallel
  along the intermediate dim; the router is replicated, so every rank routes alike and one
  all-reduce after the whole MoE block sums the partial outputs.
- Embeddings, norms and lm_head are replicated (the simplest choice): every rank computes the full
  logits, identical on every rank because all-reduce hands every rank the same bits.

Row-parallel projections have no bias in the supported models (it would be added tp times).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed import TPGroup
from runtime.model.config import ModelConfig
from runtime.model.hybrid import GatedLinearRecurrence
from runtime.model.layers import GatedMLP, MoE
from runtime.model.llama import GQAAttention
from runtime.model.mla import MLAAttention
from runtime.model.model import CausalLM


def check_tp(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError, naming the field, unless `config` splits evenly `tp_size` ways."""

    def need(ok: bool, field: str, value: int, rule: str) -> None:
        if not ok:
            raise ValueError(f"model {config.name!r} cannot run with tp={tp_size}: "
                             f"{field}={value} {rule}")

    need(tp_size >= 1, "tp_size", tp_size, "must be >= 1")
    need(config.num_heads % tp_size == 0, "num_heads", config.num_heads, "must divide by tp")
    if not config.is_mla:
        kv = config.num_kv_heads
        need(kv % tp_size == 0 if tp_size <= kv else tp_size % kv == 0, "num_kv_heads", kv,
             "and tp must divide one another")
    if config.linear_layers:
        need(config.linear_num_heads % tp_size == 0, "linear_num_heads",
             config.linear_num_heads, "must divide by tp")
    need(config.intermediate_size % tp_size == 0, "intermediate_size", config.intermediate_size,
         "must divide by tp")
    if config.num_experts:
        need(config.moe_intermediate_size % tp_size == 0, "moe_intermediate_size",
             config.moe_intermediate_size, "must divide by tp")


def head_range(config: ModelConfig, tp_size: int, rank: int) -> range:
    """The query heads rank `rank` of `tp_size` computes."""
    check_tp(config, tp_size)
    per_rank = config.num_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def kv_head_range(config: ModelConfig, tp_size: int, rank: int) -> range:
    """The heads of the full (tp=1) KV cache layout that rank `rank` of `tp_size` holds.

    GQA: a contiguous slice, or one head replicated when tp > num_kv_heads. MLA: `range(0, 1)`,
    the single latent head, held by every rank.
    """
    check_tp(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp={tp_size}")
    if config.is_mla:
        return range(0, 1)
    kv = config.num_kv_heads
    if tp_size <= kv:
        per_rank = kv // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // kv)
    return range(head, head + 1)


@torch.no_grad()
def apply_tp(model: CausalLM, group: TPGroup) -> CausalLM:
    """Shard `model` in place for rank `group.rank` of `group.size`; returns it.

    A group of one leaves the model untouched. Every rank must call this on an identical model.
    """
    config = model.config
    check_tp(config, group.size)
    if group.size == 1:
        return model
    first = next(layer.self_attn for layer in model.model.layers
                 if not isinstance(layer.self_attn, GatedLinearRecurrence))
    if first.num_heads != config.num_heads:
        raise ValueError("apply_tp: this model is already sharded")
    tp, rank, reduce = group.size, group.rank, _all_reduce_hook(group)
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, GQAAttention):
            _shard_gqa(attn, config, tp, rank)
        elif isinstance(attn, MLAAttention):
            _shard_mla(attn, config, tp, rank)
        elif isinstance(attn, GatedLinearRecurrence):
            _shard_linear(attn, tp, rank)
        else:
            raise TypeError(f"apply_tp: no rule for attention {type(attn).__name__}")
        for mlp in _gated_mlps(layer.mlp):
            _shard_mlp(mlp, tp, rank)
        attn.register_forward_hook(reduce)
        layer.mlp.register_forward_hook(reduce)
    return model


def _shard_gqa(attn: GQAAttention, config: ModelConfig, tp: int, rank: int) -> None:
    heads, kv_heads = head_range(config, tp, rank), kv_head_range(config, tp, rank)
    dim = attn.head_dim
    _keep(attn.q_proj, 0, heads.start * dim, len(heads) * dim)
    _keep(attn.k_proj, 0, kv_heads.start * dim, len(kv_heads) * dim)
    _keep(attn.v_proj, 0, kv_heads.start * dim, len(kv_heads) * dim)
    _keep(attn.o_proj, 1, heads.start * dim, len(heads) * dim)
    attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)


def _shard_mla(attn: MLAAttention, config: ModelConfig, tp: int, rank: int) -> None:
    heads = head_range(config, tp, rank)
    first, count = heads.start, len(heads)
    q_dim, kv_dim = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim
    _keep(attn.q_b_proj if attn.has_q_lora else attn.q_proj, 0, first * q_dim, count * q_dim)
    _keep(attn.kv_b_proj, 0, first * kv_dim, count * kv_dim)
    _keep(attn.o_proj, 1, first * attn.v_dim, count * attn.v_dim)
    attn.num_heads = count


def _shard_linear(attn: GatedLinearRecurrence, tp: int, rank: int) -> None:
    count = attn.heads // tp
    first = rank * count
    c = attn.channels
    _keep(attn.qkv_proj, 0, first * c, count * c)
    attn.conv_weight = nn.Parameter(attn.conv_weight.narrow(0, first * c, count * c).clone(),
                                    requires_grad=attn.conv_weight.requires_grad)
    _keep(attn.gate_proj, 0, first, count)
    _keep(attn.o_proj, 1, first * attn.value_dim, count * attn.value_dim)
    attn.heads = count


def _gated_mlps(block: GatedMLP | MoE) -> list[GatedMLP]:
    if isinstance(block, GatedMLP):
        return [block]
    shared = [block.shared_experts] if block.shared_experts is not None else []
    return [*block.experts, *shared]


def _shard_mlp(mlp: GatedMLP, tp: int, rank: int) -> None:
    width = mlp.gate_proj.out_features // tp
    _keep(mlp.gate_proj, 0, rank * width, width)
    _keep(mlp.up_proj, 0, rank * width, width)
    _keep(mlp.down_proj, 1, rank * width, width)


def _keep(linear: nn.Linear, dim: int, start: int, length: int) -> None:
    """Keep `length` output features (dim 0: column-parallel) or input features (dim 1:
    row-parallel) of `linear` from `start` on."""
    if dim == 1 and linear.bias is not None:
        raise NotImplementedError("a row-parallel projection with a bias")
    weight = linear.weight
    linear.weight = nn.Parameter(weight.narrow(dim, start, length).clone(),
                                 requires_grad=weight.requires_grad)
    if dim == 0 and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.narrow(0, start, length).clone(),
                                   requires_grad=linear.bias.requires_grad)
    linear.out_features, linear.in_features = linear.weight.shape


def _all_reduce_hook(group: TPGroup):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce_sum(output)

    return hook
