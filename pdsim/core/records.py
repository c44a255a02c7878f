"""One per-request record schema, written by the simulator and by the real backend alike.

Metrics, plots and the sim-vs-real comparison read only this, so both backends share one path.
Times are seconds on the backend's clock (simulated seconds, or a monotonic wall clock whose
zero is the start of the run); a phase a request never reached is NaN.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

NAN = math.nan

@dataclass(slots=True)
class RequestRecord:
    rid: str
    input_tokens: int
    output_tokens: int  # tokens delivered to the client, the first one included
    status: str  # "ok" or "failed"
    error: str = ""
    prefill_instance: int = -1  # -1: not served by a prefill instance
    decode_instance: int = -1  # colocated mode: the serving instance
    arrival_s: float = NAN
    bootstrap_done_s: float = NAN
    prefill_start_s: float = NAN
    prefill_end_s: float = NAN
    # Prefill side: its first pages went to the KV sender (a cached prefix goes before the
    # forward, chunks as they finish, so this may precede prefill_end_s)
    transfer_start_s: float = NAN
    transfer_done_s: float = NAN  # decode side: the KV landed (its metadata read)
    decode_join_s: float = NAN  # decode side: it left the waiting line for the running batch
    first_token_s: float = NAN  # the first token went to the client (PD: at decode_join_s)
    finish_s: float = NAN
    # Emission time of every delivered token (the first included); ITLs are its differences.
    token_times_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from a prefix cache instead of computed

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    def to_row(self) -> dict:
        """Flat row for a table: every field but the token times, plus derived latencies."""
        row = asdict(self)
        times = row.pop("token_times_s")
        row["ttft_s"] = self.ttft_s
        row["e2e_s"] = self.e2e_s
        gaps = [b - a for a, b in zip(times, times[1:])]
        row["itl_mean_s"] = sum(gaps) / len(gaps) if gaps else NAN
        row["itl_max_s"] = max(gaps) if gaps else NAN
        return row
