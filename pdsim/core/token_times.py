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
    __slots__ = ("_parts", "_len", "_offsets", "_all_steps")

    def __init__(self, values: Iterable[float] | None = None):
        self._parts: list[float | np.ndarray] = []
        self._len = 0
        # Per part: where an array part starts in its base array when it is a view of step
        # times (`extend_steps`), -1 for a single time. Metrics read gaps shared by requests
        # through these offsets; NumPy's own way to them (the data address) costs ~1 us a part.
        # A tuple of ints, which the collector stops tracking (a list it would scan each pass).
        self._offsets: tuple[int, ...] = ()
        self._all_steps = True  # every array part came from `extend_steps`
        if values is not None:
            self.extend(values)

    def append(self, t: float) -> None:
        self._parts.append(float(t))
        self._offsets += (-1,)
        self._len += 1

    def extend(self, values: Iterable[float]) -> None:
        """Append times; a NumPy array is kept as it is (not copied: it must not change)."""
        if isinstance(values, np.ndarray):
            if len(values):
                self._parts.append(values)
                self._offsets += (-1,)
                self._len += len(values)
                self._all_steps = False
            return
        for t in values:
            self.append(t)

    def extend_steps(self, view: np.ndarray, offset: int) -> None:
        """Append a non-empty view of a 1-D, contiguous float64 array of step end times that
        starts at index `offset` of that array (`view.base`); kept as it is."""
        self._parts.append(view)
        self._offsets += (offset,)
        self._len += len(view)

    def __len__(self) -> int:
        return self._len

    def parts(self) -> list[float | np.ndarray]:
        """The single times and arrays the times are made of, in order (do not modify)."""
        return self._parts

    def step_offsets(self) -> tuple[int, ...] | None:
        """Per part of `parts()`, the offset of a step-time view in its base array (-1 for a
        single time); None when some array part is not such a view."""
        return self._offsets if self._all_steps else None

    def __getstate__(self):
        return self._parts, self._len

    def __setstate__(self, state) -> None:
        # A pickled view comes back as an array of its own: its offset no longer holds.
        self._parts, self._len = state
        self._offsets = (-1,) * len(self._parts)
        self._all_steps = all(isinstance(p, float) for p in self._parts)

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
