"""The continuous-batching decode batch, with O(1) bookkeeping per step.

A request in the batch gains one token and one KV slot per step, so its lengths follow from the
step it joined at: `kv = kv_at_join + (step - join_step)`. Nothing is touched per request per
step; instead the step at which a request finishes and the steps at which it needs a new page are
kept in buckets. That keeps a simulated decode step cheap however large the batch (a real
executor still reads every request, which it must anyway). A request's lengths and token times
are settled when it leaves the batch; it leaves no trace in the buckets, and step end times
older than every member's join are dropped, so a long-running server's batch stays small.

`SpeculativeRunningBatch` keeps the same shape when each step verifies draft tokens and a
request emits a variable number of tokens per step (simulator only).
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from pdsim.core.batch import BatchResult, BatchShape, DecodeBatch
from pdsim.core.pool import PagePool
from pdsim.core.request import Request
from pdsim.core.token_times import TokenTimes

TRIM_EVERY_STEPS = 4096


class StepTimes:
    """End time of every decode step (step k + 1 at index k), in fixed-size NumPy chunks.

    A leaving request takes views of the chunks for the steps it ran (see `TokenTimes`), so the
    times are stored once however many requests shared the steps. Chunks before every running
    request's join are dropped from here (`forget_before`); views still in records keep theirs.
    """

    CHUNK = 2048

    def __init__(self) -> None:
        self.chunks: dict[int, np.ndarray] = {}
        self.count = 0  # steps recorded
        self._cur = np.empty(0)  # the chunk being filled...
        self._free = 0  # ...and how many entries it has left

    def _new_chunk(self) -> None:
        self._cur = self.chunks[self.count // self.CHUNK] = np.empty(self.CHUNK)
        self._free = self.CHUNK

    def append(self, t: float) -> None:
        if not self._free:
            self._new_chunk()
        self._cur[self.CHUNK - self._free] = t
        self._free -= 1
        self.count += 1

    def extend(self, times: list[float]) -> None:
        done = 0
        while done < len(times):
            if not self._free:
                self._new_chunk()
            at = self.CHUNK - self._free
            take = min(self._free, len(times) - done)
            self._cur[at : at + take] = times[done : done + take]
            done += take
            self._free -= take
            self.count += take

    def views(self, first: int, stop: int) -> list[tuple[np.ndarray, int]]:
        """The end times of steps `first + 1 .. stop` (indices first .. stop - 1), as views
        of the chunks, each with the index in its chunk it starts at."""
        out = []
        size = self.CHUNK
        while first < stop:
            c, i = divmod(first, size)
            take = min(size - i, stop - first)
            out.append((self.chunks[c][i : i + take], i))
            first += take
        return out

    def forget_before(self, index: int) -> None:
        for c in [c for c in self.chunks if (c + 1) * self.CHUNK <= index]:
            del self.chunks[c]

    @property
    def kept(self) -> int:
        """Step times still held here (whole chunks)."""
        return len(self.chunks) * self.CHUNK


class RunningBatch:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.reqs: dict[Request, None] = {}  # insertion-ordered set
        self.step = 0  # decode steps completed
        self.step_end_s = StepTimes()
        self.context_tokens = 0  # sum of the KV lengths of the requests in the batch
        self._finish_at: dict[int, list[Request]] = defaultdict(list)
        self._finish_steps: list[int] = []  # heap of the keys of _finish_at (some stale)
        self._grow_at: dict[int, list[Request]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.reqs)

    def join(self, req: Request) -> None:
        """Add a request whose KV holds everything but its last generated token."""
        req.join_step = self.step
        req.kv_at_join = req.computed_tokens
        req.out_at_join = req.num_output
        self.reqs[req] = None
        self.context_tokens += req.computed_tokens
        finish = self._finish_step(req)
        bucket = self._finish_at[finish]
        if not bucket:
            heapq.heappush(self._finish_steps, finish)
        bucket.append(req)
        self._schedule_growth(req)

    @staticmethod
    def _finish_step(req: Request) -> int:
        return req.join_step + req.max_new_tokens - req.out_at_join

    def _schedule_growth(self, req: Request) -> None:
        # Step count at which the KV fills its pages; the next step then needs one more page.
        req.grow_step = req.join_step + len(req.pages) * self.page_size - req.kv_at_join
        self._grow_at[req.grow_step].append(req)

    def kv_len(self, req: Request) -> int:
        return req.kv_at_join + self.step - req.join_step

    def leave(self, req: Request) -> None:
        """Remove a request, settling its lengths and token times."""
        del self.reqs[req]
        steps = self.step - req.join_step
        req.computed_tokens = req.kv_at_join + steps
        req.num_output = req.out_at_join + steps
        self.context_tokens -= req.computed_tokens
        _add_times(req, self.step_end_s.views(req.join_step, self.step))
        self._forget(req)

    def _forget(self, req: Request) -> None:
        """Leaving early (a stop token, a retraction, an abort): drop its future bucket entries."""
        for buckets, key in ((self._finish_at, self._finish_step(req)),
                             (self._grow_at, req.grow_step)):
            bucket = buckets.get(key)
            if bucket is not None and req in bucket:
                bucket.remove(req)
                if not bucket:
                    del buckets[key]
        req.grow_step = -1

    def pages_due(self) -> list[Request]:
        """Requests that need one more page before the next step."""
        return self._grow_at.pop(self.step, [])

    def add_page(self, req: Request, page: int) -> None:
        self.add_pages((req,), (page,))

    def add_pages(self, reqs: Sequence[Request], pages: Sequence[int]) -> None:
        """`add_page` for each request and page, in order (one call for a step's due pages)."""
        ps, grow = self.page_size, self._grow_at
        for req, page in zip(reqs, pages):
            req.pages.append(page)
            req.grow_step += ps
            grow[req.grow_step].append(req)

    def plan(self, now: float) -> DecodeBatch:
        n = len(self.reqs)
        shape = BatchShape(decode_reqs=n, decode_context_tokens=self.context_tokens + n)
        return DecodeBatch(shape, now, list(self.reqs), self.step + 1)

    def complete(self, batch: DecodeBatch, result: BatchResult, now: float) -> list[Request]:
        """Account one finished decode step; return the requests that are done (still in the batch)."""
        done = self._advance(now)
        self.context_tokens += len(self.reqs)
        if result.token_ids is not None:
            for req, tok, lp in zip(batch.reqs, result.token_ids, result.logprobs or _nones()):
                if req not in self.reqs:
                    continue
                req.output_ids.append(tok)
                if lp is not None:
                    req.output_logprobs.append(lp)
                if tok in req.stop_token_ids and req.out_at_join + self.step - req.join_step < req.max_new_tokens:
                    done.append(req)
        return done

    def _advance(self, now: float) -> list[Request]:
        """Count one more step ending at `now`; the requests whose last step it was."""
        self.step += 1
        self.step_end_s.append(now)
        if self.step % TRIM_EVERY_STEPS == 0:
            self._trim_times()
        return self._finish_at.pop(self.step, [])

    def _trim_times(self) -> None:
        """Forget the end times of steps before every running request joined."""
        self.step_end_s.forget_before(min((r.join_step for r in self.reqs), default=self.step))

    # ----- runs of steps (the simulator's fast path) ---------------------------------------------

    def next_finish_step(self) -> int | None:
        """The step count at which the next request finishes by length (None: none running)."""
        heap, buckets = self._finish_steps, self._finish_at
        while heap and not buckets.get(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def quiet_steps(self, max_steps: int, free_pages: int) -> int:
        """How many decode steps, from the one just planned, can run back to back with nothing
        but page growth between them: none but the last ends a request by length, and the pages
        the steps in between need (after each step, for the next) come out of `free_pages`.
        Without stop tokens (the simulator) the batch is then the same requests all along.
        A speculative batch answers 1 (its steps are not this regular)."""
        finish = self.next_finish_step()
        limit = max_steps if finish is None else min(max_steps, finish - self.step)
        need = [0] * limit  # need[j]: pages due after step j (1-based; index 0 unused)
        ps, grow, step = self.page_size, self._grow_at, self.step
        used = 0
        for j in range(1, limit):
            # Requests due now, plus those that got a page `page_size` steps ago in this run.
            need[j] = len(grow.get(step + j, ())) + (need[j - ps] if j > ps else 0)
            used += need[j]
            if used > free_pages:
                return j  # the step after j needs pages the pool may not have: stop there
        return limit

    def complete_run(self, end_times_s: list[float],
                     alloc: Callable[[int], list[int] | None]) -> list[Request]:
        """Account `len(end_times_s)` decode steps of the same batch, run back to back (see
        `quiet_steps`): between them the due pages come from `alloc` (the scheduler's page
        allocator) as `_plan_decode` takes them, in the same order. Returns the requests done
        after the last step (still in the batch)."""
        n = len(self.reqs)
        first = self.step
        last = len(end_times_s)
        finish = self.next_finish_step()
        if finish is not None and finish < first + last:
            raise RuntimeError(f"a decode run crossed step {finish}, where requests finish")
        grow = self._grow_at
        for step in range(first + 1, first + last):
            due = grow.pop(step, None)
            if due:
                pages = alloc(len(due))
                if pages is None:
                    raise RuntimeError("a decode run was planned beyond the free KV pages")
                self.add_pages(due, pages)
        self.step = first + last
        self.step_end_s.extend(end_times_s)
        self.context_tokens += n * last
        if first // TRIM_EVERY_STEPS != self.step // TRIM_EVERY_STEPS:
            self._trim_times()
        return self._finish_at.pop(self.step, [])


def _add_times(req: Request, views: list[tuple[np.ndarray, int]]) -> None:
    """Append step end times (`StepTimes.views`) to a request's token times: as views for a
    `TokenTimes` (the simulator's requests), as floats for a plain list (the real backend's,
    which go to JSON)."""
    times = req.token_times_s
    if isinstance(times, TokenTimes):
        for v, offset in views:
            times.extend_steps(v, offset)
    else:
        for v, _ in views:
            times.extend(v.tolist())


def _nones():
    while True:
        yield None


@dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative decoding as a running batch sees it (simulator only: the real backend
    speculates inside its executor, runtime/speculative.py, and plans plain decode steps).

    num_draft_tokens: drafts proposed per request per step (k); the verify forward computes
        k + 1 query tokens per request.
    accept_len_probs: P(a = 1), ..., P(a = k + 1), where a, the tokens a request emits in one
        step, is its accepted drafts plus the one token the verify adds after them.
    seed: with the request id and its output count at join, seeds the request's draws.
    """

    num_draft_tokens: int
    accept_len_probs: tuple[float, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        k, probs = self.num_draft_tokens, self.accept_len_probs
        if k < 1:
            raise ValueError(f"Speculation.num_draft_tokens must be >= 1, got {k}")
        if len(probs) != k + 1 or min(probs) < 0 or abs(sum(probs) - 1) > 1e-9:
            raise ValueError(
                f"Speculation.accept_len_probs must be {k + 1} probabilities (accept lengths "
                f"1..{k + 1}) summing to 1, got {probs}"
            )

    @property
    def mean_accept_len(self) -> float:
        return sum(a * p for a, p in enumerate(self.accept_len_probs, start=1))


class SpeculativeRunningBatch(RunningBatch):
    """Decode steps that verify `k` draft tokens per request and emit 1..k+1 tokens each.

    When a request joins, all its accept lengths are drawn at once from a generator seeded by
    (seed, request id, tokens emitted so far), so they do not depend on what else runs; their
    running sum, cut so that it ends exactly at the tokens the request has left, is kept as
    `req.emitted_by_step` (entry j: tokens emitted after j steps in the batch). Its lengths,
    finish step and page needs then follow by indexing and bisection, and the batch's context
    grows by per-step totals booked at the join: a step still touches no request.

    A verify step writes the KV of its k + 1 query tokens, so before a step a request needs
    pages for `kv + k + 1` tokens (capped at the `input_len + max_new_tokens` it was admitted
    for); the rejected drafts' slots are reused by the next step. Tokens emitted in one step
    share that step's end time.
    """

    def __init__(self, pool: PagePool, spec: Speculation):
        super().__init__(pool)
        self.spec = spec
        self._query_len = spec.num_draft_tokens + 1
        self._accept_lens = range(1, self._query_len + 1)
        self._cum_probs = list(accumulate(spec.accept_len_probs))
        self._context_growth: dict[int, int] = defaultdict(int)  # step -> context tokens it adds

    def _draw(self, req: Request) -> list[int]:
        left = req.max_new_tokens - req.num_output
        rng = random.Random(f"{self.spec.seed}/{req.rid}/{req.num_output}")
        emitted = [0]
        while True:
            batch = max(8, int(1.2 * (left - emitted[-1]) / self.spec.mean_accept_len))
            draws = rng.choices(self._accept_lens, cum_weights=self._cum_probs, k=batch)
            sums = list(accumulate(draws, initial=emitted[-1]))
            cut = bisect_left(sums, left)
            if cut < len(sums):
                emitted.extend(sums[1 : cut + 1])
                emitted[-1] = left  # the last step emits only what is left
                return emitted
            emitted.extend(sums[1:])

    def join(self, req: Request) -> None:
        req.emitted_by_step = emitted = self._draw(req)
        super().join(req)
        growth, step = self._context_growth, self.step
        for j in range(1, len(emitted)):
            growth[step + j] += emitted[j] - emitted[j - 1]

    def _finish_step(self, req: Request) -> int:
        return req.join_step + len(req.emitted_by_step) - 1

    def _need_tokens(self, req: Request, j: int) -> int:
        """KV slots the request's step j + 1 (in the batch) writes up to."""
        return min(req.kv_at_join + req.emitted_by_step[j] + self._query_len,
                   req.input_len + req.max_new_tokens)

    def _schedule_growth(self, req: Request) -> None:
        # First step whose need exceeds the pages held; a request never runs its last entry.
        emitted, capacity = req.emitted_by_step, len(req.pages) * self.page_size
        req.grow_step = -1
        if req.input_len + req.max_new_tokens <= capacity:
            return
        j = bisect_right(emitted, capacity - self._query_len - req.kv_at_join,
                         self.step - req.join_step)
        if j < len(emitted) - 1:
            req.grow_step = req.join_step + j
            self._grow_at[req.grow_step].append(req)

    def kv_len(self, req: Request) -> int:
        return req.kv_at_join + req.emitted_by_step[self.step - req.join_step]

    def quiet_steps(self, max_steps: int, free_pages: int) -> int:
        return 1  # a step's growth and page needs vary per request: no runs of steps

    def pages_due(self) -> list[Request]:
        """Requests that need more pages before the next step, once per page they need."""
        due = self._grow_at.pop(self.step, [])
        if not due:
            return due
        out = []
        for req in due:
            need = self._need_tokens(req, self.step - req.join_step)
            out.extend([req] * (-(-need // self.page_size) - len(req.pages)))
        return out

    def add_pages(self, reqs: Sequence[Request], pages: Sequence[int]) -> None:
        for req, page in zip(reqs, pages):
            self.add_page(req, page)

    def add_page(self, req: Request, page: int) -> None:
        req.pages.append(page)
        # While this step still needs more of its pages, they follow in the same due list.
        if len(req.pages) * self.page_size >= self._need_tokens(req, self.step - req.join_step):
            self._schedule_growth(req)

    def leave(self, req: Request) -> None:
        del self.reqs[req]
        emitted, join = req.emitted_by_step, req.join_step
        steps = self.step - join
        growth = self._context_growth
        for j in range(steps + 1, len(emitted)):  # leaving early: unbook its future growth
            growth[join + j] -= emitted[j] - emitted[j - 1]
        req.computed_tokens = req.kv_at_join + emitted[steps]
        req.num_output = req.out_at_join + emitted[steps]
        self.context_tokens -= req.computed_tokens
        if steps:
            times = np.concatenate([v for v, _ in self.step_end_s.views(join, join + steps)])
            repeated = np.repeat(times, np.diff(emitted[: steps + 1]))
            out = req.token_times_s  # an array of its own, not a view of the step times
            out.extend(repeated if isinstance(out, TokenTimes) else repeated.tolist())
        self._forget(req)
        req.emitted_by_step = None

    def plan(self, now: float) -> DecodeBatch:
        n, q = len(self.reqs), self._query_len
        shape = BatchShape(decode_reqs=n, decode_context_tokens=self.context_tokens + n * q,
                           decode_query_len=q)
        return DecodeBatch(shape, now, list(self.reqs), self.step + 1)

    def complete(self, batch: DecodeBatch, result: BatchResult, now: float) -> list[Request]:
        if result.token_ids is not None:
            raise ValueError("speculative decoding is simulated only: an executor that returns "
                             "token ids cannot verify draft tokens")
        done = self._advance(now)
        self.context_tokens += self._context_growth.pop(self.step, 0)
        return done
