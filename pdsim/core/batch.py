"""What one forward pass costs depends on its shape, not on which requests are in it.

`BatchShape` is the contract between the schedulers (which build batches) and whatever prices
or runs them: the simulator's cost models read only these aggregates, so pricing a batch is
O(1) however many requests it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from pdsim.core.request import Request


class BatchShape(NamedTuple):
    """Aggregate shape of one forward on one attention rank (a named tuple: the simulator
    builds one per step, and a tuple is the cheapest immutable value to build and to key a
    memo with).

    prefill_tokens: new tokens computed by prefill/extend segments (chunked prefill included).
    prefill_attn_pairs: causal (query, key) pairs those segments attend over, summed over
        requests: a segment of n new tokens after c cached ones contributes n * c + n * (n + 1) / 2.
    decode_reqs: requests in the decode step.
    decode_context_tokens: KV tokens read by those decode requests (sum of their context lengths).
    decode_query_len: query tokens each decode request computes in the step: 1 normally,
        1 + draft tokens when a speculative step verifies them.
    prefill_prefix_tokens: tokens computed before those segments that they attend over (a
        cached prefix, earlier chunks), summed over requests: MLA picks its prefill form by
        them and re-projects them (pdsim.sim.cost.mla_extend_form).
    """

    prefill_tokens: int = 0
    prefill_attn_pairs: float = 0.0
    decode_reqs: int = 0
    decode_context_tokens: int = 0
    decode_query_len: int = 1
    prefill_prefix_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens that pass through the dense/MoE layers."""
        return self.prefill_tokens + self.decode_reqs * self.decode_query_len


def extend_attn_pairs(new_tokens: int, cached_tokens: int) -> float:
    """Causal attention pairs of an extend segment of `new_tokens` after `cached_tokens`."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def extend_shape(new_tokens: int, cached_tokens: int = 0) -> BatchShape:
    """A rank's step that extends one request by `new_tokens` after `cached_tokens`."""
    return BatchShape(prefill_tokens=new_tokens,
                      prefill_attn_pairs=extend_attn_pairs(new_tokens, cached_tokens),
                      prefill_prefix_tokens=cached_tokens)


@dataclass(slots=True)
class ExtendSegment:
    """Tokens `[start, end)` of a request's fill sequence computed by one extend forward."""

    req: Request
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        """Whether this chunk completes the request's prefill (and so yields a token)."""
        return self.end == self.req.fill_len


class KVMove(NamedTuple):
    """A request's KV pages copied between device and host before a forward (a PD decode
    instance's retraction offloads them, its resumption loads them into new pages, in order):
    `to_host`, the contents of `pages` are kept under `rid`; else they are written into
    `pages`, in the same order, and dropped from the host."""

    rid: str
    pages: tuple[int, ...]
    to_host: bool


@dataclass(slots=True)
class ExtendBatch:
    """A planned extend forward (prefill, chunked prefill or recompute): each segment says which
    of its request's tokens it computes and how many are cached. A driver runs it and hands back
    a `BatchResult`. `kv_moves` run before it (`KVMove`)."""

    kind: ClassVar[str] = "extend"
    shape: BatchShape
    start_s: float
    segments: list[ExtendSegment]
    kv_moves: list[KVMove] = field(default_factory=list)


@dataclass(slots=True)
class DecodeBatch:
    """A planned decode step of the running requests, in order; `step` is the running batch's
    step the forward computes, from which `kv_lens()` gives each request's KV length, so the plan
    is complete: an executor reads no running-batch bookkeeping."""

    kind: ClassVar[str] = "decode"
    shape: BatchShape
    start_s: float
    reqs: list[Request]
    step: int
    kv_moves: list[KVMove] = field(default_factory=list)  # run before it, as an extend's

    def kv_lens(self) -> list[int]:
        """Each request's KV length before this step, in `reqs` order. O(requests), for
        executors that read every request anyway (the simulator does not)."""
        if self.shape.decode_query_len != 1:
            raise ValueError("kv_lens() of a speculative decode step (simulator only)")
        return [r.kv_at_join + self.step - 1 - r.join_step for r in self.reqs]


Batch = ExtendBatch | DecodeBatch  # what a scheduler plans; `kind` says which


@dataclass(slots=True)
class BatchResult:
    """What an executor returns. The simulator's executors produce no token ids (`None`):
    lengths drive it. A real executor returns one id and logprob per extend segment (only those
    of last chunks are used) or per decode request; `failed` names the requests whose sampling
    failed (rid -> why): each fails alone (a prefill among them sends no first token on)."""

    duration_s: float
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    failed: dict[str, str] | None = None

