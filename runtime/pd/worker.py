"""A prefill or decode worker instance: `tp` rank processes, one gloo TP group over loopback.

    serve_instance(config, "prefill", 0)        # rank 0 here; ranks 1.. as child processes

Every rank builds the same model (same seed or checkpoint) and shards it (`apply_tp`), allocates
its slice of the paged KV cache, a metadata buffer, and a Mooncake KV manager that registers both;
then it runs a `PDEngine` over the role's core scheduler in lock step with the other ranks.
With `speculative.method: mtp` (tp 1) the rank also builds the MTP draft and registers its KV
and hidden-state buffers with the rest (runtime/speculative.py). A
prefill instance's bootstrap server runs in rank 0's process and every prefill rank registers
with it; decode ranks look the prefill ranks up there per request, and refuse to pair with an
instance whose page size, KV dtype or heads differ (`check_compatible`: the request fails with
the reason). Only rank 0 talks HTTP (`WorkerServer`).

Rank 0 starts ranks 1.. with `python -m runtime.pd.worker --follower JSON`; a follower dies with
its parent (PR_SET_PDEATHSIG), ignores Ctrl-C (rank 0 stops the instance by broadcasting a stop)
and exits when its engine loop ends. `python -m runtime.pd.worker --instance JSON` runs a whole
instance (what the launcher starts).

With `dp_attention: dp` the `tp` ranks form `dp` attention-DP ranks of `tp // dp` processes each
(rank r is in DP rank `r // (tp // dp)`, attention-TP rank `r % (tp // dp)`): the instance's
group spans every process (the inbox broadcast, the MIN-reduced poll, the MLP blocks' all-gather
and all-reduce), and each DP rank of more than one process forms its own attention-TP group too
(its own rendezvous address). Each process caches and transfers its own DP rank's KV: it registers
with the bootstrap server as (dp rank, attention-TP rank) of (dp, tp // dp), which is where a
decode rank looks the room's prefill rank up (`prefill_dp_rank = room % dp`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from runtime.serve_config import PDServeConfig
from runtime.worker_process import PORT_TAKEN_EXIT

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0  # forming the TP group, and any one collective


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits, and how it meets the rest of its instance."""

    role: str
    instance: int
    rank: int
    tp: int
    init_method: str = ""  # tcp://HOST:PORT of the TP group's store (tp > 1)
    dp: int = 1  # attention-DP ranks of the instance
    attn_init_methods: tuple[str, ...] = ()  # per DP rank: its attention-TP group's store
    bootstrap_host: str = ""  # prefill: its instance's bootstrap server
    bootstrap_port: int = 0


@dataclass
class Rank:
    """What one rank holds; `close()` releases it in order."""

    spec: RankSpec
    group: object
    executor: object
    manager: object
    engine: object
    attn_group: object = None  # attention DP with tp // dp > 1: this DP rank's group

    def close(self) -> None:
        self.engine.stop()
        self.manager.close()
        self.destroy_groups()

    def destroy_groups(self) -> None:
        if self.attn_group is not None:
            self.attn_group.destroy(barrier=False)
        self.group.destroy(barrier=False)


def build_rank(config: PDServeConfig, spec: RankSpec, group) -> Rank:
    """Model, KV cache, metadata buffer, transfer manager and engine of one rank."""
    import torch

    from runtime.executor import ModelExecutor, warmup_shape
    from runtime.model.tp import DPRanks, apply_dp_attention, apply_tp
    from runtime.model.draft import build_draft
    from runtime.model.hybrid import with_state_slots
    from runtime.pd.lockstep_engine import PDEngine
    from runtime.model.loading import load_served_model, load_text_side, resolve_device
    from runtime.transfer.layout import KVArgs
    from runtime.transfer.metadata import MetadataBuffer
    from runtime.security import key_of, resolve_secret
    from runtime.faults import TransferFaults
    from runtime.speculative import with_draft_slots
    from runtime.transfer.mooncake import MooncakeKVManager

    key = key_of(resolve_secret(config.security.cluster_secret,
                                insecure=config.security.insecure, what=f"{spec.role} rank"))
    role = config.role(spec.role)
    torch.set_num_threads(1)  # the engine thread takes the forwards' (ModelExecutor.bind_thread)
    device = resolve_device(config.device)
    if device == "cuda":
        check_gpu_transfer()
        device = f"cuda:{spec.rank % torch.cuda.device_count()}"
    model = load_served_model(config, device)
    attn = dp = None
    if spec.dp == 1:
        model = apply_tp(model, group, role.ep)
        attn_group = group
    else:
        attn_group = attn = join_attn_group(spec)
        dp = DPRanks(group, attn, spec.dp)
        model = apply_dp_attention(model, dp, dense_tp=role.moe_dense_tp != 1,
                                   dp_lm_head=role.dp_lm_head)
    mcfg = model.config
    text = load_text_side(config, mcfg.vocab_size)
    sched_cfg = with_state_slots(config.scheduler_config(spec.role), mcfg)
    speculating = config.speculative.method == "mtp"
    if speculating:
        sched_cfg = with_draft_slots(sched_cfg)
    executor = ModelExecutor(model, num_pages=sched_cfg.num_pages, page_size=config.page_size,
                             seed=config.seed, vocab_limit=text.vocab_limit(mcfg.vocab_size),
                             tp_size=attn_group.size, state_slots=sched_cfg.state_slots,
                             threads=config.forward_threads(spec.role),
                             warmup=warmup_shape(sched_cfg))  # on every rank's engine thread
    if speculating:  # both roles: prefill fills the draft's KV and hidden state, decode drafts
        executor.speculate(build_draft(model, seed=config.seed),
                           config.speculative.num_draft_tokens)
    metadata = MetadataBuffer.allocate(sched_cfg.metadata_slots)
    dp_rank = 0 if dp is None else dp.dp_rank
    args = KVArgs.for_cache(executor.kv, metadata, tp_rank=attn_group.rank,
                            tp_size=attn_group.size, total_kv_heads=mcfg.num_kv_heads,
                            dp_rank=dp_rank, dp_size=spec.dp, speculation=executor.speculation)
    manager = MooncakeKVManager(args, config.transfer, key=key)
    manager.prefill.faults = TransferFaults.for_instance(config.faults, spec.role, spec.instance)
    try:
        if spec.role == "prefill":
            manager.register_with_bootstrap(spec.bootstrap_host, spec.bootstrap_port)
        engine = PDEngine(executor, sched_cfg, role=spec.role, kv_manager=manager, group=group,
                          instance_id=spec.instance, dp=spec.dp, dp_rank=dp_rank,
                          dp_assignment=config.router.dp_assignment,
                          max_records=config.max_records,
                          poll_interval_s=config.transfer.poll_interval_s)
    except BaseException:
        manager.close()
        raise
    return Rank(spec, group, executor, manager, engine, attn)


def check_gpu_transfer() -> None:
    """A KV cache in GPU memory needs Mooncake's CUDA build; the -non-cuda wheel reads host
    memory only."""
    from importlib import metadata

    try:
        metadata.version("mooncake-transfer-engine")
    except metadata.PackageNotFoundError:
        raise ValueError(
            "device cuda puts the KV cache in GPU memory, which the installed Mooncake "
            "(mooncake-transfer-engine-non-cuda) cannot transfer: install "
            "mooncake-transfer-engine, or set device: cpu") from None


def join_group(spec: RankSpec):
    from runtime.distributed import TPGroup

    if spec.tp == 1:
        return TPGroup.single()
    return TPGroup.join(spec.init_method, spec.rank, spec.tp, timeout_s=GROUP_TIMEOUT_S)


def join_attn_group(spec: RankSpec):
    """This rank's attention-TP group: the processes of its DP rank."""
    from runtime.distributed import TPGroup

    size = spec.tp // spec.dp
    if size == 1:
        return TPGroup.single()
    return TPGroup.join(spec.attn_init_methods[spec.rank // size], spec.rank % size, size,
                        timeout_s=GROUP_TIMEOUT_S)


# ---- processes -------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Get SIGTERM when the parent exits (Linux); exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def python_command(mode: str, payload: dict) -> list[str]:
    return [sys.executable, "-m", "runtime.pd.worker", f"--{mode}", json.dumps(payload)]


def child_env() -> dict[str, str]:
    """The environment of a child process: this one's, with the repository importable."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""),
            "PYTHONUNBUFFERED": "1"}


def stop_processes(procs: list[subprocess.Popen], *, grace_s: float = 0.0,
                   timeout_s: float = 20.0) -> None:
    """Give the processes `grace_s` to exit by themselves, then SIGTERM those still running,
    wait up to `timeout_s`, and SIGKILL the stragglers."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %g s; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.wait()


def _follower_main(payload: dict) -> int:
    die_with_parent(payload["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the instance stops
    config = PDServeConfig.model_validate(payload["config"])
    spec = RankSpec(**{**payload["spec"],
                       "attn_init_methods": tuple(payload["spec"]["attn_init_methods"])})
    group = join_group(spec)
    rank = build_rank(config, spec, group)
    rank.engine.start()
    rank.engine.join()  # until rank 0 broadcasts the stop (or the group breaks)
    rank.close()
    return 0


# ---- one instance ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceAddress:
    url: str
    bootstrap_host: str = ""
    bootstrap_port: int = 0


def serve_instance(config: PDServeConfig, role: str, instance: int = 0, *,
                   port: int | None = None, bootstrap_port: int | None = None,
                   on_ready: Callable[[InstanceAddress], None] | None = None) -> int:
    """Run instance `instance` of `role` until SIGINT or SIGTERM (or until a rank fails);
    returns the exit status. `port` / `bootstrap_port` override the configured ones."""
    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.distributed import free_port
    from runtime.model.tp import check_dp_attention, check_tp
    from runtime.pd.http import WorkerInfo, WorkerServer
    from runtime.sglang_compat import sglang_front
    from runtime.security import key_of, resolve_secret, secret_env
    from runtime.model.loading import model_config_of
    from runtime.transfer.bindshim import preload_env

    spec_cfg = config.role(role)
    if not 0 <= instance < spec_cfg.instances:
        raise ValueError(f"{role} instance {instance}; the config has {spec_cfg.instances}")
    # a clear error before any process starts
    check_dp_attention(model_config_of(config), spec_cfg.tp, spec_cfg.dp_attention,
                       dp_lm_head=spec_cfg.dp_lm_head)
    check_tp(model_config_of(config), spec_cfg.tp, spec_cfg.ep)
    secret = resolve_secret(config.security.cluster_secret, insecure=config.security.insecure,
                            what=f"{role} worker {instance}")
    host = spec_cfg.host
    port = config.worker_port(role, instance) if port is None else port
    bootstrap = None
    followers: list[subprocess.Popen] = []
    rank = None
    try:
        spec = RankSpec(role, instance, 0, spec_cfg.tp, dp=spec_cfg.dp_attention)
        if role == "prefill":
            bport = config.bootstrap_port(instance) if bootstrap_port is None else bootstrap_port
            bootstrap = BootstrapServer(config.transfer.host, bport, key_of(secret),
                                        limits=config.security.limits)
            bootstrap.answer_delay_s = config.faults.bootstrap_delay_s  # fault injection
            bootstrap.start()
            spec = RankSpec(role, instance, 0, spec_cfg.tp, dp=spec_cfg.dp_attention,
                            bootstrap_host=config.transfer.host, bootstrap_port=bootstrap.port)
        if spec.tp > 1:
            attn = () if spec.tp == spec.dp else tuple(
                f"tcp://127.0.0.1:{free_port()}" for _ in range(spec.dp))
            spec = RankSpec(**{**asdict(spec), "init_method": f"tcp://127.0.0.1:{free_port()}",
                               "attn_init_methods": attn})
            for r in range(1, spec.tp):
                payload = {"parent_pid": os.getpid(), "config": config.model_dump(mode="json"),
                           "spec": {**asdict(spec), "rank": r}}
                env = {**child_env(), **secret_env(secret), **preload_env(config.transfer.host)}
                followers.append(subprocess.Popen(python_command("follower", payload), env=env))
        group = join_group(spec)
        rank = build_rank(config, spec, group)
        state = rank.executor.kv.state
        state_bytes = 0 if state is None else state.slot_bytes()
        info = WorkerInfo(role=role, instance=instance, tp=spec.tp, model=config.model_name,
                          model_vocab=rank.executor.config.vocab_size,
                          max_position=rank.executor.config.max_position,
                          bootstrap_host=spec.bootstrap_host, bootstrap_port=spec.bootstrap_port,
                          dp=spec.dp, state_bytes_per_slot=state_bytes)
        front = sglang_front(config, rank.engine, model_vocab=info.model_vocab,
                             max_position=info.max_position)
        server = WorkerServer(rank.engine, info, sglang=front,
                              max_inflight_requests=config.max_inflight_requests)
        server.protect(cluster_key=key_of(secret), limits=config.security.limits)
        status = asyncio.run(_serve(server, host, port, followers, on_ready))
    finally:
        if rank is not None:
            rank.engine.stop()
        stop_processes(followers, grace_s=10.0)  # they end with rank 0's stop broadcast
        if rank is not None:
            rank.manager.close()
            rank.destroy_groups()
        if bootstrap is not None:
            bootstrap.stop()
    return status


async def _serve(server, host: str, port: int, followers: list[subprocess.Popen],
                 on_ready: Callable[[InstanceAddress], None] | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start(host, port)
    status = 0
    try:
        if on_ready is not None:
            info = server.info
            on_ready(InstanceAddress(server.url, info.bootstrap_host, info.bootstrap_port))
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            dead = [p.pid for p in followers if p.poll() is not None]
            if dead or not server.engine.running:
                log.error("%s instance %d: %s; stopping", server.info.role, server.info.instance,
                          f"rank processes {dead} exited" if dead else "the engine stopped")
                status = 1
                break
    finally:
        await server.close()
    return status


def ready_line(config: PDServeConfig, role: str, instance: int, address: InstanceAddress) -> str:
    text = (f"pdsim serve: {role} worker {instance} ({config.model_name}, tp "
            f"{config.role(role).tp}) at {address.url}")
    if address.bootstrap_port:
        text += f", bootstrap {address.bootstrap_host}:{address.bootstrap_port}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="internal: a PD worker instance or rank")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--instance", help="JSON: config, role, instance, port, bootstrap_port, "
                      "parent_pid")
    mode.add_argument("--follower", help="JSON: config, spec, parent_pid")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.follower:
        return _follower_main(json.loads(args.follower))
    payload = json.loads(args.instance)
    die_with_parent(payload["parent_pid"])
    config = PDServeConfig.model_validate(payload["config"])
    role, instance = payload["role"], payload["instance"]
    try:
        return serve_instance(
            config, role, instance, port=payload["port"],
            bootstrap_port=payload.get("bootstrap_port"),
            on_ready=lambda a: print(ready_line(config, role, instance, a), flush=True))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"{role} worker {instance}: {exc}", file=sys.stderr, flush=True)
        return PORT_TAKEN_EXIT


def exit_now(status: int) -> None:
    """Leave without the interpreter's teardown. Everything was released explicitly above;
    what is left is Mooncake's transfer engine, whose destructor alone holds an exiting
    process up for about a second."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
