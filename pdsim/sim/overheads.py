"""Host-side costs of a forward step that no kernel table holds (both cost models).

SGLang replays decode batches of up to `--cuda-graph-max-bs` requests per rank as CUDA graphs:
one launch for the whole forward. Every other forward (prefill/extend, and decode batches
above that size) runs eagerly: the host launches each kernel of each layer from Python while
the GPU runs the ones already launched, so the forward takes the longer of its kernels and
its launches. Short forwards are host-bound; long ones hide their launches. docs/cost_model.md,
"Host overheads", gives the measured eager-vs-graph forwards behind the per-launch cost and
the per-layer kernel counts below.
"""

from __future__ import annotations

from pdsim import sglang_defaults
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import ModelSpec
from pdsim.specs.precision import DTYPES

EAGER_LAUNCH_S = 25e-6  # host time of one eager kernel launch from SGLang's Python layers
# An eager MLA attention block (SGLang's DeepseekV2AttentionMLA) holds more host work than its
# launches at EAGER_LAUNCH_S. aiconfigurator's wide-EP MLA context module tables time the block
# eagerly, calls back to back with one synchronisation, so at 1-256 tokens, where the GPU waits
# for the host, a call's time is its host time: 517-666 us on the x86 hosts of its H100, H200,
# B200 and B300 (SGLang 0.5.6-0.5.10; fa3, flashinfer, trtllm_mla), ~600 the median, and
# 826-930 us on GB200/GB300's Grace. Less the module's random latent (one launch): 575 us for the
# 12 of the block's launches it runs (all but the add+RMSNorm and the fused q_a/kv_a GEMM with
# its quantisation), 23 launches' worth.
MLA_EAGER_BLOCK_S = 575e-6
MLA_BLOCK_LAUNCHES = 12
# Likewise an eager DeepEP MoE core (SGLang's DeepEPMoE.run_moe_core, between dispatch and
# combine): aiconfigurator's wide-EP MoE context tables time it eagerly, synchronised before
# each call, so at 32-256 tokens a row is its host time: 303-437 us on the x86 hosts (DeepSeek-
# V3's experts, EP 2-16, SGLang 0.5.10), 378 us the median; 495-687 us on Grace. It holds 3 of
# the launches `kernels_per_layer` counts (the grouped gate_up and down, the activation).
DEEPEP_MOE_CORE_EAGER_S = 378e-6
DEEPEP_MOE_CORE_LAUNCHES = 3


def attention_elementwise_kernels(model: ModelSpec) -> int:
    """Kernels of a full-attention layer's attention block that are neither GEMMs nor the
    attention kernel nor the layer's add+RMSNorm, from SGLang's layer code: RoPE and the
    KV-cache store; MLA adds the q_a and kv_a latent RMSNorms and the q/k concat; a GQA
    model with `qk_norm` (Qwen3) the fused per-head q/k RMSNorm."""
    return 5 if model.is_mla else 2 + model.qk_norm


def kernels_per_layer(model: ModelSpec, tp: int, attn_tp: int, dp_attention: int, deepep: bool,
                      dense_dp: bool) -> tuple[float, float]:
    """Kernels one eager forward launches per (dense layer, MoE layer), counted from the ops
    SGLang's layers run (docs/cost_model.md, "Host overheads"): FP8 GEMMs add one activation-
    quantisation kernel each; a collective is one launch. A hybrid model's attention block is
    the mean over its layers of their two kinds."""
    prec = model.precision
    fp8_attn = DTYPES[prec.attention].compute == "fp8"
    # add+RMSNorm, the GEMMs (MLA: fused q_a/kv_a, q_b, kv_b in prefill or the two absorbed
    # BMMs in decode, o; GQA: QKV, o), the attention kernel and the elementwise kernels
    gemms = 4 if model.is_mla else 2
    attn = 2 + gemms * (1 + fp8_attn) + attention_elementwise_kernels(model)
    if model.num_linear_layers:
        # Gated DeltaNet: add+RMSNorm, in_proj_qkvz and in_proj_ba GEMMs, their fused split,
        # the gates, the causal convolution, the chunked scan's eight (q and k L2 norms, gate
        # cumsum, chunk k·k^T, triangular solve, w/u, chunk states, output), the final
        # state's copy into the state pool (SGLang's extend path before it wrote in place),
        # gated RMSNorm, out_proj GEMM
        linear = 17 + 3 * fp8_attn
        attn = (1 - model.linear_share) * attn + model.linear_share * linear
    attn += attn_tp > 1
    mlp_collectives = 0 if tp == 1 else (1 if dp_attention == 1 else 2)
    fp8_dense = DTYPES[prec.dense_mlp].compute == "fp8"
    # add+RMSNorm, gate_up GEMM, SiLU-and-mul, down GEMM
    dense = attn + 4 + 2 * fp8_dense + (0 if dense_dp else mlp_collectives)
    if not model.is_moe:
        return dense, 0
    fp8_moe = DTYPES[prec.moe_experts].compute == "fp8"
    # add+RMSNorm, router GEMM, top-k; shared experts as a dense MLP without its norm
    moe = attn + 3 + (3 + 2 * fp8_moe if model.num_shared_experts else 0)
    if deepep:  # layout, dispatch, grouped gate_up, SiLU-and-mul(+quant), grouped down, combine
        moe += 6 + fp8_moe
    else:  # align/sort, fused gate_up, SiLU-and-mul, fused down, sum over top-k, collective
        moe += 5 + 2 * fp8_moe + mlp_collectives
    return dense, moe


# A piecewise-graphed extend launches per layer the graph of the ops up to the next attention
# call and the attention call itself, eager: its KV-cache store and its kernel (SGLang's
# torch.compile backend splits the forward at `unified_attention_with_output`).
PIECEWISE_LAUNCHES_PER_LAYER = 3


class HostOverheads:
    """The eager overhead of one instance's forwards (module docstring).

    launch_s: host seconds per kernel launch;
    cuda_graph_max_bs: the largest per-rank decode batch replayed as a graph;
    piecewise_max_tokens: with piecewise CUDA graphs, the largest batch (tokens per rank) an
    extend runs piecewise-graphed; None: every extend runs eagerly;
    piecewise_moe_eager: a MoE layer's eager work inside a piecewise-graphed extend beyond its
    attention call, in launches' worth (v0.5.23's DeepEP MoE forward);
    dense_excess, moe_excess: a (dense, MoE) layer's host work beyond its launches, in
    launches' worth (`host_overheads`: an MLA attention block's, a DeepEP MoE core's);
    micro_batches: how many times a step split by two-batch overlap runs each layer's ops
    (the kernel counts and excesses above are per split step)."""

    def __init__(self, model: ModelSpec, dense_kernels: float, moe_kernels: float,
                 launch_s: float, cuda_graph_max_bs: int,
                 piecewise_max_tokens: int | None = None, dense_excess: float = 0.0,
                 moe_excess: float = 0.0, micro_batches: int = 1,
                 piecewise_moe_eager: float = 0.0) -> None:
        self.launches = model.num_dense_layers * dense_kernels + model.num_moe_layers * moe_kernels
        excess = model.num_dense_layers * dense_excess + model.num_moe_layers * moe_excess
        self.eager_host_s = (self.launches + excess) * launch_s
        self.micro_batches = micro_batches
        self.cuda_graph_max_bs = cuda_graph_max_bs
        self.piecewise_max_tokens = piecewise_max_tokens
        self.piecewise_launches = PIECEWISE_LAUNCHES_PER_LAYER * model.num_layers + 1
        # what a graphed extend runs eagerly beyond its attention calls, in launches' worth a MoE
        # layer (v0.5.23's DeepEP MoE forward between two graph segments)
        self.piecewise_launches += model.num_moe_layers * piecewise_moe_eager
        self.piecewise_host_s = self.piecewise_launches * launch_s

    def eager(self, has_prefill: bool, max_rank_decode_reqs: int) -> bool:
        """Whether SGLang runs this step without its decode graphs (extend, or a decode batch
        above them)."""
        return has_prefill or max_rank_decode_reqs > self.cuda_graph_max_bs

    def host_s(self, has_prefill: bool, max_rank_decode_reqs: int, max_rank_tokens: int,
               split: bool = True) -> float:
        """Host seconds of launches for a step (0 for a graphed decode step); `split` false:
        a step two-batch overlap leaves whole launches its ops once."""
        if not self.eager(has_prefill, max_rank_decode_reqs):
            return 0.0
        if (has_prefill and self.piecewise_max_tokens is not None
                and max_rank_tokens <= self.piecewise_max_tokens):
            return self.piecewise_host_s
        return self.eager_host_s if split else self.eager_host_s / self.micro_batches

    def overhead_s(self, has_prefill: bool, max_rank_decode_reqs: int, max_rank_tokens: int,
                   kernels_s: float, split: bool = True) -> float:
        """Seconds the host's launches add to a step whose kernels take `kernels_s` and whose
        busiest rank runs `max_rank_tokens` tokens: what they outlast the kernels by."""
        return max(0.0, self.host_s(has_prefill, max_rank_decode_reqs, max_rank_tokens, split)
                   - kernels_s)


PIECEWISE_RULES = ("v0.5.10", "v0.5.23")


def piecewise_eligible(model: ModelSpec, parallel, rules: str = "v0.5.23",
                       role: str = "colocated") -> bool:
    """Whether SGLang runs this instance's extends as piecewise CUDA graphs when asked.

    v0.5.10 (`_handle_piecewise_cuda_graph`, `server_args.py`): its torch.compile piecewise
    graphs are off with DP attention, an all-to-all MoE backend, pipeline stages, hybrid
    linear-attention models and PD disaggregation (`disaggregation_mode` not "null"), so only
    a colocated instance runs them.
    v0.5.23 (`arg_groups/cuda_graph_hook.py`, `disable_breakable_cudagraph_if_incompatible`,
    `apply_cuda_graph_compatibility`, `apply_cuda_graph_disaggregation_roles`): its breakable
    prefill graphs, the default on CUDA, stay on for PD prefill servers, DP attention and
    DeepEP, and are off with two-batch overlap and pipeline stages (opt-in). pdsim keeps them
    off for hybrid linear-attention models, whose graphed launches it does not count."""
    if rules not in PIECEWISE_RULES:
        raise ValueError(f"piecewise CUDA graph rules {rules!r}; one of {PIECEWISE_RULES}")
    if parallel.pp != 1 or model.num_linear_layers:
        return False
    if rules == "v0.5.10":
        return (parallel.dp_attention == 1 and parallel.moe_a2a == "none"
                and role == "colocated")
    return parallel.moe_a2a in ("none", "deepep") and not parallel.two_batch_overlap


def host_overheads(model: ModelSpec, hardware: HardwareSpec, parallel,
                   launch_s: float | None, cuda_graph_max_bs: int | None,
                   piecewise_max_tokens: int | None = None, piecewise_rules: str = "v0.5.23",
                   role: str = "colocated") -> HostOverheads:
    """The eager overhead of an instance of `model` on `parallel` (a cost model's
    `Parallelism`: tp, attn_tp, dp_attention, moe_a2a, moe_dense_tp, two_batch_overlap, pp);
    launch_s None is EAGER_LAUNCH_S on the system's host (`host_time_scale`);
    cuda_graph_max_bs None is SGLang's default for the GPU; piecewise_max_tokens None: no
    piecewise CUDA graphs (dropped, as SGLang drops them, where `piecewise_eligible` says no
    under `piecewise_rules` for the instance's `role`). Under v0.5.23 a DeepEP MoE layer's
    `a2a_forward_with_output` (dispatch, expert core, combine) runs eagerly between two graph
    segments: its DeepEP launches, the core's excess and one more segment a layer.
    Two-batch overlap runs every layer's ops once per micro-batch (SGLang's
    `execute_overlapped_operations`; a lone prompt is cut in two token halves), so an eager
    step it splits launches each kernel twice. An MLA attention block takes MLA_EAGER_BLOCK_S at
    EAGER_LAUNCH_S (in proportion to `launch_s`), more than its MLA_BLOCK_LAUNCHES launches; a
    DeepEP MoE core DEEPEP_MOE_CORE_EAGER_S, more than its DEEPEP_MOE_CORE_LAUNCHES."""
    dense, moe = kernels_per_layer(model, parallel.tp, parallel.attn_tp, parallel.dp_attention,
                                   parallel.moe_a2a == "deepep", parallel.moe_dense_tp == 1)
    micro_batches = 2 if parallel.two_batch_overlap else 1
    if launch_s is None:
        launch_s = EAGER_LAUNCH_S * hardware.host_time_scale
    graph_bs = (sglang_defaults.cuda_graph_max_bs(hardware.hbm_gib, parallel.tp)
                if cuda_graph_max_bs is None else cuda_graph_max_bs)
    piecewise = (piecewise_max_tokens
                 if piecewise_eligible(model, parallel, piecewise_rules, role) else None)
    attention = MLA_EAGER_BLOCK_S / EAGER_LAUNCH_S - MLA_BLOCK_LAUNCHES if model.is_mla else 0.0
    experts = (DEEPEP_MOE_CORE_EAGER_S / EAGER_LAUNCH_S - DEEPEP_MOE_CORE_LAUNCHES
               if parallel.moe_a2a == "deepep" else 0.0)
    moe_eager = 0.0
    if parallel.moe_a2a == "deepep":
        fp8_moe = DTYPES[model.precision.moe_experts].compute == "fp8"
        # layout, dispatch, grouped gate_up, SiLU-and-mul(+quant), grouped down, combine; the
        # core's host work beyond its launches; the graph segment after it
        moe_eager = 6 + fp8_moe + experts + 1
    return HostOverheads(model, dense * micro_batches, moe * micro_batches, launch_s, graph_bs,
                         piecewise, dense_excess=attention * micro_batches,
                         moe_excess=(attention + experts) * micro_batches,
                         micro_batches=micro_batches, piecewise_moe_eager=moe_eager)
