"""Synthetic workloads: an arrival process and two length distributions, drawn from one seed.

Each component draws from its own `numpy.random.Generator`, spawned from the config's seed in
the order arrival, input_len, output_len; changing one distribution leaves the others' draws
as they were. Nothing is seeded globally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import BeforeValidator, Field, SerializeAsAny, model_validator

from pdsim.workload.arrays import ClosedLoop, TraceNotFoundError, Workload, WorkloadError
from pdsim.workload.prefix import Conversation, SharedPrefix, prefixed_requests
from pdsim.workload.registry import Registry, Spec
from pdsim.workload.traces import TraceFormat, read_trace, resolve_path

# --------------------------------------------------------------------------------------------
# Arrivals: open-loop processes (times drawn up front) and the closed loop (times from serving)


class Arrival(Spec):
    """How requests arrive: `process` names the registered kind."""

    process: str


class ArrivalProcess(Arrival):
    """A renewal process at `rate_rps`; the first request arrives at 0 s."""

    rate_rps: float = Field(gt=0, allow_inf_nan=False, description="mean arrivals per second")

    def arrival_times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        times = np.zeros(n, dtype=np.float64)
        if n > 1:
            np.cumsum(self.gaps(n - 1, rng), out=times[1:])
        return times

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` inter-arrival times in seconds."""
        raise NotImplementedError


ARRIVAL_PROCESSES: Registry[Arrival] = Registry("arrival process", "process")


@ARRIVAL_PROCESSES.register
class PoissonArrival(ArrivalProcess):
    """Exponential gaps: inter-arrival CV 1."""

    process: Literal["poisson"] = "poisson"

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.exponential(1.0 / self.rate_rps, n)


@ARRIVAL_PROCESSES.register
class GammaArrival(ArrivalProcess):
    """Gamma gaps with coefficient of variation `cv`: 1 is Poisson, > 1 bursty, < 1 regular."""

    process: Literal["gamma"] = "gamma"
    cv: float = Field(gt=0, allow_inf_nan=False, description="std / mean of the inter-arrival time")

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, 1.0 / (self.rate_rps * shape), n)


@ARRIVAL_PROCESSES.register
class ConstantArrival(ArrivalProcess):
    """One request every 1 / rate_rps seconds."""

    process: Literal["constant"] = "constant"

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, 1.0 / self.rate_rps)


@ARRIVAL_PROCESSES.register
class ClosedLoopArrival(Arrival):
    """`concurrency` clients that all start at 0 s; each sends its next request `think_time_s`
    after its previous one ends (see `ClosedLoop`)."""

    process: Literal["closed"] = "closed"
    concurrency: int = Field(ge=1, description="clients, each with one request in flight")
    think_time_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                description="pause between a response and the client's next request")

    @property
    def closed_loop(self) -> ClosedLoop:
        return ClosedLoop(self.concurrency, self.think_time_s)


# --------------------------------------------------------------------------------------------
# Length distributions (token counts, always >= 1)


class LengthDistribution(Spec):
    dist: str

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        """`n` token counts (int64, >= 1). `base_dir` resolves relative file paths."""
        raise NotImplementedError


LENGTH_DISTRIBUTIONS: Registry[LengthDistribution] = Registry("length distribution", "dist")

_NO_UPPER_CLIP = 2**62  # lognormal without `max`: keeps the float-to-int64 cast defined


@LENGTH_DISTRIBUTIONS.register
class FixedLength(LengthDistribution):
    dist: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@LENGTH_DISTRIBUTIONS.register
class UniformLength(LengthDistribution):
    """Integers from `low` to `high`, both included."""

    dist: Literal["uniform"] = "uniform"
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> UniformLength:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@LENGTH_DISTRIBUTIONS.register
class SGLangRandomLength(LengthDistribution):
    """SGLang bench_serving's `--dataset-name random` lengths: `--random-input-len` (or
    `--random-output-len`) as `len` and `--random-range-ratio` as `range_ratio`. Integers drawn
    uniformly from max(floor(len x range_ratio), 1) to `len`, both included. The default ratio,
    0, is bench_serving's (v0.5.10 and v0.5.23 alike): lengths from 1 to `len`, mean about
    len / 2, not `len`; a ratio of 1 gives `len` every time. (vLLM's benchmark reads its
    range ratio differently, as len x (1 +- ratio); this is SGLang's.)"""

    dist: Literal["sglang_random"] = "sglang_random"
    len: int = Field(ge=1, description="--random-input-len or --random-output-len")
    range_ratio: float = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                               description="--random-range-ratio (bench_serving's default: 0)")

    @property
    def low(self) -> int:
        return max(int(self.len * self.range_ratio), 1)

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        return rng.integers(self.low, self.len, size=n, endpoint=True, dtype=np.int64)


@LENGTH_DISTRIBUTIONS.register
class LognormalLength(LengthDistribution):
    """Lognormal with the given `mean` and spread, rounded to integers, clipped to [min, max].

    `mean` is the mean of the distribution before rounding and clipping (not the mean of the
    underlying normal). Give the spread as `cv` (std / mean) or as `sigma` (std of log length);
    they relate by sigma**2 = log(1 + cv**2). Clipping moves the mean when much mass lies
    outside [min, max]; without `max` there is no upper clip.
    """

    dist: Literal["lognormal"] = "lognormal"
    mean: float = Field(gt=0, allow_inf_nan=False)
    sigma: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    cv: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_spread(self) -> LognormalLength:
        if (self.sigma is None) == (self.cv is None):
            raise ValueError("give exactly one of sigma or cv")
        if self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self

    @property
    def log_sigma(self) -> float:
        return self.sigma if self.sigma is not None else float(np.sqrt(np.log1p(self.cv**2)))

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        sigma = self.log_sigma
        mu = np.log(self.mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2)
        upper = self.max if self.max is not None else _NO_UPPER_CLIP
        values = np.clip(np.rint(rng.lognormal(mu, sigma, n)), self.min, upper)
        return values.astype(np.int64)


@LENGTH_DISTRIBUTIONS.register
class EmpiricalLength(LengthDistribution):
    """Draws with replacement from one column of a trace file (input or output lengths).

    Input and output are drawn independently, so a pair of empirical distributions keeps each
    marginal but not their correlation; replay the trace itself to keep it.
    """

    dist: Literal["empirical"] = "empirical"
    path: str = Field(min_length=1)
    column: Literal["input", "output"]
    format: TraceFormat = "auto"

    def sample(self, n: int, rng: np.random.Generator, base_dir: str | Path | None = None) -> np.ndarray:
        trace = read_trace(resolve_path(self.path, base_dir), self.format)
        values = trace.input_tokens if self.column == "input" else trace.output_tokens
        if not len(values):
            raise WorkloadError(f"trace {self.path!r} has no rows to sample from")
        return values[rng.integers(0, len(values), size=n)]


# --------------------------------------------------------------------------------------------
# The config


ArrivalSpec = SerializeAsAny[Annotated[Arrival, BeforeValidator(ARRIVAL_PROCESSES.parse)]]
LengthSpec = SerializeAsAny[Annotated[LengthDistribution, BeforeValidator(LENGTH_DISTRIBUTIONS.parse)]]


class SyntheticWorkload(Spec):
    """`num_requests` requests from an arrival process and two length distributions.

    With `prefix` (shared system prompts) or `conversation` (multi-turn), `input_len` draws
    each request's new user text; its prompt is the system prompt (if it has one), the
    conversation so far and that text, and the workload carries prefix blocks of
    `prefix_block_tokens` tokens (the granularity at which prompts are known to be equal). With
    `conversation`, the arrival process times the conversations' first turns.
    """

    num_requests: int = Field(ge=1)
    seed: int = Field(default=0, ge=0)
    arrival: ArrivalSpec
    input_len: LengthSpec
    output_len: LengthSpec
    prefix: SharedPrefix | None = None
    conversation: Conversation | None = None
    prefix_block_tokens: int = Field(64, ge=1, description="tokens per prefix block")

    COMPONENTS: ClassVar[tuple[str, ...]] = ("arrival", "input_len", "output_len", "prefix")

    @model_validator(mode="after")
    def _open_loop_conversations(self) -> SyntheticWorkload:
        if self.conversation is not None and isinstance(self.arrival, ClosedLoopArrival):
            raise ValueError("conversation needs an open-loop arrival process (poisson, gamma, "
                             "constant), not process: closed")
        return self

    def check(self, base_dir: str | Path | None = None) -> None:
        """Raise the WorkloadError `build` would, without drawing the whole workload: only the
        lengths read files (an empirical distribution's trace); the shared prefixes or
        conversations of many requests take seconds to draw and cannot fail once validated."""
        for field in ("input_len", "output_len"):
            self._lengths(field, np.random.default_rng(), base_dir)

    def build(self, base_dir: str | Path | None = None) -> Workload:
        """Draw the workload; `base_dir` resolves an empirical distribution's relative path."""
        seeds = np.random.SeedSequence(self.seed).spawn(len(self.COMPONENTS))
        arrival_rng, input_rng, output_rng, prefix_rng = (np.random.default_rng(s) for s in seeds)
        input_tokens = self._lengths("input_len", input_rng, base_dir)
        output_tokens = self._lengths("output_len", output_rng, base_dir)
        prefix = None
        if self.prefix is not None or self.conversation is not None:
            turns = self.conversation.turns if self.conversation is not None else 1
            input_tokens, prefix = prefixed_requests(input_tokens, output_tokens, self.prefix, turns,
                                                     self.prefix_block_tokens, prefix_rng)
        if isinstance(self.arrival, ClosedLoopArrival):
            zeros = np.zeros(self.num_requests)
            return Workload(zeros, input_tokens, output_tokens, closed_loop=self.arrival.closed_loop,
                            prefix=prefix)
        if self.conversation is None:
            arrival_s = self.arrival.arrival_times(self.num_requests, arrival_rng)
            return Workload(arrival_s, input_tokens, output_tokens, prefix=prefix)
        turns = self.conversation.turns
        starts = self.arrival.arrival_times(-(-self.num_requests // turns), arrival_rng)
        index = np.arange(self.num_requests)
        arrival_s = starts[index // turns] + (index % turns) * self.conversation.think_time_s
        order = np.argsort(arrival_s, kind="stable")
        return Workload(arrival_s[order], input_tokens[order], output_tokens[order],
                        prefix=prefix.take(order))

    def _lengths(self, field: str, rng: np.random.Generator, base_dir: str | Path | None) -> np.ndarray:
        try:
            return getattr(self, field).sample(self.num_requests, rng, base_dir)
        except WorkloadError as exc:
            raise exc.in_field(f"{field}.path" if isinstance(exc, TraceNotFoundError) else field) from None
