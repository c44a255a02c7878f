"""What rank 0 of a tensor-parallel instance tells its other ranks at the start of every loop
iteration (runtime/pd/lockstep_engine.py): a `Step` of typed operations, in msgpack.

Every operation is checked when it is built: each field has its declared type and an
`AddRequest` holds what the other ranks can build a request from (a non-empty prompt,
max_new_tokens >= 1, valid sampling, top logprobs in range). Rank 0 builds each operation before
it broadcasts, so a request that cannot be sent fails alone there and the broadcast itself never
raises for one request. Decoding is the codec's, strict: anything but one `Step` of this version
raises `ProtocolError` (the engine's `StepMessageError`), and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from runtime.protocol import codec
from runtime.protocol.codec import Checked, ProtocolError, message
from runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

StepMessageError = ProtocolError  # the name the TP engine catches


@message
@dataclass(frozen=True, slots=True)
class AddRequest(Checked):
    TYPE: ClassVar[str] = "add_request"
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float
    stop_token_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    top_logprobs: int

    def _check(self) -> None:
        if not self.prompt_ids:
            self._refuse("prompt_ids", f"request {self.rid}: an empty prompt; allowed: at least "
                         "one token")
        if self.max_new_tokens < 1:
            self._refuse("max_new_tokens", f"request {self.rid}: max_new_tokens="
                         f"{self.max_new_tokens}; allowed: >= 1")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            self._refuse("top_logprobs", f"request {self.rid}: top_logprobs={self.top_logprobs}; "
                         f"allowed: 0..{MAX_TOP_LOGPROBS}")
        self.sampling()

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, seed=self.seed)
        except ValueError as exc:
            raise ProtocolError(f"{self.TYPE}: request {self.rid}: {exc}",
                                message_type=self.TYPE) from None


@message
@dataclass(frozen=True, slots=True)
class AbortRequest(Checked):
    TYPE: ClassVar[str] = "abort_request"
    rid: str
    reason: str


@message
@dataclass(frozen=True, slots=True)
class CheckPools(Checked):
    """Every rank reports whether its pools are full (a collective, at the same point)."""

    TYPE: ClassVar[str] = "check_pools"


Op = AddRequest | AbortRequest | CheckPools


@message
@dataclass(frozen=True, slots=True)
class Step(Checked):
    """One iteration's start: rank 0's clock, whether to stop, and the operations in order."""

    TYPE: ClassVar[str] = "step"
    now: float
    stop: bool
    ops: list[AddRequest | AbortRequest | CheckPools]


def encode(step: Step) -> bytes:
    return codec.encode(step)


def decode(frame: bytes) -> Step:
    return codec.decode(frame, Step)
