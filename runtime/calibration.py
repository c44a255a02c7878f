"""`pdsim calibrate`: measure this machine's real backend, component by component, and write a
calibration file the simulator reads (docs/validation.md, "Calibration").

Three measurements, none of them an end-to-end serving figure:

- **forwards**: the deployment's model (preset weights, dtype, a decode rank's torch threads) run
  over a grid of batch shapes -- extends of `prefill_tokens` new tokens after `context` cached
  ones, decodes of `batch` requests at `context` tokens each -- each the fastest of `repeats`
  passes over the grid (other processes on a shared machine only add time), on a thread of its
  own as the served engine runs them (`_profile_rank`); the rows are the executor's timings
  table (`ForwardTiming` columns), which the `profiled` cost model fits. A
  role of tp > 1 runs as its tp rank processes, sharded as served: the all-reduces and, with
  `ep`, the expert all-to-alls are in the times. A prefill role served unlike its decode peer
  (another tp, ep or thread count) gets its own table of extends. Then a few of the same
  forwards, each after the rank idled `IDLE_PROBE_GAP_S` (`profile_cold_start`): a line
  against the profile, what a step that starts after idle takes (`cold_step_s` and
  `cold_step_factor` of the roles whose ranks run as the probed one, on one torch thread).
- **KV transfer**: the Mooncake backend over TCP on loopback (sender `send(last=True)` to the
  receiver's `Success`, metadata slot and ZMQ status included) for messages of 1..256 pages of
  this model's KV; a least-squares line gives the per-transfer floor (s) and the bandwidth
  (GB/s); the receiver's bootstrap lookup and set-up after the first contact is the handshake.
  Then the cost of one descriptor (`profile_descriptors`): two ranks writing head slices, one
  per token slot, into one rank at once, as a TP 2 -> 1 transfer does.
- **the served engine**: the deployment served for real (`pdsim serve`), requests of 16 prompt
  and 32 output tokens sent one at a time, then rounds of 8 sent together (64 output tokens
  each, 4x more while their decodes do not overlap).
  - The lone requests' client TTFTs spread: threads wake late on a shared host. Each one's
    TTFT over the fastest is a draw the simulator gives a request on its way in
    (`router.jitter_s`). The client's median TTFT minus the serving engine's own (its
    `/metrics` histogram), less the draws' median, is the front end (HTTP, tokenizer and,
    disaggregated, the router, both ways: `router.frontend_latency_s`).
  - The client's gap between tokens minus the fitted forward, alone and 8 at once, is a line
    in the batch: a step overhead (scheduling; the profiled model's `step_overhead_s`) plus a
    cost per token streamed out to the client (`token_overhead_s`: encoding, the hand-off to
    the HTTP loop, the router and the client, all on the same cores).
  - Disaggregated, the prefill worker's own record of a lone request's prefill step, minus
    the fitted extend after idle (the worker idled through the last request's decode), is
    the prefill role's step overhead (it streams nothing).
  - The engine's TTFT minus what the simulator already models of it (the prefill step and,
    disaggregated, handshake and transfer) is a per-request overhead: added to
    `network.handshake_s` when disaggregated, the colocated instance's `wakeup_s` otherwise.
  - Lone requests that each reach the deployment after it idled `IDLE_PROBE_GAP_S`: their
    fastest client TTFT minus the fastest back-to-back one (less, colocated, the forward after
    idle's extra) is what waking an idle deployment costs, the simulator's
    `router.idle_wakeup_s` (a request that finds nothing in flight for `router.idle_after_s`
    takes that much longer on its way in, before its handshake, where the served requests pay
    it: docs/validation.md); each one's TTFT over their fastest is a draw such a request
    gets instead of a back-to-back one (`router.idle_jitter_s`).
  - With speculative decoding (`speculative.method: mtp`) the engine's
    `sglang:spec_accept_length` after the probes (tokens per verify step since it started: its
    accepted drafts + 1) is the simulator's `speculative.acceptance.mean_accept_len`.
  Queueing plays no part in the lone requests: nothing else is in flight.

The file is a YAML overlay of experiment fields (`cost_model`, `network`, `router`,
`kv_dtype_bytes`, `cluster`: `host_cores`, the cores' worth of work this machine's CPUs do
together -- one process multiplying matrices alone, then one per CPU at once -- which every
served rank process shares; `speculative`) plus what was measured; `pdsim validate --calibration` lays it over the
deployment before simulating. The timings table is written beside it.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pdsim.sim.spec import ColdLine

PREFILL_TOKENS = (16, 64, 128, 256, 512)
PREFILL_CONTEXT = (0, 256, 1024)
DECODE_BATCH = (1, 4, 16, 32, 64)
DECODE_CONTEXT = (64, 256, 1024)
TRANSFER_PAGES = (1, 4, 16, 64, 256)
SLICE_PAGES = (2, 8, 32)  # pages per sender in the head-slice probe
SLICE_SENDERS = 2  # prefill ranks writing into one decode rank at once: a TP 2 -> 1 transfer
DESCRIPTOR_FITS = 5  # head-slice fits per calibration, the median kept (profile_descriptors)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Lone requests (and forwards) that each reach a deployment idle this long: on this VM a lone
# colocated request's TTFT was 3.1 ms right after another and 6.4-8.1 ms after 50 ms to 1 s of
# idling (the processes and the CPUs they sleep on take that long to wake), flat past 50 ms.
IDLE_PROBE_GAP_S, IDLE_PROBES = 0.25, 40
LONE_PROBES = 40  # lone requests back to back: enough draws for a P90 of their spread


@dataclass(frozen=True)
class TransferFit:
    floor_s: float
    gb_per_s: float
    handshake_s: float
    page_bytes: int  # one page of this model's KV on one rank
    rows: list[tuple[int, float]]  # (bytes, seconds), best of the repeats per size


@dataclass(frozen=True)
class DescriptorFit:
    per_descriptor_s: float  # the network model's figure: NIC time of one descriptor per GPU
    senders: int
    rows: list[tuple[int, float]]  # (descriptors of all senders, seconds), best of the repeats


@dataclass(frozen=True)
class ColdFit(ColdLine):
    """The line of forwards after idle against the profiled (fastest back-to-back) ones: the
    simulator's `cold_step_s` and `cold_step_factor`, and the shapes it was fitted on."""

    rows: list[tuple[float, float]]  # (profiled s, after idle s) per shape


def _threads(config, role: str = "decode") -> int:
    """Torch threads of a role's forwards as served (`forward_threads`; colocated: its one
    role)."""
    return config.forward_threads("colocated" if config.mode == "colocated" else role)


def profile_forwards(config, *, role: str = "decode", repeats: int = 5,
                     prefill_tokens: Sequence[int] = PREFILL_TOKENS,
                     prefill_context: Sequence[int] = PREFILL_CONTEXT,
                     decode_batch: Sequence[int] = DECODE_BATCH,
                     decode_context: Sequence[int] = DECODE_CONTEXT, idle_gap_s: float = 0.0):
    """The executor's timings table over the grid (module docstring), as a DataFrame: each
    shape's fastest of `repeats` forwards run back to back or, with `idle_gap_s`, the median
    of `repeats` forwards each after the rank idled that long (`profile_cold_start`).

    A disaggregated `role` (prefill or decode) of tp > 1 is profiled as it serves: tp rank
    processes, the model sharded (`apply_tp`, its `ep`), each forward with its all-reduces and,
    under expert parallelism, its all-to-alls; rank 0's times are the table. Empty decode
    grids profile extends only (a prefill role runs nothing else)."""
    import pandas as pd

    from runtime.distributed import TPGroup, run_ranks
    from runtime.executor import TIMING_COLUMNS

    grid = [repeats, idle_gap_s, list(prefill_tokens), list(prefill_context),
            list(decode_batch), list(decode_context)]
    tp = 1 if config.mode == "colocated" else getattr(config, role).tp
    dumped = config.model_dump(mode="json")
    if tp == 1:
        rows = _profile_rank(TPGroup.single(), dumped, role, *grid)
    else:
        rows = run_ranks(_profile_rank, tp, dumped, role, *grid, timeout_s=1800)[0]
    return pd.DataFrame(rows, columns=list(TIMING_COLUMNS))


def served_alike(config) -> bool:
    """Whether a disaggregated deployment's two roles run the same forwards (tp, ep, torch
    threads), so one profile serves both."""
    p, d = config.prefill, config.decode
    return (p.tp, p.ep, _threads(config, "prefill")) == (d.tp, d.ep, _threads(config))


def _profile_rank(group, dumped: dict, role: str, *grid) -> list[list]:
    """One rank's part of `profile_forwards`: every rank runs the same forwards in lock step,
    as a served rank runs them: on a thread of its own with the role's torch threads, the
    process's main thread kept at one (`ModelExecutor.bind_thread` says why it matters)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="pdsim-engine") as pool:
            return pool.submit(_profile_on_this_thread, group, dumped, role, *grid).result()
    finally:
        torch.set_num_threads(before)


def _profile_on_this_thread(group, dumped: dict, role: str, repeats: int, idle_gap_s: float,
                            prefill_tokens: list[int], prefill_context: list[int],
                            decode_batch: list[int], decode_context: list[int]) -> list[list]:
    import torch

    from runtime.host_memory import retain_freed_memory
    from runtime.model import AttentionMetadata
    from runtime.model.hybrid import recurrent_state_for
    from runtime.model.kv_cache import PagedKVCache
    from runtime.model.loading import load_served_model
    from runtime.model.tp import apply_tp
    from runtime.serve_config import parse_serve_config

    config = parse_serve_config(dumped)
    torch.set_num_threads(_threads(config, role))
    retain_freed_memory()  # as a served rank's process keeps it (runtime/host_memory.py)
    ep = 1 if config.mode == "colocated" else getattr(config, role).ep
    model = apply_tp(load_served_model(config, "cpu"), group, ep)
    mcfg = model.config
    page = config.page_size
    longest = max(max(prefill_tokens) + max(prefill_context), max(decode_context, default=0) + 1)
    pages_per_req = -(-longest // page)
    most = max(decode_batch, default=1)
    kv = PagedKVCache.for_model(mcfg, num_pages=pages_per_req * most, page_size=page,
                                tp_size=group.size,
                                dtype=getattr(torch, config.dtype) if config.dtype else None)
    tables = [list(range(i * pages_per_req, (i + 1) * pages_per_req)) for i in range(most)]
    # A hybrid model's linear-attention layers read and write a state slot per request, as
    # served (runtime/executor.py); other models keep none.
    kv.state = recurrent_state_for(mcfg, most if mcfg.linear_layers else 0, tp_size=group.size)
    slots = list(range(most)) if kv.state is not None else []
    rng = np.random.default_rng(0)

    def forward(qlens: list[int], cached: list[int]) -> float:
        ids = torch.as_tensor(rng.integers(1, 256, sum(qlens)), dtype=torch.int64)
        meta = AttentionMetadata.build(qlens, cached, tables[: len(qlens)], page,
                                       state_slots=slots[: len(qlens)])
        start = time.perf_counter()
        with torch.inference_mode():
            model(ids, meta.positions(), meta, kv).argmax(-1).tolist()  # one row per segment
        return time.perf_counter() - start

    shapes = [("extend", n, n * c + n * (n + 1) / 2, 0, 0, [n], [c])
              for n in prefill_tokens for c in prefill_context]
    shapes += [("decode", 0, 0.0, b, b * (c + 1), [1] * b, [c] * b)
               for b in decode_batch for c in decode_context]
    forward([32], [0])  # lazy initialisation, untimed
    if idle_gap_s:  # a forward after idle is one draw: the median is the typical one
        def after_idle(shape) -> float:
            time.sleep(idle_gap_s)
            return forward(*shape[5:])

        return [[*shape[:5], statistics.median(after_idle(shape) for _ in range(repeats))]
                for shape in shapes]
    # The whole grid `repeats` times over, keeping each shape's fastest: other processes on
    # the machine only add time, and a burst of them then spoils one pass, not every run of
    # a shape.
    best = [math.inf] * len(shapes)
    for _ in range(repeats):
        best = [min(b, forward(*shape[5:])) for b, shape in zip(best, shapes)]
    return [[*shape[:5], t] for shape, t in zip(shapes, best)]


def cold_start_roles(config) -> list[str]:
    """The roles whose steps after idle `profile_cold_start` measures: those whose ranks run as
    its rank (the decode role's; colocated, the one role's), on one torch thread. With more
    threads a forward after the probe's sleep also waits for the machine's other CPUs to wake
    for its OpenMP workers (6-20 ms on this VM), which a served engine, whose CPUs the
    request's own hops have just woken, does not (docs/validation.md); a prefill role served
    unlike its decode peer runs other forwards."""
    if _threads(config) != 1:
        return []
    if config.mode == "colocated":
        return ["colocated"]
    return ["prefill", "decode"] if served_alike(config) else ["decode"]


def profile_cold_start(config, timings, *, repeats: int = 5) -> ColdFit:
    """Extends of every profiled length without a cached prefix, and decodes of 1 and 16
    requests, each run `repeats` times after the rank idled `IDLE_PROBE_GAP_S`, against the
    same shapes in `timings` (the back-to-back profile): a least-squares line, its slope at
    least 1 (a forward after idle is never faster)."""
    cold = profile_forwards(config, repeats=repeats, prefill_context=(0,), decode_batch=(1, 16),
                            decode_context=DECODE_CONTEXT[:1], idle_gap_s=IDLE_PROBE_GAP_S)
    keys = list(cold.columns[:-1])
    pairs = cold.merge(timings, on=keys, suffixes=("_cold", ""))
    warm, idle = pairs.duration_s.to_numpy(), pairs.duration_s_cold.to_numpy()
    factor, step_s = np.polyfit(warm, idle, 1)
    if factor < 1:
        factor, step_s = 1.0, float(np.median(idle - warm))
    return ColdFit(max(0.0, float(step_s)), float(factor),
                   [(float(w), float(c)) for w, c in zip(warm, idle)])


def profile_transfer(config, *, repeats: int = 5,
                     pages: Sequence[int] = TRANSFER_PAGES) -> TransferFit:
    """The Mooncake backend over TCP on loopback for this model's KV pages (module docstring)."""
    import torch

    from pdsim.core.kvpoll import KVPoll
    from pdsim.core.request import Request
    from pdsim.core.transfer import FirstTokenMetadata
    from pdsim.deployment import TransferConfig
    from runtime.model.kv_cache import PagedKVCache
    from runtime.model.loading import model_config_of
    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.transfer.layout import KVArgs
    from runtime.transfer.metadata import MetadataBuffer
    from runtime.transfer.mooncake import MooncakeKVManager

    mcfg = model_config_of(config)
    most = max(pages)
    dtype = getattr(torch, config.dtype) if config.dtype else None

    def side() -> KVArgs:
        cache = PagedKVCache.for_model(mcfg, num_pages=most, page_size=config.page_size,
                                       dtype=dtype)
        return KVArgs.for_cache(cache, MetadataBuffer.allocate(4),
                                total_kv_heads=mcfg.num_kv_heads)

    src, dst = side(), side()
    page_bytes = sum(src.kv_item_lens)
    mc = TransferConfig(heartbeat_interval_s=0)
    server = BootstrapServer().start()
    prefill, decode = MooncakeKVManager(src, mc), MooncakeKVManager(dst, mc)
    prefill.register_with_bootstrap("127.0.0.1", server.port)
    best: dict[int, float] = {}
    handshakes: list[float] = []
    room = 0

    def wait(poll, state: KVPoll) -> KVPoll:
        while (got := poll()) is state:
            time.sleep(0.0002)
        return got

    try:
        for n in [pages[0], *pages]:  # the first round connects the engines: not timed
            for _ in range(repeats):
                room += 1
                req = Request(rid=str(room), input_len=1, max_new_tokens=1,
                              bootstrap_host="127.0.0.1", bootstrap_port=server.port,
                              bootstrap_room=room)
                t0 = time.perf_counter()
                receiver = decode.create_receiver(req)
                sender = prefill.create_sender(req)
                wait(receiver.poll, KVPoll.Bootstrapping)
                looked_up = time.perf_counter() - t0
                order = list(range(n))
                receiver.send_metadata(order, metadata_slot=0)
                wait(sender.poll, KVPoll.Bootstrapping)
                sender.init(n, metadata_slot=0)
                prefill.metadata.write(0, FirstTokenMetadata(room, 1, 0.0, 0))
                t0 = time.perf_counter()
                sender.send(order, last=True)
                while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
                    time.sleep(0.0002)
                elapsed = time.perf_counter() - t0
                if state is KVPoll.Failed:
                    raise RuntimeError(f"calibration transfer failed: {receiver.failure_reason()}")
                if room > repeats:
                    best[n] = min(best.get(n, float("inf")), elapsed)
                    handshakes.append(looked_up)
                sender.close()
                receiver.close()
    finally:
        prefill.close()
        decode.close()
        server.stop()
    nbytes = np.array([n * page_bytes for n in best], dtype=float)
    seconds = np.array(list(best.values()))
    slope, floor = np.polyfit(nbytes, seconds, 1)
    return TransferFit(floor_s=max(float(floor), 0.0),
                       gb_per_s=float(1e-9 / slope) if slope > 0 else float("inf"),
                       handshake_s=statistics.median(handshakes), page_bytes=page_bytes,
                       rows=[(int(b), float(s)) for b, s in zip(nbytes, seconds)])


def profile_descriptors(items: Sequence[int], page_size: int, gb_per_s: float, *,
                        repeats: int = 5, pages: Sequence[int] = SLICE_PAGES,
                        senders: int = SLICE_SENDERS, fits: int = 1) -> DescriptorFit:
    """What one descriptor costs: `senders` prefill ranks, each its own Mooncake engine and
    thread, write their slice of every token slot of KV pages (`items`: bytes of one page per
    buffer, on the receiving rank) into one decode rank at once, with the descriptors
    runtime/transfer/layout.py writes across a TP mismatch (one per token slot per buffer).
    The slope of time over descriptors, less the bytes at `gb_per_s`, times the senders, is
    the network model's `per_descriptor_s`: it spreads a transfer's descriptors over the
    sending GPUs, which only the measurement can say they really do in parallel. With `fits`
    > 1 the sizes are measured that many times over and the fit of median slope is kept: one
    fit on two loopback cores spread 31-44 us a descriptor from one run to the next."""
    import threading

    from runtime.transfer.layout import HeadSlice, head_slice_descriptors
    from runtime.transfer.mooncake_engine import MooncakeEngine

    most = max(pages)
    slot_bytes = {item // page_size for item in items}
    if len(slot_bytes) != 1 or next(iter(slot_bytes)) % senders:
        raise RuntimeError(f"token slots of {sorted(slot_bytes)} bytes do not split into "
                           f"{senders} equal slices")
    piece_bytes = slot_bytes.pop() // senders
    dst = [np.zeros(most * item, dtype=np.uint8) for item in items]
    srcs = [[np.full(most * item // senders, s + 1, dtype=np.uint8) for item in items]
            for s in range(senders)]
    receiver = MooncakeEngine()
    for buf in dst:
        receiver.register(buf.ctypes.data, buf.nbytes)
    writers = []
    for bufs in srcs:
        engine = MooncakeEngine()
        for buf in bufs:
            engine.register(buf.ctypes.data, buf.nbytes)
        writers.append(engine)

    def descriptors(rank: int, n: int):
        order = list(range(n))
        return head_slice_descriptors(
            [b.ctypes.data for b in srcs[rank]], [i // senders for i in items],
            [b.ctypes.data for b in dst], items, page_size, order, order,
            HeadSlice(0, rank * piece_bytes, piece_bytes))

    def write_all(n: int) -> float:
        plans = [descriptors(rank, n) for rank in range(senders)]
        threads = [threading.Thread(target=w.write, args=(receiver.session_id, *plan))
                   for w, plan in zip(writers, plans)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    def slope(rows: list[tuple[int, float]]) -> float:
        count = np.array([d for d, _ in rows], dtype=float)
        wire = count * piece_bytes / (gb_per_s * 1e9)
        return float(np.polyfit(count, np.array([s for _, s in rows]) - wire, 1)[0])

    try:
        write_all(pages[0])  # connects the engines: not timed
        rounds = [[(senders * n * page_size * len(items),
                    min(write_all(n) for _ in range(repeats))) for n in pages]
                  for _ in range(fits)]
        landed = dst[0].reshape(most * page_size, -1)[:, :piece_bytes]
        if not (landed[:pages[-1] * page_size] == 1).all():
            raise RuntimeError("the head-slice probe's bytes did not land")
    finally:
        for engine in (*writers, receiver):
            engine.unregister_all()
    rows = sorted(rounds, key=slope)[len(rounds) // 2]
    return DescriptorFit(per_descriptor_s=max(slope(rows), 0.0) * senders, senders=senders,
                         rows=[(int(d), float(s)) for d, s in rows])


def page_bytes_per_buffer(config) -> list[int]:
    """Bytes of one page of the deployment's model, per KV buffer, on an unsplit rank."""
    import torch

    from runtime.model.kv_cache import PagedKVCache
    from runtime.model.loading import model_config_of

    dtype = getattr(torch, config.dtype) if config.dtype else None
    cache = PagedKVCache.for_model(model_config_of(config), num_pages=1,
                                   page_size=config.page_size, dtype=dtype)
    return list(cache.item_lens())


def _metrics_text(url: str, headers: dict) -> str:
    request = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read().decode()


def _histogram_totals(url: str, headers: dict, name: str) -> tuple[float, float]:
    """(sum, count) of one of the engine's histograms from its Prometheus `/metrics`."""
    text = _metrics_text(url, headers)
    got = {}
    for part in ("sum", "count"):
        m = re.search(rf"^{name}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        if m is None:
            raise RuntimeError(f"{url}/metrics has no {name}_{part}")
        got[part] = float(m.group(1))
    return got["sum"], got["count"]


def _busy_s(seconds: float) -> float:
    """One torch thread multiplying matrices for about `seconds`: the multiplications per
    second it managed."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ a
        n += 1
    return n / elapsed


def measure_host_cores(seconds: float = 1.0) -> float:
    """How many cores' worth of work this machine's CPUs do together: one process computing
    alone, then one per CPU at once (spawned rank processes, as the served ranks are); their
    summed rate over the lone rate. Below the CPU count when they share physical cores (or
    other load takes some)."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    cpus = os.cpu_count() or 1
    with ProcessPoolExecutor(cpus, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_busy_s, [0.1] * cpus))  # start (import torch) before timing
        alone = pool.submit(_busy_s, seconds).result()
        together = sum(pool.map(_busy_s, [seconds] * cpus))
    return min(float(cpus), together / alone)


PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS = 16, 32
PROBE_BATCH, PROBE_BATCH_TOKENS, PROBE_BATCH_ROUNDS = 8, 64, 3
MAX_BATCH_TOKENS = 1024  # outputs of the batch probe, grown while its requests do not overlap


@dataclass(frozen=True)
class EngineTimes:
    """Medians over requests sent one at a time to an idle deployment, then over `batch`
    requests sent together."""

    client_ttft_s: float  # at the client
    engine_ttft_s: float  # the serving engine's own (colocated server or decode worker)
    engine_itl_s: float  # the engine's gap between tokens of a lone request
    client_itl_s: float  # the same gaps as the client sees them
    batch: int = 0  # requests decoding together in the batch probe
    batch_itl_s: float = math.nan  # their gap between tokens at the client
    batch_tokens: int = PROBE_BATCH_TOKENS  # the output tokens each of them asked for
    prefill_span_s: float = math.nan  # disaggregated: a lone request's prefill step, start to end
    idle_client_ttft_s: float = math.nan  # at the client, lone, after IDLE_PROBE_GAP_S idle
    spec_accept_len: float | None = None  # speculating: tokens per verify step, every request
    lone_ttfts_s: tuple[float, ...] = ()  # every lone request's client TTFT, back to back
    idle_ttfts_s: tuple[float, ...] = ()  # ... and after idle


def read_gauge(url: str, headers: dict, name: str) -> float:
    """One of the engine's gauges from its Prometheus `/metrics`."""
    text = _metrics_text(url, headers)
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{url}/metrics has no {name}")
    return float(m.group(1))


ACCEPT_METRIC = "sglang:spec_accept_length"


def acceptance_overlay(config, mean_accept_len: float) -> dict:
    """The calibration's `speculative` section: the measured tokens per verify step as the
    simulator's acceptance (it replaces the configured `acceptance` whole)."""
    k = config.speculative.num_draft_tokens
    if not 1.0 <= mean_accept_len <= k + 1:
        raise RuntimeError(f"measured accept length {mean_accept_len}: outside [1, {k + 1}] for "
                           f"num_draft_tokens {k}")
    return {"acceptance": {"mean_accept_len": round(mean_accept_len, 6)}}


# The engine's own histograms: SGLang's names on the colocated server, `pdsim_` on a PD worker
# (runtime/serve_metrics.py).
TTFT_METRIC = "time_to_first_token_seconds"
ITL_METRIC = "inter_token_latency_seconds"


def measure_engine(config_path: str | Path, config, *, requests: int = LONE_PROBES,
                   batch: int = PROBE_BATCH) -> EngineTimes:
    """Serve the deployment for real and send `requests` requests of PROBE_PROMPT_TOKENS
    prompt tokens and PROBE_OUTPUT_TOKENS output tokens one at a time (two more first, for
    warm-up); the engine's TTFT and ITL come from its `/metrics` histograms, read around
    each request, a disaggregated prefill step's span from the prefill worker's `/records`.
    Then IDLE_PROBES more lone requests, each after the deployment idled IDLE_PROBE_GAP_S:
    their client TTFT. Then PROBE_BATCH_ROUNDS rounds of `batch` requests of
    PROBE_BATCH_TOKENS output tokens sent together: their gap between tokens, while all of
    them decode, is a step of `batch` requests as the client sees it (the streaming of every
    token included)."""
    from pdsim.validation.deployment import RealDeployment
    from pdsim.validation.replay import replay
    from runtime.security import ClusterKey, new_secret

    secret = new_secret()
    headers = ClusterKey.from_secret(secret).headers()
    n_in, n_out = PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS
    with RealDeployment(config_path, secret=secret) as real:
        engine = real.url if config.mode == "colocated" else real.workers[("decode", 0)]
        prefix = "sglang:" if config.mode == "colocated" else "pdsim_"
        names = [prefix + TTFT_METRIC, prefix + ITL_METRIC]
        replay(real.url, config.model_name, [0.0, 0.0], [n_in, n_in], [n_out, n_out])

        def one_request(seed: int):
            (rec,) = replay(real.url, config.model_name, [0.0], [n_in], [n_out], seed=seed)
            if not rec.ok:
                raise RuntimeError(f"calibration request failed: {rec.error}")
            return rec

        rows, lone = [], set()
        for i in range(requests):  # one at a time: nothing queues
            before = [_histogram_totals(engine, headers, m) for m in names]
            rec = one_request(i)
            (t_sum, t_n), (i_sum, i_n) = (
                (a[0] - b[0], a[1] - b[1]) for a, b in zip(
                    [_histogram_totals(engine, headers, m) for m in names],
                    before))
            if t_n != 1 or i_n < 1:
                raise RuntimeError(f"the engine counted {t_n} requests and {i_n} gaps for one "
                                   f"request of {n_out} tokens")
            gap = (rec.token_times_s[-1] - rec.token_times_s[0]) / (n_out - 1)
            rows.append((rec.ttft_s, t_sum, i_sum / i_n, gap))
            lone.add(rec.rid)
        idle_ttfts = []
        for i in range(requests, requests + IDLE_PROBES):
            time.sleep(IDLE_PROBE_GAP_S)
            idle_ttfts.append(one_request(i).ttft_s)
        batch_itl_s, batch_tokens = _batch_probe(real.url, config.model_name, batch, n_in,
                                                 seed=requests + IDLE_PROBES)
        span = math.nan
        if config.mode != "colocated":
            spans = [row["prefill_end_s"] - row["prefill_start_s"]
                     for rows_ in real.worker_records("prefill") for row in rows_
                     if row["rid"] in lone and row.get("prefill_end_s") is not None]
            span = statistics.median(spans) if spans else math.nan
        accept = (read_gauge(engine, headers, ACCEPT_METRIC)
                  if config.speculative.method != "none" else None)
    # Medians: a moment of load from other processes on a shared machine moves a mean.
    return EngineTimes(*(float(v) for v in np.median(np.array(rows), axis=0)), batch=batch,
                       batch_itl_s=batch_itl_s, batch_tokens=batch_tokens, prefill_span_s=span,
                       idle_client_ttft_s=statistics.median(idle_ttfts), spec_accept_len=accept,
                       lone_ttfts_s=tuple(row[0] for row in rows), idle_ttfts_s=tuple(idle_ttfts))


def over_fastest(times_s: Sequence[float]) -> list[float]:
    """Each of `times_s` less the fastest of them, sorted, to the microsecond."""
    fastest = min(times_s)
    return sorted(round(t - fastest, 6) for t in times_s)


class NotTogether(RuntimeError):
    """The batch probe's requests did not decode at the same time."""


def _batch_probe(url: str, model: str, batch: int, n_in: int, *, seed: int) -> tuple[float, int]:
    """PROBE_BATCH_ROUNDS rounds of `batch` requests sent together: the median of their pace
    while all decode, and the output tokens each asked for. A slow prefill or transfer (a tp-2
    prefill on a small machine) spreads their joins past the first one's last token: then
    every round runs again with 4x the outputs, up to MAX_BATCH_TOKENS."""
    from pdsim.validation.replay import replay

    tokens = PROBE_BATCH_TOKENS
    while True:
        try:
            gaps = [_batch_gap_s(replay(url, model, [0.0] * batch, [n_in] * batch,
                                        [tokens] * batch, seed=seed + r))
                    for r in range(PROBE_BATCH_ROUNDS)]
            return statistics.median(gaps), tokens
        except NotTogether as e:
            if tokens * 4 > MAX_BATCH_TOKENS:
                raise NotTogether(f"{e} (with up to {tokens} output tokens each)") from None
            tokens *= 4


def _batch_gap_s(records) -> float:
    """The client's gap between tokens while every request of a batch sent together decodes:
    from the latest first token to the earliest last one, over the tokens each got then."""
    for rec in records:
        if not rec.ok:
            raise RuntimeError(f"calibration request failed: {rec.error}")
    start = max(r.token_times_s[0] for r in records)
    end = min(r.token_times_s[-1] for r in records)
    steps = [sum(start < t <= end for t in r.token_times_s) for r in records]
    if end <= start or min(steps) < 2:
        raise NotTogether("the batch probe's requests did not decode together; the engine "
                           "ran them one after another")
    return (end - start) / statistics.median(steps)


def calibrate(config_path: str | Path, out_path: str | Path, *, repeats: int = 5,
              probe_requests: int = LONE_PROBES, log=print) -> Path:
    """Measure (module docstring) and write the calibration YAML and its timings CSV."""
    import yaml

    from pdsim.progress import phase
    from runtime.serve_config import load_serve_config

    config = load_serve_config(config_path)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    timings_path = out_path.with_name(out_path.stem + "_timings.csv")
    prefill_path = out_path.with_name(out_path.stem + "_prefill_timings.csv")
    own_prefill = config.mode != "colocated" and not served_alike(config)
    log(f"forwards: {config.model}, {config.dtype or 'default dtype'}, "
        f"{_threads(config)} torch threads")
    with phase("profiling forwards"):
        timings = profile_forwards(config, repeats=repeats)
    timings.to_csv(timings_path, index=False)
    log(f"  {len(timings)} forwards -> {timings_path}")
    prefill_timings = timings
    if own_prefill:  # the prefill role's own tp/ep: its extends as its rank processes run them
        with phase(f"profiling the prefill role's forwards (tp {config.prefill.tp})"):
            prefill_timings = profile_forwards(config, role="prefill", repeats=repeats,
                                               decode_batch=(), decode_context=())
        prefill_timings.to_csv(prefill_path, index=False)
        log(f"  {len(prefill_timings)} prefill forwards -> {prefill_path}")
    cold, cold_roles = ColdFit(0.0, 1.0, []), cold_start_roles(config)
    if cold_roles:
        with phase(f"profiling forwards after {IDLE_PROBE_GAP_S:g} s idle"):
            cold = profile_cold_start(config, timings, repeats=repeats)
        log(f"  after idle: {cold.step_s * 1e3:.2f} ms + {cold.factor:.3f} x the profiled "
            f"forward ({len(cold.rows)} shapes), for the {' and '.join(cold_roles)} role")
    else:
        log(f"  forwards after idle: not probed ({_threads(config)} torch threads a rank)")
    transfer = None
    if config.mode != "colocated":
        with phase("measuring the KV transfer (Mooncake TCP loopback)"):
            transfer = profile_transfer(config, repeats=max(repeats, 3))
        log(f"KV transfer (Mooncake TCP loopback): floor {transfer.floor_s * 1e3:.2f} ms, "
            f"{transfer.gb_per_s:.2f} GB/s, handshake {transfer.handshake_s * 1e3:.2f} ms")
        with phase("measuring head-slice descriptors"):
            slices = profile_descriptors(page_bytes_per_buffer(config), config.page_size,
                                         transfer.gb_per_s, repeats=max(repeats, 3),
                                         fits=DESCRIPTOR_FITS)
        log(f"  head slices ({slices.senders} ranks at once): "
            f"{slices.per_descriptor_s * 1e6:.1f} us per descriptor per GPU")
    from pdsim.core.batch import BatchShape, extend_attn_pairs
    from pdsim.sim.profiled import ProfiledCostModel

    fit = ProfiledCostModel(None, None, None, timings=timings)
    prefill_fit = ProfiledCostModel(None, None, None, timings=prefill_timings)
    n_in, n_out = PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS
    extend = [BatchShape(prefill_tokens=n_in, prefill_attn_pairs=extend_attn_pairs(n_in, 0))]
    prefill_extend_s = prefill_fit.step_time_s(extend)
    decode_s = fit.step_time_s([BatchShape(decode_reqs=1,
                                           decode_context_tokens=n_in + n_out // 2)])
    with phase("measuring how much the host's cores do together"):
        host_cores = measure_host_cores()
    log(f"host: {os.cpu_count()} CPUs do the work of {host_cores:.2f} together")
    with phase(f"serving {probe_requests} lone requests, then {PROBE_BATCH} at once"):
        engine = measure_engine(config_path, config, requests=probe_requests)
    batch_decode_s = fit.step_time_s([BatchShape(
        decode_reqs=engine.batch,
        decode_context_tokens=engine.batch * (n_in + engine.batch_tokens // 2))])
    # Lone requests' client TTFTs spread (threads waking on a shared host): the simulator
    # draws each request's delay over the fastest from these (`router.jitter_s`,
    # `idle_jitter_s`), and the front end is what is left of the median.
    jitter_s, idle_jitter_s = over_fastest(engine.lone_ttfts_s), over_fastest(engine.idle_ttfts_s)
    frontend_s = max(0.0, engine.client_ttft_s - engine.engine_ttft_s
                     - statistics.median(jitter_s))
    # The client's pace, not the engine's: on this machine tokens reach the client slower than
    # the engine emits them (docs/validation.md, "Where the error comes from"). What a step of
    # one request and a step of `batch` requests take beyond their forwards is a line: a
    # fixed part per step and a part per token streamed.
    alone_s = engine.client_itl_s - decode_s
    token_overhead_s = max(0.0, (engine.batch_itl_s - batch_decode_s - alone_s)
                           / (engine.batch - 1))
    step_overhead_s = max(0.0, alone_s - token_overhead_s)
    # A prefill worker streams nothing: its step beyond the forward is its own (disaggregated).
    # It idled through the previous lone request's decode, so its forward ran cold; a
    # colocated engine takes the next lone request right after the last one's tokens.
    if transfer is not None:
        prefill_s = prefill_extend_s + (cold.extra_s(prefill_extend_s)
                                        if "prefill" in cold_roles else 0.0)
        prefill_overhead_s = max(0.0, engine.prefill_span_s - prefill_s)
    else:
        prefill_s, prefill_overhead_s = prefill_extend_s, step_overhead_s + token_overhead_s
    # What a lone request's engine TTFT holds beyond its modelled parts.
    modelled = prefill_s + prefill_overhead_s
    if transfer is not None:
        kv_bytes = -(-n_in // config.page_size) * transfer.page_bytes
        modelled += transfer.floor_s + transfer.handshake_s + kv_bytes / (transfer.gb_per_s * 1e9)
    request_overhead_s = max(0.0, engine.engine_ttft_s - modelled)
    # What a lone request pays more when the deployment has idled, beyond its cold forward
    # (colocated: the back-to-back one ran warm): the simulator's `router.idle_wakeup_s`, the
    # fastest after idle over the fastest back to back (each side's draws add the rest).
    idle_wake_s = max(0.0, min(engine.idle_ttfts_s) - min(engine.lone_ttfts_s)
                      - (0.0 if transfer is not None else cold.extra_s(prefill_extend_s)))
    log(f"lone requests ({n_in} -> {n_out} tokens): client TTFT {engine.client_ttft_s * 1e3:.2f} "
        f"ms, engine TTFT {engine.engine_ttft_s * 1e3:.2f} ms; ITL client "
        f"{engine.client_itl_s * 1e3:.2f} ms, engine {engine.engine_itl_s * 1e3:.2f} ms, "
        f"forward alone {decode_s * 1e3:.2f} ms; {engine.batch} at once: ITL client "
        f"{engine.batch_itl_s * 1e3:.2f} ms, forward alone {batch_decode_s * 1e3:.2f} ms")
    log(f"  front end {frontend_s * 1e3:.2f} ms, step overhead {step_overhead_s * 1e3:.2f} ms "
        f"+ {token_overhead_s * 1e3:.3f} ms per token streamed, prefill step overhead "
        f"{prefill_overhead_s * 1e3:.2f} ms, per-request overhead "
        f"{request_overhead_s * 1e3:.2f} ms; after {IDLE_PROBE_GAP_S:g} s idle: client TTFT "
        f"{engine.idle_client_ttft_s * 1e3:.2f} ms, {idle_wake_s * 1e3:.2f} ms to wake")
    for label, draws in (("back to back", jitter_s), ("after idle", idle_jitter_s)):
        log(f"  client TTFT over the fastest, {label}: median "
            f"{statistics.median(draws) * 1e3:.2f} ms, largest {max(draws) * 1e3:.2f} ms")
    params = {"timings": timings_path.name, "step_overhead_s": round(step_overhead_s, 6),
              "token_overhead_s": round(token_overhead_s, 7)}
    if transfer is not None:
        params["roles"] = {"prefill": {
            **({"timings": prefill_path.name} if own_prefill else {}),
            "step_overhead_s": round(prefill_overhead_s, 6), "token_overhead_s": 0.0}}
    router = {"frontend_latency_s": round(frontend_s, 6), "idle_wakeup_s": round(idle_wake_s, 6),
              "jitter_s": jitter_s, "idle_jitter_s": idle_jitter_s}
    data = {
        "measured": {
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "config": str(config_path),
            "model": config.model, "dtype": config.dtype, "torch_threads": _threads(config),
            "forwards": len(timings),
            "after_idle_s": [[round(w, 6), round(c, 6)] for w, c in cold.rows],
            "probe": {"prompt_tokens": n_in, "output_tokens": n_out,
                      "client_ttft_s": round(engine.client_ttft_s, 6),
                      "engine_ttft_s": round(engine.engine_ttft_s, 6),
                      "engine_itl_s": round(engine.engine_itl_s, 6),
                      "client_itl_s": round(engine.client_itl_s, 6),
                      "batch": engine.batch, "batch_output_tokens": engine.batch_tokens,
                      "batch_itl_s": round(engine.batch_itl_s, 6),
                      "idle_gap_s": IDLE_PROBE_GAP_S,
                      "idle_client_ttft_s": round(engine.idle_client_ttft_s, 6),
                      **({"prefill_span_s": round(engine.prefill_span_s, 6)}
                         if transfer is not None else {}),
                      "modelled_ttft_s": round(modelled, 6)},
            **({"transfer_bytes_s": [list(r) for r in transfer.rows],
                "head_slice_descriptors_s": [list(r) for r in slices.rows],
                "head_slice_senders": slices.senders} if transfer else {}),
        },
        "cost_model": {"name": "profiled", "params": params},
        "router": router,
    }
    if engine.spec_accept_len is not None:
        data["measured"]["probe"]["spec_accept_len"] = round(engine.spec_accept_len, 6)
        data["speculative"] = acceptance_overlay(config, engine.spec_accept_len)
        log(f"  speculative acceptance: {engine.spec_accept_len:.3f} tokens per verify step")
    if config.dtype:
        data["kv_dtype_bytes"] = DTYPE_BYTES[config.dtype]
    if transfer is not None:
        data["network"] = {
            "protocol": "tcp", "bandwidth_gb_per_s": round(transfer.gb_per_s, 4),
            "line_rate_efficiency": 1.0, "transfer_floor_s": round(transfer.floor_s, 6),
            "handshake_s": round(transfer.handshake_s + request_overhead_s, 6),
            "per_descriptor_s": round(slices.per_descriptor_s, 9)}
        schedulers = {"prefill": {}, "decode": {}}
    else:
        schedulers = {"colocated": {"wakeup_s": round(request_overhead_s, 6)}}
    for role in cold_roles:
        schedulers[role].update(cold_step_s=round(cold.step_s, 6),
                                cold_step_factor=round(cold.factor, 4))
    data["cluster"] = {role: {"scheduler": knobs} for role, knobs in schedulers.items() if knobs}
    # Every rank process served here runs on this machine's cores, as the simulator then shares
    # them (pdsim/sim/host.py).
    data["cluster"]["host_cores"] = round(host_cores, 2)
    out_path.write_text("# pdsim calibrate: measured on this machine (runtime/calibration.py)\n"
                        + yaml.safe_dump(data, sort_keys=False))
    return out_path
