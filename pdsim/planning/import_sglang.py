"""SGLang launch commands -> pdsim's experiment: `pdsim import-sglang launch.sh --base EXP`.

The reverse of pdsim/planning/launch.py: a set of `python -m sglang.launch_server ...` commands
(one per server, or per node of a server that spans `--nnodes` nodes) and one `python -m
sglang_router.launch_router ...`, as `pdsim plan` writes them in launch.sh, become the deployment
they start: the roles (`--disaggregation-mode`; none: colocated) with their instances (servers
whose `--node-rank` is 0), parallelism (`--tp-size`, `--pp-size`, `--dp-size` with
`--enable-dp-attention`, `--ep-size`, `--moe-a2a-backend`), scheduler knobs
(`--mem-fraction-static`, `--max-running-requests`, `--chunked-prefill-size`,
`--max-prefill-tokens`, `--page-size`, `--num-reserved-decode-tokens`), `--kv-cache-dtype`,
the model (`--model-path`) and the router's policy (as SGLang names it: a plan's
`least_loaded`, written as `power_of_two`, comes back as that) and cache_aware settings.
Every instance of a role must have the same shape (the simulator has one per role), and every
URL the router names must be a server's `http://HOST:PORT`. Flags that do not change the simulation (ports,
devices, the transfer backend...) are read past.

What the commands do not say -- the workload, the hardware, SLOs, the cost model -- comes from a
base experiment (`pdsim plan` writes one beside launch.sh), whose model, kv_dtype_bytes,
cluster and router are replaced.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

from pdsim.config import ConfigError
from pdsim.deployment import SGLANG_OPTION_FLAGS

SERVER = "sglang.launch_server"
ROUTER = "sglang_router.launch_router"
KNOB_FLAGS = {"mem_fraction_static": "--mem-fraction-static",
              "max_running_requests": "--max-running-requests",
              "chunked_prefill_size": "--chunked-prefill-size",
              "max_prefill_tokens": "--max-prefill-tokens", "page_size": "--page-size",
              "num_reserved_decode_tokens": "--num-reserved-decode-tokens"}


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


def _module(argv: list[str]) -> str | None:
    """The module a `python -m MODULE` command runs (after any VAR=value prefixes)."""
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        argv = argv[1:]
    if len(argv) >= 3 and argv[0].startswith("python") and argv[1] == "-m":
        return argv[2]
    return None


def _server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--kv-cache-dtype", default="auto")
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
    p.add_argument("--num-reserved-decode-tokens", type=int)
    return p


def _router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", default=[])
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--worker-urls", nargs="*", default=[])
    p.add_argument("--policy", default="cache_aware")  # sglang_router's default
    for flag in SGLANG_OPTION_FLAGS.values():
        p.add_argument(flag, type=float)
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str], line: int) -> argparse.Namespace:
    try:
        args, _ignored = parser.parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as exc:
        raise ConfigError(f"line {line}: {exc}") from None
    return args


@dataclass(frozen=True)
class _Server:
    line: int
    role: str
    url: str
    shape: dict[str, Any]
    knobs: dict[str, Any]
    model: str
    kv_dtype_bytes: float


def _server(argv: list[str], line: int) -> _Server | None:
    """The server a command starts, or None for a node other than an instance's first."""
    a = _parse(_server_parser(), argv, line)
    if a.node_rank:
        return None
    role = {"prefill": "prefill", "decode": "decode", "null": "colocated"}.get(
        a.disaggregation_mode)
    if role is None:
        raise ConfigError(f"line {line}: --disaggregation-mode {a.disaggregation_mode!r}; "
                          "allowed: prefill, decode, null")
    shape: dict[str, Any] = {"tp": a.tp_size}
    for key, value, default in (("pp", a.pp_size, 1), ("ep", a.ep_size, 1),
                                ("dp_attention", a.dp_size if a.enable_dp_attention else 1, 1),
                                ("moe_a2a", a.moe_a2a_backend, "none")):
        if value != default:
            shape[key] = value
    knobs = {k: getattr(a, k) for k in KNOB_FLAGS if getattr(a, k) is not None}
    if role != "decode":
        knobs.pop("num_reserved_decode_tokens", None)  # a decode server's flag
    kv_bytes = 1 if a.kv_cache_dtype.startswith("fp8") else 2
    return _Server(line, role, f"http://{a.host}:{a.port}", shape, knobs, a.model_path,
                   kv_bytes)


def _one(values: set, what: str) -> Any:
    if len(values) != 1:
        raise ConfigError(f"the servers disagree on {what}: {sorted(map(str, values))}; a "
                          "deployment has one")
    return next(iter(values))


def import_sglang(text: str, base: dict[str, Any], *, name: str | None = None,
                  model: str | None = None) -> dict[str, Any]:
    """The experiment mapping `text`'s commands deploy, over `base` (an experiment mapping:
    its workload, hardware, SLO, ...). `model` names the simulator's model when the servers'
    `--model-path` is not one it knows (a Hugging Face id, a local path)."""
    servers: list[_Server] = []
    routers: list[tuple[int, list[str]]] = []
    for line, argv in _commands(text):
        module = _module(argv)
        if module == SERVER:
            server = _server(argv[argv.index(module) + 1:], line)
            if server is not None:
                servers.append(server)
        elif module == ROUTER:
            routers.append((line, argv[argv.index(module) + 1:]))
        else:
            raise ConfigError(f"line {line}: {shlex.join(argv)[:80]!r} is neither `python -m "
                              f"{SERVER}` nor `python -m {ROUTER}`")
    if not servers:
        raise ConfigError(f"no `python -m {SERVER}` command")
    if len(routers) != 1:
        raise ConfigError(f"{len(routers)} `python -m {ROUTER}` commands; allowed: one")
    roles = sorted({s.role for s in servers}, key=("prefill", "decode", "colocated").index)
    if roles not in (["prefill", "decode"], ["colocated"]):
        raise ConfigError(f"servers of roles {roles}; allowed: prefill and decode servers, or "
                          "servers without --disaggregation-mode")
    cluster: dict[str, Any] = {"mode": "colocated" if roles == ["colocated"] else
                               "disaggregated"}
    for role in roles:
        mine = [s for s in servers if s.role == role]
        shape = _one({tuple(sorted(s.shape.items())) for s in mine}, f"the {role} parallelism")
        knobs = _one({tuple(sorted(s.knobs.items())) for s in mine},
                     f"the {role} scheduler flags")
        cluster[role] = {"instances": len(mine), **dict(shape)}
        if knobs:
            cluster[role]["scheduler"] = dict(knobs)
    router = _router(routers[0], servers, cluster["mode"])
    data = {k: v for k, v in base.items() if k not in ("model", "kv_dtype_bytes", "cluster",
                                                        "router", "name", "description")}
    return {"name": name or base.get("name", "imported"),
            "description": "imported from SGLang launch commands (pdsim import-sglang)",
            **data, "model": model or _one({s.model for s in servers}, "--model-path"),
            "kv_dtype_bytes": _one({s.kv_dtype_bytes for s in servers}, "--kv-cache-dtype"),
            "cluster": cluster, "router": router}


def _router(command: tuple[int, list[str]], servers: list[_Server], mode: str) -> dict[str, Any]:
    line, argv = command
    a = _parse(_router_parser(), argv, line)
    named = {"prefill": [p[0] for p in a.prefill], "decode": a.decode,
             "colocated": a.worker_urls}
    if a.pd_disaggregation != (mode == "disaggregated"):
        raise ConfigError(f"line {line}: the router {'has' if a.pd_disaggregation else 'lacks'} "
                          f"--pd-disaggregation, but the servers are {mode}")
    for role, urls in named.items():
        served = sorted(s.url for s in servers if s.role == role)
        if sorted(urls) != served:
            raise ConfigError(f"line {line}: the router's {role} URLs {sorted(urls)} are not "
                              f"the {role} servers' {served}")
    router: dict[str, Any] = {"policy": a.policy}
    options = {k: getattr(a, k) for k in SGLANG_OPTION_FLAGS if getattr(a, k) is not None}
    if options:
        router["policy_options"] = options
    return router
