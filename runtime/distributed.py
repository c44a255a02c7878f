"""The ranks of one tensor-parallel instance: a gloo process group and the collectives they need.

`TPGroup.join(init_method, rank, size)` forms a group over `tcp://HOST:PORT` (rank 0 hosts the
rendezvous store, listening on HOST only; every rank must be started with the same address and
size). Gloo's own connections listen on `bind_host`, loopback by default. `TPGroup.single()`
is the one-rank group, whose collectives return their input, so callers need no tp=1 branches.

The group holds its own store and gloo process group; nothing is registered with
`torch.distributed`'s process-global default group, so one process may hold several groups (or
none). Collectives, like every rank's model, run in lock step: each rank must call the same ones in
the same order with tensors of the same shape.

- `all_reduce_sum(t)`: the row-parallel projections' partial sums (`runtime.model.tp`).
- `all_reduce_min_int(values)`: KVPoll states of an instance's ranks; MIN, so one `Failed` (0)
  fails the request everywhere (SGLang's `poll_and_all_reduce`).
- `all_to_all(rows, send_counts, recv_counts)`: expert parallelism's token dispatch and
  combine (`runtime.model.moe`).
- `broadcast_tensor` / `broadcast_bytes` / `broadcast_msgpack`: rank 0's value to every rank;
  bytes travel as a length then a uint8 tensor, objects as msgpack (never pickle).
- `all_gather` / `all_gather_msgpack`: every rank's tensor (same shape) or object, in rank order
  (attention DP: the tokens of the MLP layers, each rank's sampled tokens).

`run_ranks(fn, size)` starts `size` fresh processes that join one group and run `fn(group)`;
their JSON results come back in rank order (tests and benchmarks).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any
from urllib.parse import urlsplit

import msgpack
import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class JoinTimeout(TimeoutError):
    """The ranks of a group did not all meet within the timeout."""


class RankFailed(RuntimeError):
    """A rank started by `run_ranks` raised, died or ran past its time."""


class TPGroup:
    """One rank's handle on its tensor-parallel group. Build with `join` or `single`."""

    def __init__(self, rank: int, size: int, pg: dist.ProcessGroupGloo | None = None,
                 store: dist.TCPStore | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for a group of size {size}")
        if size > 1 and pg is None:
            raise ValueError("a group of more than one rank needs a process group; use join()")
        self.rank = rank
        self.size = size
        self._pg = pg
        self._store = store  # the rendezvous store must outlive the process group

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one rank: collectives return their input unchanged."""
        return cls(0, 1)

    @classmethod
    def join(cls, init_method: str, rank: int, size: int, *,
             timeout_s: float = DEFAULT_TIMEOUT_S, bind_host: str = "127.0.0.1") -> TPGroup:
        """Form a gloo group of `size` ranks at `init_method` (`tcp://HOST:PORT`).

        Blocks until every rank has joined; raises `JoinTimeout` after `timeout_s`. Collectives
        later time out (RuntimeError) after `timeout_s` as well. `bind_host` is the address gloo
        listens on for its peers (loopback unless the ranks span machines).
        """
        if size == 1 and rank == 0:
            return cls.single()
        parts = urlsplit(init_method)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            raise ValueError(f"init_method {init_method!r}; expected tcp://HOST:PORT")
        timeout = timedelta(seconds=timeout_s)
        try:
            # TCPStore alone would listen on every interface: rank 0 hands it a socket bound to
            # the host (the store owns and closes it)
            fd = _listen(parts.hostname, parts.port).detach() if rank == 0 else None
            store = dist.TCPStore(parts.hostname, parts.port, size, is_master=rank == 0,
                                  timeout=timeout, wait_for_workers=True, master_listen_fd=fd)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            pg = dist.ProcessGroupGloo(store, rank, size, options)
        except (RuntimeError, OSError) as exc:  # Dist*Error, gloo's own, the port is taken
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JoinTimeout(
                f"tp rank {rank} of {size} at {init_method}: the group did not form within "
                f"{timeout_s:g} s ({reason}); every rank must start with the same init_method "
                f"and size") from None
        return cls(rank, size, pg, store)

    @property
    def is_single(self) -> bool:
        return self.size == 1

    # ---- collectives -----------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (the same bits on every rank)."""
        pg = self._backend()
        if pg is not None:
            pg.allreduce([tensor]).wait()
        return tensor

    def all_reduce_min_int(self, values: Sequence[int]) -> list[int]:
        """The element-wise MIN over the ranks of `values` (e.g. KVPoll states).

        Every rank must pass the same number of values; a mismatch raises ValueError on every
        rank (checked with a two-integer collective first: gloo itself would abort the process).
        """
        values = [int(v) for v in values]
        if self._backend() is None:
            return values
        count = self._min(torch.tensor([len(values), -len(values)], dtype=torch.int64)).tolist()
        if count[0] != -count[1]:
            raise ValueError(f"all_reduce_min_int: the ranks passed between {count[0]} and "
                             f"{-count[1]} values; every rank must pass the same number")
        if not values:
            return []
        return self._min(torch.tensor(values, dtype=torch.int64)).tolist()

    def _min(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._backend().allreduce([tensor], options).wait()
        return tensor

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite `tensor` with rank 0's, in place; returns it.

        The other ranks pass a tensor of the same shape and dtype (e.g. `torch.empty`).
        """
        pg = self._backend()
        if pg is not None:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            pg.broadcast([tensor], options).wait()
        return tensor

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (the other ranks pass None): a length, then bytes."""
        if self.rank == 0:
            if not isinstance(payload, (bytes, bytearray)):
                raise TypeError(f"rank 0 must broadcast bytes, got {type(payload).__name__}")
            payload = bytes(payload)
        if self._backend() is None:
            return payload
        length = int(self.broadcast_tensor(
            torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)))
        if length == 0:
            return b""
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        return self.broadcast_tensor(buffer).numpy().tobytes()

    def broadcast_msgpack(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (msgpack-able: None, bool, int, float, str, bytes, lists, dicts) on every
        rank; the others pass nothing. Tuples come back as lists."""
        payload = msgpack.packb(obj, use_bin_type=True) if self.rank == 0 else None
        return msgpack.unpackb(self.broadcast_bytes(payload), raw=False, strict_map_key=False)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all of one shape and dtype), in rank order."""
        pg = self._backend()
        if pg is None:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        pg.allgather([out], [tensor.contiguous()]).wait()
        return out

    def all_gather_msgpack(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (msgpack-able), in rank order: the lengths first, then the
        payloads padded to the longest."""
        payload = msgpack.packb(obj, use_bin_type=True)
        if self._backend() is None:
            return [obj]
        lengths = [int(n) for n in self.all_gather(torch.tensor([len(payload)], dtype=torch.int64))]
        buffer = torch.zeros(max(lengths), dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [msgpack.unpackb(t[:n].numpy().tobytes(), raw=False, strict_map_key=False)
                for t, n in zip(self.all_gather(buffer), lengths)]

    def all_to_all(self, rows: torch.Tensor, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> torch.Tensor:
        """Send `rows` (dim 0) out in rank order, `send_counts[i]` of them to rank i; returns the
        rows received, in rank order, `recv_counts[i]` from rank i (what rank i sends here).

        Expert parallelism's dispatch and combine (`runtime.model.moe`); with a `[size]` tensor
        of counts and counts of 1 each, it tells every rank how many rows to expect.
        """
        if sum(send_counts) != rows.shape[0] or len(send_counts) != self.size \
                or len(recv_counts) != self.size:
            raise ValueError(f"all_to_all: {rows.shape[0]} rows, send counts {list(send_counts)}, "
                             f"receive counts {list(recv_counts)}; each needs one count per "
                             f"rank ({self.size}) and the send counts must sum to the rows")
        pg = self._backend()
        if pg is None:
            return rows.clone()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        pg.alltoall_base(out, rows.contiguous(), list(recv_counts), list(send_counts),
                         dist.AllToAllOptions()).wait()
        return out

    def barrier(self) -> None:
        pg = self._backend()
        if pg is not None:
            pg.barrier().wait()

    def destroy(self, *, barrier: bool = True) -> None:
        """Leave the group: a last barrier (so that no peer still talks to this rank; skip it
        when a peer may be gone), then shut the process group down.

        Safe to call twice; afterwards the collectives of a multi-rank group raise.
        """
        if self._pg is None:
            return
        pg, self._pg = self._pg, None
        try:
            if barrier:
                pg.barrier().wait()
        finally:
            pg.shutdown()
            self._store = None

    def _backend(self) -> dist.ProcessGroupGloo | None:
        if self._pg is None and self.size > 1:
            raise RuntimeError(f"tp rank {self.rank} of {self.size}: the group was destroyed")
        return self._pg

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.destroy(barrier=exc_type is None)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


# ---- starting ranks (tests, benchmarks) ------------------------------------------------------


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` only, for rank 0's rendezvous store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 120.0,
              group_timeout_s: float = 30.0) -> list[Any]:
    """Run `fn(group, *args)` on `size` new processes joined into one `TPGroup`.

    `fn` must be importable by name (a module-level function) and return something JSON can
    encode; its results come back in rank order (JSON bytes through a pipe: numbers, strings,
    lists, dicts). Each process gets `cpu_count // size` torch threads. Raises `RankFailed` with
    the rank's traceback if one raises, exits early or is not done within `timeout_s` (the other
    ranks are then terminated).
    """
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = max(1, (os.cpu_count() or 1) // size)
    procs, receivers, done = [], {}, False
    try:
        for rank in range(size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, daemon=True, name=f"tp-rank-{rank}", args=(
                fn, args, init_method, rank, size, group_timeout_s, threads, send))
            proc.start()
            send.close()
            procs.append(proc)
            receivers[recv] = rank
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while receivers:
            ready = wait(list(receivers), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(receivers.values())
                raise RankFailed(f"ranks {late} of {size} not done within {timeout_s:g} s")
            errors = []
            for recv in sorted(ready, key=receivers.get):
                rank = receivers.pop(recv)
                try:
                    reply = json.loads(recv.recv_bytes())
                except EOFError:
                    errors.append(f"rank {rank} of {size} exited without a result")
                    continue
                if "error" in reply:
                    errors.append(f"rank {rank} of {size} raised:\n{reply['error']}")
                else:
                    results[rank] = reply["result"]
            if errors:
                raise RankFailed("\n".join(errors))
        done = True
        return [results[rank] for rank in range(size)]
    finally:
        for proc in procs:  # after a failure the others may wait in a collective: stop them
            proc.join(timeout=10 if done else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _rank_main(fn: Callable[..., Any], args: tuple, init_method: str, rank: int, size: int,
               timeout_s: float, threads: int, send: Connection) -> None:
    torch.set_num_threads(threads)
    group, ok = None, False
    try:
        group = TPGroup.join(init_method, rank, size, timeout_s=timeout_s)
        reply, ok = {"result": fn(group, *args)}, True
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        reply = {"error": traceback.format_exc()}
    try:  # reply before leaving the group, so that a failure is reported before its echoes
        payload = json.dumps(reply).encode()
    except (TypeError, ValueError):
        payload, ok = json.dumps({"error": traceback.format_exc()}).encode(), False
    send.send_bytes(payload)
    send.close()
    if group is not None:
        group.destroy(barrier=ok)
