"""Progress on stderr: bars with an ETA for sweeps, spinners naming the phase of a long silent
stretch (the plan's pre-filter, `serve` waiting for its workers, `calibrate`, `validate`).

On a terminal rich draws and redraws them; elsewhere (a CI log, a pipe) the bars stay quiet and
each phase prints one line when it starts, so a log still says what was running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def _stderr() -> Console:
    return Console(stderr=True)


class Bar:
    """One task's bar: `advance()` after each item; `total(n)` when fewer than planned ran."""

    def __init__(self, progress: Progress | None, task: int | None) -> None:
        self._progress, self._task = progress, task

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def total(self, n: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=n)


@contextmanager
def progress_bar(description: str, total: int, show: bool = True) -> Iterator[Bar]:
    """A bar reading `description`, done/total, the time elapsed and the time left (ETA). Not on
    a terminal: one line naming the task and its size."""
    console = _stderr()
    if not show:
        yield Bar(None, None)
    elif not console.is_terminal:
        console.print(f"{description} ({total})...", markup=False, highlight=False,
                      soft_wrap=True)
        yield Bar(None, None)
    else:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            yield Bar(progress, progress.add_task(description, total=total))


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
