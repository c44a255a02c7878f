"""SGLang launch commands -> pdsim's experiment: `pdsim import-sglang launch.sh --base EXP`.

The reverse of pdsim/planning/launch.py: a set of `python -m sglang.launch_server ...` commands
(one per server, or per node of a server that spans `--nnodes` nodes) and one router (`python -m
sglang_router.launch_router ...`, or SGLang's PD load balancer, `python -m
sglang.srt.disaggregation.launch_lb` or `... .mini_lb`)
(none for a single server without `--disaggregation-mode`, which its clients reach directly)
become the deployment they start: the roles (`--disaggregation-mode`; none: colocated) with
their instances (servers whose `--node-rank` is 0), parallelism (`--tp-size`, `--pp-size`,
`--dp-size` with `--enable-dp-attention`, `--ep-size`, `--moe-a2a-backend` or the older
`--enable-deepep-moe`: DeepEP sets ep = tp, as SGLang does), the large-EP options
(`--enable-two-batch-overlap`, `--enable-single-batch-overlap`, `--moe-dense-tp-size`,
`--enable-dp-lm-head`, EPLB: `--enable-eplb` or `--init-expert-location` with `--ep-num-redundant-experts`,
SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK), a pipelined prefill's
`--enable-dynamic-chunking` (with SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR), scheduler knobs (`--mem-fraction-static`,
`--max-running-requests`, `--chunked-prefill-size` (-1: unchunked), `--max-prefill-tokens`,
`--page-size`, `--max-total-tokens`, `--num-reserved-decode-tokens` or
SGLANG_NUM_RESERVED_DECODE_TOKENS (SGLANG_HACK_PD_DECODE_NUM_RESERVED_DECODE_TOKENS before),
`--disable-radix-cache`, `--disable-overlap-schedule`), `--kv-cache-dtype`, the decode servers' CUDA graphs
(`--cuda-graph-max-bs`, `--cuda-graph-bs`, `--disable-cuda-graph`: the cost model's
`cuda_graph_max_bs`), the extending servers' `--enable-piecewise-cuda-graph` with
`--piecewise-cuda-graph-max-tokens` (the cost model's `piecewise_cuda_graph`) and speculative
decoding (`--speculative-algorithm` NEXTN/EAGLE/EAGLE3 with `--speculative-num-steps`: MTP
without `--speculative-draft-model-path`, EAGLE with one; its acceptance comes from the base
experiment), the model (`--model-path`; `--quantization fp8`, `w8a8_fp8` or `modelopt_fp8`
makes its 16-bit linear blocks `fp8_tensor`, `modelopt_fp4` puts it in ModelOpt's NVFP4 layout,
a value that reads the checkpoint's own format (awq, gptq, compressed-tensors, mxfp4, ...)
checks the model holds it, any other is an error: QUANTIZATIONS) and the router's
policy (as SGLang names it: a plan's `least_loaded`, written as `power_of_two`, comes back as
that; `--mini-lb` pairs servers at random) and cache_aware settings. Environment variables
count when set before a command (`VAR=value python -m ...`) or by an `export` line. Every instance of a role must have the
same shape (the simulator has one per role), and every URL the router names must be a server's
`http://HOST:PORT`.

Flags that do not change the simulation (addresses, ports, devices, logging, the transfer
backend...) are read past. Flags that may change performance but that pdsim does not model
(`--deepep-config`, `--attention-backend`, ...) are read past
too, and named in
the notes the import returns (`pdsim import-sglang` prints them), so nothing is dropped
silently.

What the commands do not say -- the workload, the hardware, SLOs, the cost model -- comes from a
base experiment (`pdsim plan` writes one beside launch.sh), whose model, kv_dtype_bytes,
cluster and router are replaced, and its sweep axes over them dropped (with a note).
"""

from __future__ import annotations

import argparse
import ipaddress
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsim.config import ConfigError
from pdsim.deployment import SGLANG_OPTION_FLAGS
from pdsim.specs.models import PRESET_REPOS, load_model_spec, model_preset_names

SERVER = "sglang.launch_server"
ROUTERS = ("sglang_router.launch_router", "sglang.srt.disaggregation.launch_lb",
           "sglang.srt.disaggregation.mini_lb")
LB_POLICIES = {"random": "random", "po2": "power_of_two"}  # SGLang's PD load balancer's
KNOB_FLAGS = {"mem_fraction_static": "--mem-fraction-static",
              "max_running_requests": "--max-running-requests",
              "chunked_prefill_size": "--chunked-prefill-size",
              "max_prefill_tokens": "--max-prefill-tokens", "page_size": "--page-size",
              "max_total_tokens": "--max-total-tokens",
              "schedule_conservativeness": "--schedule-conservativeness",
              "num_reserved_decode_tokens": "--num-reserved-decode-tokens"}
# The base experiment's sections the commands replace.
REPLACED = ("model", "kv_dtype_bytes", "cluster", "router")
# Flags that change nothing the simulator models: where a server listens, what it logs, how its
# processes find each other, names and paths, and EPLB's own bookkeeping.
INERT_FLAGS = frozenset("""
    --host --port --trust-remote-code --log-level --log-level-http --log-requests
    --log-requests-level --dist-init-addr --nnodes --node-rank --base-gpu-id --gpu-id-step
    --disaggregation-transfer-backend --disaggregation-ib-device --disaggregation-bootstrap-port
    --disaggregation-decode-tp --disaggregation-decode-dp --disaggregation-prefill-pp
    --watchdog-timeout --dist-timeout --served-model-name --api-key --tokenizer-path
    --tokenizer-mode --chat-template --tool-call-parser --reasoning-parser --decode-log-interval
    --random-seed --device --show-time-cost --enable-metrics --enable-cache-report
    --crash-dump-folder --download-dir --revision --load-format --model-loader-extra-config
    --skip-server-warmup --enable-request-time-stats-logging --collect-tokens-histogram
    --ep-dispatch-algorithm --eplb-algorithm --expert-distribution-recorder-mode
    --expert-distribution-recorder-buffer-size --enable-expert-distribution-metrics
    --eplb-rebalance-num-iterations --speculative-draft-model-path
    """.split())
# the reserve's variable, and the name SGLang's first large-EP instructions gave it
ENV_KNOBS = {"SGLANG_NUM_RESERVED_DECODE_TOKENS": "num_reserved_decode_tokens",
             "SGLANG_HACK_PD_DECODE_NUM_RESERVED_DECODE_TOKENS": "num_reserved_decode_tokens"}
LL_TOKENS_ENV = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
# SGLang's --quantization values (server_args.py QUANTIZATION_CHOICES) as pdsim reads them.
# Values that set a format on the model's linear blocks: fp8 and w8a8_fp8 quantise a 16-bit
# checkpoint at load (per tensor; w8a8_fp8 per channel) and modelopt_fp8 names a ModelOpt FP8
# checkpoint (per-tensor scales): its 16-bit blocks `fp8_tensor`; modelopt_fp4 names a ModelOpt
# NVFP4 checkpoint (nvidia/DeepSeek-R1-0528-FP4 and kin): experts and dense MLPs `nvfp4`, MLA
# attention BF16 (those checkpoints' exclude_modules keep `self_attn`), GQA attention `nvfp4`.
ONLINE_FP8 = ("fp8", "w8a8_fp8", "modelopt_fp8")
MODELOPT_FP4 = "modelopt_fp4"
# Values that read the checkpoint's own quantization_config: the model must hold that format
# (a preset of another checkpoint does not; give the checkpoint's config.json instead).
CHECKPOINT_FORMATS: dict[str, tuple[str, ...]] = {
    "modelopt": ("fp8_tensor", "nvfp4"),
    "compressed-tensors": ("fp8", "fp8_tensor", "int8", "w4a16", "w4a16_g32", "nvfp4", "mxfp4"),
    **{q: ("w4a16", "w4a16_g32")
       for q in ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "moe_wna16")},
    "mxfp4": ("mxfp4",),
    "w8a8_int8": ("int8",),
}
QUANTIZATIONS = (*ONLINE_FP8, MODELOPT_FP4, *CHECKPOINT_FORMATS)
SMOOTH_FACTOR_ENV = "SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR"
# SGLang's --load-balance-method values that pick a DP rank as a router.dp_assignment does
LOAD_BALANCE_METHODS = {"round_robin": "round_robin", "follow_bootstrap_room": "room",
                        "shortest_queue": "shortest_queue"}
# SGLang's --deepep-mode per role that prices as pdsim does (auto: normal for prefill batches,
# low latency for decode batches)
DEEPEP_MODES = {"prefill": ("auto", "normal"), "decode": ("auto", "low_latency"),
                "colocated": ("auto",)}


def _commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each command: continued lines joined, comments dropped."""
    out, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        try:
            argv = shlex.split(pending + stripped, comments=True)
        except ValueError as exc:
            raise ConfigError(f"line {start}: {exc}") from None
        pending = ""
        if argv:
            out.append((start, argv))
    return out


def _split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's leading VAR=value settings, and the rest."""
    env = {}
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    return env, argv


def _module(argv: list[str]) -> str | None:
    """The module a `python -m MODULE` command runs."""
    if len(argv) >= 3 and argv[0].startswith("python") and argv[1] == "-m":
        return argv[2]
    return None


def _server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    # SGLang's long spellings too (server_args.py)
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--dp", "--data-parallel-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--ep-size", "--ep", "--expert-parallel-size", type=int, default=1)
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--enable-deepep-moe", action="store_true")  # SGLang <= 0.4.9's spelling
    p.add_argument("--deepep-mode", default="auto")
    p.add_argument("--enable-two-batch-overlap", action="store_true")
    p.add_argument("--enable-dynamic-chunking", action="store_true")
    p.add_argument("--enable-single-batch-overlap", action="store_true")
    p.add_argument("--moe-dense-tp-size", type=int)
    p.add_argument("--enable-dp-lm-head", action="store_true")
    p.add_argument("--enable-eplb", action="store_true")
    p.add_argument("--init-expert-location", default="trivial")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization")
    p.add_argument("--disaggregation-mode", default="null")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-prefill-tokens", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--schedule-conservativeness", type=float)
    p.add_argument("--num-reserved-decode-tokens", type=int)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-cuda-graph-padding", action="store_true")
    p.add_argument("--load-balance-method", default="auto")
    p.add_argument("--enable-piecewise-cuda-graph", action="store_true")  # before v0.5.10
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-draft-model-path")
    return p


def _router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", default=[])
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--worker-urls", nargs="*", default=[])
    p.add_argument("--policy", default="cache_aware")  # sglang_router's default
    p.add_argument("--mini-lb", action="store_true")  # its Python balancer: random pairs
    for flag in SGLANG_OPTION_FLAGS.values():
        p.add_argument(flag, type=float)
    return p


def _lb_parser() -> argparse.ArgumentParser:
    """SGLang's PD load balancer: each of --prefill and --decode takes one or more URLs."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--prefill", nargs="+", action="append", default=[])
    p.add_argument("--decode", nargs="+", action="append", default=[])
    p.add_argument("--policy", default="random", choices=sorted(LB_POLICIES))
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str], line: int
           ) -> tuple[argparse.Namespace, list[str]]:
    """The flags `parser` knows, and the others' names."""
    try:
        args, rest = parser.parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as exc:
        raise ConfigError(f"line {line}: {exc}") from None
    return args, [a.partition("=")[0] for a in rest if a.startswith("--")]


@dataclass(frozen=True)
class _Server:
    line: int
    role: str
    url: str
    shape: dict[str, Any]
    knobs: dict[str, Any]
    model: str
    kv_dtype_bytes: float
    graph: tuple[tuple[str, Any], ...]  # the cost params of its CUDA-graph flags
    dp_assignment: str | None  # --load-balance-method as router.dp_assignment, if given
    piecewise: dict[str, Any]  # the cost params of piecewise-graphed extends it asks for
    speculative: dict[str, Any] | None  # the speculative section's method and drafts
    unmodelled: list[str]  # flags read past that may change performance
    quantization: str | None  # --quantization, one of QUANTIZATIONS


def _server(argv: list[str], env: dict[str, str], line: int) -> _Server | None:
    """The server a command starts, or None for a node other than an instance's first."""
    a, rest = _parse(_server_parser(), argv, line)
    if a.node_rank:
        return None
    role = {"prefill": "prefill", "decode": "decode", "null": "colocated"}.get(
        a.disaggregation_mode)
    if role is None:
        raise ConfigError(f"line {line}: --disaggregation-mode {a.disaggregation_mode!r}; "
                          "allowed: prefill, decode, null")
    unmodelled = [flag for flag in rest if flag not in INERT_FLAGS]
    if a.quantization is not None and a.quantization not in QUANTIZATIONS:
        raise ConfigError(f"line {line}: --quantization {a.quantization} is not a format pdsim "
                          f"can price; allowed: {', '.join(QUANTIZATIONS)} (or leave it out "
                          "and give the model's precision)")
    if _deepep(a) and a.deepep_mode not in DEEPEP_MODES[role]:
        unmodelled.append(f"--deepep-mode {a.deepep_mode} (priced as SGLang's auto: normal for "
                          "prefill batches, low latency for decode batches)")
    dp_assignment = None
    if a.load_balance_method != "auto":
        dp_assignment = LOAD_BALANCE_METHODS.get(a.load_balance_method)
        if dp_assignment is None:
            unmodelled.append(f"--load-balance-method {a.load_balance_method} (modelled: "
                              f"{', '.join(LOAD_BALANCE_METHODS)})")
    return _Server(line, role, f"http://{a.host}:{a.port}", _shape(a, env, line, unmodelled),
                   _knobs(a, env, role, line), a.model_path,
                   1 if a.kv_cache_dtype.startswith("fp8") else 2, _graph_params(a),
                   dp_assignment, _piecewise(a), _speculative(a, line, unmodelled), unmodelled,
                   a.quantization)


def _deepep(a: argparse.Namespace) -> bool:
    return a.enable_deepep_moe or a.moe_a2a_backend == "deepep"


def _shape(a: argparse.Namespace, env: dict[str, str], line: int,
           unmodelled: list[str]) -> dict[str, Any]:
    """The role fields of a server's parallelism and large-EP options."""
    deepep = _deepep(a)
    shape: dict[str, Any] = {"tp": a.tp_size}
    # SGLang sets ep_size = tp_size for DeepEP (server_args.py)
    ep = a.tp_size if deepep and a.ep_size == 1 else a.ep_size
    eplb = a.enable_eplb or a.init_expert_location != "trivial"
    if a.moe_a2a_backend not in ("none", "deepep"):
        raise ConfigError(f"line {line}: --moe-a2a-backend {a.moe_a2a_backend}; allowed: none, "
                          "deepep (the all-to-all backends the simulator prices)")
    if a.moe_dense_tp_size not in (None, 1, a.tp_size):
        raise ConfigError(f"line {line}: --moe-dense-tp-size {a.moe_dense_tp_size}; allowed: 1 "
                          f"or the tp size ({a.tp_size})")
    for key, value, default in (
            ("pp", a.pp_size, 1), ("ep", ep, 1),
            ("dp_attention", a.dp_size if a.enable_dp_attention else 1, 1),
            ("moe_a2a", "deepep" if deepep else a.moe_a2a_backend, "none"),
            ("two_batch_overlap", a.enable_two_batch_overlap, False),
            ("single_batch_overlap", a.enable_single_batch_overlap, False),
            ("moe_dense_tp", 1 if a.moe_dense_tp_size == 1 else None, None),
            ("dp_lm_head", a.enable_dp_lm_head, False),
            ("eplb", a.ep_num_redundant_experts if eplb else None, None),
            ("num_max_dispatch_tokens_per_rank", _env_number(env, LL_TOKENS_ENV, line, 128),
             128)):
        if value != default:
            shape[key] = value
    if a.enable_dynamic_chunking and a.pp_size > 1:  # SGLang's sizer needs pipeline stages
        shape["dynamic_chunking"] = _env_number(env, SMOOTH_FACTOR_ENV, line, 0.75, float)
    elif a.enable_dynamic_chunking:
        unmodelled.append("--enable-dynamic-chunking (SGLang sizes chunks dynamically only with "
                          "--pp-size > 1; it changes nothing here)")
    if a.ep_num_redundant_experts and not eplb:
        unmodelled.append("--ep-num-redundant-experts (without --enable-eplb or "
                          "--init-expert-location)")
    if a.dp_size > 1 and not a.enable_dp_attention:
        unmodelled.append(f"--dp-size {a.dp_size} without --enable-dp-attention (SGLang runs "
                          f"{a.dp_size} replicas of tp {a.tp_size} behind this server; read as "
                          "one: give each its own server line, or instances in the base)")
    return shape


def _env_number(env: dict[str, str], name: str, line: int, default: float | None = None,
                kind: type = int) -> float | None:
    """The variable `name` read as a number of `kind` (int or float), else `default`."""
    if name not in env:
        return default
    try:
        return kind(env[name])
    except ValueError:
        allowed = "an integer" if kind is int else "a number"
        raise ConfigError(f"line {line}: {name}={env[name]!r}; allowed: {allowed}") from None


def _knobs(a: argparse.Namespace, env: dict[str, str], role: str, line: int
           ) -> dict[str, Any]:
    knobs = {k: _env_number(env, v, line) for v, k in ENV_KNOBS.items() if v in env}
    knobs |= {k: getattr(a, k) for k in KNOB_FLAGS if getattr(a, k) is not None}
    if knobs.get("chunked_prefill_size", 0) < 0:
        knobs["chunked_prefill_size"] = 0  # SGLang's -1: no chunking
    if a.disable_radix_cache:
        knobs["disable_radix_cache"] = True
    if a.disable_overlap_schedule:
        knobs["disable_overlap_schedule"] = True
    if role != "decode":
        knobs.pop("num_reserved_decode_tokens", None)  # a decode server's flag
    return knobs


def _graph_params(a: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The CUDA-graph flags as the cost params that price them (pdsim.sim.forward_shape)."""
    if a.disable_cuda_graph:
        return (("cuda_graph_max_bs", 0),)
    params: dict[str, Any] = {}
    if a.cuda_graph_max_bs is not None:
        params["cuda_graph_max_bs"] = a.cuda_graph_max_bs
    if a.cuda_graph_bs:
        params["cuda_graph_bs"] = sorted(set(a.cuda_graph_bs))
    if a.disable_cuda_graph_padding:
        params["cuda_graph_padding"] = False
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(params.items()))


def _piecewise(a: argparse.Namespace) -> dict[str, Any]:
    """`--enable-piecewise-cuda-graph` (SGLang's opt-in before v0.5.10, when it became the
    default) as the cost params that price it; `--piecewise-cuda-graph-max-tokens` with it."""
    if not a.enable_piecewise_cuda_graph or a.disable_cuda_graph:
        return {}
    params: dict[str, Any] = {"piecewise_cuda_graph": True}
    if a.piecewise_cuda_graph_max_tokens is not None:
        params["piecewise_cuda_graph_max_tokens"] = a.piecewise_cuda_graph_max_tokens
    return params


# SGLang's `auto_choose_speculative_params` (server_args.py, v0.5.10): a server given
# --speculative-algorithm without --speculative-num-steps drafts 3 steps with top-k 1 (4 draft
# tokens) for DeepSeek-V3/R1, GLM-4.5, gpt-oss and every architecture it does not list; Llama
# and Grok get 5 steps of a top-4 tree (8 tokens), which pdsim prices as a chain.
AUTO_SPECULATIVE_STEPS = 3
AUTO_TREE_MODELS = ("llama", "grok")
AUTO_TREE_TOPK = 4


def _speculative(a: argparse.Namespace, line: int, unmodelled: list[str]
                 ) -> dict[str, Any] | None:
    if a.speculative_algorithm is None:
        return None
    algorithm = a.speculative_algorithm.upper()
    if algorithm not in ("NEXTN", "EAGLE", "EAGLE3"):
        raise ConfigError(f"line {line}: --speculative-algorithm {a.speculative_algorithm}; "
                          "allowed: NEXTN, EAGLE, EAGLE3")
    steps, topk = a.speculative_num_steps, a.speculative_eagle_topk
    if steps is None:  # SGLang's auto_choose_speculative_params (server_args.py)
        tree = any(name in (a.model_path or "").lower() for name in AUTO_TREE_MODELS)
        steps, topk = AUTO_SPECULATIVE_STEPS, (AUTO_TREE_TOPK if tree else 1)
    if topk not in (None, 1):
        unmodelled.append(f"--speculative-eagle-topk {topk} (pdsim drafts a chain: top-k 1)")
    if a.speculative_num_draft_tokens not in (None, steps + 1):
        # a chain of `steps` drafts verifies steps + 1 tokens; more come from a tree (top-k > 1)
        unmodelled.append(f"--speculative-num-draft-tokens {a.speculative_num_draft_tokens} "
                          f"(a chain of {steps} steps verifies {steps + 1})")
    # Without a draft model SGLang's EAGLE runs the target's own MTP (NextN) layers.
    method = "eagle" if a.speculative_draft_model_path else "mtp"
    return {"method": method, "num_draft_tokens": steps}


def _quantized(model: str | dict[str, Any], quantization: str,
               base_dir: str | Path | None) -> str | dict[str, Any]:
    """The model as SGLang serves it with `--quantization` (QUANTIZATIONS): fp8, w8a8_fp8 and
    modelopt_fp8 make its 16-bit linear blocks `fp8_tensor` (the LM head and a checkpoint's
    own FP8 or other blocks as they are); modelopt_fp4 puts a model with no NVFP4 block in
    ModelOpt's NVFP4 layout; the others need the model to hold their format already."""
    spec = load_model_spec(model, base_dir)
    present = ("attention", *(("dense_mlp",) if spec.num_dense_layers else ()),
               *(("moe_experts",) if spec.is_moe else ()))
    formats = {getattr(spec.precision, block) for block in present}
    if quantization in CHECKPOINT_FORMATS:
        if not formats & set(CHECKPOINT_FORMATS[quantization]):
            raise ConfigError(
                f"--quantization {quantization} reads a checkpoint in "
                f"{' or '.join(CHECKPOINT_FORMATS[quantization])}, but the model "
                f"({spec.name}) holds {', '.join(sorted(formats))}; give the checkpoint's "
                "config.json as --model-path (or --model), or a model with that precision")
        return model
    if quantization == MODELOPT_FP4:
        if "nvfp4" in formats:
            return model
        blocks = {block: "nvfp4" for block in present}
        if spec.is_mla:
            blocks["attention"] = "bf16"
    else:
        blocks = {block: "fp8_tensor" for block in present
                  if getattr(spec.precision, block) in ("bf16", "fp16")}
    if not blocks:
        return model
    base = model if isinstance(model, str) else dict(model)
    return {"base": base, "precision": blocks}


def _known_model(path: str, base_dir: str | Path | None) -> str:
    """`--model-path` if the simulator can read it (a preset, a preset's Hugging Face
    repository, or a checkpoint's config.json on this machine); else an error that suggests
    the preset its name contains."""
    by_repo = {repo.lower(): name for name, repo in PRESET_REPOS.items()}
    if path.lower() in by_repo:
        return by_repo[path.lower()]
    try:
        load_model_spec(path, base_dir)
    except ValueError:
        name = Path(path).name.lower()
        guesses = sorted((p for p in model_preset_names() if p in name), key=len)
        hint = f" (its name suggests --model {guesses[-1]})" if guesses else ""
        raise ConfigError(
            f"--model-path {path!r} is neither a model preset nor a checkpoint whose "
            f"config.json is on this machine; pass --model with a preset{hint} or the "
            f"checkpoint's config.json; presets: {', '.join(model_preset_names())}") from None
    return path


def _one(values: set, what: str) -> Any:
    if len(values) != 1:
        raise ConfigError(f"the servers disagree on {what}: {sorted(map(str, values))}; a "
                          "deployment has one")
    return next(iter(values))


def import_sglang(text: str, base: dict[str, Any], *, name: str | None = None,
                  model: str | None = None, base_dir: str | Path | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """The experiment mapping `text`'s commands deploy, over `base` (an experiment mapping:
    its workload, hardware, SLO, ...), and notes naming the flags read past that may change
    performance. `model` names the simulator's model when the servers' `--model-path` is not
    one it knows (a Hugging Face id, a checkpoint not on this machine); a relative path is
    looked for under `base_dir`, then here."""
    servers: list[_Server] = []
    routers: list[tuple[int, str, list[str]]] = []
    exported: dict[str, str] = {}
    for line, argv in _commands(text):
        if argv[0] == "export":
            exported |= _split_env(argv[1:])[0]
            continue
        env, argv = _split_env(argv)
        if not argv:  # a shell variable, not exported: the servers never see it
            continue
        module = _module(argv)
        if module == SERVER:
            server = _server(argv[3:], exported | env, line)
            if server is not None:
                servers.append(server)
        elif module in ROUTERS:
            routers.append((line, module, argv[3:]))
        else:
            raise ConfigError(f"line {line}: {shlex.join(argv)[:80]!r} is neither `python -m "
                              f"{SERVER}` nor a router (`python -m {ROUTERS[0]}`)")
    if not servers:
        raise ConfigError(f"no `python -m {SERVER}` command")
    roles = sorted({s.role for s in servers}, key=("prefill", "decode", "colocated").index)
    if roles not in (["prefill", "decode"], ["colocated"]):
        raise ConfigError(f"servers of roles {roles}; allowed: prefill and decode servers, or "
                          "servers without --disaggregation-mode")
    alone = not routers and roles == ["colocated"] and len(servers) == 1
    if len(routers) != 1 and not alone:  # one server serves its clients itself
        raise ConfigError(f"{len(routers)} router commands (`python -m {ROUTERS[0]}`); "
                          "allowed: one (none only for a single server without "
                          "--disaggregation-mode)")
    cluster: dict[str, Any] = {"mode": "colocated" if roles == ["colocated"] else
                               "disaggregated"}
    notes = []
    for role in roles:
        mine = [s for s in servers if s.role == role]
        shape = dict(_one({tuple(sorted(s.shape.items())) for s in mine},
                          f"the {role} parallelism"))
        knobs = _one({tuple(sorted(s.knobs.items())) for s in mine},
                     f"the {role} scheduler flags")
        if "eplb" in shape:
            shape["eplb"] = {"redundant_experts": shape["eplb"]}
        if "dynamic_chunking" in shape:
            shape["dynamic_chunking"] = {"smooth_factor": shape["dynamic_chunking"]}
        cluster[role] = {"instances": len(mine), **shape}
        if knobs:
            cluster[role]["scheduler"] = dict(knobs)
        notes += [f"line {s.line} ({role} server): read past, not modelled: "
                  f"{', '.join(dict.fromkeys(s.unmodelled))}" for s in mine if s.unmodelled]
    generating = [s for s in servers if s.role != "prefill"]
    router = {"policy": "round_robin"} if alone else _router(routers[0], servers, cluster["mode"])
    data = {k: v for k, v in base.items() if k not in (*REPLACED, "name", "description")}
    sweep, dropped = _sweep_kept(base.get("sweep") or {})
    if sweep:
        data["sweep"] = sweep
    else:
        data.pop("sweep", None)
    if dropped:
        notes.append(f"the base's sweep over {', '.join(dropped)} is dropped: the commands fix "
                     "the deployment it would vary")
    params = {k: list(v) if isinstance(v, tuple) else v
              for k, v in _one({s.graph for s in generating}, "CUDA graph batch sizes")}
    dp_assignment = _one({s.dp_assignment for s in generating}, "--load-balance-method")
    if dp_assignment is not None:
        router["dp_assignment"] = dp_assignment
    params.update(_one({tuple(sorted(s.piecewise.items())) for s in servers
                        if s.role != "decode"}, "piecewise CUDA graphs"))
    if params:
        cost = dict(data.get("cost_model") or {})
        cost["params"] = {**(cost.get("params") or {}), **params}
        data["cost_model"] = cost
    spec = _one({None if s.speculative is None else tuple(sorted(s.speculative.items()))
                 for s in generating}, "speculative decoding")
    if spec is not None:
        data["speculative"] = _with_acceptance(dict(spec), base.get("speculative") or {})
    model = model or _known_model(_one({s.model for s in servers}, "--model-path"), base_dir)
    quantization = _one({s.quantization for s in servers}, "--quantization")
    if quantization is not None:
        model = _quantized(model, quantization, base_dir)
    return {"name": name or base.get("name", "imported"),
            "description": "imported from SGLang launch commands (pdsim import-sglang)",
            **data, "model": model,
            "kv_dtype_bytes": _one({s.kv_dtype_bytes for s in servers}, "--kv-cache-dtype"),
            "cluster": cluster, "router": router}, notes


def _sweep_kept(sweep: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The base's sweep axes that vary none of the sections the commands replace, and the
    keys of the others (an axis of several fields goes whole)."""
    kept, dropped = {}, []
    for key, values in sweep.items():
        fields = [f.strip().split(".")[0] for f in key.split(",")]
        if any(f in REPLACED for f in fields):
            dropped.append(key)
        else:
            kept[key] = values
    return kept, dropped


def _with_acceptance(spec: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The commands' speculative method and drafts, with the base experiment's acceptance
    (launch commands cannot say how often drafts are accepted)."""
    if not (base.get("acceptance") or {}):
        raise ConfigError(
            f"the servers decode speculatively ({spec['method']}, {spec['num_draft_tokens']} "
            "draft tokens) but the base experiment gives no speculative.acceptance (rates or "
            "mean_accept_len) to simulate them with; add one, e.g. from `pdsim calibrate` or "
            "the server's accept-length metric")
    return {**base, **spec}


def _router(command: tuple[int, str, list[str]], servers: list[_Server], mode: str
            ) -> dict[str, Any]:
    line, module, argv = command
    if module == ROUTERS[0]:
        a, _ = _parse(_router_parser(), argv, line)
        named = {"prefill": [p[0] for p in a.prefill], "decode": a.decode,
                 "colocated": a.worker_urls}
        pd, policy = a.pd_disaggregation, "random" if a.mini_lb else a.policy
    else:  # SGLang's PD-only load balancer
        a, _ = _parse(_lb_parser(), argv, line)
        named = {"prefill": [u for group in a.prefill for u in group],
                 "decode": [u for group in a.decode for u in group], "colocated": []}
        pd, policy = True, LB_POLICIES[a.policy]
    if pd != (mode == "disaggregated"):
        raise ConfigError(f"line {line}: the router {'has' if pd else 'lacks'} "
                          f"--pd-disaggregation, but the servers are {mode}")
    for role, urls in named.items():
        served = sorted(s.url for s in servers if s.role == role)
        if not _same_servers(urls, served):
            raise ConfigError(f"line {line}: the router's {role} URLs {sorted(urls)} are not "
                              f"the {role} servers' {served}")
    router: dict[str, Any] = {"policy": policy}
    if module == ROUTERS[0]:
        options = {k: getattr(a, k) for k in SGLANG_OPTION_FLAGS if getattr(a, k) is not None}
        if options:
            router["policy_options"] = options
    return router


def _same_servers(urls: list[str], served: list[str]) -> bool:
    """Whether the router's URLs name the servers one to one; a server given the unspecified
    address (`--host 0.0.0.0`, as multi-node launch scripts have it) answers at any host with
    its port."""
    exact = [u for u in served if not _any_host(u)]
    any_host = sorted(_port(u) for u in served if _any_host(u))
    rest = list(urls)
    for url in exact:
        if url not in rest:
            return False
        rest.remove(url)
    return sorted(_port(u) for u in rest) == any_host


def _any_host(url: str) -> bool:
    host = url.removeprefix("http://").rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a name
        return False


def _port(url: str) -> str:
    return url.rpartition(":")[2]
