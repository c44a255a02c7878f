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
  all-reduce after the whole MoE block sums the partial outputs. With `ep` > 1 the routed
  experts are instead split whole over ep groups of tp/ep ranks (sliced within a group) and
  tokens reach them by all-to-all (runtime.model.moe); the same all-reduce ends the block.
- Embeddings, norms and lm_head are replicated (the simplest choice): every rank computes the full
  logits, identical on every rank because all-reduce hands every rank the same bits (under
  attention DP see below for the LM head).

Row-parallel projections have no bias in the supported models (it would be added tp times).

Attention data parallelism (`apply_dp_attention`, SGLang's --enable-dp-attention): the tp ranks
of an instance form `dp` DP ranks of `tp // dp` processes each (process p is in DP rank
`p // (tp // dp)`). Each DP rank runs attention on its own batch, its heads split over its
processes (the attention-TP group, one all-reduce after attention); the embeddings run on its own
rows. The LM head, as SGLang runs it: by default split by vocabulary over the whole instance on the
gathered last-token rows of every DP rank, each process computing its vocabulary slice and an
all-gather joining the slices before each rank keeps its own rows; with `dp_lm_head`
(`--enable-dp-lm-head`) whole on each DP rank's own rows, no collective. The dense MLP and MoE
blocks gather the tokens of every DP rank over the whole instance (an all-gather padded to the
longest rank's), run split `tp` ways as above, sum (all-reduce) and keep this rank's rows. With
`moe_dense_tp: 1` a dense MLP instead runs whole on each process over its own tokens, with no
collective. A DP rank with no batch in a step runs the idle batch (`run_idle`): no tokens of its
own through every MLP block's and the LM head's collectives, so the ranks with work are never
left waiting.
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
from runtime.model.moe import ExpertParallelMoE, check_ep


def check_tp(config: ModelConfig, tp_size: int, ep_size: int = 1) -> None:
    """Raise ValueError, naming the field, unless `config` splits evenly `tp_size` ways (its
    routed experts `ep_size` ways)."""

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
    check_ep(config, tp_size, ep_size)


def check_dp_attention(config: ModelConfig, tp_size: int, dp_size: int, *,
                       dp_lm_head: bool = False) -> None:
    """Raise ValueError unless `config` runs with `tp_size` processes in `dp_size` DP ranks:
    attention splits over `tp_size // dp_size`, the MLP blocks (and without `dp_lm_head` the LM
    head's vocabulary) over `tp_size`."""
    if dp_size < 1 or tp_size % dp_size:
        raise ValueError(f"dp_attention={dp_size} must divide tp={tp_size}")
    check_tp(config, tp_size // dp_size)
    if dp_size > 1 and not dp_lm_head and config.vocab_size % tp_size:
        raise ValueError(f"model {config.name!r} cannot split its LM head over tp={tp_size}: "
                         f"vocab_size={config.vocab_size} must divide by tp (or set dp_lm_head "
                         "to run it per DP rank)")
    for field in ("intermediate_size", "moe_intermediate_size"):
        if getattr(config, field) and getattr(config, field) % tp_size:
            raise ValueError(f"model {config.name!r} cannot run with tp={tp_size}: "
                             f"{field}={getattr(config, field)} must divide by tp")


class DPRanks:
    """One process's place in an instance with attention DP: `world` is the instance's group
    (every process), `attn` this DP rank's attention-TP group. `token_counts` holds each DP
    rank's tokens in the forward about to run, `row_counts` its rows for the LM head (one per
    segment); the executor sets both before every forward."""

    def __init__(self, world: TPGroup, attn: TPGroup, dp_size: int) -> None:
        if world.size != dp_size * attn.size:
            raise ValueError(f"an instance of {world.size} processes cannot hold {dp_size} DP "
                             f"ranks of {attn.size}")
        self.world = world
        self.attn = attn
        self.dp_size = dp_size
        self.dp_rank = world.rank // attn.size
        self.token_counts = [0] * dp_size
        self.row_counts = [0] * dp_size

    def gather(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Every DP rank's rows of `x`, in DP-rank order; `counts` (default: `token_counts`)
        holds each rank's rows."""
        counts = self.token_counts if counts is None else counts
        if x.shape[0] != counts[self.dp_rank]:
            raise ValueError(f"DP rank {self.dp_rank}: {x.shape[0]} rows, expected "
                             f"{counts[self.dp_rank]}")
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = self.world.all_gather(padded)
        return torch.cat([parts[r * self.attn.size][:n] for r, n in enumerate(counts)])

    def own_rows(self, y: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """This DP rank's rows of a gathered `y` (`counts` as in `gather`)."""
        counts = self.token_counts if counts is None else counts
        start = sum(counts[: self.dp_rank])
        return y[start: start + counts[self.dp_rank]]


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
def apply_tp(model: CausalLM, group: TPGroup, ep: int = 1) -> CausalLM:
    """Shard `model` in place for rank `group.rank` of `group.size`, its routed experts over `ep`
    of them; returns it.

    A group of one leaves the model untouched. Every rank must call this on an identical model.
    """
    config = model.config
    check_tp(config, group.size, ep)
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
        if ep > 1 and isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, config, group, ep)
            for mlp in layer.mlp.experts:
                _shard_mlp(mlp, tp // ep, rank % (tp // ep))
            if layer.mlp.shared_experts is not None:
                _shard_mlp(layer.mlp.shared_experts, tp, rank)
        else:
            for mlp in _gated_mlps(layer.mlp):
                _shard_mlp(mlp, tp, rank)
        attn.register_forward_hook(reduce)
        layer.mlp.register_forward_hook(reduce)
    return model


@torch.no_grad()
def apply_dp_attention(model: CausalLM, dp: DPRanks, *, dense_tp: bool = True,
                       dp_lm_head: bool = False) -> CausalLM:
    """Shard `model` in place for its process of an instance with attention DP (module
    docstring); `dense_tp=False` is `moe_dense_tp: 1`, `dp_lm_head` SGLang's
    `--enable-dp-lm-head`. Every process must call this on an identical model; the model then
    keeps `dp` as `model.dp`."""
    config = model.config
    check_dp_attention(config, dp.world.size, dp.dp_size, dp_lm_head=dp_lm_head)
    attn_tp, attn_rank = dp.attn.size, dp.attn.rank
    tp, rank = dp.world.size, dp.world.rank
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn_tp > 1:
            if isinstance(attn, GQAAttention):
                _shard_gqa(attn, config, attn_tp, attn_rank)
            else:
                _shard_mla(attn, config, attn_tp, attn_rank)
            attn.register_forward_hook(_all_reduce_hook(dp.attn))
        if isinstance(layer.mlp, GatedMLP) and not dense_tp:
            continue  # whole on every process, over its own tokens
        for mlp in _gated_mlps(layer.mlp):
            _shard_mlp(mlp, tp, rank)
        layer.mlp.register_forward_pre_hook(lambda _m, args: (dp.gather(args[0]),))
        layer.mlp.register_forward_hook(
            lambda _m, _args, out: dp.own_rows(dp.world.all_reduce_sum(out)))
    if not dp_lm_head:
        _vocab_parallel_lm_head(model, dp)
    model.dp = dp
    return model


def _vocab_parallel_lm_head(model: CausalLM, dp: DPRanks) -> None:
    """This process's vocabulary slice of the LM head (a tied embedding keeps the whole
    table), run on every DP rank's rows; the logits of all slices come back for its own rows."""
    tp, rank = dp.world.size, dp.world.rank
    width = model.config.vocab_size // tp
    _keep(model.lm_head, 0, rank * width, width)
    model.lm_head.register_forward_pre_hook(
        lambda _m, args: (dp.gather(args[0], dp.row_counts),))
    model.lm_head.register_forward_hook(
        lambda _m, _args, out: dp.own_rows(torch.cat(dp.world.all_gather(out), dim=-1),
                                           dp.row_counts))


@torch.inference_mode()
def run_idle(model: CausalLM) -> None:
    """The idle batch of a DP rank with nothing to run: no tokens through every layer's MLP
    block and the LM head, whose collectives the other DP ranks' forwards are waiting in."""
    weight = model.model.embed_tokens.weight
    empty = weight.new_zeros((0, model.config.hidden_size))
    for layer in model.model.layers:
        layer.mlp(empty)
    model.compute_logits(empty)


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
