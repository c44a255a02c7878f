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
  waiting queue: a wait for room counts in the request's TTFT, not in its first ITL.
- **running**: continuous-batching decode; when the pool runs out a request is retracted and
  later recomputed by a local extend (the shared waiting queue).
"""

from __future__ import annotations

from collections import deque

from pdsim.core.config import SchedulerConfig
from pdsim.core.kvpoll import KVPoll
from pdsim.core.pages import num_pages
from pdsim.core.pool import IndexPool
from pdsim.core.request import Request
from pdsim.core.scheduler import InstanceScheduler, next_deadline
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
        # What the last scan of each queue saw (`_prealloc_due`); an unchanged epoch means a
        # rescan would find no endpoint changed (see KVManager.poll_epoch).
        self._prealloc_seen: tuple[int, tuple[int, ...]] | None = None
        self._prealloc_blocked = False
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
        epoch = self.kv.poll_epoch()
        if self.prealloc and self._prealloc_due(epoch):
            self._pop_preallocated(now)
            self._prealloc_seen = (epoch, self._room())
        if self.transfer:
            overdue = now - self.transfer[0].queued_s >= self.config.waiting_timeout_s
            if epoch != self._transfer_seen or overdue:
                self._transfer_seen = epoch
                self._pop_transferred(now)
        if self.prebuilt:
            self._merge_prebuilt(now)
        # Retracted requests recompute first; decode otherwise.
        return (self.waiting and self._plan_extend(now)) or self._plan_decode(now)

    def next_deadline_s(self, now: float) -> float | None:
        return next_deadline(self.transfer, self.config.waiting_timeout_s, now)

    def _num_decoding(self) -> int:
        return len(self.running) + len(self.transfer) + len(self.prebuilt) + len(self.waiting)

    def _only_decoding(self) -> bool:
        # Prealloc stays blocked while pages only shrink; transfers move on outside events or
        # at their timeouts (the simulator ends a run of steps at the next one); prebuilt
        # requests wait while the batch is full.
        return not self.waiting and (not self.prebuilt
                                     or len(self.running) >= self.config.max_running_requests)

    def abort(self, rid: str, reason: str, now: float) -> bool:
        """Also searches the prealloc, transfer and prebuilt queues; a request still waiting for
        its KV aborts its receiver, so the prefill side stops sending."""
        for queue in (self.prealloc, self.transfer, self.prebuilt):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._prealloc_seen = None  # the head may have gone: scan again
                    if queue is not self.prebuilt:
                        req.receiver.abort(reason)
                    self._fail(req, reason, now)
                    return True
        return super().abort(rid, reason, now)

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
        if seen is None or epoch != seen[0]:
            return True
        return self._prealloc_blocked and any(a > b for a, b in zip(self._room(), seen[1]))

    def _pop_preallocated(self, now: float) -> None:
        still = []
        blocked = False
        for req in self.prealloc:
            poll = req.receiver.poll()
            if poll is KVPoll.Failed:
                self._fail(req, f"handshake failed: {req.receiver.failure_reason()}", now)
            elif blocked or poll is KVPoll.Bootstrapping:
                still.append(req)
            elif not self._preallocate(req):
                blocked = True  # first come, first served: later requests wait behind it
                still.append(req)
            else:
                req.queued_s = now
                self.transfer.append(req)
                self._transfer_seen = -1
        self.prealloc = still
        self._prealloc_blocked = blocked

    def _preallocate(self, req: Request) -> bool:
        cfg = self.config
        pages_needed = num_pages(req.input_len, cfg.page_size)
        budget = self.pool.free_tokens - self._reserved_tokens()
        if pages_needed * cfg.page_size + cfg.num_reserved_decode_tokens > budget and self._num_decoding():
            return False
        if (self.req_slots.num_free == 0 or self.metadata_slots.num_free == 0
                or self._state_slots_free() == 0):
            return False
        pages = self.pool.alloc_many(pages_needed)
        if pages is None:
            return False
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

    def _prefilled(self, req: Request, token: int | None, logprob: float, now: float) -> None:
        """A retracted request is recomputed: like a prebuilt one, it joins the running batch only
        when there is room (else first in the prebuilt line), so the batch stays within
        `max_running_requests`."""
        self._emit(req, token, logprob, now)
        if len(self.running) < self.config.max_running_requests or req.num_output >= req.max_new_tokens:
            self._start_decoding(req, now)
        else:
            self.prebuilt.appendleft(req)

    def _merge_prebuilt(self, now: float) -> None:
        cap = self.config.max_running_requests
        while self.prebuilt and len(self.running) < cap:
            req = self.prebuilt.popleft()
            if req.landed_token is not None:  # (a recomputed one has its tokens already)
                token, logprob = req.landed_token
                req.landed_token = None
                req.decode_join_s = now
                self._emit(req, token, logprob, now)
                self.emitted.append(req)
            self._start_decoding(req, now)
