"""`pdsim explain`: one step of a config's role, priced op by op.

The config's cost model for the role (as a run builds it) prices one step: a decode step of
`batch` requests at `context` tokens each, or `prompts` prompts of `prompt` tokens prefilled in
the extend steps the role's scheduler cuts them into, every attention-DP rank running the same.
A colocated instance runs both kinds of step: prompt options ask for its extend step. Each row is
one op: how many times the step runs it (its layers), seconds per call and in all, its share of
the step and how it was priced. The silicon model traces its table lookups
(`SiliconCostModel.trace`), so its rows are kernels with the table each came from; the
roofline's rows are its step-breakdown parts, all "roofline". A speculating role's step is
its target's verify forward (k + 1 query tokens a request) op by op, then the draft's
forwards part by part: its extend over the same shape and, decoding, its k - 1 one-token
forwards (pdsim.sim.speculative).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pdsim import sglang_defaults
from pdsim.config import ExperimentConfig
from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.core.chunking import chunk_cap
from pdsim.core.config import SchedulerConfig
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import BREAKDOWN_PARTS, SHARE_GROUPS, part_group
from pdsim.sim.silicon import SiliconCostModel
from pdsim.sim.speculative import SpeculativeCostModel

# What a breakdown part is called where it is one row (the roofline's parts, and the parts
# the silicon model prices without a table).
PART_NAMES = {
    "attention": "attention block", "dense_mlp": "dense MLP", "dense_comm": "MLP all-reduce",
    "moe_experts": "MoE experts", "moe_comm": "MoE communication",
    "tbo_overlap": "two-batch overlap", "lm_head": "LM head", "vocab_comm": "vocab collectives",
    "overhead": "host overhead",
}
# Worst first: a row merged from several lookups reports the least direct of them.
_HOW_ORDER = ("extrapolated", "transferred", "derived", "roofline", "constant", "interpolated")


@dataclass
class OpRow:
    """One op of the step: `count` calls of `each_s` seconds (summed over chunks when a prompt
    is chunked)."""

    name: str
    part: str  # pdsim.sim.cost.BREAKDOWN_PARTS
    group: str  # pdsim.sim.cost.SHARE_GROUPS
    count: int
    total_s: float
    table: str
    how: str

    @property
    def each_s(self) -> float:
        return self.total_s / self.count


@dataclass
class Explanation:
    role: str
    cost_model: str
    model: str
    hardware: str
    step: str  # the priced step in words
    steps: list[list[BatchShape]]  # the rank shapes of each step priced (chunks)
    step_s: float  # the cost model's step_time_s, summed over `steps`
    rows: list[OpRow] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(r.total_s for r in self.rows)

    def share(self, row: OpRow) -> float:
        return row.total_s / self.total_s if self.total_s else 0.0

    def group_shares(self) -> dict[str, float]:
        out = dict.fromkeys(SHARE_GROUPS, 0.0)
        for row in self.rows:
            out[row.group] += self.share(row)
        return out

    def to_json(self) -> dict:
        return {
            "role": self.role, "cost_model": self.cost_model, "model": self.model,
            "hardware": self.hardware, "step": self.step, "step_s": self.step_s,
            "ranks": len(self.steps[0]),  # attention-DP ranks, each running these shapes
            "shapes": [shapes[0]._asdict() for shapes in self.steps],
            "ops": [{**asdict(r), "each_s": r.each_s, "share": self.share(r)}
                    for r in self.rows],
            "group_shares": self.group_shares(),
        }


_DEFAULTS = {"batch": 64, "context": 2048, "prompt": 4096, "prompts": 1}
_DECODE_OPTIONS = ("batch", "context")  # the rest of _DEFAULTS set an extend step


def explain_step(cfg: ExperimentConfig, role: str | None = None, batch: int | None = None,
                 context: int | None = None, prompt: int | None = None,
                 prompts: int | None = None, base_dir: str | None = None) -> Explanation:
    """Price one step of `role` of `cfg` op by op: an extend step for prefill, a decode step
    for decode. A colocated instance runs both: colocated is its extend step when given
    `prompt` or `prompts`, and on a colocated cluster prefill and decode name its two steps.
    The default role is colocated on a colocated cluster, else prefill when given `prompt` or
    `prompts`, else decode. Options left None take _DEFAULTS; one that the step does not take
    is refused, never ignored."""
    cluster = build_cluster(cfg, base_dir)
    roles = {"prefill": cluster.prefill, "decode": cluster.decode,
             "colocated": cluster.colocated}
    present = [name for name, spec in roles.items() if spec is not None]
    asked = {name: value for name, value in (("batch", batch), ("context", context),
                                             ("prompt", prompt), ("prompts", prompts))
             if value is not None}
    for name, value in asked.items():
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    wants_extend = any(name not in _DECODE_OPTIONS for name in asked)
    colocated = cluster.colocated is not None
    role = role or ("colocated" if colocated else "prefill" if wants_extend else "decode")
    if role not in present and not (colocated and role in ("prefill", "decode")):
        raise ValueError(f"role {role!r} is not in this {cluster.mode} cluster; its roles: "
                         f"{', '.join(present)}" + (" (or prefill and decode: its extend and "
                                                    "decode steps)" if colocated else ""))
    extend = role == "prefill" or (role == "colocated" and wants_extend)
    wrong = [f"--{name}" for name in asked if (name in _DECODE_OPTIONS) == extend]
    if wrong:
        if role == "colocated":
            given = [f"--{name}" for name in asked if name not in _DECODE_OPTIONS]
            raise ValueError(f"{' and '.join(wrong)} cannot be honoured with "
                             f"{' and '.join(given)}: a colocated instance runs its extend and "
                             f"decode steps apart; explain an extend step (--prompt, --prompts) "
                             f"or a decode step (--batch, --context)")
        step, takes = (("an extend step", "--prompt and --prompts") if extend
                       else ("a decode step", "--batch and --context"))
        raise ValueError(f"{' and '.join(wrong)} cannot be honoured: the {role} role explains "
                         f"{step}, which takes {takes}")
    role = "colocated" if colocated else role  # its instance runs both kinds of step
    batch, context, prompt, prompts = ({**_DEFAULTS, **asked}[name] for name in _DEFAULTS)
    spec = roles[role]
    whole = spec.cost()
    cost, draft, k = whole, None, 0
    if isinstance(whole, SpeculativeCostModel):
        cost, draft, k = whole.target, whole.draft, whole.num_draft_tokens
    if not hasattr(cost, "step_breakdown_s"):
        raise ValueError(f"the {cfg.cost_model.name!r} cost model has no step breakdown; "
                         f"explain prices roofline and silicon steps")
    dp = spec.dp_attention
    if extend:
        planned = extend_steps(prompts, prompt, spec.scheduler)
        steps = [[_extend_shape(segments)] * dp for segments in planned]
        sizes = [shapes[0].prefill_tokens for shapes in steps]
        words = (f"prefill of a {prompt}-token prompt in {len(steps)} chunk(s) of <= "
                 f"{max(sizes)}" if prompts == 1 else f"prefill of {prompts} prompts of {prompt} "
                 f"tokens in {len(steps)} step(s) of <= {max(sizes)} tokens")
        if spec.scheduler.dynamic_chunking is not None and len(steps) > 1:
            words += f" (dynamic chunking: {' → '.join(map(str, sizes))})"
    else:
        steps = [[BatchShape(decode_reqs=batch, decode_context_tokens=batch * context,
                             decode_query_len=k + 1)] * dp]
        words = f"decode of {batch} requests at {context} tokens of context"
        most = spec.scheduler.max_running_requests  # a DP rank's
        if batch > most:
            role_cfg = getattr(cfg.cluster, role)
            tokens = role_cfg.num_max_dispatch_tokens_per_rank
            if role_cfg.moe_a2a == "deepep" and most == tokens // (k + 1):
                why = f"DeepEP's low-latency dispatch takes {tokens} tokens a rank"
            elif draft is not None and role_cfg.scheduler.max_running_requests is None:
                why = (f"SGLang's default of {sglang_defaults.SPECULATIVE_MAX_RUNNING_REQUESTS} "
                       "running requests an instance under speculation; set "
                       "scheduler.max_running_requests for more")
            else:
                why = "its max_running_requests"
            words += f" (a run holds at most {most} a rank: {why})"
    if dp > 1:
        words += f", on each of {dp} attention-DP ranks"
    if draft is not None:
        words += (f"; {cfg.speculative.method} verifies {k} draft token{'s' * (k > 1)} a "
                  f"request: the target's forward, then the draft's extend (\"draft\")"
                  + ("" if extend or k == 1 else f" and {k - 1} one-token step"
                     f"{'s' * (k > 2)} (\"draft step\")"))
    order = {part: i for i, part in enumerate(BREAKDOWN_PARTS)}
    rows: dict[tuple[str, str], OpRow] = {}
    for shapes in steps:
        for row in _rows(cost, shapes):
            _merge(rows, row)
    ordered = sorted(rows.values(), key=lambda r: order[r.part])  # stable: trace order kept
    if draft is not None:
        passes = [("draft", steps, 1)]
        if not extend and k > 1:
            one_each = [[s._replace(decode_query_len=1) for s in shapes] for shapes in steps]
            passes.append(("draft step", one_each, k - 1))
        for title, pass_steps, calls in passes:
            parts: dict[str, OpRow] = {}  # the draft's ops summed by part
            for shapes in pass_steps:
                for row in _rows(draft, shapes):
                    part = parts.setdefault(row.part, _row(
                        draft, row.part, f"{title}: {PART_NAMES[row.part]}",
                        calls * _layers(draft, row.part), 0.0, "-", row.how))
                    part.total_s += calls * row.total_s
                    if row.part == "overhead":  # one graph replay for all the steps
                        part.total_s -= (calls - 1) * whole.graph_fixed_s
                    part.how = min(part.how, row.how, key=_HOW_ORDER.index)
            ordered += sorted(parts.values(), key=lambda r: order[r.part])
    silicon = isinstance(cost, SiliconCostModel)
    return Explanation(role, "silicon" if silicon else "roofline", cost.model.name,
                       cost.hardware.name, words, steps,
                       sum(whole.step_time_s(shapes) for shapes in steps), ordered)


def extend_steps(prompts: int, prompt: int,
                 sched: SchedulerConfig) -> list[list[tuple[int, int]]]:
    """(tokens already computed, new tokens) of each request's segment in each extend step that
    prefills `prompts` `prompt`-token prompts waiting together, as
    `InstanceScheduler._plan_extend` plans them with pages and request slots to spare: a step
    takes the prompts in turn until it holds a chunk (the prompt crossing it is cut there; its
    rest leads the next step, whose chunk dynamic chunking sizes by it) or max_prefill_tokens
    (unchunked, a prompt over what is left waits for the next step). One prompt: the chunks of
    `prompt_chunks`."""
    steps, left, done = [], prompts, 0  # prompts not yet prefilled; the first one's tokens done
    while left:
        chunk = chunk_cap(sched.chunked_prefill_size, sched.dynamic_chunking, done)
        segments, tokens, budget = [], 0, sched.max_prefill_tokens
        while left and budget > 0 and (not chunk or tokens < chunk):
            take = prompt - done
            if chunk:
                take = min(take, chunk - tokens)
            elif take > budget and segments:
                break
            segments.append((done, take))
            tokens, budget, done = tokens + take, budget - take, done + take
            if done == prompt:
                left, done = left - 1, 0
        steps.append(segments)
    return steps


def _extend_shape(segments: list[tuple[int, int]]) -> BatchShape:
    return BatchShape(prefill_tokens=sum(n for _, n in segments),
                      prefill_attn_pairs=sum(extend_attn_pairs(n, done) for done, n in segments),
                      prefill_prefix_tokens=sum(done for done, _ in segments))


def _rows(cost, shapes: list[BatchShape]) -> list[OpRow]:
    if isinstance(cost, SiliconCostModel):
        return _silicon_rows(cost, shapes)
    return _roofline_rows(cost, shapes)


def _merge(rows: dict[tuple[str, str], OpRow], row: OpRow) -> None:
    key = (row.part, row.name)
    have = rows.get(key)
    if have is None:
        rows[key] = row
        return
    have.count += row.count
    have.total_s += row.total_s
    have.how = min(have.how, row.how, key=_HOW_ORDER.index)


def _layers(cost, part: str) -> int:
    """Calls of a part's ops in one step: once per layer that has it, else once."""
    m = cost.model
    if part == "attention":
        return m.num_dense_layers + m.num_moe_layers
    if part in ("dense_mlp", "dense_comm"):
        return m.num_dense_layers
    if part in ("moe_experts", "moe_comm"):
        return m.num_moe_layers
    return 1


def _row(cost, part: str, name: str, count: int, total_s: float, table: str,
         how: str) -> OpRow:
    return OpRow(name, part, part_group(part, total_s), count, total_s, table, how)


def _roofline_rows(cost, shapes: list[BatchShape]) -> list[OpRow]:
    """The roofline's step-breakdown parts, one row each."""
    return [_row(cost, part, PART_NAMES[part], _layers(cost, part), seconds, "analytic",
                 "roofline")
            for part, seconds in cost.step_breakdown_s(shapes).items() if seconds]


def _silicon_rows(cost: SiliconCostModel, shapes: list[BatchShape]) -> list[OpRow]:
    """The silicon model's traced ops, once per rank shape (every rank runs the same) times
    its part's layers; the parts it prices without a table (two-batch overlap, overheads)
    as one row each."""
    cost.trace = []
    try:
        parts = cost.step_breakdown_s(shapes)
        traced = cost.trace
    finally:
        cost.trace = None
    rows, seen = [], set()
    for op in traced:
        if op.part == "tbo_overlap" or (op.part, op.name) in seen:
            continue  # a micro-batch's lookups; or another rank's copy of the same op
        seen.add((op.part, op.name))
        n = round(_layers(cost, op.part) * op.layers)
        rows.append(_row(cost, op.part, op.name, n, n * op.seconds, op.table, op.how))
    for part, how in (("tbo_overlap", "derived"), ("overhead", "constant")):
        if parts[part]:
            rows.append(_row(cost, part, PART_NAMES[part], 1, parts[part], "-", how))
    return rows
