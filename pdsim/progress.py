"""Progress on stderr: bars with an ETA for sweeps, spinners naming the phase of a long silent
stretch (the plan's pre-filter, `serve` waiting for its workers, `calibrate`, `validate`).

On a terminal rich draws and redraws them; elsewhere (a CI log, a pipe) the bars stay quiet and
each phase prints one line when it starts, so a log still says what was running.

A bar also moves within the points in flight, by the share of each one's requests finished:
the simulation reports it through its `stop` check (`RequestShare`), from this process or, in a
process pool, through a multiprocessing manager (`point_shares`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing import Manager
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def _stderr() -> Console:
    return Console(stderr=True)


class Bar:
    """One task's bar: `advance()` after each item, `within(share)` for the items in flight (the
    share of each done, summed); `total(n)` when fewer than planned will run; `note(text)`: a
    line, above the bar on a terminal."""

    def __init__(self, progress: Progress | None, task: int | None,
                 console: Console | None = None) -> None:
        self._progress, self._task, self._console = progress, task, console
        self._done, self._shown = 0, 0.0

    @property
    def live(self) -> bool:
        """Whether a bar is drawn (on a terminal, shown)."""
        return self._progress is not None

    def advance(self) -> None:
        self._done += 1
        self.within(0.0)

    def within(self, share: float) -> None:
        # Never back: an item's share leaves the sum in flight as it counts as done, and the
        # shares of the others can come a moment later.
        self._shown = max(self._shown, self._done + share)
        if self._progress is not None:
            self._progress.update(self._task, completed=self._shown)

    def total(self, n: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=n)

    def note(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False)


@contextmanager
def progress_bar(description: str, total: int, show: bool = True,
                 size: str | None = None) -> Iterator[Bar]:
    """A bar reading `description`, done/total, the time elapsed and the time left (ETA). Not on
    a terminal: one line naming the task and its size (`size`, default the total)."""
    console = _stderr()
    if not show:
        yield Bar(None, None)
    elif not console.is_terminal:
        console.print(f"{description} ({size or total})...", markup=False, highlight=False,
                      soft_wrap=True)
        yield Bar(None, None, console)
    else:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            yield Bar(progress, progress.add_task(description, total=total), progress.console)


# A simulation reports its share done at most this often (wall time).
REPORT_S = 0.25


class RequestShare:
    """A simulation's `stop` check (pdsim.sim.cluster.simulate calls it with each finished
    request, `sent` with each routed one) that reports the share of the run's `total` requests
    finished to `report`, at most every REPORT_S, and leaves whether to stop to `check` (none:
    never)."""

    def __init__(self, report: Callable[[float], None], total: int,
                 check: Callable[[Any], str] | None = None) -> None:
        self._report, self._total, self._check = report, max(total, 1), check
        self._check_sent = getattr(check, "sent", None)
        self._finished, self._next_s = 0, 0.0

    def sent(self, req: Any) -> str:
        return "" if self._check_sent is None else self._check_sent(req)

    def __call__(self, req: Any) -> str:
        self._finished += 1
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + REPORT_S
            self._report(self._finished / self._total)
        return "" if self._check is None else self._check(req)


def share_stop(report: Callable[[float], None], make_check: Callable | None,
               workload: Any) -> RequestShare:
    """A `stop` factory for pdsim.runner.run_point (bind `report` and `make_check`, the run's
    own `stop` factory or None, with functools.partial): a RequestShare over the workload."""
    check = None if make_check is None else make_check(workload)
    return RequestShare(report, len(workload.input_tokens), check)


class _Shares:
    """Where the points in flight report their share done (`reporter(key)`, a picklable
    function of the share) and the bar reads them (`refresh(keys)`, the keys in flight)."""

    def __init__(self, bar: Bar, shared: Any = None) -> None:
        self._bar, self._shared = bar, shared

    def reporter(self, key: Any) -> Callable[[float], None]:
        if self._shared is None:  # run here, one at a time: the bar takes it as it comes
            return self._bar.within
        return partial(_store, self._shared, key)

    def refresh(self, keys: Any) -> None:
        if self._shared is not None:
            shares = self._shared.copy()
            self._bar.within(sum(shares.get(k, 0.0) for k in keys))


def _store(shared: Any, key: Any, share: float) -> None:
    shared[key] = share


@contextmanager
def point_shares(bar: Bar, pool: Any) -> Iterator[_Shares | None]:
    """How the points `pool` runs report their share done to `bar`: directly where it runs them
    here (an inline pool), through a multiprocessing manager's dict for a process pool (its
    proxy pickles into their tasks). None where no bar is drawn or on Ray (its workers may be
    other machines, which the manager does not reach)."""
    from pdsim.pools import InlinePool, ProcessPool

    if not bar.live or not isinstance(pool, (InlinePool, ProcessPool)):
        yield None
    elif isinstance(pool, InlinePool):
        yield _Shares(bar)
    else:
        with Manager() as manager:
            yield _Shares(bar, manager.dict())


@contextmanager
def phase(name: str, show: bool = True) -> Iterator[Callable[[str], None]]:
    """A spinner reading `name` while the block runs; yields a function that replaces its text
    (what it is waiting for now). Not on a terminal: `name` printed once, updates dropped."""
    console = _stderr()
    if not show:
        yield lambda text: None
    elif not console.is_terminal:
        console.print(f"{name}...", markup=False, highlight=False, soft_wrap=True)
        yield lambda text: None
    else:
        with console.status(name) as status:
            yield lambda text: status.update(text)
