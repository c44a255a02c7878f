"""Terminal tables that fit the terminal: no cell is ever cut to `…`.

Each column has a priority (0: always shown). The widths are laid out here, not left to Rich:
every column gets the width of its widest cell (headers fold between words); when the table
does not fit, the columns of the largest priority number are dropped first, and the note under
the table names them (`--wide` shows every column). Columns marked `wrap` (free text) fold
their cells between words instead. Labels longer than `LABEL_CHARS` are replaced by short names
(`p0`, `p1`...) with a legend under the table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

LABEL_CHARS = 20  # longer row labels are replaced by short names and a legend
_UNLIMITED = 10_000


@dataclass(frozen=True)
class Column:
    header: str
    priority: int = 0  # 0: never dropped; the largest numbers are dropped first
    justify: str = "right"
    wrap: bool = False  # free text: cells fold between words rather than widen the column


def _words_len(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=0)


def _widths(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """(narrowest, natural) content width of each column."""
    out = []
    for i, col in enumerate(columns):
        cells = [row[i] for row in rows]
        natural = max([cell_len(col.header)] + [cell_len(c) for c in cells])
        if col.wrap:
            narrowest = max([_words_len(col.header)] + [_words_len(c) for c in cells])
        else:
            narrowest = max([_words_len(col.header)] + [cell_len(c) for c in cells])
        out.append((narrowest, natural))
    return out


def _table_width(widths: Sequence[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1  # one space each side of a cell, the rules


def layout(columns: Sequence[Column], rows: Sequence[Sequence[str]],
           width: int | None) -> tuple[list[int], list[int]]:
    """The indices of the columns shown and their content widths, for a table at most `width`
    characters wide (None: no limit, every column at its natural width)."""
    sizes = _widths(columns, rows)
    if width is None:
        return list(range(len(columns))), [natural for _, natural in sizes]
    shown = list(range(len(columns)))
    while _table_width([sizes[i][0] for i in shown]) > width:
        droppable = [i for i in shown if columns[i].priority > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].priority, i)))
    widths = {i: sizes[i][0] for i in shown}
    spare = width - _table_width(list(widths.values()))
    # Spare room unfolds the headers needing the least of it first, so that most unfold.
    for i in sorted(shown, key=lambda i: (sizes[i][1] - widths[i], i)):
        grow = max(0, min(spare, sizes[i][1] - widths[i]))
        widths[i] += grow
        spare -= grow
    return shown, [widths[i] for i in shown]


def short_labels(labels: Sequence[str], prefix: str) -> tuple[list[str], list[tuple[str, str]]]:
    """`labels` as they are when all are short, else `prefix0`, `prefix1`... and the legend
    pairs (short name, label)."""
    labels = [str(label) for label in labels]
    if all(cell_len(label) <= LABEL_CHARS for label in labels):
        return labels, []
    names = [f"{prefix}{i}" for i in range(len(labels))]
    return names, list(zip(names, labels))


def counted(n: int, noun: str) -> str:
    """"1 GPU", "8 GPUs"."""
    return f"{n} {noun}{'s' * (n != 1)}"


def shows_prefix_hits(summary) -> bool:
    """Whether a table of run summaries has a prefix-hit column: some run took prompt tokens
    from a prefix cache (`prefix_hit_rate` > 0; without a cache it is 0 everywhere)."""
    return "prefix_hit_rate" in summary and bool((summary["prefix_hit_rate"].fillna(0) > 0).any())


def target_width(console: Console, wide: bool) -> int | None:
    """The width tables are laid out for: the terminal's (or $COLUMNS); None (every column)
    with `wide`, or when the output is piped with no $COLUMNS."""
    if wide or not (console.is_terminal or os.environ.get("COLUMNS", "").isdigit()):
        return None
    return console.width


def print_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
                title: str | None = None, caption: str | None = None, wide: bool = False,
                legend: Sequence[tuple[str, str]] = ()) -> None:
    """Print a table laid out by `layout` for the console's width, then which columns did not
    fit, then the legend of short labels."""
    rows = [[str(c) for c in row] for row in rows]
    width = target_width(console, wide)
    shown, widths = layout(columns, rows, width)
    table = Table(title=title, caption=caption)
    for i, w in zip(shown, widths):
        col = columns[i]
        # Never no_wrap: headers fold between words; a cell is as wide as the column unless
        # the column wraps.
        table.add_column(col.header, justify=col.justify, width=w, overflow="fold")
    for row in rows:  # Text: a label such as "rates=[0.8, 0.6]" is not markup
        table.add_row(*(Text(row[i]) for i in shown))
    if width is None:  # as wide as the table, whatever the terminal's width
        Console(width=_UNLIMITED, file=console.file, force_terminal=console.is_terminal).print(
            table, width=_table_width(widths))
    else:
        console.print(table)
    hidden = [columns[i].header for i in range(len(columns)) if i not in shown]
    if hidden:
        console.print(f"not shown at {width} columns: {', '.join(hidden)} (--wide shows them)",
                      highlight=False, markup=False)
    for name, label in legend:
        console.print(f"{name}: {label}", highlight=False, markup=False, soft_wrap=True)
