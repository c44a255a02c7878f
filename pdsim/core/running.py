"""The continuous-batching decode batch, with O(1) bookkeeping per step.

A request in the batch gains one token and one KV slot per step, so its lengths follow from the
step it joined at: `kv = kv_at_join + (step - join_step)`. Nothing is touched per request per
step; instead the step at which a request finishes and the steps at which it needs a new page are
kept in buckets. That keeps a simulated decode step cheap however large the batch (a real
executor still reads every request, which it must anyway). A request's lengths and token times
are settled when it leaves the batch; it leaves no trace in the buckets, and step end times
older than every member's join are dropped, so a long-running server's batch stays small.
"""

from __future__ import annotations

from collections import defaultdict

from pdsim.core.batch import Batch, BatchResult, BatchShape
from pdsim.core.pool import PagePool
from pdsim.core.request import Request

TRIM_EVERY_STEPS = 4096


class RunningBatch:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.reqs: dict[Request, None] = {}  # insertion-ordered set
        self.step = 0  # decode steps completed
        self.step_end_s: list[float] = []  # end time of step k+1 at index k - self._times_base
        self._times_base = 0
        self.context_tokens = 0  # sum of the KV lengths of the requests in the batch
        self._finish_at: dict[int, list[Request]] = defaultdict(list)
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
        self._finish_at[self._finish_step(req)].append(req)
        self._schedule_growth(req)

    @staticmethod
    def _finish_step(req: Request) -> int:
        return req.join_step + req.max_new_tokens - req.out_at_join

    def _schedule_growth(self, req: Request) -> None:
        # Step count at which the KV fills its pages; the next step then needs one more page.
        kv = req.kv_at_join + self.step - req.join_step
        req.grow_step = self.step + len(req.pages) * self.page_size - kv
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
        base = self._times_base
        req.token_times_s.extend(self.step_end_s[req.join_step - base : self.step - base])
        # Leaving early (a stop token, a retraction, an abort): drop its future bucket entries.
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
        req.pages.append(page)
        self._schedule_growth(req)

    def plan(self, now: float) -> Batch:
        n = len(self.reqs)
        shape = BatchShape(decode_reqs=n, decode_context_tokens=self.context_tokens + n)
        return Batch("decode", shape, now, reqs=list(self.reqs), step=self.step + 1)

    def complete(self, batch: Batch, result: BatchResult, now: float) -> list[Request]:
        """Account one finished decode step; return the requests that are done (still in the batch)."""
        self.step += 1
        self.step_end_s.append(now)
        self.context_tokens += len(self.reqs)
        if self.step % TRIM_EVERY_STEPS == 0:
            self._trim_times()
        done = self._finish_at.pop(self.step, [])
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


    def _trim_times(self) -> None:
        """Forget the end times of steps before every running request joined."""
        low = min((r.join_step for r in self.reqs), default=self.step)
        del self.step_end_s[: low - self._times_base]
        self._times_base = low


def _nones():
    while True:
        yield None
