"""One deployment, two backends: the config sections `pdsim run` simulates and `pdsim serve` serves.

An experiment (pdsim.config.ExperimentConfig) and a serve config (runtime.serve_config) are both
a `Deployment` plus what only their backend reads, so one YAML file can be simulated and served.
Every field says whether a backend ignores it ("sim only", "real only"); docs/experiments.md,
"One deployment, two backends", lists them.

Scheduler knobs are SGLang's flags with SGLang's defaults and its per-instance meaning, as in
sglang/python/sglang/srt/server_args.py (v0.4.9-v0.5): `--max-prefill-tokens 16384`,
`--num-reserved-decode-tokens 512`, `--chunked-prefill-size` and `--mem-fraction-static` derived
from the GPU as SGLang derives them (pdsim.sglang_defaults; `SchedulerKnobs.for_gpu`), and
sglang/srt/disaggregation/mooncake/conn.py: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and
SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s each. Where pdsim's default differs, the field says so.
`SchedulerKnobs.build` is the one place a core `SchedulerConfig` is made from them.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdsim import sglang_defaults
from pdsim.autoscaling_config import AutoscalingConfig
from pdsim.core.config import SchedulerConfig
from pdsim.core.router import POLICIES, make_policy
from pdsim.core.running import Speculation
from pdsim.specs.precision import KV_DTYPE_BYTES, KVDTypeName, kv_format
from pdsim.faults import FaultsConfig


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _renamed(data: Any, old: dict[str, str]) -> Any:
    """A clear error for a field that was renamed or moved (`old` maps old name -> new place);
    the error's path names the section."""
    if isinstance(data, dict):
        for name, new in old.items():
            if name in data:
                raise ValueError(f"{name} is now {new}")
    return data


# ---- model presets ------------------------------------------------------------------------


def servable_presets() -> tuple[str, ...]:
    """The model presets the real backend can build (random weights): pdsim.specs.servable's.
    Every one is also a simulator preset (pdsim.specs.models), so the same name serves both."""
    from pdsim.specs.servable import SERVABLE_HF_CONFIGS

    return tuple(sorted(SERVABLE_HF_CONFIGS))


def model_presets() -> dict[str, tuple[str, ...]]:
    """Every model preset -> the backends it works with ("sim", "real")."""
    from pdsim.specs.models import model_preset_names

    real = set(servable_presets())
    return {name: ("sim", "real") if name in real else ("sim",) for name in model_preset_names()}


# ---- scheduler ----------------------------------------------------------------------------


# SGLang's `_handle_data_parallelism`: DP attention scales --schedule-conservativeness by 0.3.
DP_CONSERVATIVENESS = 0.3


class SchedulerKnobs(_Spec):
    """One instance's scheduler flags, SGLang's names, defaults and meanings (module docstring).

    Per instance, as SGLang's flags: with attention DP, `max_running_requests` and
    `chunked_prefill_size` are split over the DP ranks (each gets value // dp_attention);
    `max_prefill_tokens` and the KV pool are per rank."""

    page_size: int = Field(16, ge=1, description="KV tokens per page (SGLang's default is 1; "
                           "prefill and decode need the same)")
    max_running_requests: int | None = Field(
        None, ge=1, description="requests in a batch at most, per instance (split over DP "
        "ranks). None: SGLang's derivation per rank, min(pool tokens // 2, request pool), the "
        "request pool being pool tokens * 512 / context length clamped to 2048..4096; with "
        "speculative decoding SGLang's 48 per instance (split over DP ranks)")
    max_prefill_tokens: int = Field(16384, ge=1, description="new tokens of one extend batch, "
                                    "per DP rank")
    chunked_prefill_size: int | None = Field(
        None, ge=0, description="prefill chunk, per instance; 0 disables chunking (SGLang: -1). "
        "None: SGLang's default for the GPU's memory (2048 under 35 GiB, 4096 under 60, 8192 "
        "under 160, else 16384); the real backend, which does not know its device: 8192")
    num_reserved_decode_tokens: int = Field(
        512, ge=0, description="PD decode: KV tokens set aside per running or queued request "
        "when preallocating or resuming one (a colocated instance reserves SGLang's "
        "new_token_ratio of what its running requests may still generate)")
    pre_alloc_size: int | None = Field(
        None, ge=0, description="decode: request slots beyond max_running_requests for requests "
        "whose KV is on its way, per DP rank. None: SGLang's, twice max_running_requests up to "
        "32 of them, else 0 (SGLANG_DISAGGREGATION_NUM_PRE_ALLOCATE_REQS)")
    metadata_slots: int = Field(512, ge=1, description="first-token metadata slots of a "
                                "prefill or decode rank")
    schedule_conservativeness: float = Field(
        1.0, ge=0, description="colocated: SGLang's --schedule-conservativeness, the scale on the "
        "share of what running requests may still generate that admission keeps free (0.7 x it "
        "at first); SGLang takes 0.3 x it under DP attention")
    context_length: int | None = Field(
        None, gt=0, description="the longest prompt + output a request may ask for; a longer "
        "one fails at once, as SGLang's --context-length refuses it. None: the model's "
        "(config.json's max_position_embeddings)")
    bootstrap_timeout_s: float = Field(
        300.0, gt=0, description="prefill: a request whose decode side never says where to "
        "write its KV fails after this (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
    waiting_timeout_s: float = Field(
        300.0, gt=0, description="decode: a request whose KV does not arrive fails after this "
        "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
    mem_fraction_static: float | None = Field(
        None, gt=0, le=1, description="sim only: share of GPU memory for weights and KV pool "
        "when num_pages is not given. None: SGLang's derivation from the GPU's memory, the "
        "prefill chunk, the CUDA graphs, tp, pp and DP attention (pdsim.sglang_defaults)")
    num_pages: int | None = Field(
        None, ge=1, description="KV pool pages per DP rank, in both backends. None: the "
        "simulator sizes it from mem_fraction_static of the hardware's memory after the "
        "weights; the real backend does not measure its device and needs it (or "
        "max_total_tokens) given")
    max_total_tokens: int | None = Field(
        None, ge=1, description="SGLang's --max-total-tokens: KV pool tokens per DP rank at "
        "most, whole pages; the simulator takes the smaller of this and what memory leaves, "
        "the real backend this. Give it or num_pages, not both")
    wakeup_s: float = Field(0.0, ge=0, description="sim only: an idle scheduler notices new "
                            "work (a request, a finished transfer) this late")
    cold_step_s: float = Field(0.0, ge=0, description="sim only: the first step after the "
                               "instance idled cold_after_s or longer takes cold_step_s + "
                               "cold_step_factor x its cost-model time (a CPU host's forward "
                               "after idle; pdsim calibrate measures it)")
    cold_step_factor: float = Field(1.0, ge=1, description="sim only: see cold_step_s")
    cold_after_s: float = Field(0.025, gt=0, description="sim only: the idle time after which "
                                "a step starts cold (cold_step_s)")
    max_mamba_cache_size: int | None = Field(
        None, ge=1, description="sim only, models with linear-attention layers: recurrent-state "
        "slots per DP rank (SGLang's --max-mamba-cache-size); a request holds one from "
        "admission to its end. None: sized by mamba_full_memory_ratio")
    mamba_full_memory_ratio: float = Field(
        0.9, gt=0, description="sim only: recurrent-state memory over KV-pool memory when "
        "max_mamba_cache_size is not given (SGLang's --mamba-full-memory-ratio)")
    swa_full_tokens_ratio: float = Field(
        0.8, gt=0, description="sim only, models with sliding-window layers: their pool's tokens "
        "over the full-attention pool's (SGLang's --swa-full-tokens-ratio)")
    disable_overlap_schedule: bool = Field(
        False, description="SGLang's --disable-overlap-schedule. Else its overlap event loop "
        "plans each batch while the one before it runs, so a prefill or colocated request that "
        "arrives during a forward waits for the batch after the next, and a PD decode request "
        "whose KV lands during a step decodes from the step after the next (a DeepEP prefill "
        "takes up its results a forward late instead; nothing with pipeline stages or "
        "speculative decoding, where SGLang runs without it)")
    disable_radix_cache: bool = Field(
        False, description="SGLang's --disable-radix-cache: the prefill and colocated "
        "schedulers keep a radix prefix cache unless true (decode has none)")

    @model_validator(mode="after")
    def _one_pool_size(self) -> SchedulerKnobs:
        if self.num_pages is not None and self.max_total_tokens is not None:
            raise ValueError(f"num_pages {self.num_pages} and max_total_tokens "
                             f"{self.max_total_tokens} both size the KV pool; give one")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens {self.max_total_tokens} is less than one page "
                             f"(page_size {self.page_size}); give at least {self.page_size}")
        return self

    def pool_pages(self, memory_tokens: int | None = None) -> int | None:
        """KV pool pages of one DP rank: num_pages, else max_total_tokens and the
        `memory_tokens` the GPU's memory leaves (SGLang keeps the smaller), in whole pages;
        None when neither bounds it."""
        if self.num_pages is not None:
            return self.num_pages
        bounds = [t for t in (self.max_total_tokens, memory_tokens) if t is not None]
        return min(bounds) // self.page_size if bounds else None

    def for_gpu(self, hbm_gib: float, tp: int, pp: int, dp_attention: int, graph_bs: int,
                speculative: bool) -> SchedulerKnobs:
        """These knobs with the prefill chunk and memory fraction, where not given, as SGLang
        derives them for an instance of tp x pp GPUs of `hbm_gib` each, replaying decode
        batches of up to `graph_bs` as CUDA graphs."""
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = sglang_defaults.chunked_prefill_size(hbm_gib)
        fraction = self.mem_fraction_static
        if fraction is None:
            fraction = sglang_defaults.mem_fraction_static(
                hbm_gib, chunk=chunk, max_prefill_tokens=self.max_prefill_tokens,
                graph_bs=graph_bs, tp=tp, pp=pp, dp_attention=dp_attention,
                speculative=speculative)
        return self.model_copy(update={"chunked_prefill_size": chunk,
                                       "mem_fraction_static": fraction})

    def build(self, num_pages: int, dp_attention: int = 1, where: str = "scheduler",
              speculation: Speculation | None = None, state_slots: int = 0,
              model_context_len: int | None = None,
              overlap_schedule: str = "off", speculating: bool = False) -> SchedulerConfig:
        """The core config of one DP rank of an instance with `num_pages` pages and
        `state_slots` recurrent-state slots per rank, serving a model of `model_context_len`
        tokens at most; `overlap_schedule`: how SGLang's overlap loop shifts its batches
        (`pdsim.core.config.OVERLAP_SCHEDULES`; both backends' roles: `overlap_schedule`),
        "off" under --disable-overlap-schedule. `speculating`: the
        instance drafts (implied by `speculation`, which only the simulator passes), so its
        running requests default as a speculating SGLang server's do."""
        running = self._running_per_rank(num_pages, dp_attention, where,
                                         speculating or speculation is not None)
        return SchedulerConfig(
            state_slots=state_slots,
            num_pages=num_pages, page_size=self.page_size,
            max_running_requests=running,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_size=self._per_dp_rank("chunked_prefill_size", dp_attention, where,
                                                   default=REAL_CHUNKED_PREFILL_SIZE),
            num_reserved_decode_tokens=self.num_reserved_decode_tokens,
            pre_alloc_size=(self.pre_alloc_size if self.pre_alloc_size is not None
                            else sglang_defaults.pre_alloc_size(running)),
            metadata_slots=self.metadata_slots,
            bootstrap_timeout_s=self.bootstrap_timeout_s,
            waiting_timeout_s=self.waiting_timeout_s, speculation=speculation,
            prefix_cache=not self.disable_radix_cache, dynamic_chunking=None,
            context_len=self.context_length or model_context_len,
            overlap_schedule="off" if self.disable_overlap_schedule else overlap_schedule,
            schedule_conservativeness=(self.schedule_conservativeness
                                       * (DP_CONSERVATIVENESS if dp_attention > 1 else 1.0)))

    def _running_per_rank(self, num_pages: int, dp: int, where: str,
                          speculative: bool = False) -> int:
        # sglang/srt/model_executor/model_runner.py (init_memory_pool) sizes the request pool
        # from the KV pool of the rank; the scheduler then caps running requests at half the
        # pool's tokens. Only the 2048..4096 clamp depends on the context length.
        pool_tokens = num_pages * self.page_size
        req_pool = min(max(pool_tokens * 512 // SGLANG_CONTEXT_LEN, 2048), 4096)
        if self.max_running_requests is not None:
            return self._per_dp_rank("max_running_requests", dp, where)
        if speculative:  # SGLang sets 48 per instance when speculating (sglang_defaults)
            per_rank = sglang_defaults.SPECULATIVE_MAX_RUNNING_REQUESTS // dp
            if per_rank < 1:
                raise ValueError(
                    f"{where}.max_running_requests: unset, a speculating SGLang server runs "
                    f"{sglang_defaults.SPECULATIVE_MAX_RUNNING_REQUESTS} requests, less than one "
                    f"per each of dp_attention={dp} ranks (SGLang would not start); set it")
            return min(per_rank, req_pool)
        return max(1, min(pool_tokens // 2, req_pool))

    def _per_dp_rank(self, knob: str, dp: int, where: str, default: int | None = None) -> int:
        value = getattr(self, knob)
        if value is None:
            value = default
        if dp == 1 or value == 0:
            return value
        if value < dp:
            raise ValueError(f"{where}.{knob}: {value} is per instance and split over "
                             f"dp_attention={dp} ranks; give at least {dp}")
        return value // dp


REAL_CHUNKED_PREFILL_SIZE = 8192  # a chunk left unset on the real backend (its device unknown)
SGLANG_CONTEXT_LEN = 131072  # context length assumed when deriving the request pool (Llama-3.1, Qwen3, DeepSeek-V3 ~128k)


# ---- roles and cluster --------------------------------------------------------------------


class EPLBConfig(_Spec):
    """Sim only: SGLang's expert-parallel load balancer (--enable-eplb)."""

    redundant_experts: int = Field(0, ge=0, description="SGLang's --ep-num-redundant-experts: "
                                   "extra copies of the hottest experts; experts + copies must "
                                   "split evenly over the ep ranks")


class DynamicChunkingConfig(_Spec):
    """Sim only: SGLang's --enable-dynamic-chunking for pipeline stages (pdsim.core.chunking);
    `dynamic_chunking: true` takes the defaults."""

    smooth_factor: float = Field(
        0.75, ge=0, le=1, description="SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR: how far a later "
        "chunk moves from --chunked-prefill-size towards the size that makes it cost what the "
        "first chunk does (0: not at all, 1: all the way)")


class RoleConfig(_Spec):
    """The instances of one role (prefill, decode or colocated): each is `tp * pp` GPUs (sim)
    or `tp` rank processes (real)."""

    instances: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    hardware: str | dict[str, Any] | None = Field(
        None, description="sim only: this role's GPU, as the deployment's `hardware` takes it "
        "(a preset, a YAML file or a mapping); it prices the role's steps, sizes its KV pool "
        "and sets its NIC. None: the deployment's `hardware`")
    pp: int = Field(1, ge=1, description="sim only, prefill only: pipeline stages per instance "
                    "(SGLang's --pp-size), each tp GPUs with its share of the layers "
                    "(docs/cost_model.md, \"Pipeline-parallel prefill\")")
    dp_attention: int = Field(1, ge=1, description="attention data-parallel ranks per instance "
                              "(SGLang's --dp-size with --enable-dp-attention); real: PD roles "
                              "only, docs/serving.md")
    ep: int = Field(1, ge=1, description="expert-parallel size: routed experts split whole over "
                    "ep of the tp GPUs (sliced over tp/ep); real: prefill and decode roles, "
                    "tokens moved by all-to-all (docs/serving.md, \"Expert parallelism\")")
    kv_dtype: KVDTypeName | None = Field(
        None, description="sim only: KV-cache dtype (SGLang's --kv-cache-dtype); default: the "
        "experiment's kv_dtype_bytes")
    moe_a2a: Literal["none", "deepep"] = Field(
        "none", description="sim only: deepep is SGLang's --moe-a2a-backend deepep (needs "
        "ep = tp > 1 and a MoE model)")
    two_batch_overlap: bool = Field(
        False, description="sim only: SGLang's --enable-two-batch-overlap (needs moe_a2a: deepep)")
    single_batch_overlap: bool = Field(
        False, description="sim only: SGLang's --enable-single-batch-overlap: a decode step's "
        "DeepEP calls beside its own shared and routed experts (needs moe_a2a: deepep; not with "
        "two_batch_overlap)")
    moe_dense_tp: Literal[1] | None = Field(
        None, description="SGLang's --moe-dense-tp-size: None = tp; 1 = dense MLP "
        "layers data-parallel, per GPU on its own tokens (needs dp_attention > 1)")
    dp_lm_head: bool = Field(
        False, description="SGLang's --enable-dp-lm-head: LM head and embedding per "
        "attention-DP rank (needs dp_attention > 1); false: the LM head split by vocabulary over "
        "tp on every DP rank's gathered rows (the real backend keeps the embedding whole on "
        "each process either way)")
    eplb: EPLBConfig | None = Field(
        None, description="sim only: SGLang's --enable-eplb (needs ep > 1): experts placed by "
        "their load, redundant copies of the hottest")
    expert_imbalance: bool = Field(
        True, description="sim only: a MoE layer takes as long as its busiest EP rank under "
        "skewed routing; false prices the mean rank (docs/cost_model.md)")
    num_max_dispatch_tokens_per_rank: int = Field(
        128, ge=1, description="sim only: DeepEP low-latency's tokens per rank per dispatch "
        "(SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK); with moe_a2a deepep it caps a "
        "decode batch per DP rank")
    dynamic_chunking: DynamicChunkingConfig | None = Field(
        None, description="sim only, prefill with pp > 1: SGLang's --enable-dynamic-chunking, "
        "a request's later chunks sized to cost what its first one does (scheduler."
        "chunked_prefill_size); true takes SGLang's smooth factor, 0.75")
    scheduler: SchedulerKnobs = SchedulerKnobs()
    host: str = Field("127.0.0.1", description="real only: the workers' HTTP bind address")
    port: int = Field(0, ge=0, le=65535, description="real only: HTTP port of instance 0 "
                      "(instance i: port + i); 0 picks free ports")
    bootstrap_port: int = Field(0, ge=0, le=65535, description="real only, prefill: bootstrap "
                                "server port of instance 0 (instance i: + i); 0 picks free ports")
    threads: int | None = Field(None, ge=1, description="real only: torch threads of a rank's "
                                "forwards, on its engine thread (default: the CPUs divided by "
                                "tp)")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return _renamed(data, {k: f"scheduler.{k}" for k in
                               ("num_pages", "metadata_slots", "pre_alloc_size")})

    @field_validator("dynamic_chunking", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        """`true` takes SGLang's defaults, `false` is off."""
        return ({} if value else None) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _divides(self) -> RoleConfig:
        from pdsim.specs.parallel import check_dp_options, check_moe_a2a

        for name in ("dp_attention", "ep"):
            if self.tp % getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} must divide tp={self.tp}")
        check_moe_a2a(self.moe_a2a, self.two_batch_overlap, self.tp, self.ep,
                      self.single_batch_overlap)
        check_dp_options(self.moe_dense_tp, self.dp_lm_head, self.dp_attention)
        if self.eplb is not None and self.ep < 2:
            raise ValueError(f"eplb balances experts over expert-parallel ranks: it needs "
                             f"ep > 1, got ep={self.ep}")
        if self.dynamic_chunking is not None:
            if self.pp < 2:
                raise ValueError(f"dynamic_chunking sizes chunks for pipeline stages (SGLang "
                                 f"installs it only with --pp-size > 1): it needs pp > 1, got "
                                 f"pp={self.pp}")
            if self.scheduler.chunked_prefill_size == 0:
                raise ValueError("dynamic_chunking starts from scheduler.chunked_prefill_size, "
                                 "which is 0 (chunking off); give a chunk size or leave it "
                                 "unset for SGLang's default")
        return self

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.pp

    @property
    def gpus(self) -> int:
        return self.instances * self.gpus_per_instance

    def kv_bytes(self, default_bytes: float) -> float:
        """Bytes per KV-cache element: this role's kv_dtype, else the experiment's."""
        return KV_DTYPE_BYTES[self.kv_dtype] if self.kv_dtype else default_bytes


def overlap_schedule(role_name: str, role: RoleConfig, speculative_method: str) -> str:
    """How SGLang's overlap event loop shifts the batches of `role_name`'s instances
    (`pdsim.core.config.OVERLAP_SCHEDULES`), for both backends: each loop plans step k+1 while
    step k runs ("plans_ahead"), so a request that arrives (or, on a decode instance, whose KV
    lands) while a step runs is prefilled (decodes) a step later than a loop that plans at the
    step's end. SGLang runs without it with pipeline stages (`_handle_pipeline_parallelism`,
    which also picks `event_loop_pp_disagg_prefill`) and with speculative decoding
    (`_handle_speculative_decoding`, before its opt-in v2). DeepEP's normal-mode dispatch
    returns its per-expert token counts to the host (`num_recv_tokens_per_expert`, a list), so
    the host waits in every MoE layer of an extend until the GPU gets there: a prefill instance
    plans the next batch only as the forward ends, and takes up a batch's results
    (`process_batch_result_disagg_prefill`: its first tokens and KV sends) only after
    launching the next batch, which returns as that batch ends ("late_results"); a colocated
    DeepEP instance runs without it (not modelled there)."""
    if role.pp > 1 or speculative_method != "none":
        return "off"
    if role.moe_a2a == "deepep" and role_name != "decode":
        return "late_results" if role_name == "prefill" else "off"
    return "plans_ahead"


class ClusterConfig(_Spec):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: RoleConfig = RoleConfig()
    decode: RoleConfig = RoleConfig()
    colocated: RoleConfig = Field(RoleConfig(instances=2), description="mode colocated: "
                                  "instances that each prefill and decode (real: one)")
    host_cores: float | None = Field(
        None, gt=0, description="sim only: every instance's rank processes share this many "
        "host CPU cores, as the real backend served on one CPU machine does (`pdsim calibrate` "
        "sets it); unset: each instance runs on its own devices")

    @model_validator(mode="after")
    def _pp_only_prefill(self) -> ClusterConfig:
        """Pipeline stages are modelled for chunked prefill only: a decode step's tokens depend
        on the previous step, so its stages would need SGLang's micro-batches, which are not
        modelled."""
        for name, role in self.roles.items():
            if role.pp > 1 and name != "prefill":
                raise ValueError(
                    f"cluster.{name}.pp={role.pp}: pipeline parallelism is modelled for the "
                    "prefill role of a disaggregated deployment only; give cluster.prefill.pp "
                    f"and leave cluster.{name}.pp at 1")
        return self

    @model_validator(mode="after")
    def _same_page_size(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            p, d = self.prefill.scheduler.page_size, self.decode.scheduler.page_size
            if p != d:
                raise ValueError(
                    f"prefill page_size {p} != decode page_size {d}: a decode instance "
                    "cannot pair with a prefill instance of another page size"
                )
        return self

    @property
    def roles(self) -> dict[str, RoleConfig]:
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def num_gpus(self) -> int:
        return sum(r.gpus for r in self.roles.values())


# ---- router, network, transfer, security ----------------------------------------------------


WayInDelay = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RouterConfig(_Spec):
    """The front: picks a (prefill, decode) pair or a colocated instance; real: serves the
    OpenAI API at host:port (a colocated deployment's one engine serves it there itself)."""

    policy: str = "round_robin"
    policy_options: dict[str, float] = Field(
        default_factory=dict, description="both: the policy's settings, by name (cache_aware: "
        "cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size; "
        "defaults sgl-router's)")
    dp_assignment: Literal["auto", "room", "round_robin", "shortest_queue"] = Field(
        "auto", description="how an instance picks a request's DP rank (SGLang's "
        "--load-balance-method; auto: round_robin, a prefill instance room; a real prefill "
        "instance always takes room % dp_attention, where the decode side looks it up)")
    frontend_latency_s: float = Field(4.4e-3, ge=0, description="sim only: tokenizer, HTTP and "
                                      "router time of a request, both ways, counted in its TTFT "
                                      "(default: SGLang's own, docs/cost_model.md)")
    idle_wakeup_s: float = Field(0.0, ge=0, description="sim only: a request that reaches a "
                                 "deployment with no request in flight for idle_after_s or "
                                 "longer takes this much longer on its way in (its processes' "
                                 "threads wake; pdsim calibrate measures it)")
    idle_after_s: float = Field(0.025, gt=0, description="sim only: see idle_wakeup_s")
    jitter_s: list[WayInDelay] = Field(
        default_factory=list, description="sim only: extra delays on a request's way in, one "
        "drawn at random per request (seeded); pdsim calibrate measures them on a CPU host: lone "
        "requests' client TTFTs over the fastest of them")
    idle_jitter_s: list[WayInDelay] = Field(
        default_factory=list, description="sim only: likewise for a request that finds the "
        "deployment idle (see idle_wakeup_s), drawn instead of jitter_s; pdsim calibrate "
        "measures them from lone requests after idle")
    host: str = Field("127.0.0.1", description="real only: the API's bind address")
    port: int = Field(30000, ge=0, le=65535, description="real only: the API's port; 0 picks "
                      "a free one")
    prefill_urls: list[str] = Field(
        default_factory=list, description="real only, `--role router` alone: the prefill "
        "workers' URLs (default: cluster.prefill.host and ports from cluster.prefill.port)")
    decode_urls: list[str] = Field(default_factory=list, description="real only: likewise for "
                                   "decode")
    read_timeout_s: float = Field(300.0, gt=0, description="real only: the most a worker may "
                                  "stay silent on a request before the router fails it (a decode "
                                  "stream is silent while it waits for its KV: keep this above the "
                                  "decode scheduler's waiting_timeout_s)")
    impl: Literal["pdsim", "sglang"] = Field(
        "pdsim", description="real only, disaggregated: whose router `pdsim serve` starts: "
        "pdsim's (runtime/router.py) or SGLang's (sglang-router, `pip install sglang-router`; "
        "docs/serving.md, \"Behind SGLang's router\")")

    @field_validator("policy")
    @classmethod
    def _known(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; allowed: {', '.join(sorted(POLICIES))}")
        return policy

    @model_validator(mode="after")
    def _options_fit_the_policy(self) -> RouterConfig:
        make_policy(self.policy, random.Random(0), **self.policy_options)  # raises naming the problem
        if self.impl == "sglang":
            if self.policy not in SGLANG_POLICIES:
                raise ValueError(f"policy {self.policy!r} has no counterpart in SGLang's router; "
                                 f"allowed with impl sglang: {', '.join(SGLANG_POLICIES)}")
            unmapped = sorted(set(self.policy_options) - set(SGLANG_OPTION_FLAGS))
            if unmapped:
                raise ValueError(f"policy_options {unmapped} have no counterpart in SGLang's "
                                 f"router; allowed with impl sglang: "
                                 f"{', '.join(SGLANG_OPTION_FLAGS)}")
        return self


# The policies both routers have, under the same names (SGLang's also has manual, bucket and
# consistent_hashing; pdsim's least_loaded)
SGLANG_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
# cache_aware's settings -> sglang_router's flags. max_tree_size has none: sglang_router counts
# its tree in characters, pdsim in prefix keys (pages or blocks).
SGLANG_OPTION_FLAGS = {"cache_threshold": "--cache-threshold",
                       "balance_abs_threshold": "--balance-abs-threshold",
                       "balance_rel_threshold": "--balance-rel-threshold"}


class NetworkConfig(_Spec):
    """Sim only: the modelled KV path between instances. Bandwidths are GB/s (gigabytes) per
    GPU. Defaults and their sources: docs/cost_model.md, "Fixed costs and KV transfer"."""

    enabled: bool = True
    protocol: Literal["rdma", "tcp"] = "rdma"
    bandwidth_gb_per_s: float | None = Field(None, gt=0, description="line rate in GB/s; "
                                             "default: the hardware's NIC")
    line_rate_efficiency: float | None = Field(
        None, gt=0, le=1, description="share of the line rate a transfer reaches; default by protocol")
    transfer_floor_s: float | None = Field(
        None, ge=0, description="fixed time of every KV transfer (one per chunk); default by protocol")
    message_latency_s: float = Field(50e-6, ge=0)
    first_contact_s: float = Field(2e-3, ge=0)
    handshake_s: float = Field(0.58e-3, ge=0, description="per request: the decode side's "
                               "bootstrap lookup and receiver set-up before it asks for the KV")
    sharing: Literal["fair", "fifo"] = Field(
        "fair", description="fair: transfers in flight share each NIC max-min fairly; fifo: one "
        "chunk at a time holds both NICs")
    per_descriptor_s: float | None = Field(
        None, ge=0, description="NIC time of one descriptor (contiguous write) on one GPU; "
        "default by protocol. GQA head slices across a TP mismatch are one per token slot")
    intra_node: bool = Field(False, description="prefill and decode share a node: the KV moves "
                             "over NVLink (the hardware's nvlink_gb_per_s, unless "
                             "bandwidth_gb_per_s is given)")

    @model_validator(mode="before")
    @classmethod
    def _units(cls, data: Any) -> Any:
        return _renamed(data, {
            "bandwidth_gbps": "bandwidth_gb_per_s (GB/s)",
            "head_slice_efficiency": "per_descriptor_s (head slices cost their descriptors; "
                                     "the flat efficiency is gone)"})


class TransferConfig(_Spec):
    """Real only: the Mooncake transfer engine, ZMQ and the peers' liveness (docs/architecture.md
    "Failure edges"). The transfer manager (runtime/transfer/mooncake.py) reads this section as
    it is, under these names. The requests' own timeouts are scheduler knobs
    (bootstrap_timeout_s, waiting_timeout_s)."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device, e.g. mlx5_0 (rdma only)")
    host: str = Field("127.0.0.1", description="ZMQ bind address and transfer-engine hostname: "
                      "this machine's routable IP when the roles span machines")
    num_workers: int = Field(2, ge=1, description="KV-sending threads per prefill rank")
    heartbeat_interval_s: float = Field(
        2.0, ge=0, description="decode -> prefill heartbeats; 0 disables them")
    heartbeat_timeout_s: float = Field(
        20.0, gt=0, description="a peer silent this long fails its unfinished requests")
    handshake_timeout_s: float = Field(
        30.0, gt=0, description="decode: a bootstrap-server lookup gives up after this; "
        "prefill: a decode side's destination for a request not yet seen is kept this long")
    poll_interval_s: float = Field(
        0.005, gt=0, description="tp > 1: how often rank 0 re-polls transfers in flight")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        where = "cluster.<role>.scheduler.{} (a scheduler knob; transfer.handshake_timeout_s is " \
                "the bootstrap-server lookup's)"
        return _renamed(data, {k: where.format(k) for k in
                               ("bootstrap_timeout_s", "waiting_timeout_s")})

    @model_validator(mode="after")
    def _consistent(self) -> TransferConfig:
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("protocol rdma needs a device_name (e.g. mlx5_0)")
        if self.heartbeat_interval_s and self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        return self


class HttpLimits(_Spec):
    """Real only: what one client may hold of every HTTP listener (router, colocated server,
    workers, bootstrap servers), enforced by aiohttp's own settings (runtime/http_app.py;
    docs/serving.md, "Security")."""

    max_body_bytes: int = Field(
        8 << 20, ge=1024, description="a request body larger than this gets 413, refused from "
        "its Content-Length or as soon as that much has been read (aiohttp's client_max_size)")
    keepalive_timeout_s: float = Field(
        75.0, gt=0, description="a connection with no request in progress (a new one too) is "
        "closed after this long idle (aiohttp's keepalive_timeout); keep it above clients' "
        "pool keep-alive (aiohttp's client: 15 s)")
    max_connections: int = Field(
        512, ge=1, description="open connections per listener; one more closes the longest-"
        "idle connection, or is closed itself when every connection has a request in progress")
    backlog: int = Field(128, ge=1, description="the listening socket's accept queue (listen())")
    max_line_bytes: int = Field(8190, ge=256, description="the request line at most (aiohttp's "
                                "max_line_size); longer: 400")
    max_field_bytes: int = Field(8190, ge=256, description="one header at most (aiohttp's "
                                 "max_field_size); longer: 400")


class SecurityConfig(_Spec):
    """Real only: the cluster secret and the public API key (runtime/security.py;
    docs/serving.md, "Security"). Neither is ever written out: `model_dump` leaves them out,
    and the launcher hands the secret to the processes it starts in their environment."""

    cluster_secret: str | None = Field(
        None, min_length=16, exclude=True, repr=False,
        description="authenticates internal calls and messages (PDSIM_CLUSTER_SECRET wins); "
        "`pdsim serve` of a whole deployment generates one when none is given")
    api_key: str | None = Field(
        None, min_length=1, exclude=True, repr=False,
        description="clients of the public API must send `Authorization: Bearer KEY` "
        "(also PDSIM_API_KEY); none: the API is open")
    insecure: bool = Field(
        False, description="a role started alone (--role) may run without a cluster secret")
    limits: HttpLimits = Field(HttpLimits(), description="real only: connection and body "
                               "limits of every HTTP listener")


# ---- the deployment -----------------------------------------------------------------------


class Deployment(_Spec):
    """What is deployed: model, hardware, roles with their parallelism and scheduler knobs,
    router, KV path; the sections both `pdsim run` and `pdsim serve` read."""

    seed: int = Field(0, description="sim: every random choice; real: a preset's random "
                      "weights and unseeded sampling")
    model: str | dict[str, Any] = Field(
        "llama-3.1-8b", description="sim: a preset, a file (relative to this YAML's folder "
        "first) or a mapping of ModelSpec fields, optionally over `base: <preset or file>`; "
        "real: a servable preset (`pdsim presets` marks them) or a local checkpoint directory")
    hardware: str | dict[str, Any] = Field(
        "h100", description="sim only: a preset, a YAML file or a mapping of HardwareSpec "
        "fields, optionally over `base:`")
    kv_dtype_bytes: float = Field(2, gt=0, description="sim only: KV-cache bytes per element "
                                  "of the roles without their own kv_dtype")
    cluster: ClusterConfig = ClusterConfig()
    router: RouterConfig = RouterConfig()
    network: NetworkConfig = NetworkConfig()
    transfer: TransferConfig = TransferConfig()
    faults: FaultsConfig = Field(FaultsConfig(), description="fault injection (pdsim/faults.py)")
    security: SecurityConfig = SecurityConfig()
    autoscaling: AutoscalingConfig | None = Field(
        None, description="resize the prefill and decode roles while serving "
        "(pdsim/autoscaling_config.py); none: the counts stay as given")
    # Real only: the served model's weights, text side and HTTP limits.
    served_model_name: str | None = Field(
        None, description="real only: the name clients send as `model` (default: the preset "
        "or the directory's name)")
    tokenizer: str | None = Field(
        None, description="real only: tokenizer.json (or its directory); default: the "
        "checkpoint's own tokenizer.json, else the byte-level tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="real only: weights and KV dtype (default: the model config's)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="real only")
    default_max_tokens: int = Field(
        256, ge=1, description="real only: max_tokens of a chat request that gives none "
        "(completions: 16)")
    max_records: int = Field(100_000, ge=1, description="real only: finished requests' "
                             "records kept")
    max_inflight_requests: int = Field(
        4096, ge=1, description="real only: requests one server (colocated server, PD worker "
        "or router) answers at once; more get 503 with Retry-After")
    records_path: str | None = Field(None, description="real only, colocated: write the "
                                     "records here (.csv/.parquet) at shutdown")
    timings_path: str | None = Field(None, description="real only, colocated: write the "
                                     "forward timings here (.csv/.parquet) at shutdown")

    @model_validator(mode="before")
    @classmethod
    def _flat_layout(cls, data: Any) -> Any:
        """The earlier flat serve layout's keys, for both backends: an error naming the place
        each has in this one."""
        role = "cluster.<role>"
        return _renamed(data, {
            "mode": "cluster.mode", "page_size": f"{role}.scheduler.page_size",
            "num_pages": f"{role}.scheduler.num_pages", "scheduler": f"{role}.scheduler",
            "prefill": "cluster.prefill", "decode": "cluster.decode",
            "host": f"router.host (the API's; a worker's: {role}.host)",
            "port": f"router.port (the API's; a worker's: {role}.port)"})

    @model_validator(mode="after")
    def _one_kv_dtype_across_pd(self) -> Deployment:
        c = self.cluster
        if c.mode == "colocated":
            return self
        p, d = c.prefill, c.decode
        p_bytes, d_bytes = p.kv_bytes(self.kv_dtype_bytes), d.kv_bytes(self.kv_dtype_bytes)
        if p_bytes != d_bytes or (p.kv_dtype and d.kv_dtype
                                    and kv_format(p.kv_dtype) != kv_format(d.kv_dtype)):
            raise ValueError(
                f"cluster.prefill.kv_dtype {p.kv_dtype or 'default'} ({p_bytes:g} B) and "
                f"cluster.decode.kv_dtype {d.kv_dtype or 'default'} ({d_bytes:g} B) differ: the KV "
                "is copied byte for byte from prefill to decode, so both need one KV dtype"
            )
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> Deployment:
        c = self.cluster
        self.faults.check_instances({} if c.mode == "colocated" else
                                    {"prefill": c.prefill.instances, "decode": c.decode.instances})
        return self

    @model_validator(mode="after")
    def _autoscaling_fits(self) -> Deployment:
        if self.autoscaling is not None:
            c = self.cluster
            self.autoscaling.check_cluster(c.mode, c.prefill.instances, c.decode.instances)
        return self

    def role_hardware(self, role: str) -> str | dict[str, Any]:
        """The hardware field a role runs on: its own `hardware`, else the deployment's."""
        own = self.cluster.roles[role].hardware
        return self.hardware if own is None else own

    @property
    def mode(self) -> str:
        return self.cluster.mode

    @property
    def page_size(self) -> int:
        """KV tokens per page (one value: prefill and decode must agree)."""
        return next(iter(self.cluster.roles.values())).scheduler.page_size
