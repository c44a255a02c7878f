"""The shape SGLang's kernels run a step at, which is not always the batch its scheduler built
(SGLang v0.5: `cuda_graph_runner.py`, `layers/dp_attention.py`, `server_args.py`). Both the
roofline and the silicon cost models price a step at `StepShaper`'s shape.

- CUDA graphs. A decode step of at most `cuda_graph_max_bs` requests per rank replays the graph
  captured at the next captured batch size (`capture_batch_sizes`, `replay_prepare`'s bisect):
  65 requests run as 72. The padded requests pass through every kernel, attention over a
  one-token context (the backends' `get_cuda_graph_seq_len_fill_value`), which adds next to
  nothing to the attention kernel itself: the cost models run that on the scheduler's batch.
- DP attention's gathered MLP. Where the MLP takes its input by an all-gather over the DP ranks
  (`mlp_gathers`), a decode step pads every rank to the largest rank's batch (`DpPaddingMode`
  MAX_LEN), idle ranks included: under graphs always, at the largest rank's captured size;
  eagerly when the padded gather is at most twice the sum (2 * sum >= max * dp). A step with
  an extend on any rank gathers the sum (SUM_LEN) and pads nothing.

Under DeepEP the routed experts and the dispatch skip padded rows (SGLang masks their top-k by
`num_token_non_padded`), so the cost models price those on the scheduler's batch,
`StepShape.raw`.
"""

from __future__ import annotations

from bisect import bisect_left
from copy import copy
from collections.abc import Sequence
from typing import NamedTuple

from pdsim.core.batch import BatchShape

SEQ_LEN_FILL = 1  # context of a padded request in a graph replay (SGLang's attention backends)


class StepTotals(NamedTuple):
    """What every cost model needs of a step's per-rank shapes (`step_totals`)."""

    tokens: int  # tokens through the MLP
    max_rank_tokens: int
    lm_rows: int  # LM-head rows
    max_rank_rows: int  # the largest rank's LM-head rows
    has_prefill: bool  # whether any rank extends


def step_totals(shapes: Sequence[BatchShape]) -> StepTotals:
    """The totals of a step's per-rank shapes. A rank with prefill ends at least one sequence,
    so it adds an LM-head row."""
    tokens = lm_rows = max_rank_tokens = max_rank_rows = 0
    has_prefill = False
    for shape in shapes:
        n = shape.num_tokens
        if n == 0:
            continue
        tokens += n
        max_rank_tokens = max(max_rank_tokens, n)
        rows = shape.decode_reqs * shape.decode_query_len
        if shape.prefill_tokens:
            has_prefill = True
            rows += 1
        lm_rows += rows
        max_rank_rows = max(max_rank_rows, rows)
    return StepTotals(tokens, max_rank_tokens, lm_rows, max_rank_rows, has_prefill)


def capture_batch_sizes(max_bs: int, speculative: bool, alignment: int = 1,
                        tokens_per_req: int = 1) -> tuple[int, ...]:
    """The decode batch sizes SGLang captures as CUDA graphs by default up to `max_bs`, max_bs
    itself included (`_generate_cuda_graph_batch_sizes`; finer with speculative decoding),
    keeping those whose `tokens_per_req` tokens a request make a multiple of `alignment`
    (`get_batch_sizes_to_capture`'s `bs * num_tokens_per_bs % mul_base`)."""
    if max_bs < 1:
        return ()
    if speculative:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
                 *range(272, max_bs + 1, 16)]
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16),
                 *range(512, max_bs + 1, 32)]
    sizes = [s for s in sizes if s <= max_bs] + [max_bs]
    return tuple(sorted({s for s in sizes if s * tokens_per_req % alignment == 0}))


def mlp_gathers(dp_attention: int, moe_a2a: str, moe_dense_tp: int | None,
                dp_lm_head: bool) -> bool:
    """Whether the MLP takes its input by an all-gather over the DP ranks (SGLang's
    `require_mlp_tp_gather`): under DP attention, unless the dense MLP runs per GPU
    (moe_dense_tp 1), the LM head per rank and the MoE by an all-to-all."""
    if dp_attention == 1:
        return False
    return not (moe_dense_tp == 1 and dp_lm_head and moe_a2a != "none")


def graph_alignment(parallel) -> int:
    """What a captured batch size must be a multiple of (SGLang's `mul_base`): 2 under
    two-batch overlap, times the attention-TP size where the step's input sits in a gathered
    buffer (the MLP's gather, or attention's own when an all-to-all MoE or a per-GPU dense MLP
    scatters its input over the attention-TP group)."""
    alignment = 2 if parallel.two_batch_overlap else 1
    scattered = parallel.moe_a2a != "none" or parallel.moe_dense_tp == 1
    attn_gather = scattered and (parallel.dp_attention == 1 or parallel.attn_tp > 1)
    if attn_gather or mlp_gathers(parallel.dp_attention, parallel.moe_a2a,
                                  parallel.moe_dense_tp, parallel.dp_lm_head):
        alignment *= parallel.attn_tp
    return alignment


class StepShape(NamedTuple):
    """A step as its kernels run it: `ranks`, each rank's shape padded as SGLang pads it, and
    their `totals`; `raw` and `raw_totals`, the scheduler's batch."""

    ranks: tuple[BatchShape, ...]
    totals: StepTotals
    raw: tuple[BatchShape, ...]
    raw_totals: StepTotals


class StepShaper:
    """Pads a step's per-rank shapes as SGLang runs them (module docstring).

    cuda_graph_max_bs: the largest per-rank decode batch replayed as a graph (0: none);
    capture_bs: the captured sizes (None: SGLang's default list up to cuda_graph_max_bs);
    padding: False replays every batch at its own size (SGLang's
    --disable-cuda-graph-padding; the DP gather still pads)."""

    def __init__(self, parallel, cuda_graph_max_bs: int,
                 capture_bs: Sequence[int] | None = None, padding: bool = True) -> None:
        self.graph_max_bs = cuda_graph_max_bs
        self.dp = parallel.dp_attention
        self.gathers = mlp_gathers(parallel.dp_attention, parallel.moe_a2a,
                                   parallel.moe_dense_tp, parallel.dp_lm_head)
        self.padding = padding
        self._alignment = graph_alignment(parallel)
        self._tbo = parallel.two_batch_overlap
        self._given = None if capture_bs is None else tuple(sorted(capture_bs))
        self.speculative = False  # the instance speculates: every graph at the finer sizes
        self.verify = False  # its query_len > 1 steps are target verifies (else draft extends)
        self._sizes: dict[tuple[bool, int], tuple[int, ...]] = {}

    def speculating(self, verify: bool) -> StepShaper:
        """This shaper for a speculating instance's target (`verify`) or draft model. SGLang
        captures every graph of such a server at the speculative sizes (server_args's
        `cuda_graph_bs`), the draft's one-token forwards too; the target's verify graphs keep
        the sizes whose `bs * num_draft_tokens` tokens are a multiple of `mul_base`
        (`CudaGraphRunner`'s `num_tokens_per_bs`, 1 under two-batch overlap), the draft's
        graphs those whose `bs` is (`EAGLEDraftCudaGraphRunner`,
        `EAGLEDraftExtendCudaGraphRunner` call `get_batch_sizes_to_capture` with its default)."""
        shaper = copy(self)
        shaper.speculative, shaper.verify, shaper._sizes = True, verify, {}
        return shaper

    def capture_sizes(self, query_len: int) -> tuple[int, ...]:
        """The captured batch sizes a decode step of `query_len` tokens a request replays."""
        spec = self.speculative or query_len > 1
        tokens = query_len if self.verify and query_len > 1 and not self._tbo else 1
        key = (spec, tokens)
        if key not in self._sizes:
            self._sizes[key] = (self._given if self._given is not None else capture_batch_sizes(
                self.graph_max_bs, spec, self._alignment, tokens))
        return self._sizes[key]

    def padded_reqs(self, reqs: int, query_len: int) -> int:
        """The captured size a rank of `reqs` decode requests replays at."""
        if not self.padding:
            return reqs
        sizes = self.capture_sizes(query_len)
        i = bisect_left(sizes, reqs)
        return sizes[i] if i < len(sizes) else reqs

    def __call__(self, shapes: Sequence[BatchShape]) -> StepShape:
        raw = tuple(shapes)
        totals = step_totals(raw)
        if totals.has_prefill or totals.tokens == 0:
            return StepShape(raw, totals, raw, totals)
        max_reqs = max(s.decode_reqs for s in raw)
        query_len = max(s.decode_query_len for s in raw)
        if max_reqs <= self.graph_max_bs:  # a decode step its graphs replay
            if self.gathers:
                target = self.padded_reqs(max_reqs, query_len)
                ranks = tuple(_padded(s, target, query_len) for s in raw)
            else:
                ranks = tuple(s if s.decode_reqs == 0 else
                              _padded(s, self.padded_reqs(s.decode_reqs, query_len), query_len)
                              for s in raw)
        elif self.gathers and 2 * totals.tokens >= totals.max_rank_tokens * self.dp:
            ranks = tuple(_padded(s, max_reqs, query_len) for s in raw)
        else:
            return StepShape(raw, totals, raw, totals)
        return StepShape(ranks, step_totals(ranks), raw, totals)


def _padded(shape: BatchShape, reqs: int, query_len: int) -> BatchShape:
    """`shape` with decode requests of `query_len` tokens added up to `reqs`, each over a
    SEQ_LEN_FILL context."""
    extra = reqs - shape.decode_reqs
    if extra <= 0:
        return shape
    return shape._replace(decode_reqs=reqs, decode_query_len=query_len,
                          decode_context_tokens=shape.decode_context_tokens + extra * SEQ_LEN_FILL)
