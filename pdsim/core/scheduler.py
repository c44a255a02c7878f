"""The part every instance shares: a waiting queue that extend batches draw from (prefill,
chunked prefill, recompute after retraction) and, where tokens are generated locally, the
continuous-batching running batch.

`ColocatedScheduler` is that alone: the non-disaggregated baseline. The prefill and decode
schedulers add their transfer queues around it.

Drivers call `step(now)` to let the queues advance and get the next forward to run (or None),
run it, then `on_batch_done(batch, result, now)`. Finished and failed requests collect in
`done`, which the driver drains.
"""

from __future__ import annotations

from collections import deque

from pdsim.core.batch import (
    Batch, BatchResult, BatchShape, ExtendBatch, ExtendSegment, extend_attn_pairs,
)
from pdsim.core.chunking import chunk_cap
from pdsim.core.config import SchedulerConfig
from pdsim.core.pages import num_pages
from pdsim.core.pool import IndexPool, PagePool
from pdsim.core.radix import RadixCache, max_match_pages
from pdsim.core.request import Request
from pdsim.core.running import RunningBatch, SpeculativeRunningBatch


class InstanceScheduler:
    caches_prefixes = False  # whether `config.prefix_cache` gives this kind a RadixCache
    meets_by_room = False  # whether its requests meet a peer instance's by bootstrap room (PD)
    # how its instance spreads requests over DP ranks by default (SGLang >= 0.5.10's `auto`
    # --load-balance-method: round robin, a PD prefill instance by bootstrap room)
    auto_dp_assignment = "round_robin"

    def __init__(self, config: SchedulerConfig, instance_id: int = 0, req_slots: int | None = None):
        self.config = config
        self.instance_id = instance_id
        self.pool = PagePool(config.num_pages, config.page_size)
        self.cache = RadixCache(self.pool) if config.prefix_cache and self.caches_prefixes else None
        self.req_slots = IndexPool(req_slots or config.max_running_requests, "request slot")
        # A hybrid model's recurrent states: one slot per request beside its pages.
        self.state_slots = (IndexPool(config.state_slots, "state slot") if config.state_slots
                            else None)
        self.waiting: deque[Request] = deque()
        spec = config.speculation
        self.running = (RunningBatch(self.pool) if spec is None
                        else SpeculativeRunningBatch(self.pool, spec))
        self.metadata_slots: IndexPool | None = None  # PD instances only
        # The outbox a driver drains after each step: `done` (finished or failed requests, kept
        # until the driver clears it) and `emitted` (requests given a token outside a forward by
        # the last `step()`: a decode worker's first token, read from the KV metadata).
        self.done: list[Request] = []
        self.emitted: list[Request] = []
        self.num_active = 0  # requests added and not yet done (the router's load signal)
        self.retractions = 0  # running requests retracted for want of KV pages
        self._decode_now = 0.0
        # Set by the instance under overlap_schedule "plans_ahead": an extend takes no request that
        # reached the waiting queue after this time, nor does a decode take a request whose KV
        # landed after it (None: any); `held_back` says whether the last plan left one out.
        self.plan_cutoff_s: float | None = None
        self.held_back = False

    # ----- admission -------------------------------------------------------------------------

    def _reject_if_too_long(self, req: Request, tokens: int, now: float) -> bool:
        """Fail `req` at once when it asks for more than the model's context (SGLang's
        tokenizer manager refuses a prompt of context_len tokens or more, and a prompt + output
        that reach it) or `tokens` is more than the pool holds; whether it did."""
        context = self.config.context_len
        if context is not None and req.input_len + req.max_new_tokens >= context:
            self._fail(req, f"request asks for {req.input_len} prompt + {req.max_new_tokens} "
                            f"output tokens, beyond the model's context length of {context} "
                            "tokens", now)
            return True
        if tokens > self.config.pool_tokens:
            self._fail(
                req,
                f"request needs {tokens} KV tokens but the instance's pool holds "
                f"{self.config.pool_tokens} ({self.config.num_pages} pages of {self.config.page_size})",
                now,
            )
            return True
        return False

    def _reserved_tokens(self) -> int:
        """KV tokens set aside so that admitted requests can keep decoding."""
        return self.config.num_reserved_decode_tokens * self._num_decoding()

    def _num_decoding(self) -> int:
        return len(self.running)

    def _admit_extend(self, req: Request, tokens: int) -> bool:
        """Whether a request that has no KV yet may start its extend of `tokens` new tokens."""
        if req.req_slot < 0:
            if self._free_tokens() - self._reserved_tokens() < req.fill_len - req.computed_tokens:
                return False
            slot = self.req_slots.alloc()
            if slot is None:
                return False
            if not self._take_state_slot(req):
                self.req_slots.free(slot)
                return False
            req.req_slot = slot
        return True

    def _take_state_slot(self, req: Request) -> bool:
        """A recurrent-state slot for `req`; False when none is free (always True when the
        model keeps no per-request state)."""
        if self.state_slots is None:
            return True
        slot = self.state_slots.alloc()
        if slot is None:
            return False
        req.state_indices = [slot]
        return True

    def _state_slots_free(self) -> int:
        """Free recurrent-state slots (-1 without a state pool): part of what a blocked queue
        waits for."""
        return -1 if self.state_slots is None else self.state_slots.num_free

    def _free_tokens(self) -> int:
        """KV tokens new requests can have: free pages, plus cached pages nobody pins."""
        free = self.pool.num_free + (self.cache.evictable_pages if self.cache is not None else 0)
        return free * self.config.page_size

    def _alloc_pages(self, n: int) -> list[int] | None:
        """`n` pages, evicting unpinned cached prefixes if needed; None when there are not."""
        return self.pool.alloc_many(n) if self.cache is None else self.cache.alloc(n)

    def _match_prefix(self, req: Request, now: float) -> None:
        """At admission: take the longest cached prefix of the request's prompt pages (pinned
        until it finishes), so its extend starts after them."""
        limit = min(len(req.prefix_keys), max_match_pages(req.fill_len, self.config.page_size))
        match = self.cache.match_prefix(req.prefix_keys[:limit], now)
        self.cache.lock(match.node)
        req.cache_node = match.node
        req.pages = list(match.pages)
        req.computed_tokens = match.cached_tokens
        if req.num_output == 0:
            req.cached_tokens = match.cached_tokens

    def _release_pages(self, req: Request, now: float) -> None:
        """Give back the request's pages: with a cache, its computed whole prompt pages join
        the cache (where they are not already) and its pin drops; the rest go to the pool."""
        if self.cache is not None and req.cache_node is not None:
            whole = min(len(req.prefix_keys), req.computed_tokens // self.config.page_size)
            self.cache.cache_finished(req.prefix_keys[:whole], req.pages, req.cache_node, now)
            req.cache_node = None
        elif req.pages:
            self.pool.free_many(req.pages)
        req.pages = []

    # ----- planning --------------------------------------------------------------------------

    def step(self, now: float) -> Batch | None:
        """Advance the queues and plan the next forward: prefill first, else decode."""
        return (self.waiting and self._plan_extend(now)) or self._plan_decode(now)

    def _plan_extend(self, now: float) -> Batch | None:
        if not self.waiting:
            return None
        cfg = self.config
        budget = cfg.max_prefill_tokens
        head = self.waiting[0]  # a request part-way through its chunks comes first
        started = head.prefill_start_s == head.prefill_start_s
        chunk = chunk_cap(cfg.chunked_prefill_size, cfg.dynamic_chunking,
                          head.computed_tokens if started else 0)
        segments: list[ExtendSegment] = []
        tokens = prefix = 0
        pairs = 0.0
        cutoff = self.plan_cutoff_s
        self.held_back = False
        # With chunking the whole batch holds at most one chunk: SGLang's PrefillAdder takes
        # each admitted request's tokens off `rem_chunk_tokens` (and `rem_input_tokens`, the
        # max_prefill_tokens budget) and stops when either is spent, cutting the request that
        # crosses the chunk there.
        while self.waiting and budget > 0 and (not chunk or tokens < chunk):
            req = self.waiting[0]
            if cutoff is not None and self._entered_waiting_s(req) > cutoff:
                self.held_back = True  # it came after this batch was due to be planned
                break
            if self.cache is not None and req.cache_node is None and req.prefix_keys and not req.pages:
                self._match_prefix(req, now)
            take = req.fill_len - req.computed_tokens
            if chunk:
                take = min(take, chunk - tokens)
            elif take > budget and segments:
                break  # without chunking a long prompt runs alone
            if not self._admit_extend(req, take):
                break
            # All of the fill's pages at its first chunk: a half-prefilled request then never
            # waits for pages, so requests holding partial KV cannot deadlock the pool.
            new_pages = num_pages(req.fill_len, cfg.page_size) - len(req.pages)
            pages = self._alloc_pages(new_pages)
            if pages is None:
                break
            req.pages.extend(pages)
            self.waiting.popleft()
            if req.prefill_start_s != req.prefill_start_s:  # its first extend (after any hit)
                req.prefill_start_s = now
            segments.append(ExtendSegment(req, req.computed_tokens, req.computed_tokens + take))
            tokens += take
            pairs += extend_attn_pairs(take, req.computed_tokens)
            prefix += req.computed_tokens
            budget -= take
        if not segments:
            return None
        shape = BatchShape(prefill_tokens=tokens, prefill_attn_pairs=pairs,
                           prefill_prefix_tokens=prefix)
        return ExtendBatch(shape, now, segments)

    def _entered_waiting_s(self, req: Request) -> float:
        """When `req` became eligible for an extend here (overlap_schedule "plans_ahead" holds
        back one that came after the forward in progress began): a colocated request's
        arrival (a retracted one's is earlier still)."""
        return req.queued_s

    def _plan_decode(self, now: float) -> Batch | None:
        running = self.running
        if not running.reqs:
            return None
        self._decode_now = now  # the time `_retract_one` caches a victim's prompt pages at
        due = running.pages_due()
        pages = self._alloc_pages(len(due)) if due else None
        if pages is not None:  # the common case: one page each, no retraction needed
            running.add_pages(due, pages)
            due = []
        for req in due:
            if req not in running.reqs:
                continue  # retracted for an earlier request of this step
            page = self._alloc_pages(1)
            while page is None:
                if not self._retract_one():
                    raise RuntimeError("KV pool exhausted with nothing left to retract")
                if req not in running.reqs:
                    break  # it was the victim itself
                page = self._alloc_pages(1)
            if page is not None:
                running.add_page(req, page[0])
        if not running.reqs:
            return None
        return running.plan(now)

    def _retract_one(self) -> bool:
        """Free the KV of the running batch's `_retraction_victim`; it goes back to the front
        of the waiting queue and is recomputed (prompt + generated tokens; with a cache, from
        its cached prompt pages on, cached as used at this decode step)."""
        if not self.running.reqs:
            return False
        victim = self._retraction_victim()
        self.running.leave(victim)
        self._release_pages(victim, self._decode_now)
        victim.computed_tokens = 0
        self.waiting.appendleft(victim)
        self.retractions += 1
        return True

    def _retraction_victim(self) -> Request:
        """The running request SGLang retracts first (`ScheduleBatch.retract_decode`): the one
        with the fewest tokens generated, of those the longest prompt."""
        kv_len = self.running.kv_len  # the prompt and every generated token but the last
        return min(self.running.reqs, key=lambda r: (kv_len(r) - r.input_len, -r.input_len))

    def decode_run_steps(self, max_steps: int) -> int:
        """After a `step` that planned a decode: how many decode steps (at most `max_steps`)
        could run back to back with each `step` between them doing nothing but the running
        batch's page growth, if nothing outside the scheduler happens meanwhile. A simulator
        runs them as one event and settles them with `on_decode_run_done`; the outcome is the
        same as one by one. 1 when no such run is possible."""
        if not self._only_decoding():
            return 1
        return self.running.quiet_steps(max_steps, self.pool.num_free)

    def _only_decoding(self) -> bool:
        """Whether a `step` now would plan nothing but the running batch's next decode (what it
        skips stays skipped while the free pages only shrink)."""
        return not self.waiting

    def on_decode_run_done(self, end_times_s: list[float]) -> None:
        """Settle a run of decode steps (`decode_run_steps`) that ended at `end_times_s`."""
        now = end_times_s[-1]
        for req in self.running.complete_run(end_times_s, self._alloc_pages):
            self.running.leave(req)
            self._finish(req, now)

    # ----- results ---------------------------------------------------------------------------

    def on_batch_done(self, batch: Batch, result: BatchResult, now: float) -> None:
        if batch.kind == "extend":
            self._extend_done(batch, result, now)
        else:
            for req in self.running.complete(batch, result, now):
                self.running.leave(req)
                self._finish(req, now)
        if result.failed:
            self._fail_unsampled(result.failed, now)

    def _fail_unsampled(self, failed: dict[str, str], now: float) -> None:
        """Fail, alone, the batch's requests whose sampling failed. An extend left them in the
        waiting queue unprefilled (so no first token, and no KV sent on); a decode step that
        also ended one by length left it in `done`: it fails there."""
        for rid, reason in failed.items():
            if self.abort(rid, reason, now):
                continue
            for req in self.done:
                if req.rid == rid and not req.error:
                    req.error = reason

    def _extend_done(self, batch: Batch, result: BatchResult, now: float) -> None:
        unfinished = []
        failed = result.failed or ()
        for i, seg in enumerate(batch.segments):
            req = seg.req
            req.computed_tokens = seg.end
            if req.rid in failed:
                unfinished.append(req)  # back where it came from; `_fail_unsampled` aborts it
            elif seg.is_last:
                token = result.token_ids[i] if result.token_ids is not None else None
                logprob = result.logprobs[i] if result.logprobs is not None else float("nan")
                self._prefilled(req, token, logprob, now)
            else:
                self._chunk_done(req, now)
                unfinished.append(req)
        self.waiting.extendleft(reversed(unfinished))

    def take_up_results(self, now: float) -> None:
        """Under overlap_schedule "late_results": act now on the results of extends held back
        since their forward ended (the prefill scheduler's; nothing elsewhere)."""

    def _chunk_done(self, req: Request, now: float) -> None:
        """A non-final chunk of `req` has its KV (the prefill side starts sending it)."""

    def _prefilled(self, req: Request, token: int | None, logprob: float, now: float) -> None:
        """The extend that completes `req`'s fill produced its next token."""
        if req.num_output == 0:
            req.prefill_end_s = now
            req.first_logprob = logprob
        self._emit(req, token, logprob, now)
        self._start_decoding(req, now)

    def _emit(self, req: Request, token: int | None, logprob: float, now: float) -> None:
        req.num_output += 1
        req.token_times_s.append(now)
        if token is not None:
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)

    def _start_decoding(self, req: Request, now: float) -> None:
        stopped = req.output_ids and req.output_ids[-1] in req.stop_token_ids
        if req.num_output >= req.max_new_tokens or stopped:
            self._finish(req, now)
        else:
            self.running.join(req)

    # ----- endings ---------------------------------------------------------------------------

    def _release(self, req: Request, now: float) -> None:
        self._release_pages(req, now)
        if req.req_slot >= 0:
            self.req_slots.free(req.req_slot)
            req.req_slot = -1
        if req.state_indices:
            self.state_slots.free_many(req.state_indices)
            req.state_indices = []
        if req.metadata_slot >= 0:
            self.metadata_slots.free(req.metadata_slot)
            req.metadata_slot = -1

    def _finish(self, req: Request, now: float) -> None:
        self._release(req, now)
        req.finish_s = now
        req.finished = True
        self.num_active -= 1
        self.done.append(req)

    def _fail(self, req: Request, reason: str, now: float) -> None:
        req.error = reason
        self._finish(req, now)

    def fail_batch(self, batch: Batch, reason: str, now: float) -> None:
        """Fail the requests of a planned batch whose forward raised (the others go on). An
        extend batch's requests go back to the front of the waiting queue first, where the
        planner took them from, so they are released like any aborted waiting request."""
        if batch.kind == "extend":
            reqs = [seg.req for seg in batch.segments]
            self.waiting.extendleft(reversed(reqs))
        else:
            reqs = list(batch.reqs)
        for req in reqs:
            self.abort(req.rid, reason, now)

    def abort(self, rid: str, reason: str, now: float) -> bool:
        """Fail request `rid` wherever it is queued (its client went away, say): its pages and
        slots return to their pools and it goes to `done`; a PD scheduler also aborts its
        sender or receiver, so the other side learns. Returns whether it was found. Call it
        between forwards, never while a batch holding the request is being executed."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._fail(req, reason, now)
                return True
        for req in self.running.reqs:
            if req.rid == rid:
                self.running.leave(req)
                self._fail(req, reason, now)
                return True
        return False

    def check_pools_full(self) -> None:
        """Raise unless every page and slot is back (call when the instance is idle); with a
        prefix cache, back means free or cached and not pinned."""
        (self.pool if self.cache is None else self.cache).check_full()
        self.req_slots.check_full()
        if self.state_slots is not None:
            self.state_slots.check_full()
        if self.metadata_slots is not None:
            self.metadata_slots.check_full()

    def load(self) -> float:
        """The router's load signal, the same in the simulator and in serving: requests added
        and not yet done (a prefill scheduler counts prompt tokens not yet computed instead)."""
        return self.num_active

    def next_deadline_s(self, now: float) -> float | None:
        """The next time after `now` at which a queued request may time out (None: none may),
        so an idle driver knows when to call `step` even if nothing else happens."""
        return None

    @property
    def is_idle(self) -> bool:
        return self.num_active == 0


# SGLang's estimate of the tokens running requests will still generate, which a colocated
# instance keeps free when it admits a prompt (scheduler.py, schedule_policy.py; the defaults of
# environ.py): a share of each one's remaining max_new_tokens (at most 4,096 counted), from
# 0.7 x --schedule-conservativeness (SGLANG_INIT_NEW_TOKEN_RATIO; at most 1) down to 0.14 of
# that (SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR) over 600 decode steps
# (SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS), back to the start when idle; a retraction sets it to
# what the batch has decoded, plus 20 steps a request (SGLANG_RETRACT_DECODE_STEPS), over what
# it may decode.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20


class ColocatedScheduler(InstanceScheduler):
    """Prefill and decode on the same instance: the baseline PD disaggregation is compared with.

    A prompt is admitted when the pool holds it and the tokens it may generate (at most
    CLIP_MAX_NEW_TOKENS) beside `new_token_ratio` of what the running requests may still
    generate and what the batch being planned took (SGLang's `PrefillAdder`), not
    `num_reserved_decode_tokens` a request, which is the PD decode side's rule."""

    caches_prefixes = True

    def __init__(self, config: SchedulerConfig, instance_id: int = 0, **kw) -> None:
        super().__init__(config, instance_id, **kw)
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio = self.init_ratio
        self._planned_output = 0  # output tokens the extend being planned has admitted

    def step(self, now: float) -> Batch | None:
        if not self.running.reqs and not self.waiting:
            self.new_token_ratio = self.init_ratio  # idle
        try:
            return super().step(now)
        finally:
            self._planned_output = 0

    def _admit_extend(self, req: Request, tokens: int) -> bool:
        """With nothing running or admitted, a prompt that fits the pool goes in whatever it
        may generate (admission checked that it fits with all of it): it can always finish."""
        if req.req_slot < 0:
            output = min(req.max_new_tokens - req.num_output, CLIP_MAX_NEW_TOKENS)
            alone = not self.running.reqs and not self._planned_output
            if not alone and (req.fill_len - req.computed_tokens + output
                              >= self._free_tokens() - self._reserved_tokens()):
                return False
            if not super()._admit_extend(req, tokens):
                return False
            self._planned_output += output
        return True

    def _reserved_tokens(self) -> int:
        kv_len = self.running.kv_len  # the prompt and every generated token but the last
        left = sum(min(r.max_new_tokens - (kv_len(r) - r.input_len + 1), CLIP_MAX_NEW_TOKENS)
                   for r in self.running.reqs)
        return int(left * self.new_token_ratio) + self._planned_output

    def on_batch_done(self, batch: Batch, result: BatchResult, now: float) -> None:
        if batch.kind == "decode":
            self._decay(1)
        super().on_batch_done(batch, result, now)

    def on_decode_run_done(self, end_times_s: list[float]) -> None:
        self._decay(len(end_times_s))
        super().on_decode_run_done(end_times_s)

    def _decay(self, steps: int) -> None:
        decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = max(self.new_token_ratio - steps * decay, self.min_ratio)

    def _retract_one(self) -> bool:
        if not super()._retract_one():
            return False
        reqs, kv_len = self.running.reqs, self.running.kv_len
        decoded = sum(kv_len(r) - r.input_len + 1 for r in reqs)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(reqs))
                                   / (sum(r.max_new_tokens for r in reqs) + 1))
        return True

    def add_request(self, req: Request, now: float) -> None:
        self.num_active += 1
        req.decode_instance = self.instance_id
        req.queued_s = now
        if self._reject_if_too_long(req, req.input_len + req.max_new_tokens, now):
            return
        self.waiting.append(req)


def next_deadline(queue, timeout_s: float, now: float) -> float | None:
    """The first deadline after `now` in a queue ordered by `queued_s`. Entries already past
    theirs were looked at by the last `step(now)` and are not waiting to time out."""
    for req in queue:
        deadline = req.queued_s + timeout_s
        if deadline > now:
            return deadline
    return None
