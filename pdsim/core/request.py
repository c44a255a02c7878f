"""A request as the schedulers see it: lengths, progress, owned resources and timestamps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdsim.core.records import RequestRecord

NAN = math.nan


@dataclass(eq=False, slots=True)
class Request:
    """One request on one instance.

    In PD mode the prefill and the decode instance each hold their own `Request` for the same
    `rid` (in the real backend they live in different processes); they meet by `bootstrap_room`.

    Token accounting: a forward that computes the KV of some tokens also produces the next token,
    which is not yet in the KV. So a request that has generated `n` tokens holds
    `input_len + n - 1` tokens of KV (`computed_tokens`), and each decode step writes one more.
    """

    rid: str
    input_len: int
    max_new_tokens: int
    arrival_s: float = NAN
    prompt_ids: list[int] | None = None  # None in the simulator, which needs only lengths
    prefix_keys: list | None = None  # one key per whole prompt page, for the prefix cache
    stop_token_ids: frozenset[int] = frozenset()
    sampling: object = None  # opaque to the core; the executor reads it
    bootstrap_host: str = ""
    bootstrap_port: int = 0
    bootstrap_room: int = -1
    prefill_instance: int = -1
    decode_instance: int = -1

    # Progress
    output_ids: list[int] = field(default_factory=list)  # filled only when the executor returns ids
    num_output: int = 0  # tokens generated so far, settled whenever the request leaves the batch
    computed_tokens: int = 0  # tokens of `fill_len` whose KV is computed (chunked prefill)
    first_logprob: float = NAN
    output_logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prefix tokens found in a cache (reported in the metadata)
    # PD decode side: the first token (id or None, logprob) read from the KV metadata, sent when
    # the request joins the running batch
    landed_token: tuple[int | None, float] | None = None

    # Resources
    pages: list[int] = field(default_factory=list)
    req_slot: int = -1
    metadata_slot: int = -1
    state_indices: list[int] = field(default_factory=list)  # its recurrent-state slot, if any
    sender: object = None
    receiver: object = None
    sent_pages: int = 0  # prefill side: pages already handed to the sender
    cache_node: object = None  # the prefix-cache node it pins (its matched prefix)

    # Running-batch bookkeeping (see RunningBatch)
    join_step: int = 0
    kv_at_join: int = 0
    out_at_join: int = 0
    grow_step: int = -1
    # Speculative decoding (simulator only): tokens emitted after j steps in the batch, j = 0, 1, ...
    emitted_by_step: list[int] | None = None

    # Lifecycle
    queued_s: float = NAN  # when it entered its current queue (timeouts)
    bootstrap_done_s: float = NAN  # prefill side: also when it entered the waiting queue
    prefill_start_s: float = NAN
    prefill_end_s: float = NAN
    transfer_start_s: float = NAN
    transfer_done_s: float = NAN
    decode_join_s: float = NAN
    finish_s: float = NAN
    token_times_s: list[float] = field(default_factory=list)
    error: str = ""
    finished: bool = False

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"request {self.rid}: input_len must be >= 1, got {self.input_len}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"request {self.rid}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.prompt_ids is not None and len(self.prompt_ids) != self.input_len:
            raise ValueError(
                f"request {self.rid}: input_len {self.input_len} != len(prompt_ids) "
                f"{len(self.prompt_ids)}"
            )

    @property
    def fill_len(self) -> int:
        """Tokens a prefill must have in the KV before it yields the next token: the prompt, plus
        every generated token when a retracted request is recomputed."""
        return self.input_len + self.num_output

    def fill_ids(self) -> list[int]:
        """Token ids a (re)prefill computes: the prompt, plus generated tokens after a retraction."""
        assert self.prompt_ids is not None
        return self.prompt_ids + self.output_ids

    def to_record(self, status: str) -> RequestRecord:
        return RequestRecord(
            rid=self.rid,
            input_tokens=self.input_len,
            output_tokens=self.num_output,
            status=status,
            error=self.error,
            prefill_instance=self.prefill_instance,
            decode_instance=self.decode_instance,
            arrival_s=self.arrival_s,
            bootstrap_done_s=self.bootstrap_done_s,
            prefill_start_s=self.prefill_start_s,
            prefill_end_s=self.prefill_end_s,
            transfer_start_s=self.transfer_start_s,
            transfer_done_s=self.transfer_done_s,
            decode_join_s=self.decode_join_s,
            first_token_s=self.token_times_s[0] if self.token_times_s else NAN,
            finish_s=self.finish_s,
            token_times_s=self.token_times_s,
            cached_tokens=self.cached_tokens,
        )
