"""The decode instance's scheduler.

Queues, in the order a request passes them:

- **prealloc**: a `KVReceiver` per request; it handshakes with the prefill rank
  (`Bootstrapping` → `WaitingForInput`). When a request slot and a metadata slot are free and
  the token budget allows, allocate its KV pages and `send_metadata` (page indices and metadata
  slot) to the prefill side. Budget = free tokens − `num_reserved_decode_tokens` per request that
  is running or holds preallocated KV. Request slots number `max_running_requests +
  pre_alloc_size`, so preallocation never takes the slots the running batch needs.
- **transfer**: poll the receiver. On `Success` read the metadata; its room id must be this
  request's (else the buffer was crossed: abort), and keep its first token. `Failed`, or no KV
  within `waiting_timeout_s`, aborts.
- **prebuilt**: the KV is in place, so no prefill forward runs; the request merges into the
  running batch as soon as it has room (`max_running_requests`), and only then is its first
  token sent, as SGLang streams it from the prebuilt batch that takes the request out of the
  waiting queue: a wait for room counts in the request's TTFT, not in its first ITL. Under
  overlap_schedule "plans_ahead" (SGLang's overlap event loop, `event_loop_overlap_disagg_decode`)
  a request merged while a forward ran is **staged**: its first token goes now, but the step
  that follows was planned when the forward before it began, so it decodes from the step after.
  The room counts the running requests that ended in the step just taken up (`_just_finished`,
  as SGLang sizes the merge before it filters them out), so at a full batch a landed request
  joins a plan after a finish.
- **running**: continuous-batching decode. When the pool runs out, a request is retracted as
  SGLang's PD decode retracts it (`retract_decode`, `offload_kv_cache`): its KV pages are
  copied to host memory and freed (a `KVMove` the next forward runs first) and it waits in the
  **retracted** queue. Each step first resumes retracted requests, in order, while a request
  slot is free and the pool holds one's KV and its `num_reserved_decode_tokens` beyond what
  the decoding requests reserve (`resume_retracted_reqs`): new pages, its KV loaded back, then
  the prebuilt line. While any request is retracted, nothing is preallocated, so the
  retracted go first. (SGLang's `process_decode_queue` stops polling transfers then too;
  pdsim polls them, since their pages are already taken: else retracted requests waiting for
  pages that landed transfers hold would stall the instance for good.)
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from pdsim.core.batch import KVMove
from pdsim.core.config import SchedulerConfig
from pdsim.core.kvpoll import KVPoll
from pdsim.core.pages import num_pages
from pdsim.core.pool import IndexPool
from pdsim.core.request import Request
from pdsim.core.scheduler import CLIP_MAX_NEW_TOKENS, InstanceScheduler, next_deadline
from pdsim.core.transfer import KVManager


class DecodeScheduler(InstanceScheduler):
    meets_by_room = True

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager, instance_id: int = 0):
        super().__init__(
            config, instance_id, req_slots=config.max_running_requests + config.pre_alloc_size
        )
        self.kv = kv_manager
        self.metadata_slots = IndexPool(config.metadata_slots, "metadata slot")
        self.prealloc: list[Request] = []
        self.transfer: list[Request] = []
        self.prebuilt: deque[Request] = deque()
        self.retracted: list[Request] = []
        self.staged: list[Request] = []  # merged under "plans_ahead": they decode from the next step
        self._host_pages: dict[str, int] = {}  # a retracted request's KV pages on the host
        self._kv_moves: list[KVMove] = []  # for the next planned forward to run first
        self._moving = False  # whether the last planned forward carries KV moves
        # Running requests that ended in the decode step just taken up: SGLang's next plan
        # still counts them in the running batch when it sizes the prebuilt merge (see
        # `_merge_prebuilt`); the plan after it has filtered them out.
        self._just_finished = 0
        # What each request joining the batch (or staged for it) may need to finish, a
        # max-heap of (-(prompt + min(max_new_tokens, 4,096)), push order, request) read by
        # `_admission_headroom`; entries of requests that left are dropped as they surface.
        self._needs: list[tuple[int, int, Request]] = []
        self._pushes = itertools.count()
        # What the last scan of each queue saw (`_prealloc_due`); an unchanged epoch means a
        # rescan would find no endpoint changed (see KVManager.poll_epoch).
        self._prealloc_seen: tuple[int, tuple[int, ...]] | None = None
        self._prealloc_blocked = False
        self._prealloc_by_output = False  # blocked by what the running batch may still need
        self._transfer_seen = -1

    def add_request(self, req: Request, now: float) -> None:
        self.num_active += 1
        req.decode_instance = self.instance_id
        req.queued_s = now
        req.receiver = self.kv.create_receiver(req)
        if self._reject_if_too_long(req, req.input_len + req.max_new_tokens, now):
            req.receiver.abort(f"decode instance cannot hold the request: {req.error}")
            return
        self.prealloc.append(req)
        self._prealloc_seen = None

    def step(self, now: float):
        self.emitted.clear()  # the outbox holds the first tokens of this step only
        self.held_back = False
        if self.staged:  # merged at the last step boundary: SGLang's plan of this step has them
            for req in self.staged:
                self.running.join(req)
            self.staged.clear()
        if self.retracted:
            self._resume_retracted()
        # No new request takes pages while one is retracted, nor while a retracted one's KV
        # is still to be copied out (a transfer could land in its freed pages).
        epoch = self.kv.poll_epoch()
        if not self.retracted and not any(move.to_host for move in self._kv_moves):
            self._preallocate_ready(epoch, now)
        if self.transfer:
            overdue = now - self.transfer[0].queued_s >= self.config.waiting_timeout_s
            if epoch != self._transfer_seen or overdue:
                self._transfer_seen = epoch
                self._pop_transferred(now)
        if self.prebuilt:
            self._merge_prebuilt(now)
        self._just_finished = 0
        batch = self._plan_decode(now)  # (no extend: the KV arrives, or comes back from host)
        self._moving = batch is not None and bool(self._kv_moves)
        if self._moving:
            batch.kv_moves, self._kv_moves = self._kv_moves, []
        return batch

    def _preallocate_ready(self, epoch: int, now: float) -> None:
        if self.prealloc and self._prealloc_due(epoch):
            self._pop_preallocated(now)
            self._prealloc_seen = (epoch, self._room())

    def next_deadline_s(self, now: float) -> float | None:
        return next_deadline(self.transfer, self.config.waiting_timeout_s, now)

    def _num_decoding(self) -> int:
        return len(self.running) + len(self.staged) + len(self.transfer) + len(self.prebuilt)

    def _only_decoding(self) -> bool:
        # Prealloc stays blocked while pages only shrink; transfers move on outside events or
        # at their timeouts (the simulator ends a run of steps at the next one); prebuilt
        # requests wait while the batch is full; a retracted one may resume at any step; a
        # step that copies KV is priced on its own.
        return (not self.retracted and not self.staged and not self._kv_moves and not self._moving
                and not self._prealloc_by_output) and (
            not self.prebuilt or len(self.running) >= self.config.max_running_requests)

    def _start_decoding(self, req: Request, now: float) -> None:
        super()._start_decoding(req, now)
        if req in self.running.reqs:
            self._note_need(req)

    def _note_need(self, req: Request) -> None:
        need = req.input_len + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        heapq.heappush(self._needs, (-need, next(self._pushes), req))

    def on_batch_done(self, batch, result, now: float) -> None:
        before = self.num_active
        super().on_batch_done(batch, result, now)
        if batch.kind == "decode":
            self._just_finished = before - self.num_active

    def on_decode_run_done(self, end_times_s: list[float]) -> None:
        before = self.num_active
        super().on_decode_run_done(end_times_s)
        self._just_finished = before - self.num_active  # (a run's finishes end its last step)

    def abort(self, rid: str, reason: str, now: float) -> bool:
        """Also searches the prealloc, transfer, prebuilt and retracted queues; a request still
        waiting for its KV aborts its receiver, so the prefill side stops sending; a retracted
        one's KV is dropped from the host."""
        for queue in (self.prealloc, self.transfer, self.prebuilt, self.staged, self.retracted):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._prealloc_seen = None  # the head may have gone: scan again
                    if queue is self.prealloc or queue is self.transfer:
                        req.receiver.abort(reason)
                    elif queue is self.retracted:
                        del self._host_pages[rid]
                        self._kv_moves.append(KVMove(rid, (), to_host=False))
                    self._fail(req, reason, now)
                    return True
        return super().abort(rid, reason, now)

    # ----- retraction ------------------------------------------------------------------------

    def _retract_one(self) -> bool:
        """Retract the running batch's `_retraction_victim`, keeping its KV on the host (see the
        module docstring); its request slot is freed too, as SGLang frees it."""
        if not self.running.reqs:
            return False
        victim = self._retraction_victim()
        self.running.leave(victim)
        self._kv_moves.append(KVMove(victim.rid, tuple(victim.pages), to_host=True))
        self._host_pages[victim.rid] = len(victim.pages)
        self.pool.free_many(victim.pages)
        victim.pages = []
        self.req_slots.free(victim.req_slot)
        victim.req_slot = -1
        self.retracted.append(victim)
        self.retractions += 1
        return True

    def _resume_retracted(self) -> None:
        """Give retracted requests, in order, new pages and their KV back while a request slot
        is free and the pool holds the request's prompt, its generated tokens and
        `num_reserved_decode_tokens` beyond what the decoding requests reserve; they then wait
        in the prebuilt line for room in the batch."""
        allocatable = self.pool.free_tokens - self._reserved_tokens()
        resumed = 0
        for req in self.retracted:
            need = req.computed_tokens + 1 + self.config.num_reserved_decode_tokens
            if self.req_slots.num_free == 0 or need > allocatable:
                break
            pages = self.pool.alloc_many(self._host_pages[req.rid])
            if pages is None:
                break
            del self._host_pages[req.rid]
            req.pages = pages
            req.req_slot = self.req_slots.alloc()
            self._kv_moves.append(KVMove(req.rid, tuple(pages), to_host=False))
            allocatable -= need
            resumed += 1
            self.prebuilt.append(req)
        del self.retracted[:resumed]

    # ----- prealloc --------------------------------------------------------------------------

    def _room(self) -> tuple[int, ...]:
        """What a request blocked in prealloc waits for, each entry larger when there is more
        room: free pages and slots, and fewer decoding requests to reserve tokens for."""
        return (self.pool.num_free, self.req_slots.num_free, self.metadata_slots.num_free,
                self._state_slots_free(), -self._num_decoding())

    def _prealloc_due(self, epoch: int) -> bool:
        """Whether scanning the prealloc queue could move it. Only a changed epoch can turn a
        bootstrapping request ready (or failed); a request blocked for room stays blocked while
        no entry of `_room()` grew past what the last scan left, since `_preallocate` refuses
        monotonically. So the long queue of an overloaded instance, whose decoding requests
        take pages step by step, is not re-read every step."""
        seen = self._prealloc_seen
        if seen is None or epoch != seen[0] or self._prealloc_by_output:
            return True
        return self._prealloc_blocked and any(a > b for a, b in zip(self._room(), seen[1]))

    def _pop_preallocated(self, now: float) -> None:
        still = []
        blocked = False
        self._prealloc_by_output = False
        headroom = None  # read once a scan, when a request first reaches the test
        for req in self.prealloc:
            poll = req.receiver.poll()
            if poll is KVPoll.Failed:
                self._fail(req, f"handshake failed: {req.receiver.failure_reason()}", now)
            elif blocked or poll is KVPoll.Bootstrapping:
                still.append(req)
            elif not self._preallocate(req, headroom := headroom or self._admission_headroom()):
                blocked = True  # first come, first served: later requests wait behind it
                still.append(req)
            else:
                req.queued_s = now
                self.transfer.append(req)
                self._transfer_seen = -1
        self.prealloc = still
        self._prealloc_blocked = blocked

    def _admission_headroom(self) -> list[int]:
        """What `pop_preallocated` (SGLang's `DecodePreallocQueue`, v0.5.10 and v0.5.23) reads
        once per scan: the running batch's KV ("retractable" tokens: prompt and output so far,
        the staged included, as they are in SGLang's running batch), and the allocatable
        tokens: free tokens less the larger of `num_reserved_decode_tokens` per decoding
        request and what the largest running request still needs to finish were all the others
        retracted (its prompt + min(max_new_tokens, 4,096) less the retractable tokens,
        `_allocatable_tokens`' need_space_for_single_req). [retractable, allocatable]."""
        needs, running = self._needs, self.running.reqs
        while needs and needs[0][2] not in running and needs[0][2] not in self.staged:
            heapq.heappop(needs)
        retractable = (self.running.context_tokens + len(self.running)  # sum of kv_len + 1
                       + sum(r.input_len + r.num_output for r in self.staged))
        single = -needs[0][0] - retractable if needs else 0
        reserve = max(self._reserved_tokens(), single)
        return [retractable, self.pool.free_tokens - reserve]

    def _preallocate(self, req: Request, headroom: list[int]) -> bool:
        """SGLang's test in `pop_preallocated`: the prompt + `num_reserved_decode_tokens`, and
        the prompt + min(max_new_tokens, 4,096) less the running batch's KV, must both fit in
        the allocatable tokens, which each admitted request then takes its prompt and reserve
        from. The first request with nothing else decoding goes regardless (SGLang would wait
        for good on one whose prompt and reserve outgrow the whole pool)."""
        cfg = self.config
        pages_needed = num_pages(req.input_len, cfg.page_size)
        retractable, allocatable = headroom
        required = pages_needed * cfg.page_size + cfg.num_reserved_decode_tokens
        to_finish = req.input_len + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) - retractable
        if max(required, to_finish) > allocatable and self._num_decoding():
            # Only the reserve refuses monotonically in `_room()`; the rest eases as the
            # running batch's KV grows (see `_prealloc_due`).
            self._prealloc_by_output = (
                required <= self.pool.free_tokens - self._reserved_tokens())
            return False
        if (self.req_slots.num_free == 0 or self.metadata_slots.num_free == 0
                or self._state_slots_free() == 0):
            return False
        pages = self.pool.alloc_many(pages_needed)
        if pages is None:
            return False
        headroom[1] -= required
        req.pages = pages
        req.req_slot = self.req_slots.alloc()
        req.metadata_slot = self.metadata_slots.alloc()
        self._take_state_slot(req)
        req.receiver.send_metadata(pages, req.metadata_slot, state_indices=req.state_indices)
        return True

    # ----- transfer --------------------------------------------------------------------------

    def _pop_transferred(self, now: float) -> None:
        still = []
        for req in self.transfer:
            poll = req.receiver.poll()
            if poll is KVPoll.Success:
                self._commit_transfer(req, now)
            elif poll is KVPoll.Failed:
                self._fail(req, f"KV transfer failed: {req.receiver.failure_reason()}", now)
            elif now - req.queued_s >= self.config.waiting_timeout_s:
                reason = f"KV did not arrive within {self.config.waiting_timeout_s} s"
                req.receiver.abort(reason)
                self._fail(req, reason, now)
            else:
                still.append(req)
        self.transfer = still

    def _commit_transfer(self, req: Request, now: float) -> None:
        meta = self.kv.metadata.read(req.metadata_slot)
        if meta is None or meta.bootstrap_room != req.bootstrap_room:
            got = None if meta is None else meta.bootstrap_room
            self._fail(
                req,
                f"metadata room {got} does not match request room {req.bootstrap_room}: "
                "the metadata buffer was crossed",
                now,
            )
            return
        self.metadata_slots.free(req.metadata_slot)
        req.metadata_slot = -1
        req.transfer_done_s = now
        req.computed_tokens = req.input_len
        req.cached_tokens = meta.cached_tokens
        req.first_logprob = meta.first_logprob
        token = meta.first_token_id if req.prompt_ids is not None else None
        req.landed_token = (token, meta.first_logprob)
        self.prebuilt.append(req)

    def _merge_prebuilt(self, now: float) -> None:
        """Take prebuilt requests into the batch while it has room, sending first tokens
        (SGLang's `get_new_prebuilt_batch` and `process_batch_result_prebuilt`). Under
        "plans_ahead" with a forward in progress (`plan_cutoff_s` set), SGLang's iteration that
        merges them plans the step after the one already launched: they are staged.

        The room counts the requests that ended in the step just taken up: SGLang's
        `get_next_disagg_decode_batch_to_run` sizes the merge by `running_batch.batch_size()`
        before `update_running_batch` filters the finished out (v0.5.10 and v0.5.23, either
        event loop), so a full batch lets a landed request in one plan later. With nothing
        left running, SGLang's next iteration merges at once (no forward between): no lag."""
        cap = self.config.max_running_requests
        if self.running.reqs:
            cap -= self._just_finished
        staging = self.plan_cutoff_s is not None
        while self.prebuilt and len(self.running) + len(self.staged) < cap:
            req = self.prebuilt.popleft()
            if req.landed_token is not None:  # (a resumed one has its tokens already)
                token, logprob = req.landed_token
                req.landed_token = None
                req.decode_join_s = now
                self._emit(req, token, logprob, now)
                self.emitted.append(req)
            stopped = req.output_ids and req.output_ids[-1] in req.stop_token_ids
            if staging and req.num_output < req.max_new_tokens and not stopped:
                self.staged.append(req)
                self._note_need(req)
                self.held_back = True
            else:
                self._start_decoding(req, now)
