"""Where sweep points and plan candidates run: this machine's processes, or a Ray cluster.

Both behind one small pool interface: `submit(fn, *args)` returns a `concurrent.futures.Future`
(so `wait` and `as_completed` work on either) and `workers` says how many tasks are worth
keeping in flight. Every task is a whole simulation whose seeds are in its config, so where it
runs cannot change its result.

    with open_pool("ray", jobs=None, ray_address="auto", tasks=len(points)) as pool:
        for result in pool.imap_unordered(run_point, args): ...
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any

from pdsim.config import ConfigError

EXECUTORS = ("local", "ray")
RAY_MISSING = "--executor ray needs Ray: pip install 'pdsim[ray]'"


class Pool:
    workers: int

    def submit(self, fn: Callable, /, *args: Any) -> Future:
        raise NotImplementedError

    def imap_unordered(self, fn: Callable, arg_tuples: Iterable[tuple]) -> Iterator:
        """fn(*args) for every tuple, results as they finish; a task's exception is raised."""
        for fut in as_completed([self.submit(fn, *a) for a in arg_tuples]):
            yield fut.result()


class InlinePool(Pool):
    """One worker: each task runs in this process when submitted (no pickling, live progress)."""

    workers = 1

    def submit(self, fn: Callable, /, *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 (handed to the caller through the future)
            fut.set_exception(exc)
        return fut

    def imap_unordered(self, fn: Callable, arg_tuples: Iterable[tuple]) -> Iterator:
        for a in arg_tuples:
            yield fn(*a)


class ProcessPool(Pool):
    """This machine's cores: a process pool of `workers` processes."""

    def __init__(self, pool: ProcessPoolExecutor, workers: int):
        self._pool, self.workers = pool, workers

    def submit(self, fn: Callable, /, *args: Any) -> Future:
        return self._pool.submit(fn, *args)


class RayPool(Pool):
    """A Ray cluster: each task a Ray task of one CPU; `workers` is the cluster's CPU count
    unless `jobs` caps it."""

    def __init__(self, ray, workers: int):
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_call)
        self.workers = workers

    def submit(self, fn: Callable, /, *args: Any) -> Future:
        return self._remote.remote(fn, args).future()


def _call(fn: Callable, args: tuple) -> Any:
    return fn(*args)


def _workers(jobs: int | None, available: int, tasks: int | None) -> int:
    n = jobs or available
    return max(1, n if tasks is None else min(n, tasks))


@contextmanager
def open_pool(executor: str = "local", jobs: int | None = None, ray_address: str | None = None,
              tasks: int | None = None) -> Iterator[Pool]:
    """A pool for `tasks` tasks (None: unknown) on `executor`. `jobs`: tasks in flight at most
    (default: this machine's CPUs, or the Ray cluster's). `ray_address`: an existing cluster
    (`auto`, `ray://host:10001`, `host:6379`); default: a new local Ray instance (`jobs` CPUs)
    shut down on exit. A Ray already initialised in this process is used and left running."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor: {executor!r}; allowed: {', '.join(EXECUTORS)}")
    if ray_address is not None and executor != "ray":
        raise ConfigError(f"ray_address {ray_address!r} given with executor {executor!r}; "
                          "it needs executor 'ray'")
    if jobs is not None and jobs < 1:
        raise ConfigError(f"jobs: {jobs}; allowed: an integer >= 1")
    if executor == "local":
        workers = _workers(jobs, os.cpu_count() or 1, tasks)
        if workers == 1:
            yield InlinePool()
            return
        # The workers are forked: garbage left in this process (say a native transfer engine
        # in a reference cycle) would otherwise be collected in a child, whose copy of that
        # object's locks may be held by threads that stayed here (a deadlock). Collect it here.
        gc.collect()
        with ProcessPoolExecutor(max_workers=workers) as pool:
            try:
                yield ProcessPool(pool, workers)
            except BaseException:  # a task failed (or Ctrl-C): start none of those queued
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return
    with _ray_session(jobs, ray_address) as ray:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        yield RayPool(ray, _workers(jobs, cpus, tasks))


@contextmanager
def _ray_session(jobs: int | None, address: str | None):
    """Ray, initialised for the pool's lifetime unless this process already was."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    if ray.is_initialized():
        yield ray
        return
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None and jobs is not None and not os.environ.get("RAY_ADDRESS"):
        options["num_cpus"] = jobs  # only a new local instance takes a CPU count
    try:
        ray.init(address=address, **options)
    except ConnectionError as exc:
        raise ConfigError(f"ray_address {address!r}: cannot connect: {exc}") from None
    try:
        yield ray
    finally:
        ray.shutdown()
