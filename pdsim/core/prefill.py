"""The prefill instance's scheduler.

Queues, in the order a request passes them:

- **bootstrap**: a `KVSender` per request, polled until the decode side has said where to write
  (`WaitingForInput`). Then, if a metadata slot and a request slot are free, `init` the sender
  with the page count and move on. `Failed` aborts; staying in `Bootstrapping` longer than
  `bootstrap_timeout_s` aborts too. Prefill forces `max_new_tokens = 1`.
- **waiting**: the shared extend planner (token budget per batch, chunked prefill; with a prefix
  cache, the prompt's cached pages are reused, handed to the sender at once, and only the rest
  is computed). After each chunk its complete pages are handed to the sender; the last chunk
  also writes the metadata (first token, logprob, cached tokens, room) and sends the remaining
  pages.
- **inflight**: poll the sender; `Success` frees the KV, `Failed` aborts.
"""

from __future__ import annotations

from pdsim.core.config import SchedulerConfig
from pdsim.core.kvpoll import KVPoll
from pdsim.core.pages import num_pages
from pdsim.core.pool import IndexPool
from pdsim.core.request import Request
from pdsim.core.scheduler import InstanceScheduler, next_deadline
from pdsim.core.transfer import FirstTokenMetadata, KVManager


class PrefillScheduler(InstanceScheduler):
    caches_prefixes = True
    meets_by_room = True
    auto_dp_assignment = "room"

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager, instance_id: int = 0):
        super().__init__(config, instance_id)
        self.kv = kv_manager
        self.metadata_slots = IndexPool(config.metadata_slots, "metadata slot")
        self.bootstrap: list[Request] = []
        self.inflight: list[Request] = []
        self.pending_tokens = 0  # prompt tokens not yet computed (the router's load signal)
        # What the last scan of each queue saw; an unchanged key means a rescan would find
        # nothing new (see KVManager.poll_epoch).
        # Free slots count only while a request waits for them (`_take_slots` refused):
        # otherwise every request left in bootstrap is bootstrapping, and only the epoch (or
        # its timeout) can change that.
        self._bootstrap_seen: tuple | int | None = None
        self._bootstrap_blocked = False
        self._inflight_seen = -1
        # overlap_schedule "late_results": finished extends' results not yet taken up, as
        # (request, whether its last chunk, token, logprob, when its forward ended)
        self._late = config.overlap_schedule == "late_results"
        self._held: list[tuple[Request, bool, int | None, float, float]] = []
        self._taking_up = False

    def add_request(self, req: Request, now: float) -> None:
        self.num_active += 1
        req.max_new_tokens = 1
        req.prefill_instance = self.instance_id
        req.queued_s = now
        req.sender = self.kv.create_sender(req)
        if self._reject_if_too_long(req, req.input_len, now):
            # tell the decode side, with the sizes
            req.sender.abort(f"prefill instance cannot hold the request: {req.error}")
            return
        self.pending_tokens += req.input_len
        self.bootstrap.append(req)
        self._bootstrap_seen = None

    def step(self, now: float):
        epoch = self.kv.poll_epoch()
        if self.bootstrap:
            seen = ((epoch, self.metadata_slots.num_free, self.req_slots.num_free,
                     self._state_slots_free())
                    if self._bootstrap_blocked else epoch)
            overdue = now - self.bootstrap[0].queued_s >= self.config.bootstrap_timeout_s
            if seen != self._bootstrap_seen or overdue:
                self._bootstrap_seen = seen
                self._pop_bootstrapped(now)
        if self.inflight and epoch != self._inflight_seen:
            self._inflight_seen = epoch
            self._poll_inflight(now)
        return self._plan_extend(now)

    def load(self) -> float:
        return self.pending_tokens

    def next_deadline_s(self, now: float) -> float | None:
        return next_deadline(self.bootstrap, self.config.bootstrap_timeout_s, now)

    def _num_decoding(self) -> int:
        return 0  # nothing decodes here: no tokens need reserving

    def _pop_bootstrapped(self, now: float) -> None:
        still = []
        self._bootstrap_blocked = False
        for i, req in enumerate(self.bootstrap):
            poll = req.sender.poll()
            if poll is KVPoll.Failed:
                self._drop_bootstrapping(req, f"bootstrap failed: {req.sender.failure_reason()}", now)
            elif poll is KVPoll.Bootstrapping:
                if now - req.queued_s >= self.config.bootstrap_timeout_s:
                    reason = f"bootstrap timed out after {self.config.bootstrap_timeout_s} s"
                    req.sender.abort(reason)
                    self._drop_bootstrapping(req, reason, now)
                else:
                    still.append(req)
            elif not self._take_slots(req):
                still.extend(r for r in self.bootstrap[i:] if not r.finished)
                self._bootstrap_blocked = True
                break
            else:
                req.sender.init(num_pages(req.input_len, self.config.page_size), req.metadata_slot)
                req.bootstrap_done_s = now
                self.waiting.append(req)
        self.bootstrap = still

    def abort(self, rid: str, reason: str, now: float) -> bool:
        """Also searches the bootstrap and inflight queues; the sender is aborted, so the decode
        side fails the request too."""
        for req in self.bootstrap:
            if req.rid == rid:
                self.bootstrap.remove(req)
                req.sender.abort(reason)
                self._drop_bootstrapping(req, reason, now)
                return True
        for req in self.inflight:
            if req.rid == rid:
                self.inflight.remove(req)
                req.sender.abort(reason)
                self._fail(req, reason, now)
                return True
        for req, last, *_ in self._held:
            if last and req.rid == rid and not req.finished:  # prefilled, results held
                req.sender.abort(reason)
                self._fail(req, reason, now)
                return True
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.pending_tokens -= req.input_len - req.computed_tokens
                req.sender.abort(reason)
                self._fail(req, reason, now)
                return True
        return False

    def _drop_bootstrapping(self, req: Request, reason: str, now: float) -> None:
        self.pending_tokens -= req.input_len
        self._fail(req, reason, now)

    def _take_slots(self, req: Request) -> bool:
        meta = self.metadata_slots.alloc()
        if meta is None:
            return False
        slot = self.req_slots.alloc()
        if slot is None:
            self.metadata_slots.free(meta)
            return False
        if not self._take_state_slot(req):
            self.metadata_slots.free(meta)
            self.req_slots.free(slot)
            return False
        req.metadata_slot, req.req_slot = meta, slot
        return True

    def _entered_waiting_s(self, req: Request) -> float:
        return req.bootstrap_done_s  # it left the bootstrap queue

    def _admit_extend(self, req: Request, tokens: int) -> bool:
        return True  # slots were taken when it left the bootstrap queue; pages are per chunk

    def _match_prefix(self, req: Request, now: float) -> None:
        """Also sends the cached prefix's pages at once (SGLang's early send of the cached
        prefix): their KV moves while the suffix is computed."""
        super()._match_prefix(req, now)
        self.pending_tokens -= req.computed_tokens  # cached: never computed here
        if req.pages:
            self._send(req, req.pages, False, now)
            req.sent_pages = len(req.pages)

    def on_batch_done(self, batch, result, now: float) -> None:
        self.pending_tokens -= batch.shape.prefill_tokens
        super().on_batch_done(batch, result, now)

    def take_up_results(self, now: float) -> None:
        """Send the KV of chunks and first tokens whose forward ended earlier (SGLang's
        `process_batch_result_disagg_prefill` for the last batch, which its overlap loop runs
        after launching the next one); a request aborted meanwhile is skipped."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._taking_up = True
        try:
            for req, last, token, logprob, end_s in held:
                if req.finished:
                    continue
                if last:
                    self._prefilled(req, token, logprob, now)
                    req.prefill_end_s = end_s  # its first token was computed then
                else:
                    self._chunk_done(req, now)
        finally:
            self._taking_up = False

    def _chunk_done(self, req: Request, now: float) -> None:
        if self._late and not self._taking_up:
            self._held.append((req, False, None, float("nan"), now))
            return
        full = req.computed_tokens // self.config.page_size
        if full > req.sent_pages:
            self._send(req, req.pages[req.sent_pages : full], False, now)
            req.sent_pages = full

    def _send(self, req: Request, pages: list[int], last: bool, now: float) -> None:
        if req.transfer_start_s != req.transfer_start_s:  # NaN: its first pages go now
            req.transfer_start_s = now
        # The last chunk also carries the request's state (its slot on this side).
        req.sender.send(pages, last=last, state_indices=req.state_indices if last else ())

    def _prefilled(self, req: Request, token: int | None, logprob: float, now: float) -> None:
        if self._late and not self._taking_up:
            self._held.append((req, True, token, logprob, now))
            return
        req.prefill_end_s = now
        req.first_logprob = logprob
        self._emit(req, token, logprob, now)
        meta = FirstTokenMetadata(
            bootstrap_room=req.bootstrap_room,
            first_token_id=token if token is not None else 0,
            first_logprob=logprob,
            cached_tokens=req.cached_tokens,
        )
        self.kv.metadata.write(req.metadata_slot, meta)
        self._send(req, req.pages[req.sent_pages :], True, now)
        req.sent_pages = len(req.pages)
        self.inflight.append(req)
        self._inflight_seen = -1

    def _poll_inflight(self, now: float) -> None:
        still = []
        for req in self.inflight:
            poll = req.sender.poll()
            if poll is KVPoll.Success:
                self._finish(req, now)
            elif poll is KVPoll.Failed:
                self._fail(req, f"KV transfer failed: {req.sender.failure_reason()}", now)
            else:
                still.append(req)
        self.inflight = still
