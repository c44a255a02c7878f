"""The real backend's executor: runs the core's planned batches through the torch model.

`ModelExecutor` implements the core's `Executor` port (`execute(step) -> BatchResult`, one batch: `forward`). It owns
the model, the paged KV cache (sized like the scheduler's page pool, whose page indices it is
handed) and one sampling generator per non-greedy request. The core's conventions:

- `extend` batch: segment `ExtendSegment(req, start, end)` computes tokens `[start, end)` of
  `req.fill_ids()` (the prompt, plus the generated tokens when a retracted request is recomputed);
  the first `start` are already cached and `req.pages` covers every slot below `end`. One token is
  returned per segment; only those of last chunks (`seg.is_last`) are sampled, so chunking never
  moves a request's random stream.
- `decode` batch: request `req` feeds `req.output_ids[-1]` at position `batch.kv_lens()[i]`
  (its KV length before the step).

`req.sampling` is a `runtime.sampling.SamplingParams` (None means greedy). A seeded request draws
from its own generator, so its tokens never depend on what else is batched with it; an unseeded
one gets a seed from the executor's own seeded stream. A request whose sampling fails (its
generator cannot be made, its distribution is not one) gets the greedy token in the result and
is named in the result's `failed`: the scheduler fails it alone (a prefill sends no first token
on), the rest of the batch goes on. Every TP rank samples the same rows with the same
generators, so every rank fails the same requests.

With attention DP (a model sharded by `runtime.model.tp.apply_dp_attention`) a step holds one
batch per DP rank: this process runs its own rank's batch (or the idle batch when it has none,
so the other ranks' MLP collectives go on), and every process then gathers every rank's sampled
tokens, logprobs, failures and top logprobs, so that each holds the same results per rank
(`execute` returns one `BatchResult` per rank, None for an idle one).

With `speculate(draft, k)` greedy decode steps verify MTP draft tokens (runtime/speculative.py):
the tokens are the same, some steps run no forward, and `speculation.stats` counts the
accepted drafts. Every forward then extends the draft too (its KV in `speculation.kv`, on the
same pages; each request's last hidden state at its state slot, `speculation.hidden`), so a
prefill instance leaves both ready to travel with the request's KV.

Every forward is timed (wall clock, the device synchronised) and recorded with its `BatchShape`,
the inputs of the simulator's cost model: `timings_frame()` / `save_timings(path)`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdsim.core.batch import Batch, BatchResult, DecodeBatch, ExtendBatch, KVMove
from pdsim.core.config import SchedulerConfig
from pdsim.core.executor import only_batch
from pdsim.core.request import Request
from runtime.model.hybrid import recurrent_state_for
from runtime.model.kv_cache import PagedKVCache
from runtime.model import AttentionMetadata, CausalLM
from runtime.model.draft import MTPDraft
from runtime.host_memory import retain_freed_memory
from runtime.model.tp import run_idle
from runtime.speculative import DecodeSpeculation
from runtime.sampler import make_generator, sample
from runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class ForwardTiming:
    """One measured forward: the batch's shape (`BatchShape` fields) and its wall time."""

    kind: str  # "extend" or "decode"
    prefill_tokens: int
    prefill_attn_pairs: float
    decode_reqs: int
    decode_context_tokens: int
    duration_s: float


TIMING_COLUMNS = tuple(ForwardTiming.__dataclass_fields__)
# The warm-up's bounds: a larger step (or prompt) grows the heap once, at its first run. A
# 2048-token prompt alone warms in 0.4 s on a CPU, in four 512-token chunks 0.06 s.
WARMUP_MAX_TOKENS, WARMUP_MAX_CHUNK = 2048, 512


def warmup_shape(cfg: SchedulerConfig) -> tuple[int, int]:
    """(tokens, chunk) of a scheduler's largest extend step, for `ModelExecutor`'s warm-up: one
    chunk of `chunked_prefill_size` (without chunking its `max_prefill_tokens`), in segments
    of at most a chunk (or one prompt), within WARMUP_MAX_TOKENS and WARMUP_MAX_CHUNK."""
    chunk = cfg.chunked_prefill_size
    tokens = min(chunk or cfg.max_prefill_tokens, WARMUP_MAX_TOKENS)
    return tokens, min(chunk or tokens, WARMUP_MAX_CHUNK)


class ModelExecutor:
    """Runs `Batch`es on `model` against a `PagedKVCache` of `num_pages` x `page_size` tokens.

    vocab_limit: sample only among the first `vocab_limit` ids (the tokenizer's vocabulary, when
        the model's embedding table is larger); None samples over the whole vocabulary.
    tp_size: the tensor-parallel size `model` was sharded for (`apply_tp`): a GQA cache then
        holds this rank's `max(1, num_kv_heads // tp_size)` heads.
    max_timings: forwards whose timing is kept (the oldest are dropped beyond it).
    state_slots: the scheduler's `state_slots` (a request runs on its `state_indices[0]`): a
        hybrid model's recurrent states, or the draft's hidden states of a speculating
        executor (`with_draft_slots`); 0 for other models.
    warmup: (tokens, chunk) of the extend that `bind_thread` warms the forward thread with
        (`warmup`; `warmup_shape` gives a scheduler's largest step).

    On a CPU the process keeps the memory a forward frees for the next one
    (runtime/host_memory.py).
    """

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int, seed: int = 0,
                 vocab_limit: int | None = None, kv_dtype: torch.dtype | None = None,
                 tp_size: int = 1, max_timings: int = 1_000_000, state_slots: int = 0,
                 threads: int | None = None, warmup: tuple[int, int] = (32, 0)) -> None:
        self.model = model
        self.threads = threads
        self.warmup_step = warmup
        self.config = model.config
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            retain_freed_memory()
        self.page_size = page_size
        self.kv = PagedKVCache.for_model(self.config, num_pages=num_pages, page_size=page_size,
                                         tp_size=tp_size, dtype=kv_dtype, device=self.device)
        self.kv.state = recurrent_state_for(self.config,
                                            state_slots if self.config.linear_layers else 0,
                                            tp_size=tp_size, device=self.device)
        self.state_slots = state_slots
        if vocab_limit is not None and not 0 < vocab_limit <= self.config.vocab_size:
            raise ValueError(f"vocab_limit={vocab_limit}; must be in 1..{self.config.vocab_size}")
        self.vocab_limit = vocab_limit
        self.timings: deque[ForwardTiming] = deque(maxlen=max_timings)
        self._seeds = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._top_k: dict[str, int] = {}
        self._top: dict[str, list[list[tuple[int, float]]]] = {}
        self._failures: dict[str, str] = {}
        self._new_top: dict[str, list[tuple[int, float]]] = {}  # the last forward's top logprobs
        self.dp = getattr(model, "dp", None)  # `DPRanks` of an attention-DP instance
        self.tp_size = tp_size
        self.speculation: DecodeSpeculation | None = None
        self._host_kv: dict[str, list[list[torch.Tensor]]] = {}  # retracted requests' KV

    def bind_thread(self) -> None:
        """Make the calling thread the one that runs the forwards (the engine's): give it
        `threads` torch threads (None: leave torch's setting), then warm it up at the
        constructor's `warmup` shape (glibc gives each thread a heap of its own, which the
        largest step then finds grown).

        A serving process keeps its main thread at one torch thread (`torch.set_num_threads(1)`
        before loading the model). On a 2-CPU host with two torch threads, once the main thread
        had opened OpenMP regions of its own, tiny-llama's forwards on the engine thread took
        2.2-2.4x as long, and an RMSNorm of 384 x 512 270-390 us instead of 40: every region
        waited for its workers to wake, as a lone pool's regions do under
        OMP_WAIT_POLICY=PASSIVE (two pools hold more threads than there are CPUs, and OpenMP
        stops spinning between regions)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self.warmup(*self.warmup_step)

    def speculate(self, draft: MTPDraft, num_draft_tokens: int) -> None:
        """Verify up to `num_draft_tokens` drafts of `draft` per greedy decode step. Call it
        before the caches are registered for transfer: it allocates the draft's."""
        if self.kv.state:
            raise ValueError(f"model {self.config.name!r} keeps a recurrent state; speculative "
                             "decoding supports attention-only models")
        if self.tp_size != 1 or self.dp is not None:
            raise ValueError("speculative decoding runs on one GPU: tp_size 1, no attention DP")
        if self.state_slots < 1:
            raise ValueError("speculative decoding keeps each request's last hidden state in a "
                             f"state slot: state_slots={self.state_slots}; must be >= 1 (give "
                             "the scheduler runtime.speculative.with_draft_slots)")
        hidden = torch.zeros(self.state_slots, self.config.hidden_size, device=self.device,
                             dtype=self.kv.dtype)
        self.speculation = DecodeSpeculation(draft, num_draft_tokens, draft.make_cache(self.kv),
                                             hidden)

    # ---- per-request state -----------------------------------------------------------------

    def want_top_logprobs(self, rid: str, k: int) -> None:
        """Also keep the `k` most likely tokens of every token `rid` generates."""
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs k={k}; must be in 0..{MAX_TOP_LOGPROBS}")
        if k:
            self._top_k[rid] = k
            self._top.setdefault(rid, [])

    def take_top_logprobs(self, rid: str) -> list[list[tuple[int, float]]]:
        """The top-k (token id, logprob) lists gathered for `rid` since the last call."""
        got = self._top.get(rid)
        if not got:
            return []
        self._top[rid] = []
        return got

    def release(self, rid: str) -> None:
        """Forget a finished request's generator and logprob state."""
        self._generators.pop(rid, None)
        self._top_k.pop(rid, None)
        self._top.pop(rid, None)
        if self.speculation is not None:
            self.speculation.forget(rid)

    def _sampling(self, req: Request) -> tuple[SamplingParams, torch.Generator | None]:
        params = req.sampling if req.sampling is not None else GREEDY
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {req.rid}: sampling must be a runtime SamplingParams or "
                            f"None, got {type(params).__name__}")
        if params.greedy:
            return params, None
        gen = self._generators.get(req.rid)
        if gen is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            gen = self._generators[req.rid] = make_generator(seed, self.device)
        return params, gen

    # ---- the port --------------------------------------------------------------------------

    def execute(self, step: Sequence[Batch | None]) -> BatchResult | list[BatchResult | None]:
        """The executor port (pdsim/core/executor.py): run the step's one batch, or with
        attention DP this rank's batch, and return every rank's result."""
        if self.dp is None:
            return self.forward(only_batch(step))
        return self._execute_dp(step)

    def _execute_dp(self, step: Sequence[Batch | None]) -> list[BatchResult | None]:
        dp = self.dp
        if len(step) != dp.dp_size:
            raise ValueError(f"a step of {len(step)} batches for {dp.dp_size} DP ranks")
        dp.token_counts = [0 if b is None else _num_tokens(b) for b in step]
        dp.row_counts = [0 if b is None else _num_rows(b) for b in step]
        start = time.perf_counter()
        own = step[dp.dp_rank]
        if own is None:
            run_idle(self.model)
            mine = None
        else:
            r = self.forward(own)
            mine = {"tokens": r.token_ids, "logprobs": r.logprobs, "failed": r.failed or {},
                    "top": self._new_top}
        gathered = dp.world.all_gather_msgpack(mine)
        duration = time.perf_counter() - start
        results: list[BatchResult | None] = []
        for rank, batch in enumerate(step):
            got = gathered[rank * dp.attn.size]  # the first process of DP rank `rank`
            if batch is None:
                results.append(None)
                continue
            if rank != dp.dp_rank:
                for rid, top in got["top"].items():
                    if rid in self._top_k:
                        self._top[rid].append([(int(t), float(lp)) for t, lp in top])
            results.append(BatchResult(duration_s=duration, token_ids=got["tokens"],
                                       logprobs=got["logprobs"], failed=got["failed"] or None))
        return results

    def forward(self, batch: Batch) -> BatchResult:
        """Run one batch; its measured duration and the sampled tokens."""
        start = time.perf_counter()
        self._failures = {}  # this batch's rows whose sampling fails
        self._new_top = {}
        self._ran_forward = True
        if batch.kv_moves:
            self._move_kv(batch.kv_moves)
        if batch.kind == "extend":
            token_ids, logprobs = self._extend(batch)
        elif batch.kind == "decode":
            token_ids, logprobs = self._decode(batch)
        else:
            raise ValueError(f"batch kind {batch.kind!r}; allowed: 'extend', 'decode'")
        duration = time.perf_counter() - start  # .tolist() above synchronised the device
        s = batch.shape
        if self._ran_forward:  # a speculative step may only hand out verified tokens
            self.timings.append(ForwardTiming(batch.kind, s.prefill_tokens, s.prefill_attn_pairs,
                                              s.decode_reqs, s.decode_context_tokens,
                                              duration))
        return BatchResult(duration_s=duration, token_ids=token_ids, logprobs=logprobs,
                           failed=self._failures or None)

    def _move_kv(self, moves: Sequence[KVMove]) -> None:
        """Copy retracted requests' KV pages to the host, or back into new pages, before the
        forward that may reuse them (pdsim.core.batch.KVMove), in every paged cache: the
        target's and a speculating draft's."""
        caches = [self.kv] if self.speculation is None else [self.kv, self.speculation.kv]
        for move in moves:
            if move.to_host:
                self._host_kv[move.rid] = [cache.copy_out(move.pages) for cache in caches]
            else:
                saved = self._host_kv.pop(move.rid)
                if move.pages:
                    for cache, copy in zip(caches, saved, strict=True):
                        cache.copy_in(move.pages, copy)

    def _extend(self, batch: ExtendBatch) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        query_lens, cached_lens, tables, reqs, sampled = [], [], [], [], []
        for seg in batch.segments:
            req = seg.req
            if seg.end <= seg.start or seg.end > req.fill_len:
                raise ValueError(f"request {req.rid}: extend segment [{seg.start}, {seg.end}) "
                                 f"outside its fill of {req.fill_len} tokens")
            ids.extend(req.fill_ids()[seg.start: seg.end])
            query_lens.append(seg.end - seg.start)
            cached_lens.append(seg.start)
            tables.append(req.pages)
            reqs.append(req)
            sampled.append(seg.is_last)
        return self._forward(ids, query_lens, cached_lens, tables, reqs, sampled, decoding=False)

    def _decode(self, batch: DecodeBatch) -> tuple[list[int], list[float]]:
        if self.speculation is not None:
            return self._decode_speculative(batch)
        ids = [req.output_ids[-1] for req in batch.reqs]
        tables = [req.pages for req in batch.reqs]
        n = len(batch.reqs)
        return self._forward(ids, [1] * n, batch.kv_lens(), tables, batch.reqs, [True] * n,
                             decoding=True)

    def _decode_speculative(self, batch: DecodeBatch) -> tuple[list[int], list[float]]:
        """Rows holding verified tokens take them; greedy rows verify drafts in one forward;
        the others decode plainly."""
        spec, kv_lens = self.speculation, batch.kv_lens()
        out: list[tuple[int, float] | None] = [spec.take(r, L)
                                               for r, L in zip(batch.reqs, kv_lens)]
        verify = [i for i, r in enumerate(batch.reqs)
                  if out[i] is None and spec.can_verify(r, self._top_k)]
        if verify:
            got = spec.verify(self, [batch.reqs[i] for i in verify], [kv_lens[i] for i in verify])
            for i, token in zip(verify, got):
                out[i] = token
        plain = [i for i, token in enumerate(out) if token is None]
        self._ran_forward = bool(verify or plain)
        if plain:
            reqs = [batch.reqs[i] for i in plain]
            tokens, logprobs = self._forward([r.output_ids[-1] for r in reqs], [1] * len(reqs),
                                             [kv_lens[i] for i in plain], [r.pages for r in reqs],
                                             reqs, [True] * len(reqs), decoding=True)
            for i, token, logprob in zip(plain, tokens, logprobs):
                out[i] = (token, logprob)
        return [t for t, _ in out], [lp for _, lp in out]

    def _forward(self, ids: list[int], query_lens: list[int], cached_lens: list[int],
                 tables: Sequence[Sequence[int]], reqs: Sequence[Request],
                 sampled: Sequence[bool], *, decoding: bool) -> tuple[list[int], list[float]]:
        state_slots = [req.state_indices[0] for req in reqs] if self.kv.state else ()
        meta = AttentionMetadata.build(query_lens, cached_lens, tables, self.page_size,
                                       device=self.device, state_slots=state_slots)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if self.speculation is None:
            logits = self.model(input_ids, meta.positions(), meta, self.kv)
        else:  # the draft extends over every token, from the target's hidden states
            hidden = self.model.hidden_states(input_ids, meta.positions(), meta, self.kv)
            self.speculation.after_forward(reqs, meta, input_ids, hidden, decoding=decoding)
            logits = self.model.compute_logits(hidden[meta.last_token_indices()])
        if self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        params, gens = [], []
        for req, last in zip(reqs, sampled):
            p, g = GREEDY, None
            if last:
                try:
                    p, g = self._sampling(req)
                except (ValueError, RuntimeError) as exc:  # e.g. a seed torch cannot take
                    self._failures[req.rid] = f"sampling failed: {exc}"
            params.append(p)
            gens.append(g)
        result = sample(logits, params, gens)
        for row, reason in result.failed.items():
            self._failures[reqs[row].rid] = reason
        self._gather_top(logits, reqs, sampled)
        return result.token_ids.tolist(), result.logprobs.tolist()

    def _gather_top(self, logits: torch.Tensor, reqs: Sequence[Request],
                    sampled: Sequence[bool]) -> None:
        if not self._top_k:
            return
        rows = [i for i, (r, last) in enumerate(zip(reqs, sampled))
                if last and r.rid in self._top_k]
        if not rows:
            return
        k = max(self._top_k[reqs[i].rid] for i in rows)
        top = logits[rows].float().log_softmax(-1).topk(k, dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(rows):
            rid = reqs[i].rid
            want = self._top_k[rid]
            top_k = list(zip(indices[j][:want], values[j][:want]))
            self._top[rid].append(top_k)
            self._new_top[rid] = top_k

    # ---- warm-up and timings ---------------------------------------------------------------

    def warmup(self, tokens: int = 32, chunk: int = 0) -> None:
        """Run an untimed extend of `tokens` new tokens, in segments of `chunk` as the scheduler
        cuts a step (0: one segment), then a decode, through pages 0..: the first request then
        pays for no lazy initialisation, nor this thread's heap for growing to the step. The
        scratch KV (and state slots) is overwritten before anything reads it."""
        room = min(self.kv.num_pages * self.page_size, self.config.max_position) - 1
        tokens = max(2, min(tokens, room))
        chunk = min(chunk or tokens, tokens)
        slots = self.state_slots if self.kv.state is not None else tokens
        lens, tables, used = [], [], 0
        for start in range(0, tokens, chunk):  # as many segments as the pool and slots hold
            n = min(chunk, tokens - start)
            need = -(-(n + 1) // self.page_size)
            if lens and (used + need > self.kv.num_pages or len(lens) == slots):
                break
            lens.append(n)
            tables.append(list(range(used, used + need)))
            used += need
        for qlens, cached, pages in ((lens, [0] * len(lens), tables), ([1], lens[:1], tables[:1])):
            ids = [i % self.config.vocab_size for i in range(sum(qlens))]
            if self.dp is not None:  # every DP rank warms up alike, in step
                self.dp.token_counts = [len(ids)] * self.dp.dp_size
                self.dp.row_counts = [len(qlens)] * self.dp.dp_size
            meta = AttentionMetadata.build(
                qlens, cached, pages, self.page_size, device=self.device,
                state_slots=list(range(len(qlens))) if self.kv.state else ())
            self.model(torch.tensor(ids, device=self.device), meta.positions(), meta, self.kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timings_frame(self):
        """The recorded forwards as a pandas DataFrame (columns `TIMING_COLUMNS`)."""
        import pandas as pd

        return pd.DataFrame([asdict(t) for t in self.timings], columns=list(TIMING_COLUMNS))

    def save_timings(self, path: str | Path) -> Path:
        """Write the recorded forwards to `.csv` or `.parquet` (by the file's suffix)."""
        return save_table(self.timings_frame(), path, "timings")


def _num_tokens(batch: Batch) -> int:
    """The tokens a batch feeds the model."""
    if batch.kind == "extend":
        return sum(seg.end - seg.start for seg in batch.segments)
    return len(batch.reqs)


def _num_rows(batch: Batch) -> int:
    """The logits rows a batch's forward computes: one per segment."""
    return len(batch.segments) if batch.kind == "extend" else len(batch.reqs)


def save_table(frame, path: str | Path, what: str) -> Path:
    """Write a DataFrame to `.csv` or `.parquet`, by the file's suffix."""
    path = Path(path)
    if path.suffix not in (".csv", ".parquet"):
        raise ValueError(f"{what} file {path}: suffix {path.suffix!r}; allowed: .csv, .parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)
    return path
