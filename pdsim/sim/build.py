"""Experiment config → the simulator's cluster: specs looked up, pools sized, costs bound."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from pdsim import sglang_defaults
from pdsim.config import ConfigError, ExperimentConfig, RoleConfig
from pdsim.core.config import SchedulerConfig
from pdsim.core.running import Speculation
from pdsim.deployment import SchedulerKnobs, overlap_schedule
from pdsim.sim.spec import ClusterSpec, ColdStart, RoleSpec
from pdsim.sim.cost import Parallelism, make_cost_model, pool_sizes, weight_bytes_per_gpu
from pdsim.sim.expert_load import uneven_split_note
from pdsim.sim.pipeline import fit_dynamic_chunking
from pdsim.sim.network import PROTOCOLS, NetworkModel, descriptor_counts, stage_kv_page_bytes
from pdsim.sim.speculative import (
    draft_spec,
    draft_state_bytes_per_request,
    kv_capacity_with_draft,
    make_speculative_cost_model,
)
from pdsim.specs.hardware import HardwareSpec, load_hardware_spec
from pdsim.specs.models import ModelSpec, load_model_spec


def build_role(cfg: ExperimentConfig, role: RoleConfig, name: str, model: ModelSpec,
               hw: HardwareSpec, base_dir: str | None = None) -> RoleSpec:
    par = Parallelism(tp=role.tp, dp_attention=role.dp_attention, ep=role.ep,
                      moe_a2a=role.moe_a2a, two_batch_overlap=role.two_batch_overlap,
                      single_batch_overlap=role.single_batch_overlap,
                      moe_dense_tp=role.moe_dense_tp, dp_lm_head=role.dp_lm_head, pp=role.pp)
    kv_bytes = role.kv_bytes(cfg.kv_dtype_bytes)
    # Every cost model prices KV reads in the role's KV dtype unless told otherwise, and
    # learns the role it serves (prefill, decode or colocated).
    params = {"kv_dtype_bytes": kv_bytes, "role": name, **_expert_load_params(cfg, role),
              **{k: _resolve(v, base_dir) for k, v in cfg.cost_model.params.items()}}
    spec = cfg.speculative
    knobs = _knobs_for_gpu(role, name, hw, params.get("cuda_graph_max_bs"),
                           spec.method != "none")
    if (params.get("piecewise_cuda_graph") and params.get("piecewise_cuda_graph_max_tokens") is None
            and knobs.chunked_prefill_size > 0):  # SGLang's default, from this role's chunk
        params["piecewise_cuda_graph_max_tokens"] = sglang_defaults.piecewise_cuda_graph_max_tokens(
            model.is_mla, knobs.chunked_prefill_size,
            params.get("piecewise_cuda_graph_rules", "v0.5.23"))
    if (problem := model.split_error(par.attn_tp, role.ep)
            or model.block_fp8_error(role.tp, role.ep, role.moe_dense_tp)) is not None:
        raise ConfigError(f"cluster.{name}: {problem}")
    if role.pp > 1 and spec.method != "none":
        raise ConfigError(f"cluster.{name}.pp={role.pp}: pipeline stages are not modelled "
                          f"with speculative decoding (speculative.method {spec.method!r}); "
                          "use pp 1 or method none")
    redundant = role.eplb.redundant_experts if role.eplb is not None else 0
    try:
        draft = None if spec.method == "none" else draft_spec(
            spec.method, model, spec.draft_layers, spec.draft_model)
        sizes = pool_sizes(model, hw, par, knobs.mem_fraction_static, kv_bytes,
                           max_mamba_cache_size=knobs.max_mamba_cache_size,
                           mamba_full_memory_ratio=knobs.mamba_full_memory_ratio,
                           swa_full_tokens_ratio=knobs.swa_full_tokens_ratio,
                           redundant_experts=redundant)
        tokens = sizes.kv_tokens if draft is None else kv_capacity_with_draft(
            sizes.kv_tokens, model, draft, par, kv_bytes)
        num_pages = knobs.pool_pages(tokens)
    except ValueError as exc:  # the weights, KV or state do not fit
        derived = "" if role.scheduler.mem_fraction_static is not None else (
            f" ({knobs.mem_fraction_static:g} is the mem_fraction_static SGLang derives here, "
            f"keeping memory for a {knobs.chunked_prefill_size}-token prefill chunk and the "
            f"CUDA graphs; set cluster.{name}.scheduler.mem_fraction_static, as large-EP "
            "launches set --mem-fraction-static)")
        raise ConfigError(f"cluster.{name}: {exc}{derived}") from None
    try:
        cost = _cost_factory(cfg, model, hw, par, params, draft)
        built = cost()  # a bad param fails here, naming the role
    except ValueError as exc:
        raise ConfigError(f"cluster.{name}: {exc}") from None
    if num_pages < 1:
        raise ConfigError(f"cluster.{name}: no room for a single KV page after the weights")
    try:
        sched = knobs.build(num_pages, role.dp_attention, f"cluster.{name}.scheduler",
                            _speculation(cfg), state_slots=sizes.state_slots,
                            model_context_len=model.context_len,
                            overlap_schedule=overlap_schedule(name, role, cfg.speculative.method))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sched = _low_latency_cap(sched, role, name, cfg)
    if role.dynamic_chunking is not None:
        sched = replace(sched, dynamic_chunking=fit_dynamic_chunking(
            built, sched, role.dp_attention, role.dynamic_chunking.smooth_factor))
    attn_tp = role.tp // role.dp_attention
    # What a page weighs on the wire: every attention-TP rank of the receiving side needs its
    # own slice (GQA) or its own replica (MLA). A speculating draft's KV and last hidden state
    # move with it (SGLang ships them in the KV and metadata buffers), and so do a hybrid
    # model's per-request states: its sliding-window KV (a whole window, the last pages) and
    # its recurrent state.
    kv_models = [model] if draft is None else [model, draft]
    state_bytes = attn_tp * (model.swa_window_bytes_per_request_per_rank(attn_tp, kv_bytes)
                             + model.recurrent_state_bytes_per_request_per_rank(attn_tp))
    if draft is not None:
        state_bytes += draft_state_bytes_per_request(model)
    kv_page_bytes = sum(knobs.page_size * m.kv_bytes_per_token_per_rank(attn_tp, kv_bytes)
                        * attn_tp for m in kv_models)
    net = cfg.network
    if net.intra_node:  # NVLink: no protocol stack between the GPUs
        nic = (net.bandwidth_gb_per_s or hw.nvlink_gb_per_s) * 1e9 * role.tp
    else:
        line_rate = net.line_rate_efficiency or PROTOCOLS[net.protocol].line_rate_efficiency
        nic = (net.bandwidth_gb_per_s or hw.rdma_gb_per_s) * 1e9 * role.tp * line_rate
    # Each pipeline stage sends its own layers' KV over its own NICs, all stages at once: a
    # transfer lasts as long as the stage with the most bytes takes on one stage's NICs.
    nic *= kv_page_bytes / max(stage_kv_page_bytes(kv_page_bytes, model.num_layers, role.pp))
    # On shared host cores every rank process runs its torch threads (unset: as many as the
    # host has cores, as a served rank does on its own).
    host = cfg.cluster.host_cores
    demand = role.gpus_per_instance * role.threads if role.threads else (host or 1)
    # A retraction's host copy: each GPU its own share of a page, over its own host link (at
    # the link's rate: SGLang gathers each layer's rows into pageable memory, no faster).
    host_copy_s_per_page = kv_page_bytes / attn_tp / (hw.host_link_gb_per_s * 1e9)
    return RoleSpec(role.instances, role.dp_attention, role.gpus_per_instance, sched, cost, nic,
                    kv_page_bytes, state_bytes_per_request=state_bytes, wakeup_s=knobs.wakeup_s,
                    cold=cold_start(knobs),
                    pp=role.pp, weight_bytes_per_gpu=weight_bytes_per_gpu(model, par, redundant),
                    host_demand=demand, host_copy_s_per_page=host_copy_s_per_page)


def _check_one_domain(cfg: ExperimentConfig, hws: dict[str, HardwareSpec]) -> None:
    """network.intra_node moves the KV over NVLink between any prefill and any decode
    instance: the roles' GPUs (at their most instances, when autoscaled) must share one
    hardware and fit its NVLink domain."""
    c, scale = cfg.cluster, cfg.autoscaling
    if hws["prefill"] != hws["decode"]:
        raise ConfigError(
            f"network.intra_node: prefill on {hws['prefill'].name} and decode on "
            f"{hws['decode'].name} cannot share an NVLink domain; drop intra_node or give "
            "both roles one hardware")
    gpus = {name: (scale.prefill.max_instances if scale and name == "prefill" else
                   scale.decode.max_instances if scale else role.instances)
            * role.gpus_per_instance for name, role in (("prefill", c.prefill),
                                                        ("decode", c.decode))}
    domain = hws["prefill"].gpus_per_node
    if sum(gpus.values()) > domain:
        raise ConfigError(
            f"network.intra_node: the deployment's {gpus['prefill']} prefill and "
            f"{gpus['decode']} decode GPUs do not fit {hws['prefill'].name}'s NVLink domain of "
            f"{domain}; drop intra_node (the KV then crosses the RDMA NICs) or use fewer GPUs")


def cold_start(knobs: SchedulerKnobs) -> ColdStart | None:
    """The role's slower first step after idle, None where its knobs leave steps as priced."""
    if knobs.cold_step_s == 0 and knobs.cold_step_factor == 1:
        return None
    return ColdStart(knobs.cold_step_s, knobs.cold_step_factor, after_s=knobs.cold_after_s)


def _knobs_for_gpu(role: RoleConfig, name: str, hw: HardwareSpec, graph_bs: int | None,
                   speculative: bool) -> SchedulerKnobs:
    """The role's scheduler knobs with the prefill chunk and memory fraction SGLang derives
    on `hw` where the config leaves them out."""
    if graph_bs is None:
        graph_bs = sglang_defaults.cuda_graph_max_bs(hw.hbm_gib, role.tp)
    knobs = role.scheduler.for_gpu(hw.hbm_gib, role.tp, role.pp, role.dp_attention, graph_bs,
                                   speculative)
    if knobs.mem_fraction_static <= 0:
        raise ConfigError(
            f"cluster.{name}: SGLang's derived --mem-fraction-static is "
            f"{knobs.mem_fraction_static:g} on {hw.name} (it keeps memory for CUDA graphs of "
            f"{graph_bs} requests on each of {role.dp_attention} DP ranks, and for a "
            f"{knobs.chunked_prefill_size}-token chunk), so SGLang would not start; set "
            f"cluster.{name}.scheduler.mem_fraction_static as such launches do, or a smaller "
            "cost_model.params.cuda_graph_max_bs")
    return knobs


def _expert_load_params(cfg: ExperimentConfig, role: RoleConfig) -> dict:
    """The role's expert-load settings for the cost model; only with EP, where there is a
    busiest rank to price (the config rejects eplb without it)."""
    if role.ep == 1:
        return {}
    return {"expert_imbalance": role.expert_imbalance, "seed": cfg.seed,
            "eplb_redundant_experts": None if role.eplb is None else role.eplb.redundant_experts}


def low_latency_cap(role: RoleConfig, name: str, cfg: ExperimentConfig) -> int | None:
    """The most requests a DP rank of the role can decode at once under DeepEP's low-latency
    dispatch (decode steps under moe_a2a deepep), None where there is no such cap: it takes at
    most `num_max_dispatch_tokens_per_rank` tokens per rank and call, so a running batch
    can't exceed that over the tokens each request decodes per step; under two-batch overlap
    each micro-batch, half the batch, makes its own call."""
    if role.moe_a2a != "deepep" or name == "prefill":
        return None
    spec = cfg.speculative
    step_tokens = 1 if spec.method == "none" else spec.num_draft_tokens + 1
    calls = 2 if role.two_batch_overlap else 1
    return max(1, role.num_max_dispatch_tokens_per_rank // step_tokens * calls)


def _low_latency_cap(sched: SchedulerConfig, role: RoleConfig, name: str,
                     cfg: ExperimentConfig) -> SchedulerConfig:
    cap = low_latency_cap(role, name, cfg)
    if cap is None or sched.max_running_requests <= cap:
        return sched
    return replace(sched, max_running_requests=cap)


def low_latency_cap_note(role: RoleConfig, name: str, cfg: ExperimentConfig) -> str | None:
    """What to say where a given max_running_requests is above the low-latency cap: SGLang's
    dispatch asserts on a larger batch, so the run is priced at the cap."""
    cap, given = low_latency_cap(role, name, cfg), role.scheduler.max_running_requests
    if cap is None or given is None or given // role.dp_attention <= cap:
        return None
    return (f"cluster.{name}: max_running_requests {given} ({given // role.dp_attention} a DP "
            f"rank) is above DeepEP's low-latency cap of {cap} a rank (num_max_dispatch_tokens_"
            f"per_rank {role.num_max_dispatch_tokens_per_rank}, SGLANG_DEEPEP_NUM_MAX_DISPATCH_"
            "TOKENS_PER_RANK), whose dispatch SGLang asserts on; priced at the cap, raise the "
            "role's num_max_dispatch_tokens_per_rank to run more")


def speculative_running_note(role: RoleConfig, name: str, cfg: ExperimentConfig) -> str | None:
    """What to say where a speculating role that generates tokens leaves max_running_requests
    to SGLang: its default under speculation is 48 requests an instance, not the pool's
    derived limit, so a batch that stops at 48 has a reason the config does not show."""
    if (cfg.speculative.method == "none" or name == "prefill"
            or role.scheduler.max_running_requests is not None):
        return None
    most = sglang_defaults.SPECULATIVE_MAX_RUNNING_REQUESTS
    per_rank = (f" ({most // role.dp_attention} a DP rank over dp_attention {role.dp_attention})"
                if role.dp_attention > 1 else "")
    return (f"cluster.{name}: speculative decoding ({cfg.speculative.method}) without "
            f"scheduler.max_running_requests runs at most {most} requests an instance{per_rank}, "
            "SGLang's default under speculation (it sets --max-running-requests so); set "
            "max_running_requests to run more, as speculating deployments do")


def _cost_factory(cfg: ExperimentConfig, model: ModelSpec, hw: HardwareSpec, par: Parallelism,
                  params: dict, draft: ModelSpec | None):
    """Builds one instance's cost model: the named one, wrapped for speculative decoding."""
    if draft is None:
        return partial(make_cost_model, cfg.cost_model.name, model, hw, par, **params)
    return partial(make_speculative_cost_model, cfg.cost_model.name, model, hw, par, draft,
                   cfg.speculative.num_draft_tokens, **params)


def _speculation(cfg: ExperimentConfig) -> Speculation | None:
    spec = cfg.speculative
    if spec.method == "none":
        return None
    return Speculation(spec.num_draft_tokens, spec.accept_len_probs(), cfg.seed)


def _resolve(value, base_dir: str | None):
    """A string parameter naming a file relative to the experiment's folder, made absolute (in
    nested mappings too: a profiled model's per-role `timings`)."""
    if isinstance(value, dict):
        return {k: _resolve(v, base_dir) for k, v in value.items()}
    if isinstance(value, str) and base_dir and (Path(base_dir) / value).exists():
        return str(Path(base_dir) / value)
    return value


def role_hardware(cfg: ExperimentConfig, base_dir: str | None = None) -> dict[str, HardwareSpec]:
    """Each role's GPU: its own `hardware`, else the deployment's; an error names the field."""
    specs: dict[str, HardwareSpec] = {}
    for name in cfg.cluster.roles:
        field = cfg.role_hardware(name)
        where = "hardware" if field is cfg.hardware else f"cluster.{name}.hardware"
        try:
            specs[name] = load_hardware_spec(field, base_dir)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return specs


def usd_per_gpu_hour(cfg: ExperimentConfig, base_dir: str | None = None) -> float | None:
    """The deployment's price per GPU-hour: each role's GPUs at their hardware's price,
    averaged over the GPUs; None when a role's hardware has no price."""
    hws = role_hardware(cfg, base_dir)
    roles = cfg.cluster.roles
    if any(hws[name].usd_per_gpu_hour is None for name in roles):
        return None
    return (sum(role.gpus * hws[name].usd_per_gpu_hour for name, role in roles.items())
            / cfg.cluster.num_gpus)


def build_cluster(cfg: ExperimentConfig, base_dir: str | None = None) -> ClusterSpec:
    try:
        model = load_model_spec(cfg.model, base_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    hws = role_hardware(cfg, base_dir)
    net = cfg.network
    proto = PROTOCOLS[net.protocol]
    c = cfg.cluster
    pd = c.mode != "colocated"
    if pd and net.intra_node:
        _check_one_domain(cfg, hws)
    src_attn = c.prefill.tp // c.prefill.dp_attention if pd else 0
    dst_attn = c.decode.tp // c.decode.dp_attention if pd else 0
    if pd and (problem := model.pd_tp_error(src_attn, dst_attn)) is not None:
        raise ConfigError(f"cluster: {problem}")
    per_run, per_page = (0.0, 0.0) if not pd else descriptor_counts(
        model.num_layers, 1 if model.is_mla else 2, c.prefill.scheduler.page_size,
        model.num_kv_heads, src_attn, dst_attn, model.is_mla)
    network = NetworkModel(
        enabled=net.enabled,
        message_latency_s=net.message_latency_s,
        first_contact_s=net.first_contact_s,
        handshake_s=net.handshake_s,
        transfer_floor_s=proto.transfer_floor_s if net.transfer_floor_s is None
        else net.transfer_floor_s,
        sharing=net.sharing,
        per_descriptor_s=proto.per_descriptor_s if net.per_descriptor_s is None
        else net.per_descriptor_s,
        sender_posts=proto.sender_posts,
        descriptors_per_run=per_run,
        descriptors_per_page=per_page,
    )
    roles = {"colocated": c.colocated} if not pd else {"prefill": c.prefill, "decode": c.decode}
    notes = tuple(note for name, role in roles.items() if model.is_moe and role.eplb is None
                  and (note := uneven_split_note(name, model.name, model.num_experts, role.ep)))
    notes += tuple(note for name, role in roles.items()
                   if (note := low_latency_cap_note(role, name, cfg)))
    notes += tuple(note for name, role in roles.items()
                   if (note := speculative_running_note(role, name, cfg)))
    overheads = {"notes": notes, "frontend_latency_s": cfg.router.frontend_latency_s,
                 "idle_wakeup_s": cfg.router.idle_wakeup_s,
                 "idle_after_s": cfg.router.idle_after_s,
                 "jitter_s": tuple(cfg.router.jitter_s),
                 "idle_jitter_s": tuple(cfg.router.idle_jitter_s),
                 "dp_assignment": cfg.router.dp_assignment,
                 "router_options": dict(cfg.router.policy_options),
                 "host_cores": cfg.cluster.host_cores}
    if not pd:
        return ClusterSpec("colocated", cfg.router.policy, network,
                           colocated=build_role(cfg, c.colocated, "colocated", model,
                                                hws["colocated"], base_dir=base_dir),
                           **overheads)
    # GQA KV split over different attention-TP sizes on the two sides moves as head slices:
    # many small writes instead of whole pages (docs/architecture.md, "TP mismatch"), priced by the
    # network model per descriptor.
    prefill = build_role(cfg, c.prefill, "prefill", model, hws["prefill"], base_dir)
    if model.is_mla and src_attn > dst_attn:  # only dst_attn prefill ranks send; the rest idle
        prefill = replace(prefill, nic_bytes_per_s=prefill.nic_bytes_per_s * dst_attn / src_attn)
    return ClusterSpec(
        "disaggregated",
        cfg.router.policy,
        network,
        prefill=prefill,
        decode=build_role(cfg, c.decode, "decode", model, hws["decode"], base_dir),
        faults=cfg.faults,
        **overheads,
    )
