"""Speculative decoding (MTP, EAGLE) in the simulator: the acceptance model and the draft's cost.

The real backend runs its own MTP draft (runtime/speculative.py); here its cost and its
acceptance are modelled (`pdsim calibrate` measures the served acceptance into
`speculative.acceptance`). Each decode step of a speculating instance (SGLang's EAGLE worker with top-k 1, which also runs DeepSeek's MTP) is

1. a **verify** forward of the target model with k + 1 query tokens per request (the last
   accepted token and k drafts): the core plans it as a `BatchShape` with
   `decode_query_len = k + 1`, priced by the base cost model;
2. a **draft extend** over the same positions (the draft model fills its KV and hidden states
   for the accepted tokens and proposes the first draft of the next step);
3. k - 1 **draft decode** forwards with one query token per request (the remaining drafts).

So a step costs `target(verify) + draft(verify shape) + (k - 1) * draft(one token each)`,
except that SGLang replays the k - 1 one-token forwards as one CUDA graph
(`EAGLEDraftCudaGraphRunner` captures its whole `draft_forward` loop): the per-step fixed
cost they carry (`step_overhead_s` of the roofline and silicon models) is paid once for
them. An extend (a prompt's prefill) also runs the draft extend over the prompt: the draft
needs its KV. The draft is a `ModelSpec` priced by the same registered cost model as the target:

- `mtp`: DeepSeek-V3's multi-token-prediction module, one decoder layer of the target's kind
  (`draft_layers` of them) with the target's LM head, run once per draft token;
- `eagle`: a small draft model, `draft_model` (a preset or config.json) or else `draft_layers`
  layers of the target's attention with a dense MLP.

The draft's weights and KV take GPU memory from the KV pool (`kv_capacity_with_draft`), and
its state moves with the KV in PD: its KV pages with the target's, and the last hidden state
with each request's last chunk (`draft_state_bytes_per_request`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdsim.core.batch import BatchShape
from pdsim.sim.cost import ACT_BYTES, CostModel, Parallelism, StepParams, make_cost_model
from pdsim.sim.forward_shape import StepShaper
from pdsim.specs.hardware import HardwareSpec
from pdsim.specs.models import LINEAR_FIELDS, ModelSpec, load_model_spec

DraftBuilder = Callable[[ModelSpec, int, "str | None"], ModelSpec]
_DRAFTS: dict[str, DraftBuilder] = {}


def register_draft(method: str) -> Callable[[DraftBuilder], DraftBuilder]:
    """Register `(target, draft_layers, draft_model) -> draft ModelSpec` for a method name."""

    def add(builder: DraftBuilder) -> DraftBuilder:
        if method in _DRAFTS:
            raise ValueError(f"speculative method {method!r} is already registered")
        _DRAFTS[method] = builder
        return builder

    return add


def draft_method_names() -> list[str]:
    return sorted(_DRAFTS)


# A draft's layers attend over the whole context (Qwen3-Next's MTP layer is full attention).
FULL_ATTENTION_ONLY = {"layer_pattern": ("full_attention",), "sliding_window": None,
                       **dict.fromkeys(LINEAR_FIELDS)}


@register_draft("mtp")
def mtp_draft(target: ModelSpec, draft_layers: int, draft_model: str | None) -> ModelSpec:
    """MTP layers are decoder layers of the target's own kind (DeepSeek-V3's is a MoE layer)."""
    if draft_model is not None:
        raise ValueError("speculative.draft_model: MTP drafts with the target's own MTP layers; "
                         "a separate draft model is for method 'eagle'")
    return target.model_copy(update={"name": f"{target.name}-mtp", "num_layers": draft_layers,
                                     "first_k_dense_layers": 0, **FULL_ATTENTION_ONLY})


@register_draft("eagle")
def eagle_draft(target: ModelSpec, draft_layers: int, draft_model: str | None) -> ModelSpec:
    """A named draft model, or `draft_layers` layers of the target's attention, dense MLP."""
    if draft_model is not None:
        return load_model_spec(draft_model)
    return target.model_copy(update={
        "name": f"{target.name}-eagle", "num_layers": draft_layers,
        "first_k_dense_layers": draft_layers if target.is_moe else 0, **FULL_ATTENTION_ONLY,
    })


def draft_spec(method: str, target: ModelSpec, draft_layers: int = 1,
               draft_model: str | None = None) -> ModelSpec:
    try:
        builder = _DRAFTS[method]
    except KeyError:
        raise ValueError(f"unknown speculative method {method!r}; registered: "
                         f"{', '.join(draft_method_names())}") from None
    return builder(target, draft_layers, draft_model)


def accept_len_probs(rates: Sequence[float]) -> tuple[float, ...]:
    """P(a = 1), ..., P(a = k + 1) for emitted tokens a when draft i is accepted with
    probability `rates[i - 1]` given that the drafts before it were (and none after a reject)."""
    probs, reach = [], 1.0
    for rate in rates:
        probs.append(reach * (1 - rate))
        reach *= rate
    probs.append(reach)
    return tuple(probs)


def rate_for_mean_accept_len(mean: float, num_draft_tokens: int) -> float:
    """The per-position acceptance rate p with 1 + p + ... + p^k = `mean` (bisection)."""
    k = num_draft_tokens
    if not 1 <= mean <= k + 1:
        raise ValueError(f"a mean accept length with {k} draft tokens lies in [1, {k + 1}], "
                         f"got {mean}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SpeculativeCostModel:
    """A base cost model's target and draft, composed into one speculative step (see above).

    `graph_fixed_s`: the fixed cost of one draft forward that its one-token forwards share,
    replayed as one graph (a profiled model's measured forwards keep theirs: the real
    backend runs each draft forward on its own)."""

    def __init__(self, target: CostModel, draft: CostModel, num_draft_tokens: int):
        self.target = target
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens
        # Both models replay SGLang's speculative graph sizes (StepShaper.speculating).
        for model, verify in ((target, True), (draft, False)):
            if isinstance(shaper := getattr(model, "_shape", None), StepShaper):
                model._shape = shaper.speculating(verify)
        params = getattr(draft, "params", None)
        self.graph_fixed_s = (params.step_overhead_s if isinstance(params, StepParams)
                              and params.scheduler_overhead else 0.0)

    def step_time_s(self, shapes: Sequence[BatchShape]) -> float:
        total = self.target.step_time_s(shapes) + self.draft.step_time_s(shapes)
        if self.num_draft_tokens > 1 and any(s.decode_reqs for s in shapes):
            one_each = [BatchShape(decode_reqs=s.decode_reqs,
                                   decode_context_tokens=s.decode_context_tokens) for s in shapes]
            steps = self.num_draft_tokens - 1
            total += steps * self.draft.step_time_s(one_each) - (steps - 1) * self.graph_fixed_s
        return total


def make_speculative_cost_model(name: str, model: ModelSpec, hardware: HardwareSpec,
                                parallel: Parallelism, draft: ModelSpec, num_draft_tokens: int,
                                **params: object) -> SpeculativeCostModel:
    """The registered cost model `name` for the target and for its draft, composed. A dense
    draft of a MoE target runs without expert parallelism (nor its all-to-all)."""
    draft_par = parallel if draft.is_moe else Parallelism(tp=parallel.tp,
                                                          dp_attention=parallel.dp_attention)
    return SpeculativeCostModel(
        make_cost_model(name, model, hardware, parallel, **params),
        make_cost_model(name, draft, hardware, draft_par, **params),
        num_draft_tokens,
    )


def kv_capacity_with_draft(target_tokens: int, target: ModelSpec, draft: ModelSpec,
                           parallel: Parallelism, kv_dtype_bytes: float) -> int:
    """KV tokens of one attention-DP rank when a draft speculates: its weights take GPU memory,
    and every token also holds the draft's KV (the draft's pool shares the target's token
    slots). `target_tokens` is what fits without a draft (`kv_capacity_tokens`).

    A draft of the target's hidden and vocabulary sizes (MTP, an EAGLE head) shares the target's
    embedding and LM head, so only its layers count; another draft model counts whole."""
    attn_tp = parallel.attn_tp
    per_token = target.kv_bytes_per_token_per_rank(attn_tp, kv_dtype_bytes)
    draft_per_token = draft.kv_bytes_per_token_per_rank(attn_tp, kv_dtype_bytes)
    ep = parallel.ep if draft.is_moe else 1
    weights = draft.weight_bytes_per_rank(parallel.tp, ep, parallel.dp_attention)
    if (draft.hidden_size, draft.vocab_size) == (target.hidden_size, target.vocab_size):
        # Minus what the same spec holds without layers: the embedding, LM head, final norm.
        head = draft.model_copy(update={"num_layers": 0, "first_k_dense_layers": 0})
        weights -= head.weight_bytes_per_rank(parallel.tp, ep, parallel.dp_attention)
    free = target_tokens * per_token - weights
    return max(0, int(free // (per_token + draft_per_token)))


def draft_state_bytes_per_request(target: ModelSpec) -> float:
    """What the prefill side ships per request besides KV pages: the last position's hidden
    state (bf16), from which the decode side's first draft starts."""
    return target.hidden_size * ACT_BYTES
