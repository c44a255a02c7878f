"""A request's token emission times, kept compact: single times plus runs of decode-step end
times that are views of the running batch's step-time store (`RunningBatch`).

A decode run of n steps adds one NumPy view (about a hundred bytes) instead of n Python floats,
so a simulation of 100,000 requests of 256 tokens keeps tens of MB of token times, not a GB.
The simulator gives its requests a `TokenTimes`; the real backend keeps plain lists (they go
to JSON), and the core accepts both. It reads as a sequence of floats and compares equal to a
list of the same floats; metrics read it whole with `copy_into`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np


class TokenTimes(Sequence):
    __slots__ = ("_parts", "_len")

    def __init__(self, values: Iterable[float] | None = None):
        self._parts: list[float | np.ndarray] = []
        self._len = 0
        if values is not None:
            self.extend(values)

    def append(self, t: float) -> None:
        self._parts.append(float(t))
        self._len += 1

    def extend(self, values: Iterable[float]) -> None:
        """Append times; a NumPy array is kept as it is (not copied: it must not change)."""
        if isinstance(values, np.ndarray):
            if len(values):
                self._parts.append(values)
                self._len += len(values)
            return
        for t in values:
            self.append(t)

    def __len__(self) -> int:
        return self._len

    def parts(self) -> list[float | np.ndarray]:
        """The single times and arrays the times are made of, in order (do not modify)."""
        return self._parts

    def __iter__(self) -> Iterator[float]:
        for part in self._parts:
            if isinstance(part, float):
                yield part
            else:
                yield from part.tolist()

    def __getitem__(self, index):
        if index == 0 and self._parts and isinstance(self._parts[0], float):
            return self._parts[0]  # the first token's time: every record asks for it
        if isinstance(index, slice):
            return self.as_array()[index].tolist()
        n = self._len
        if not -n <= index < n:
            raise IndexError(f"token time index {index} out of range for {n} tokens")
        if index < 0:
            index += n
        for part in self._parts:
            size = 1 if isinstance(part, float) else len(part)
            if index < size:
                return part if isinstance(part, float) else float(part[index])
            index -= size
        raise AssertionError("unreachable: lengths disagree")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenTimes, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenTimes({list(self)!r})"

    def copy_into(self, out: np.ndarray, pos: int) -> int:
        """Write the times into `out` from `pos`; return the position after them."""
        for part in self._parts:
            if isinstance(part, float):
                out[pos] = part
                pos += 1
            else:
                out[pos : pos + len(part)] = part
                pos += len(part)
        return pos

    def as_array(self) -> np.ndarray:
        out = np.empty(self._len)
        self.copy_into(out, 0)
        return out


def flatten_times(seqs: Sequence[Sequence[float]], total: int) -> np.ndarray:
    """Every sequence's times one after the other (`total` in all); lists and `TokenTimes`."""
    out = np.empty(total)
    pos = 0
    for times in seqs:
        if isinstance(times, TokenTimes):
            pos = times.copy_into(out, pos)
        else:
            n = len(times)
            out[pos : pos + n] = times
            pos += n
    return out
