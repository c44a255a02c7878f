"""The one cost hook: how long one forward step of one instance takes, given its batch shapes.

A cost model prices `BatchShape`s, one per attention-DP rank, and nothing else: it never sees
requests. Implementations are looked up by name (`make_cost_model`); "roofline" is the analytic
one, described with its defaults in docs/cost_model.md.

This module also answers the other sizing question the simulator asks of a (model, GPU,
parallelism) triple: how many KV tokens and recurrent-state slots fit (`pool_sizes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdsim import sglang_defaults
from pdsim.core.batch import BatchShape
from pdsim.sim.expert_load import (
    ExpertLoad, check_redundant_experts, expert_load, routing_alpha,
)
from pdsim.sim.forward_shape import StepShape, StepShaper, StepTotals, step_totals
from pdsim.sim.moe_comm import A2AMode, deepep_traffic
from pdsim.sim.overheads import HostOverheads, host_overheads
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec
from pdsim.specs.parallel import check_dp_options, check_moe_a2a
from pdsim.specs.pipeline import stage_model
from pdsim.specs.precision import DTYPES, compute_on, gemm_peak_tflops

ACT_BYTES = 2  # activations are bf16
# MLA decode kernels (FlashMLA, FlashAttention-3's MLA path) compute a 64-row block of query
# rows (heads x queries of one request) at a time, Hopper's warp-group MMA height: fewer rows
# compute as 64. Memory-bound on an H100 it costs nothing; on an H20 it is the time: FlashMLA
# there takes 0.60 ms for 128 requests of 4,096 keys at 16 heads and 1 to 4 queries a request
# alike, 1.17 ms at 5 (FlashMLA issue #30).
MLA_DECODE_ROWS = 64


def fp8_attention_kernel(model: ModelSpec, hardware: HardwareSpec, kv_dtype_bytes: float) -> bool:
    """Whether the attention kernels compute in FP8: the model's `attention_compute` says so,
    or, for GQA/MHA, the KV cache is FP8 on a GPU with FP8 tensor cores (SGLang's fa3 and
    trtllm_mha backends cast q to the cache's dtype: `q.to(self.kv_cache_dtype)`; its MLA
    backends on Hopper cast the cache to BF16 instead)."""
    if model.precision.attention_compute == "fp8":
        return True
    return not model.is_mla and kv_dtype_bytes == 1 and hardware.fp8_tflops is not None


def mla_decode_rows(rows: float) -> int:
    """The query rows (heads x queries of a request) an MLA decode kernel computes."""
    return math.ceil(rows / MLA_DECODE_ROWS) * MLA_DECODE_ROWS


def decode_query_scale(model: ModelSpec, heads: float) -> Callable[[int], float]:
    """A decode attention kernel's FLOPs at q queries a request over its FLOPs at one, for
    `heads` query heads on a GPU: q, or for MLA its padded rows' ratio."""
    if not model.is_mla:
        return float
    one = mla_decode_rows(heads)
    return lambda q: mla_decode_rows(heads * q) / one


# Gated DeltaNet (a hybrid model's linear-attention layers) as SGLang runs it: its Triton
# kernels scan a prompt in chunks of this many tokens.
GDN_CHUNK = 64
GDN_KERNELS = ("causal_conv1d_fn", "chunk_gated_delta_rule",  # prefill
               "causal_conv1d_update", "fused_recurrent_gated_delta_rule_packed_decode")


def gdn_kernel_work(kernel: str, b: float, s: float, k_heads: int, v_heads: int, dk: int,
                    dv: int, state_bytes: float, taps: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one Gated DeltaNet kernel (`GDN_KERNELS`) of one layer over b
    sequences of s new tokens (decode kernels: b requests, s = 1), for the heads of one GPU.
    The causal convolution (`taps` wide) streams the q/k/v channels and, decoding, reads and
    writes each request's last inputs; the chunked scan does per token and value head the
    state's read-out and update (2 dk dv FLOPs each) and attention inside its chunk, and
    writes and reads back one state per chunk; a decode step reads and writes each request's
    state (`state_bytes` an element)."""
    conv = 2 * k_heads * dk + v_heads * dv
    qkvo = (2 * k_heads * dk + 2 * v_heads * dv) * ACT_BYTES
    state = v_heads * dk * dv * state_bytes
    if kernel == "causal_conv1d_fn":
        return 2 * taps * b * s * conv, 2 * b * s * conv * ACT_BYTES
    if kernel == "chunk_gated_delta_rule":
        chunks = b * -(-s // GDN_CHUNK)
        return (b * s * v_heads * (4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)),
                b * s * qkvo + 2 * chunks * state)
    if kernel == "causal_conv1d_update":
        return 2 * taps * b * conv, 2 * taps * b * conv * ACT_BYTES
    if kernel == "fused_recurrent_gated_delta_rule_packed_decode":
        return 6 * b * v_heads * dk * dv, b * (2 * state + qkvo)
    raise ValueError(f"unknown Gated DeltaNet kernel {kernel!r}; allowed: "
                     f"{', '.join(GDN_KERNELS)}")


# The parts `step_breakdown_s` reports, in step order (both cost models).
BREAKDOWN_PARTS = ("attention", "dense_mlp", "dense_comm", "moe_experts", "moe_comm",
                   "tbo_overlap", "lm_head", "vocab_comm", "overhead")
# The groups summary.csv reports each role's shares of forward time in (docs/experiments.md),
# and the group each BREAKDOWN_PARTS part counts in. attention: its block whole (projections,
# kernels, attention-TP all-reduce, norms); gemm: dense MLP and LM head; moe: the experts
# (router and shared experts included); communication: the MLP's collectives or DeepEP's
# dispatch/combine, less what an overlap hides of them, the embedding's and LM head's
# collectives; overhead: scheduler and eager launches. Two-batch overlap's change counts in
# communication where it hides some, in moe where splitting costs more than it hides (each
# micro-batch reads the experts' weights and pays the kernels' floors: `part_group`).
SHARE_GROUPS = ("attention", "gemm", "moe", "communication", "overhead")
PART_GROUPS = {"attention": "attention", "dense_mlp": "gemm", "dense_comm": "communication",
               "moe_experts": "moe", "moe_comm": "communication",
               "tbo_overlap": "communication", "lm_head": "gemm",
               "vocab_comm": "communication", "overhead": "overhead"}


def part_group(part: str, seconds: float) -> str:
    """The share group `seconds` of a BREAKDOWN_PARTS part count in (PART_GROUPS; a positive
    two-batch-overlap change is the split's extra compute)."""
    return "moe" if part == "tbo_overlap" and seconds > 0 else PART_GROUPS[part]


def experts_reached(experts: int, topk: int, tokens):
    """How many of `experts` the `tokens` of a layer reach when each routes its top-k at
    random: each expert is left out by a token with probability 1 - topk / experts."""
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def remote_row_bytes(hidden: int, inter_slice: float, topk: int, ep: int) -> float:
    """Bytes per token a GPU moves for the top-k rows of experts held by other ranks, under
    expert parallelism without an all-to-all backend. SGLang's fused MoE then keeps every
    token's top-k rows in its buffers (`fused_experts_impl`, the standard dispatcher maps other
    ranks' experts to -1): the kernels skip their FLOPs but write zeros for their gate_up and
    down outputs, the activation reads and writes them, and the top-k sum reads them, 2 + 3
    intermediate and 2 hidden values a row in BF16."""
    if ep <= 1:
        return 0.0
    return topk * (1.0 - 1.0 / ep) * (5.0 * inter_slice + 2.0 * hidden) * ACT_BYTES


class Parallelism(BaseModel):
    """How one instance spreads over its GPUs.

    tp: GPUs per instance (the tensor-parallel group of dense and MoE layers).
    dp_attention: attention data-parallel size; each DP rank runs attention on its own batch
        over `tp // dp_attention` GPUs (its attention-TP group). Must divide tp.
    ep: expert-parallel size; routed experts are split whole over `ep` GPUs, then sliced over
        `tp // ep`. Must divide tp.
    moe_a2a: how tokens reach their experts. "none": the MoE block runs on the tokens of all
        DP ranks, gathered over tp (an all-gather before, a reduce-scatter after). "deepep":
        SGLang's `--moe-a2a-backend deepep`: each GPU sends only the routed copies of its own
        tokens (pdsim.sim.moe_comm); needs ep = tp > 1, as SGLang sets it.
    two_batch_overlap: split each step into two micro-batches and overlap one's DeepEP
        communication with the other's compute (SGLang's `--enable-two-batch-overlap`).
    single_batch_overlap: overlap a decode step's DeepEP low-latency calls with its own
        expert compute (SGLang's `--enable-single-batch-overlap`; `single_batch_overlap_s`).
    moe_dense_tp: GPUs the dense MLP layers split over (SGLang's `--moe-dense-tp-size`):
        None (SGLang's default) = tp, on the gathered tokens of all DP ranks with the MLP's
        collective; 1 = each GPU runs the whole dense MLP on its own tokens, no collective.
    dp_lm_head: SGLang's `--enable-dp-lm-head`: embedding and LM head split over each
        attention-DP rank's GPUs, each rank on its own rows, instead of over tp.
    pp: pipeline stages (SGLang's `--pp-size`), each of tp GPUs with its share of the layers
        (pdsim.specs.pipeline). A cost model then prices one stage's step: the slowest stage's
        layers plus the activation send to the next stage (`pp_send_terms`); the pipeline's
        overlap of chunks across stages is the simulator's (pdsim/sim/pipeline.py).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1)
    dp_attention: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    moe_a2a: Literal["none", "deepep"] = "none"
    two_batch_overlap: bool = False
    single_batch_overlap: bool = False
    moe_dense_tp: Literal[1] | None = None
    dp_lm_head: bool = False
    pp: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check_divides(self) -> Parallelism:
        for label in ("dp_attention", "ep"):
            if self.tp % getattr(self, label):
                raise ValueError(f"{label}={getattr(self, label)} must divide tp={self.tp}")
        check_moe_a2a(self.moe_a2a, self.two_batch_overlap, self.tp, self.ep,
                      self.single_batch_overlap)
        check_dp_options(self.moe_dense_tp, self.dp_lm_head, self.dp_attention)
        return self

    @property
    def attn_tp(self) -> int:
        """GPUs in one attention-DP rank."""
        return self.tp // self.dp_attention


def ring_link_gb_per_s(hardware: HardwareSpec, gpus: int) -> float:
    """The link rate a ring collective over `gpus` GPUs moves at, per rank: NVLink inside one
    NVLink domain. Beyond it NCCL runs one ring per NIC (rail-aligned, a NIC per GPU), each
    carrying its share of the data across the nodes, so the crossing moves at the node's
    `gpus_per_node` NICs together, NVLink's rate at most: H100 TP 16 over two nodes, 8 x 50 =
    400 GB/s, not one NIC's 50 (multi-node nccl-tests on H100 SXM with NDR InfiniBand: 400-450
    GB/s of all-reduce bus bandwidth, docs/cost_model.md)."""
    if gpus <= hardware.gpus_per_node:
        return hardware.nvlink_gb_per_s
    return min(hardware.nvlink_gb_per_s, hardware.rdma_gb_per_s * hardware.gpus_per_node)


def weight_bytes_per_gpu(model: ModelSpec, parallel: Parallelism, redundant_experts: int = 0
                         ) -> int:
    """Weight bytes on one GPU under `parallel` (shared experts replicated under DeepEP, dense
    MLP over moe_dense_tp, LM head per DP rank with dp_lm_head, EPLB's redundant experts with
    the routed ones; with pp, the slowest stage's layers): what KV capacity subtracts."""
    return stage_model(model, parallel.pp).weight_bytes_per_rank(
        parallel.tp, parallel.ep, parallel.dp_attention, deepep=parallel.moe_a2a == "deepep",
        dense_tp=parallel.moe_dense_tp, dp_lm_head=parallel.dp_lm_head,
        redundant_experts=redundant_experts)


@runtime_checkable
class CostModel(Protocol):
    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        """Seconds one forward step takes; `shapes` holds one shape per attention-DP rank."""
        ...


CostModelFactory = Callable[..., CostModel]
_REGISTRY: dict[str, CostModelFactory] = {}


def register_cost_model(name: str) -> Callable[[CostModelFactory], CostModelFactory]:
    """Register a factory `(model, hardware, parallel, **params) -> CostModel` under `name`.

    Every factory accepts `kv_dtype_bytes` and `role` among its params: the simulator passes
    the experiment's KV dtype size and the instance's role ("prefill", "decode" or
    "colocated") that way; a model that has no use for one accepts and ignores it."""

    def add(factory: CostModelFactory) -> CostModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"cost model {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return add


def cost_model_names() -> list[str]:
    return sorted(_REGISTRY)


def make_cost_model(
    name: str, model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism, **params: object
) -> CostModel:
    """Build the cost model registered as `name`; `params` override its defaults."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown cost model {name!r}; registered: {', '.join(cost_model_names())}"
        ) from None
    return factory(model, hardware, parallel, **params)


Role = Literal["prefill", "decode", "colocated"]


class VocabCollective(NamedTuple):
    """One collective SGLang runs around its vocabulary-parallel embedding or LM head: `op`
    over `gpus` GPUs on rows of `width` BF16 elements, as many rows as `rows` names in a
    step: "tokens" (all of the instance's), "lm_rows" (its LM-head rows), "rank_rows" (the
    busiest DP rank's LM-head rows)."""

    name: str
    op: Literal["all_reduce", "all_gather"]
    gpus: int
    width: int
    rows: Literal["tokens", "lm_rows", "rank_rows"]

    def count(self, totals: StepTotals) -> int:
        """Its rows in a step of `step_totals`."""
        return {"tokens": totals.tokens, "lm_rows": totals.lm_rows,
                "rank_rows": totals.max_rank_rows}[self.rows]


def vocab_collectives(model: ModelSpec, parallel: Parallelism) -> tuple[VocabCollective, ...]:
    """The collectives of SGLang's `VocabParallelEmbedding` and `LogitsProcessor` (both cost
    models price them in the `vocab_comm` part). Over tp without DP attention: the
    embedding's all-reduce of every token, and the all-gather of each LM-head row's logits
    from the vocabulary shards. With DP attention the embedding is replicated
    (`enable_tp=not is_dp_attention_enabled()`); without `dp_lm_head` the LM head still
    splits the vocabulary over tp, so every DP rank's LM-head rows are gathered to all GPUs
    (`dp_gather_replicate`) and their logits all-gathered over tp, then each rank keeps its
    own; with `dp_lm_head` a rank's logits are gathered over its attention-TP group only."""
    tp, attn_tp = parallel.tp, parallel.attn_tp
    h, vocab = model.hidden_size, model.vocab_size
    if parallel.dp_attention == 1:
        if tp == 1:
            return ()
        return (VocabCollective("embedding all_reduce", "all_reduce", tp, h, "tokens"),
                VocabCollective("logits all_gather", "all_gather", tp, vocab, "lm_rows"))
    if parallel.dp_lm_head:
        if attn_tp == 1:
            return ()
        return (VocabCollective("logits all_gather", "all_gather", attn_tp, vocab,
                                "rank_rows"),)
    return (VocabCollective("LM-head rows all_gather", "all_gather", tp, h, "lm_rows"),
            VocabCollective("logits all_gather", "all_gather", tp, vocab, "lm_rows"))


def deepep_normal(role: str, has_prefill: bool) -> bool:
    """Whether a step's DeepEP calls run in normal mode (else low latency): a prefill
    instance's always, a colocated one's when the step extends (SGLang's `auto` mode)."""
    return role == "prefill" or (role == "colocated" and has_prefill)


def tbo_splits(parallel: Parallelism, role: str, shapes: Sequence[BatchShape]) -> bool:
    """Whether SGLang runs this step as two-batch overlap's two micro-batches
    (`TboDPAttentionPreparer`): only when every rank with work runs the same forward mode, all
    extend or all decode, and an extend's DeepEP calls are not low-latency ones (a decode
    instance's); any other step runs whole."""
    if not parallel.two_batch_overlap:
        return False
    modes = {(s.prefill_tokens > 0, s.decode_reqs > 0) for s in shapes if s.num_tokens}
    if len(modes) != 1:
        return False
    ((extend, decode),) = modes
    return not (extend and decode) and not (extend and not deepep_normal(role, True))


def micro_batches(shapes: Sequence[BatchShape]) -> tuple[list[BatchShape], list[BatchShape]]:
    """Two-batch overlap's two micro-batches, per DP rank, as SGLang cuts each rank's batch
    (two_batch_overlap.py, `compute_split_seq_index`): its first n // 2 decode requests and the
    rest, so a rank with one request leaves the first micro-batch empty (its kernels have no
    rows; its dispatch and combine still run); an extend batch in halves of its tokens (SGLang
    balances the two by tokens, cutting a sequence in two when it must). Both halves of an
    extend attend over its cached prefix, so each runs MLA in the batch's form
    (`mla_extend_form`)."""
    first, second = [], []
    for s in shapes:
        n, pf, prefix = s.decode_reqs, s.prefill_tokens, s.prefill_prefix_tokens
        reqs = n // 2
        ctx = s.decode_context_tokens * reqs // n if n else 0
        pairs = s.prefill_attn_pairs / 2
        first.append(BatchShape(pf // 2, pairs, reqs, ctx, s.decode_query_len, prefix))
        second.append(BatchShape(pf - pf // 2, pairs, n - reqs, s.decode_context_tokens - ctx,
                                 s.decode_query_len, prefix))
    return first, second


def overlapped_layers_s(layers: int, first: tuple[float, float], second: tuple[float, float],
                        sm_share: float = 0.0) -> float:
    """MoE layers under two-batch overlap, each micro-batch's (compute, communication) per
    layer: one micro-batch computes while the other communicates, so a layer takes
    max(c1, x2) + max(c2, x1), and the step pays one half-batch min(c, x) to fill the
    pipeline (both cost models). Communication kernels that hold `sm_share` of the GPU's SMs
    (DeepEP's normal mode, `tbo_sm_share`) slow the compute beside them to 1 - sm_share of its
    pace: a compute c beside a communication x ends at max(x, c + sm_share * x)."""
    (c1, x1), (c2, x2) = first, second
    r = sm_share
    return (layers * (max(c1 + r * x2, x2) + max(c2 + r * x1, x1))
            + min(c1 + c2, x1 + x2) / 2)


# SGLang's single-batch overlap (batch_overlap/single_batch_overlap.py): DeepEP's low-latency
# combine sends from SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS SMs (by default 32 on Blackwell, 3
# elsewhere) while the rest compute beside it.
SBO_COMBINE_SMS_BLACKWELL = 32
SBO_COMBINE_SMS_OTHER = 3
# A SwiGLU expert's down projection holds a third of its weights and FLOPs (d x i of 3 d x i).
EXPERT_DOWN_SHARE = 1 / 3


def single_batch_overlap_s(dispatch: float, combine: float, shared: float, routed: float,
                           hardware: HardwareSpec, expert_dtype: str) -> tuple[float, float]:
    """One decode MoE layer under SGLang's single-batch overlap (`SboFlags`), as (compute,
    communication left exposed); they add up to the layer's time. With `x'` the time of x on
    the SMs the combine leaves (`hardware.sms`; unknown: all):

    - before Blackwell (DeepGEMM): the shared experts run while the dispatch is in flight and
      the routed experts' down projection while the combine sends (3 SMs):
      max(dispatch, shared) + gate_up + max(combine, down');
    - Blackwell, FP4 experts (flashinfer's CuTe DSL kernels): the down projection and then the
      shared experts beside the combine (32 SMs): dispatch + gate_up + max(combine, down' +
      shared');
    - Blackwell, other experts (DeepGEMM): the shared experts beside the combine:
      dispatch + routed + max(combine, shared').

    `routed` is the routed experts' gate_up, activation and down, `EXPERT_DOWN_SHARE` of it
    the down projection."""
    comm_sms = SBO_COMBINE_SMS_BLACKWELL if hardware.blackwell else SBO_COMBINE_SMS_OTHER
    pace = hardware.sms / (hardware.sms - comm_sms) if hardware.sms else 1.0
    down = routed * EXPERT_DOWN_SHARE
    if not hardware.blackwell:
        beside_dispatch, beside_combine = shared, down * pace
    elif DTYPES[expert_dtype].compute == "fp4":
        beside_dispatch, beside_combine = 0.0, (down + shared) * pace
    else:
        beside_dispatch, beside_combine = 0.0, shared * pace
    # the compute, at the pace it runs: what runs beside the combine slowed by the SMs it holds
    compute = routed + shared + beside_combine * (1 - 1 / pace)
    layer = (compute - beside_dispatch - beside_combine + max(dispatch, beside_dispatch)
             + max(combine, beside_combine))
    return compute, layer - compute


def tbo_sm_share(hardware: HardwareSpec, p: StepParams, normal: bool) -> float:
    """The share of the GPU's SMs two-batch overlap's communication holds while the other
    micro-batch computes: DeepEP's normal-mode kernels run on `deepep_normal_sms` SMs (DeepSeek's
    prefill profile: 24 of an H800's 132 communicate, 108 compute); its low-latency kernels
    hold none while they wait (their RDMA proceeds without SMs). 0 where the GPU's SM count
    is unknown."""
    if not normal or hardware.sms is None:
        return 0.0
    if p.deepep_normal_sms >= hardware.sms:
        raise ValueError(f"deepep_normal_sms={p.deepep_normal_sms} leaves none of the "
                         f"{hardware.name}'s {hardware.sms} SMs to compute; allowed: 0 to "
                         f"{hardware.sms - 1}")
    return p.deepep_normal_sms / hardware.sms


# SGLang's SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD: the fa3 and flashinfer MLA backends (Hopper,
# Ampere) run an extend batch whose prefixes sum to fewer cached tokens in the absorbed form.
MLA_CHUNKED_PREFIX_THRESHOLD = 8192


def mla_prefix_threshold(hardware: HardwareSpec, p: StepParams) -> int:
    """The cached prefix tokens from which an MLA extend batch runs MHA: the given
    `chunked_prefix_cache_threshold`, else SGLang's default for the GPU's MLA backend:
    Blackwell (the GPUs with FP4 tensor cores) runs trtllm_mla, which re-projects any prefix
    (1); the fa3 and flashinfer backends elsewhere 8,192."""
    if p.chunked_prefix_cache_threshold is not None:
        return p.chunked_prefix_cache_threshold
    return 1 if hardware.blackwell else MLA_CHUNKED_PREFIX_THRESHOLD


def mla_extend_form(prefix_tokens: int, threshold: int) -> str:
    """How SGLang runs an MLA extend batch over `prefix_tokens` cached tokens (summed over its
    requests; `attention_backend_handler.py`): "mha" without a prefix or from `threshold`
    prefix tokens on (the prefix's latent KV re-projected by kv_b into K/V for it), else
    "absorbed" (decode's form: kv_b folded into q and o, attention over the latent, 3.4x the
    FLOPs a pair for DeepSeek's dimensions)."""
    return "mha" if prefix_tokens == 0 or prefix_tokens >= threshold else "absorbed"


def layers_attention_s(attn: float, dense_layers: int, moe_layers: int) -> float:
    """Every layer's attention block, one layer's being `attn`: the dense layers' then the MoE
    layers' (both cost models add them in this order; their step times are tested bit for bit
    against the sum of their parts)."""
    attention = dense_layers * attn if dense_layers else 0.0
    if moe_layers:
        attention += moe_layers * attn
    return attention


class StepParams(BaseModel):
    """What both cost models take beyond their own constants (docs/cost_model.md, "Expert load
    imbalance" and "Host overheads").

    expert_imbalance: price a MoE layer at its busiest EP rank (pdsim.sim.expert_load); false
    prices the mean rank. eplb_redundant_experts: None without EPLB, else SGLang's
    --enable-eplb with that many --ep-num-redundant-experts. seed: the expert popularity draw.
    eager_overhead: charge eager forwards (extend, decode above cuda_graph_max_bs requests per
    rank; None: SGLang's default for the GPU, or the largest of cuda_graph_bs) the time their
    kernel launches, eager_launch_s each (None: EAGER_LAUNCH_S on the hardware's host,
    `host_time_scale`), outlast their kernels. cuda_graph_bs: the decode batch sizes captured
    as graphs (SGLang's --cuda-graph-bs; None: its default list); a graphed decode step runs at
    the next of them (pdsim.sim.forward_shape), at its own size with cuda_graph_padding false
    (SGLang's --disable-cuda-graph-padding). piecewise_cuda_graph: an extend of at most
    piecewise_cuda_graph_max_tokens tokens per rank (None: SGLang's default for the rules, the
    chunk size, for MLA models 2,048 under v0.5.10 and up to 8,192 under v0.5.23) runs as
    piecewise CUDA graphs, launching 3 per layer, where `piecewise_eligible` says SGLang keeps
    them under piecewise_cuda_graph_rules ("v0.5.10": colocated servers only; "v0.5.23", its
    breakable prefill graphs: PD prefill too, with DP attention and DeepEP, not with TBO).
    role: which role the instance plays ("prefill", "decode" or "colocated"): it picks
    DeepEP's mode and whether SGLang keeps piecewise graphs.
    scheduler_overhead: charge step_overhead_s per step and extend_overhead_s per extend step
    (the scheduler loop's host work).
    deepep_normal_sms: the SMs DeepEP's normal-mode kernels run on (DeepEP's `Buffer.num_sms`,
    20 unless SGLang's --deepep-config sets it); under two-batch overlap the other micro-batch
    computes on the rest (`tbo_sm_share`).
    chunked_prefix_cache_threshold: an MLA extend batch after at least this many cached
    prefix tokens runs MHA over the prefix re-projected by kv_b, after fewer the absorbed
    form (`mla_extend_form`); None: SGLang's default for the GPU's MLA backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    expert_imbalance: bool = True
    eplb_redundant_experts: int | None = Field(default=None, ge=0)
    seed: int = 0
    eager_overhead: bool = True
    eager_launch_s: float | None = Field(default=None, ge=0)
    cuda_graph_max_bs: int | None = Field(default=None, ge=0)
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_padding: bool = True
    piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int | None = Field(default=None, ge=1)
    piecewise_cuda_graph_rules: Literal["v0.5.10", "v0.5.23"] = "v0.5.23"
    role: Role = "colocated"
    scheduler_overhead: bool = True
    deepep_normal_sms: int = Field(default=20, ge=0)
    chunked_prefix_cache_threshold: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_graph_sizes(self) -> StepParams:
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs
                                               or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"cuda_graph_bs must list batch sizes of at least 1, got "
                             f"{list(self.cuda_graph_bs)}")
        return self

    def graph_max_bs(self, hardware: HardwareSpec, tp: int) -> int:
        """The largest per-rank decode batch replayed as a CUDA graph."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        if self.cuda_graph_bs is not None:
            return max(self.cuda_graph_bs)
        return sglang_defaults.cuda_graph_max_bs(hardware.hbm_gib, tp)


def step_extras(model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism, p: StepParams
                ) -> tuple[ExpertLoad | None, HostOverheads | None, StepShaper]:
    """The expert-load model (None: every rank at the mean), the host overheads (None: off)
    and the step shaper (CUDA-graph and DP-gather padding) of one instance, as both cost models
    price them."""
    if model.is_moe and p.eplb_redundant_experts is not None:  # a dense draft has no experts
        check_redundant_experts(p.eplb_redundant_experts, model.num_experts, parallel.ep)
    load = None
    if p.expert_imbalance and model.is_moe and parallel.ep > 1:
        load = expert_load(model.num_experts, model.experts_per_token, parallel.ep,
                           p.eplb_redundant_experts, p.seed, routing_alpha(model))
    graph_bs = p.graph_max_bs(hardware, parallel.tp)
    host = None
    if p.eager_overhead:
        piecewise = None
        if p.piecewise_cuda_graph:
            piecewise = (p.piecewise_cuda_graph_max_tokens
                         or sglang_defaults.piecewise_cuda_graph_max_tokens(
                             model.is_mla, sglang_defaults.chunked_prefill_size(hardware.hbm_gib),
                             p.piecewise_cuda_graph_rules))
        host = host_overheads(model, hardware, parallel, p.eager_launch_s, graph_bs, piecewise,
                              p.piecewise_cuda_graph_rules, p.role)
    shaper = StepShaper(parallel, graph_bs, p.cuda_graph_bs, p.cuda_graph_padding)
    return load, host, shaper


def with_eager_overhead(parts: tuple[float, ...], host: HostOverheads | None,
                        has_prefill: bool, max_rank_decode_reqs: int, max_rank_tokens: int,
                        split: bool = False) -> tuple[float, ...]:
    """`parts` (BREAKDOWN_PARTS order) with the eager overhead added to the last, "overhead"
    (host work); the parts before it are the kernels the launches run beside. `split`: the
    step runs as two-batch overlap's two micro-batches."""
    extra = 0.0 if host is None else host.overhead_s(has_prefill, max_rank_decode_reqs,
                                                     max_rank_tokens, sum(parts[:-1]), split)
    return (*parts[:-1], parts[-1] + extra) if extra else parts


PP_LINK_EFFICIENCY = 0.7  # share of the link a stage-to-stage send reaches (as the roofline's collectives)
PP_SEND_LATENCY_S = 10e-6  # fixed time of one stage-to-stage send (as one all-reduce's)


class PPSend(NamedTuple):
    """A pipeline stage's send of its step's activations to the next stage, per GPU:
    fixed_s + tokens * s_per_token (zero without pipeline stages)."""

    fixed_s: float
    s_per_token: float

    def at(self, tokens: float) -> float:
        return self.fixed_s + tokens * self.s_per_token if tokens else 0.0


def pp_send_terms(model: ModelSpec, hardware: HardwareSpec, parallel: Parallelism) -> PPSend:
    """SGLang's stages hand the next one the hidden states and the residual (bf16), each
    attention-TP rank its 1/attn_tp slice of its rank's tokens (the receiver all-gathers them),
    over NVLink when the instance's tp * pp GPUs fit in one node, else over the RDMA NICs."""
    if parallel.pp == 1:
        return PPSend(0.0, 0.0)
    nvlink = parallel.tp * parallel.pp <= hardware.gpus_per_node
    gb_per_s = hardware.nvlink_gb_per_s if nvlink else hardware.rdma_gb_per_s
    bytes_per_token = 2 * model.hidden_size * ACT_BYTES / parallel.attn_tp
    return PPSend(PP_SEND_LATENCY_S, bytes_per_token / (gb_per_s * 1e9 * PP_LINK_EFFICIENCY))


def max_rank_decode_reqs(shapes: Sequence[BatchShape]) -> int:
    return max((s.decode_reqs for s in shapes), default=0)


class RooflineParams(StepParams):
    """Efficiency factors and fixed costs of the roofline model (see docs/cost_model.md).
    DeepEP's mode follows the role (prefill: normal, decode: low latency, colocated: normal for
    steps with prefill tokens, low latency otherwise)."""

    gemm_mfu: float = Field(default=0.7, gt=0, le=1)
    fp8_gemm_mfu: float = Field(default=0.6, gt=0, le=1)
    fp4_gemm_mfu: float = Field(default=0.44, gt=0, le=1)
    attn_mfu: float = Field(default=0.62, gt=0, le=1)
    fp8_attn_mfu: float = Field(default=0.38, gt=0, le=1)
    prefill_attn_extra_keys: float = Field(default=500, ge=0)
    bw_efficiency: float = Field(default=0.8, gt=0, le=1)
    comm_efficiency: float = Field(default=0.7, gt=0, le=1)
    allreduce_latency_s: float = Field(default=10e-6, ge=0)
    gemm_floor_s: float = Field(default=4e-6, ge=0)
    attn_floor_s: float = Field(default=10e-6, ge=0)
    decode_attn_req_s: float = Field(default=0.05e-6, ge=0)
    moe_floor_s: float = Field(default=23e-6, ge=0)
    gdn_prefill_floor_s: float = Field(default=24e-6, ge=0)
    gdn_decode_floor_s: float = Field(default=6e-6, ge=0)
    layer_overhead_s: float = Field(default=15e-6, ge=0)
    step_overhead_s: float = Field(default=0.5e-3, ge=0)
    extend_overhead_s: float = Field(default=2e-3, ge=0)
    kv_dtype_bytes: float = Field(default=2, gt=0)
    deepep_ll_latency_s: float = Field(default=12e-6, ge=0)
    deepep_normal_latency_s: float = Field(default=37e-6, ge=0)
    deepep_rdma_latency_s: float = Field(default=12e-6, ge=0)
    deepep_ll_nvlink_efficiency: float = Field(default=0.5, gt=0, le=1)
    deepep_normal_nvlink_efficiency: float = Field(default=0.65, gt=0, le=1)
    deepep_rdma_efficiency: float = Field(default=0.9, gt=0, le=1)


def _peak_flops(block: str, dtype: str, hardware: HardwareSpec) -> float:
    """The tensor-core peak (FLOP/s) `dtype` runs at; a format the GPU cannot run is an error
    naming the block."""
    try:
        return gemm_peak_tflops(dtype, hardware) * 1e12
    except ValueError as err:
        raise ValueError(f"precision.{block}: {err}") from None


def check_formats(model: ModelSpec, hardware: HardwareSpec) -> None:
    """Every weight format the model runs has tensor cores (or a weight-only path) on
    `hardware`: NVFP4 before Blackwell, FP8 on an A100 are errors naming the block, whichever
    cost model prices it (the silicon tables would otherwise move a curve to it)."""
    prec = model.precision
    blocks = {"attention": prec.attention, "lm_head": prec.lm_head,
              "attention_compute": prec.attention_compute}
    if model.num_dense_layers:
        blocks["dense_mlp"] = prec.dense_mlp
    if model.is_moe:
        blocks["moe_experts"] = prec.moe_experts
    for block, dtype in blocks.items():
        _peak_flops(block, dtype, hardware)


def _block_rate(block: str, dtype: str, hardware: HardwareSpec, p: RooflineParams) -> float:
    """Achieved FLOP/s of one block's GEMMs: its format's peak times that format's measured
    GEMM efficiency (docs/cost_model.md)."""
    mfu = {"bf16": p.gemm_mfu, "fp8": p.fp8_gemm_mfu, "fp4": p.fp4_gemm_mfu}
    return _peak_flops(block, dtype, hardware) * mfu[compute_on(dtype, hardware)]


class GemmTerms(NamedTuple):
    """One GEMM's roofline terms: time = floor_s + max(rows * s_per_row,
    (fixed_bytes + rows * bytes_per_row) / mem_rate)."""

    floor_s: float
    s_per_row: float
    fixed_bytes: float
    bytes_per_row: float
    mem_rate: float

    def at(self, rows: float) -> float:
        return self.floor_s + max(rows * self.s_per_row,
                                  (self.fixed_bytes + rows * self.bytes_per_row) / self.mem_rate)


def gemm_terms(n: float, k: int, dtype: str, hardware: HardwareSpec, p: RooflineParams,
               block: str = "lm_head") -> GemmTerms:
    """A (rows x k) @ (k x n) GEMM with `dtype` weights as the roofline prices a block's GEMMs:
    its floor + max(FLOPs / achieved rate, (weights + activations) / memory rate)."""
    return GemmTerms(p.gemm_floor_s, 2.0 * n * k / _block_rate(block, dtype, hardware, p),
                     n * k * DTYPES[dtype].weight_bytes, (n + k) * ACT_BYTES,
                     hardware.stream_gb_per_s * 1e9 * p.bw_efficiency)


def gemm_time_s(rows: float, n: float, k: int, dtype: str, hardware: HardwareSpec,
                p: RooflineParams, block: str = "lm_head") -> float:
    """Seconds of one GEMM (`gemm_terms`) on `rows` rows."""
    return gemm_terms(n, k, dtype, hardware, p, block).at(rows)


@register_cost_model("roofline")
class RooflineCostModel:
    """Per part of a layer, time = kernel floors + max(FLOPs / compute rate, bytes / memory
    rate), summed.

    Parts: attention projections and attention itself (per attention-DP rank, on that rank's
    own shape; the step waits for the slowest rank), the dense MLP or MoE block, memory-bound
    elementwise kernels, the LM head once, the collectives (TP all-reduces, or DeepEP's
    dispatch/combine, optionally overlapped with compute) and a fixed per-step overhead. Each
    block's GEMMs run at the peak of its weight format (`ModelSpec.precision`); the floors and
    efficiencies are fitted on measured kernel tables (docs/cost_model.md).
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        parallel: Parallelism,
        **params: object,
    ) -> None:
        try:
            p = RooflineParams(**params)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                for e in err.errors()
            )
            allowed = ", ".join(RooflineParams.model_fields)
            raise ValueError(f"roofline params: {problems}; allowed params: {allowed}") from None
        if parallel.ep > 1 and not model.is_moe:
            raise ValueError(f"ep={parallel.ep} needs a MoE model; {model.name} is dense")
        check_formats(model, hardware)
        self.model, self.hardware, self.parallel, self.params = model, hardware, parallel, p
        model = stage_model(model, parallel.pp)  # with pp, one stage's layers are priced
        self._pp_send = pp_send_terms(model, hardware, parallel)
        self._load, self._host, self._shape = step_extras(model, hardware, parallel, p)

        tp, attn_tp, ep = parallel.tp, parallel.attn_tp, parallel.ep
        h, nh = model.hidden_size, model.num_attention_heads
        prec = model.precision
        heads = nh / attn_tp  # query heads on one GPU
        mem_rate = hardware.stream_gb_per_s * 1e9 * p.bw_efficiency
        self._mem_rate = mem_rate
        self._layers = model.num_layers

        # Attention block on one GPU of a DP rank: projections, then the attention kernels.
        attn_rate = _block_rate("attention", prec.attention, hardware, p)
        wb = DTYPES[prec.attention].weight_bytes
        self._attn_proj_s_tok = 2 * model.attn_params / model.num_layers / attn_tp / attn_rate
        self._attn_w_bytes = model.attn_params / model.num_layers * wb / attn_tp
        if model.is_mla:
            q_out = heads * model.head_dim
            q_io = h + model.q_lora_rank * 2 + q_out if model.q_lora_rank else h + q_out
            kv_io = h + model.kv_elems_per_token_per_layer
            kv_io += model.kv_lora_rank + heads * (model.qk_nope_head_dim + model.v_head_dim)
            proj_io = q_io + kv_io + heads * model.v_head_dim + h
            # Prefill runs attention as MHA over the up-projected K/V; decode absorbs kv_b into
            # q and o and attends over the latent (score: kv_lora+rope, value: kv_lora).
            pf_flops_pair = 2 * heads * (model.head_dim + model.v_head_dim)
            dec_flops_ctx = (2 * mla_decode_rows(heads)
                             * (2 * model.kv_lora_rank + model.qk_rope_head_dim))
            rope_elems = heads * model.qk_rope_head_dim + model.qk_rope_head_dim
        else:
            kv_heads = model.kv_heads_per_rank(attn_tp)
            qkv_out = (heads + 2 * kv_heads) * model.head_dim
            proj_io = h + qkv_out + heads * model.head_dim + h
            pf_flops_pair = 4 * heads * model.head_dim
            dec_flops_ctx = 4 * heads * model.head_dim
            # RoPE on q and k, and a second pass over them for the per-head q/k RMSNorm
            rope_elems = (1 + model.qk_norm) * (heads + kv_heads) * model.head_dim
        # The attention kernel's efficiency rises with the keys each query attends to: a
        # prefill query costs as if it attended `prefill_attn_extra_keys` more keys.
        fp8_kernel = fp8_attention_kernel(model, hardware, p.kv_dtype_bytes)
        kernel_rate = _peak_flops("attention_compute", "fp8" if fp8_kernel else "bf16",
                                  hardware) * (p.fp8_attn_mfu if fp8_kernel else p.attn_mfu)
        self._pf_extra_pairs_tok = p.prefill_attn_extra_keys
        # Per layer on average: a hybrid model's Gated DeltaNet layers run no softmax attention
        # kernel (their own are below) and three projection GEMMs.
        linear_share = model.linear_share
        self._decode_req_s = p.decode_attn_req_s * (1 - linear_share)
        self._attn_floor_s = p.attn_floor_s * (1 - linear_share)
        # Kernel floors of the projections: GQA's QKV and O GEMMs; MLA's fused q_a/kv_a, q_b,
        # kv_b (or its two absorbed batched GEMMs in decode) and o.
        self._attn_gemm_floor_s = ((5 if model.is_mla else 2) * (1 - linear_share)
                                   + 3 * linear_share) * p.gemm_floor_s
        self._attn_act_tok = proj_io * ACT_BYTES
        # Per layer on average: in a hybrid model only full-attention layers attend over the
        # whole context (a sliding window's and a recurrent state's per-token work is not
        # priced beyond the projections).
        full_share = model.num_full_attention_layers / model.num_layers
        self._pf_attn_s_pair = pf_flops_pair / kernel_rate * full_share
        self._dec_attn_s_ctx = dec_flops_ctx / kernel_rate * full_share
        # MLA extends after a cached prefix (`mla_extend_form`): the absorbed form's kernel
        # per pair, or kv_b re-projecting the prefix's latent KV for MHA.
        self._mla_threshold = mla_prefix_threshold(hardware, p) if model.is_mla else 0
        if model.is_mla:
            self._absorbed_s_pair = (2 * heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
                                     / kernel_rate * full_share)
            self._reproject = gemm_terms(heads * (model.qk_nope_head_dim + model.v_head_dim),
                                         model.kv_lora_rank, prec.attention, hardware, p,
                                         "attention")
        # A Gated DeltaNet layer's kernels instead, as their rooflines (a long prompt's
        # measured scan runs ~3x above its roofline: docs/cost_model.md).
        self._gdn_pf_s_tok = self._gdn_dec_s_req = 0.0
        if linear_share:
            gdn = (*model.linear_heads_per_rank(attn_tp), model.recurrent_state_dtype_bytes,
                   model.linear_conv_kernel_dim)

            def seconds(kernel: str, s: int) -> float:  # per token (s > 1) or request
                flops, nbytes = gdn_kernel_work(kernel, 1, s, *gdn)
                return linear_share * max(flops / kernel_rate, nbytes / mem_rate) / s

            self._gdn_pf_s_tok = (seconds("causal_conv1d_fn", GDN_CHUNK)
                                  + seconds("chunk_gated_delta_rule", GDN_CHUNK))
            self._gdn_dec_s_req = (seconds("causal_conv1d_update", 1)
                                   + seconds("fused_recurrent_gated_delta_rule_packed_decode", 1))
            self._gdn_pf_floor_s = linear_share * p.gdn_prefill_floor_s
            self._gdn_dec_floor_s = linear_share * p.gdn_decode_floor_s
        self._dec_query_scale = decode_query_scale(model, heads)
        kv_bytes = model.kv_bytes_per_token_per_rank(attn_tp, p.kv_dtype_bytes)
        self._kv_mem_s_tok = kv_bytes / model.num_layers / mem_rate  # write or read, per layer
        # Two fused add+RMSNorms (read x and residual, write both) and RoPE (read+write q, k).
        self._attn_elem_s_tok = (8 * h + 2 * rope_elems) * ACT_BYTES / mem_rate

        # Dense MLP layers: on the tokens of all DP ranks over tp GPUs, or with moe_dense_tp=1
        # whole on each GPU over its own tokens (its rank's tokens split over attention TP).
        self._dense_layers = model.num_dense_layers
        self._dense_dp = parallel.moe_dense_tp == 1
        dense_tp = parallel.moe_dense_tp or tp
        # (a model without dense layers needs no dense rate: its checkpoint may name a format
        # for MLPs it does not have, gpt-oss's MXFP4 say, that this GPU cannot run)
        dense_rate = (_block_rate("dense_mlp", prec.dense_mlp, hardware, p)
                      if model.num_dense_layers else math.inf)
        self._dense_floor_s = 2 * p.gemm_floor_s  # gate_up and down
        inter = model.intermediate_size / dense_tp
        self._dense_s_tok = 2 * model.dense_mlp_params / dense_tp / dense_rate
        self._dense_w_bytes = (model.dense_mlp_params * DTYPES[prec.dense_mlp].weight_bytes
                               / dense_tp)
        self._dense_act_tok = (2 * h + 3 * inter) * ACT_BYTES  # gate_up in/out, down in/out
        self._dense_elem_s_tok = 3 * inter * ACT_BYTES / mem_rate  # silu(gate) * up

        # MoE layers. Routed experts see the tokens of all DP ranks spread over the ep GPUs.
        # Without DeepEP the shared experts and router run over tp on the gathered tokens
        # ("global" terms, per token of the instance); with DeepEP SGLang replicates the shared
        # experts (tp_size=1) and each GPU runs them on its own tokens ("local" terms, per
        # token of one GPU).
        self._moe_layers = model.num_moe_layers
        self._deepep = parallel.moe_a2a == "deepep"
        self._tbo = parallel.two_batch_overlap
        self._decode_fixed: dict[tuple[int, int], tuple] = {}  # see _decode_step_s
        if model.is_moe:
            e, k = model.num_experts, model.experts_per_token
            moe_rate = _block_rate("moe_experts", prec.moe_experts, hardware, p)
            # The fused routed-expert kernel's floor, the router GEMM's and the shared experts'.
            shared_gemms = 2 if model.num_shared_experts else 0
            self._moe_floor_s = p.moe_floor_s + (1 + shared_gemms) * p.gemm_floor_s
            self._moe_part_floors_s = (p.moe_floor_s, (1 + shared_gemms) * p.gemm_floor_s)
            wb = DTYPES[prec.moe_experts].weight_bytes
            moe_inter = model.moe_intermediate_size / (tp // ep)
            shared = model.num_shared_experts * model.expert_params
            shared_inter = model.num_shared_experts * model.moe_intermediate_size
            router = model.router_params  # kept in BF16 by every quantised checkpoint
            # the experts' slots: EPLB's redundant copies are experts a step reads as well
            self._experts_topk = (e + (p.eplb_redundant_experts or 0), k)
            self._expert_w_bytes = model.expert_params * wb / tp  # per expert hit, per GPU
            pairs_io = k / ep * (2 * h + 3 * moe_inter)  # token-expert pairs on one GPU
            routed_s_tok = 2 * k * model.expert_params / tp / moe_rate
            split = 1 if self._deepep else tp  # shared experts: replicated, or over tp
            shared_s_tok = 2 * (shared + router) / split / moe_rate
            shared_act_tok = (2 * h + 3 * shared_inter / split + e) * ACT_BYTES
            shared_elem_s_tok = 3 * shared_inter / split * ACT_BYTES / mem_rate
            self._moe_w_bytes = (shared * wb + router * ACT_BYTES) / split
            # Routed terms per token of the instance (at the busiest EP rank, scaled by the
            # imbalance); shared-expert and router terms per token they run on: one GPU's under
            # DeepEP, the instance's otherwise.
            self._routed_s_tok = routed_s_tok
            self._routed_act_tok = pairs_io * ACT_BYTES
            self._routed_elem_s_tok = k / ep * moe_inter * 3 * ACT_BYTES / mem_rate
            # (SGLang's Triton MoE; Blackwell's FlashInfer kernels move a rank's rows only)
            self._remote_rows_s_tok = (0.0 if self._deepep or hardware.blackwell
                                       else remote_row_bytes(h, moe_inter, k, ep) / mem_rate)
            self._shared_s_tok = shared_s_tok
            self._shared_act_tok = shared_act_tok
            self._shared_elem_s_tok = shared_elem_s_tok

        # LM head on the last position of each sequence, split over tp; with dp_lm_head over
        # each DP rank's GPUs, on that rank's rows (the slowest rank's).
        self._dp_lm_head = parallel.dp_lm_head
        lm_tp = attn_tp if parallel.dp_lm_head else tp
        self._lm_gemm = gemm_terms(model.vocab_size / lm_tp, h, prec.lm_head, hardware, p)

        # Per layer: an all-reduce in each attention-TP group after the output projection, and
        # across all tp GPUs around the MLP (an all-reduce; with DP attention an all-gather
        # before and a reduce-scatter after, which move the same bytes). Ring all-reduce time:
        # 2 (n - 1) / n * bytes / link bandwidth, plus a fixed latency per call. DeepEP
        # replaces the MLP collective of MoE layers. A group larger than one node's NVLink
        # domain crosses its nodes' NICs (`ring_link_gb_per_s`).
        def link(gpus: int) -> float:
            return ring_link_gb_per_s(hardware, gpus) * 1e9 * p.comm_efficiency

        self._attn_ar_s_tok = 2 * (attn_tp - 1) / attn_tp * h * ACT_BYTES / link(attn_tp)
        self._attn_ar_fixed_s = p.allreduce_latency_s if attn_tp > 1 else 0.0
        self._mlp_ar_s_tok = 2 * (tp - 1) / tp * h * ACT_BYTES / link(tp)
        self._mlp_ar_fixed_s = p.allreduce_latency_s if tp > 1 else 0.0
        # The embedding's and LM head's collectives (`vocab_collectives`), as rings: (the
        # collective, fixed seconds, seconds per row); an all-gather moves half an all-reduce.
        self._vocab_comm = [(c, p.allreduce_latency_s,
                             (2 if c.op == "all_reduce" else 1) * (c.gpus - 1) / c.gpus
                             * c.width * ACT_BYTES / link(c.gpus))
                            for c in vocab_collectives(model, parallel)]
        if self._deepep:
            self._a2a = {mode: self._deepep_cost(mode) for mode in ("low_latency", "normal")}
            self._tbo_sm_share = {normal: tbo_sm_share(hardware, p, normal)
                                  for normal in (False, True)}
        self._layer_overhead_s = p.layer_overhead_s
        self._step_overhead_s = p.step_overhead_s
        self._extend_overhead_s = p.extend_overhead_s

    def deepep_calls_s(self, mode: A2AMode, tokens: float) -> tuple[float, float]:
        """Seconds of one dispatch and of one combine of `tokens` tokens of one GPU (uniform
        routing). Each call pays its mode's latency (plus the RDMA one when the EP group spans
        nodes) and moves its bytes over NVLink and RDMA at once: the slower link sets it."""
        p, hw, m = self.params, self.hardware, self.model
        traffic = deepep_traffic(tokens, m.hidden_size, m.experts_per_token, self.parallel.ep,
                                 hw.gpus_per_node, mode)
        ll = mode == "low_latency"
        nvlink = hw.nvlink_gb_per_s * 1e9 * (
            p.deepep_ll_nvlink_efficiency if ll else p.deepep_normal_nvlink_efficiency
        )
        rdma = hw.rdma_gb_per_s * 1e9 * p.deepep_rdma_efficiency
        latency = p.deepep_ll_latency_s if ll else p.deepep_normal_latency_s
        if hw.gpus_per_node < self.parallel.ep:
            latency += p.deepep_rdma_latency_s
        dispatch, combine = (latency + max(call.nvlink_bytes / nvlink, call.rdma_bytes / rdma)
                             for call in (traffic.dispatch, traffic.combine))
        return dispatch, combine

    def _deepep_cost(self, mode: A2AMode) -> tuple[float, float]:
        """(fixed seconds, seconds per token of one GPU) of one dispatch plus one combine."""
        fixed = sum(self.deepep_calls_s(mode, 0.0))
        return fixed, sum(self.deepep_calls_s(mode, 1.0)) - fixed

    def _attention_s(self, shapes: Sequence[BatchShape],
                     kernels: Sequence[BatchShape] | None = None) -> float:
        """One layer's attention block on the slowest DP rank; `kernels`, the ranks' shapes
        before graph padding, if padded (`StepShape`): a padded request's one-token context
        adds next to nothing to the attention kernel, so it runs on the scheduler's batch."""
        slowest = 0.0
        for i, shape in enumerate(shapes):
            n = shape.num_tokens
            if n == 0:
                continue
            attn = self._attention_block_s(self._attn_proj_s(n),
                                           shape if kernels is None else kernels[i], n)
            if attn > slowest:
                slowest = attn
        return slowest

    def _attn_proj_s(self, n: float) -> float:
        """The QKV and output projections of `n` tokens."""
        return self._attn_gemm_floor_s + max(
            n * self._attn_proj_s_tok,
            (self._attn_w_bytes + n * self._attn_act_tok) / self._mem_rate)

    def _attention_block_s(self, proj: float, shape: BatchShape, n: float) -> float:
        """One rank's attention block: projections `proj`, kernels, norms, all-reduce."""
        return (proj + self.attention_kernels_s(shape) + n * self._attn_elem_s_tok
                + self._attn_ar_fixed_s + n * self._attn_ar_s_tok)

    def attention_kernels_s(self, shape: BatchShape) -> float:
        """One layer's attention kernels (prefill and decode parts) on one GPU of a rank."""
        q = shape.decode_query_len
        pf = shape.prefill_tokens
        prefill = 0.0
        if pf:
            pairs = shape.prefill_attn_pairs + pf * self._pf_extra_pairs_tok
            per_pair = self._pf_attn_s_pair
            prefix = shape.prefill_prefix_tokens
            if prefix and self._mla_threshold:
                if mla_extend_form(prefix, self._mla_threshold) == "absorbed":
                    per_pair = self._absorbed_s_pair
                else:
                    prefill += self._reproject.at(prefix)
            prefill += self._attn_floor_s + max(pairs * per_pair, pf * self._kv_mem_s_tok)
            if self._gdn_pf_s_tok:
                prefill += self._gdn_pf_floor_s + pf * self._gdn_pf_s_tok
        # Each of a request's q query tokens attends over its whole context; the KV is read
        # once for all of them, and their own q entries are written.
        reqs = shape.decode_reqs
        decode = 0.0
        if reqs:
            ctx = shape.decode_context_tokens
            decode = self._attn_floor_s + reqs * self._decode_req_s + max(
                ctx * self._dec_query_scale(q) * self._dec_attn_s_ctx,
                (ctx + reqs * q) * self._kv_mem_s_tok)
            if self._gdn_dec_s_req:  # each draft token's state is kept (for rollback)
                decode += self._gdn_dec_floor_s + reqs * q * self._gdn_dec_s_req
        return prefill + decode

    def _imbalance(self, tokens: float) -> float:
        """E[busiest EP rank's routed tokens] / the mean rank's (1 without the load model)."""
        return 1.0 if self._load is None else self._load.imbalance(tokens)

    def _moe_s(self, tokens: float, routed_tokens: float, shared_tokens: float) -> float:
        """One MoE layer's expert compute on the busiest GPU: `tokens` of the instance, routed
        as if `routed_tokens` (tokens times the imbalance), shared experts and router on
        `shared_tokens`; one of them 0 prices the other's kernels alone (as single-batch
        overlap runs them, on two streams)."""
        hit = experts_reached(*self._experts_topk, tokens) if routed_tokens else 0.0
        flops_s = routed_tokens * self._routed_s_tok + shared_tokens * self._shared_s_tok
        w_bytes = (self._moe_w_bytes if shared_tokens else 0.0) + hit * self._expert_w_bytes
        act = routed_tokens * self._routed_act_tok + shared_tokens * self._shared_act_tok
        elem = (routed_tokens * self._routed_elem_s_tok + shared_tokens * self._shared_elem_s_tok
                + (tokens * self._remote_rows_s_tok if routed_tokens else 0.0))
        floor = (self._moe_floor_s if routed_tokens and shared_tokens
                 else self._moe_part_floors_s[0 if routed_tokens else 1])
        return floor + max(flops_s, (w_bytes + act) / self._mem_rate) + elem

    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        if len(shapes) == 1 and not self._tbo:
            shape = shapes[0]
            if shape.decode_reqs and not shape.prefill_tokens:
                return self._decode_step_s(shape)
        return sum(self._parts(shapes))

    def _decode_step_s(self, shape: BatchShape) -> float:
        """A decode-only step of one rank, the floats of `sum(self._parts((shape,)))`: all but
        the attention kernels depend only on the batch's size and query length, so those parts
        are kept per (requests, query length) and only the context-dependent chain is redone
        (a simulated decode step calls this with a new context every time)."""
        key = (shape.decode_reqs, shape.decode_query_len)
        fixed = self._decode_fixed.get(key)
        if fixed is None:
            step = self._shape((shape,))
            n = float(step.totals.tokens)
            rest = self._parts_but_attention(step, math.nan)
            fixed = self._decode_fixed[key] = (self._attn_proj_s(n), n, rest)
        proj, n, rest = fixed
        attn = self._attention_block_s(proj, shape, n)
        attn = (attn if attn > 0.0 else 0.0) + self._layer_overhead_s
        return sum(with_eager_overhead((self._layers_attention_s(attn), *rest), self._host,
                                       False, shape.decode_reqs, shape.num_tokens))

    def step_breakdown_s(self, shapes: Sequence[BatchShape]) -> dict[str, float]:
        """Seconds of one step by part (`BREAKDOWN_PARTS`), summed over its layers; the
        values add up to `step_time_s`. attention: projections, kernels, attention-TP
        all-reduce, norms, per-layer overhead; moe_experts: routed and shared experts, router;
        moe_comm: the MLP collective or DeepEP's dispatch/combine; tbo_overlap: what two-batch
        overlap changes (negative where it hides communication, positive where splitting a
        weight-bound batch reads the weights twice); overhead: per step and extend, and with
        pipeline stages the send to the next stage."""
        return dict(zip(BREAKDOWN_PARTS, self._parts(shapes)))

    def _parts(self, shapes: Sequence[BatchShape]) -> tuple[float, ...]:
        """The step's parts in `BREAKDOWN_PARTS` order."""
        step = self._shape(shapes)
        if step.totals.tokens == 0:
            return (0.0,) * len(BREAKDOWN_PARTS)
        attn = self._attention_s(step.ranks, step.raw) + self._layer_overhead_s
        parts = (self._layers_attention_s(attn), *self._parts_but_attention(step, attn))
        return with_eager_overhead(parts, self._host, step.totals.has_prefill,
                                   max_rank_decode_reqs(shapes), step.totals.max_rank_tokens,
                                   tbo_splits(self.parallel, self.params.role, shapes))

    def _layers_attention_s(self, attn: float) -> float:
        return layers_attention_s(attn, self._dense_layers, self._moe_layers)

    def _parts_but_attention(self, step: StepShape, attn: float) -> tuple[float, ...]:
        """The parts after `attention` in `BREAKDOWN_PARTS` order; `attn` (one layer's attention
        block) is read only by two-batch overlap."""
        totals = step.totals
        tokens, max_rank_tokens, lm_rows, max_rank_rows, has_prefill = totals
        mlp_comm = self._mlp_ar_fixed_s + tokens * self._mlp_ar_s_tok
        dense_mlp = dense_comm = 0.0
        if self._dense_layers:
            layers = self._dense_layers
            n = max_rank_tokens / self.parallel.attn_tp if self._dense_dp else tokens
            dense_mlp = layers * (self._dense_floor_s + n * self._dense_elem_s_tok + max(
                n * self._dense_s_tok,
                (self._dense_w_bytes + n * self._dense_act_tok) / self._mem_rate))
            dense_comm = 0.0 if self._dense_dp else layers * mlp_comm
        experts = comm = tbo = 0.0
        if self._moe_layers:
            experts, comm, tbo = self._moe_layers_s(step, attn, mlp_comm)
        lm_head = self._lm_gemm.at(max_rank_rows if self._dp_lm_head else lm_rows)
        vocab_comm = 0.0
        for collective, fixed, s_row in self._vocab_comm:
            if rows := collective.count(totals):
                vocab_comm += fixed + rows * s_row
        overhead = self._pp_send.at(max_rank_tokens)
        if self.params.scheduler_overhead:
            overhead += self._step_overhead_s + (self._extend_overhead_s if has_prefill else 0.0)
        return dense_mlp, dense_comm, experts, comm, tbo, lm_head, vocab_comm, overhead

    def _moe_layers_s(self, step: StepShape, attn: float, mlp_comm: float
                      ) -> tuple[float, float, float]:
        """The MoE layers' (experts, communication, two-batch-overlap change), attention
        apart; with two-batch overlap (`overlapped_layers_s`) the change is against attention
        + experts + communication unsplit. The fused kernel runs on the padded rows; DeepEP
        dispatches and computes the scheduler's."""
        layers = self._moe_layers
        if not self._deepep:
            tokens = step.totals.tokens
            imbalance = self._imbalance(tokens)
            return (layers * self._moe_s(tokens, tokens * imbalance, tokens), layers * mlp_comm,
                    0.0)
        shapes = step.raw
        tokens, max_rank_tokens, _, _, has_prefill = step.raw_totals
        normal = deepep_normal(self.params.role, has_prefill)
        a2a = self._a2a["normal" if normal else "low_latency"]
        if self.parallel.single_batch_overlap and not normal:
            experts, comm = self._single_batch_overlap_layer_s(tokens, max_rank_tokens)
            return layers * experts, layers * comm, 0.0
        experts, comm = self._deepep_layer_s(tokens, max_rank_tokens, a2a)
        tbo = 0.0
        if tbo_splits(self.parallel, self.params.role, shapes):
            halves = [self._micro_batch_s(half, a2a) for half in micro_batches(shapes)]
            tbo = (overlapped_layers_s(layers, *halves, self._tbo_sm_share[normal])
                   - layers * (attn + experts + comm))
        return layers * experts, layers * comm, tbo

    def _deepep_layer_s(self, tokens: float, max_rank_tokens: float,
                        a2a: tuple[float, float]) -> tuple[float, float]:
        """One MoE layer's experts and DeepEP dispatch + combine on the busiest GPU. Each GPU
        sends the copies of its share of its rank's tokens; the busiest receives `imbalance`
        times the mean share and sends as many outputs back."""
        imbalance, gpu_tokens, busiest = self._deepep_loads(tokens, max_rank_tokens)
        fixed_s, per_token_s = a2a
        return (self._moe_s(tokens, tokens * imbalance, gpu_tokens),
                fixed_s + busiest * per_token_s)

    def _deepep_loads(self, tokens: float, max_rank_tokens: float
                      ) -> tuple[float, float, float]:
        """(the routed load's imbalance, tokens of one GPU, tokens the busiest GPU sends and
        receives) of a MoE layer under DeepEP."""
        attn_tp, tp = self.parallel.attn_tp, self.parallel.tp
        imbalance = self._imbalance(tokens)
        return (imbalance, max(max_rank_tokens / attn_tp, tokens / tp),
                max(max_rank_tokens / attn_tp, tokens / tp * imbalance))

    def _single_batch_overlap_layer_s(self, tokens: float, max_rank_tokens: float
                                      ) -> tuple[float, float]:
        """`_deepep_layer_s` of a decode step under single-batch overlap: the shared experts
        (and router) and the routed experts priced apart, the dispatch and the combine apart,
        overlapped as `single_batch_overlap_s` says."""
        imbalance, gpu_tokens, busiest = self._deepep_loads(tokens, max_rank_tokens)
        dispatch, combine = self.deepep_calls_s("low_latency", busiest)
        return single_batch_overlap_s(dispatch, combine, self._moe_s(tokens, 0.0, gpu_tokens),
                                      self._moe_s(tokens, tokens * imbalance, 0.0),
                                      self.hardware, self.model.precision.moe_experts)

    def _micro_batch_s(self, shapes: Sequence[BatchShape], a2a: tuple[float, float]
                       ) -> tuple[float, float]:
        """One micro-batch's compute (attention block and experts) and DeepEP time per MoE
        layer; an empty one computes nothing but still joins the dispatch and combine."""
        tokens, max_rank_tokens, *_ = step_totals(shapes)
        if not tokens:
            return 0.0, a2a[0]
        experts, comm = self._deepep_layer_s(tokens, max_rank_tokens, a2a)
        return self._attention_s(shapes) + self._layer_overhead_s + experts, comm


class PoolSizes(NamedTuple):
    """One attention-DP rank's pools: KV tokens (of the full-attention layers) and state slots
    (requests that can hold a recurrent state at once; 0 when the model keeps none)."""

    kv_tokens: int
    state_slots: int


# SGLang's defaults for hybrid models (--swa-full-tokens-ratio, --mamba-full-memory-ratio).
SWA_FULL_TOKENS_RATIO = 0.8
MAMBA_FULL_MEMORY_RATIO = 0.9


def kv_capacity_tokens(
    model: ModelSpec,
    hardware: HardwareSpec,
    parallel: Parallelism,
    mem_fraction_static: float = 0.88,
    kv_dtype_bytes: float = 2,
) -> int:
    """KV tokens one attention-DP rank can hold (`pool_sizes` with SGLang's hybrid defaults)."""
    return pool_sizes(model, hardware, parallel, mem_fraction_static, kv_dtype_bytes).kv_tokens


def pool_sizes(
    model: ModelSpec,
    hardware: HardwareSpec,
    parallel: Parallelism,
    mem_fraction_static: float = 0.88,
    kv_dtype_bytes: float = 2,
    *,
    max_mamba_cache_size: int | None = None,
    mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO,
    swa_full_tokens_ratio: float = SWA_FULL_TOKENS_RATIO,
    redundant_experts: int = 0,
) -> PoolSizes:
    """KV tokens and recurrent-state slots one attention-DP rank can hold.

    SGLang's rule: `mem_fraction_static` of each GPU's memory holds the weights and the pools.
    Each GPU of a DP rank stores every token of that rank's pool, but only its own slice of it
    (GQA: its KV heads; MLA: the whole latent, replicated), so the tokens that fit are the free
    bytes of one GPU over the per-GPU bytes of one token. The same count holds for every DP
    rank. With pipeline stages a GPU holds only its stage's layers, weights and KV (the slowest
    stage's, which holds the most). EPLB's `redundant_experts` copies are weights too.

    Hybrid models, as SGLang sizes them: the recurrent states of linear-attention layers take
    `max_mamba_cache_size` slots, or (None) `mamba_full_memory_ratio` of the KV pool's memory
    (state : KV = ratio : 1); sliding-window layers get a pool of `swa_full_tokens_ratio` times
    the full-attention tokens, so a token of the pool costs its full-attention KV plus that
    share of its sliding-window KV.
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    if mamba_full_memory_ratio <= 0 or swa_full_tokens_ratio <= 0:
        raise ValueError(f"mamba_full_memory_ratio ({mamba_full_memory_ratio}) and "
                         f"swa_full_tokens_ratio ({swa_full_tokens_ratio}) must be > 0")
    budget = hardware.hbm_bytes * mem_fraction_static
    weights = weight_bytes_per_gpu(model, parallel, redundant_experts)
    free = budget - weights
    if free <= 0:
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} at tp={parallel.tp}: its weights "
            f"take {weights / 2**30:.1f} GiB per GPU but only {budget / 2**30:.1f} GiB "
            f"({mem_fraction_static} x {hardware.hbm_gib} GiB) is available; raise tp or "
            f"mem_fraction_static"
        )
    stage = stage_model(model, parallel.pp)
    attn_tp = parallel.attn_tp
    per_token = (stage.kv_bytes_per_token_per_rank(attn_tp, kv_dtype_bytes)
                 + swa_full_tokens_ratio * stage.swa_bytes_per_token_per_rank(
                     attn_tp, kv_dtype_bytes))
    state_bytes = stage.recurrent_state_bytes_per_request_per_rank(attn_tp)
    slots = 0
    if state_bytes:
        if max_mamba_cache_size is None:
            slots = int(free * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)
                        // state_bytes)
        else:
            slots = max_mamba_cache_size
        free -= slots * state_bytes
        if slots < 1 or free <= 0:
            raise ValueError(
                f"{model.name}: {slots} recurrent-state slots of {state_bytes / 2**20:.1f} MiB "
                f"leave no room for a KV pool (or hold no request); change "
                "max_mamba_cache_size, mamba_full_memory_ratio, tp or mem_fraction_static"
            )
    return PoolSizes(int(free // per_token), slots)
