"""Latency between and beyond measured grid points.

Inside a table's grid, latency is interpolated linearly in log(size) → log(latency): exact at
grid points, monotone between two of them, and right for the power laws kernels follow (flat at
a launch floor, then linear in size). Outside the grid, the nearest measured point is scaled by
the ratio of a roofline estimate at the asked size to the roofline at that point, and the
lookup counts as extrapolated.

`Curve` is one op over one size (tokens); `Stage` sums the curves a step looks up at the same
size, precomputed densely so that a lookup is a list index; `Grid2` is one op over two sizes
(batch, sequence) with bilinear interpolation.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np

DENSE_MAX = 65536  # integer sizes up to this are looked up in a precomputed array


def log_interp(x: float, lxs: Sequence[float], lys: Sequence[float]) -> float:
    """exp of the piecewise-linear interpolation of (log x → log y) at x, inside [xs0, xs-1]."""
    lx = math.log(x)
    i = bisect_right(lxs, lx) - 1
    if i >= len(lxs) - 1:
        return math.exp(lys[-1])
    if i < 0:
        return math.exp(lys[0])
    w = (lx - lxs[i]) / (lxs[i + 1] - lxs[i])
    return math.exp(lys[i] + w * (lys[i + 1] - lys[i]))


class Curve:
    """Seconds of one op versus one size `x` (tokens, usually), from measured points.

    xs, ys_s: the measured sizes (ascending, > 0) and seconds. roofline: seconds the analytic
    model gives at any size, used only to scale a measured point beyond the grid.
    static_extrapolated: the op's other dimensions (shape, dtype, GPU count) are not in the table,
    so every lookup rests on a roofline scaling and counts as extrapolated.
    """

    __slots__ = ("lo", "hi", "static_extrapolated", "_lxs", "_lys", "_roofline")

    def __init__(self, xs: Sequence[float], ys_s: Sequence[float],
                 roofline: Callable[[float], float], static_extrapolated: bool = False) -> None:
        xs_a, ys_a = np.asarray(xs, dtype=float), np.asarray(ys_s, dtype=float)
        if len(xs_a) == 0 or np.any(np.diff(xs_a) <= 0) or np.any(xs_a <= 0) or np.any(ys_a <= 0):
            raise ValueError("a curve needs ascending positive sizes and positive latencies")
        self.lo, self.hi = float(xs_a[0]), float(xs_a[-1])
        self.static_extrapolated = static_extrapolated
        self._lxs, self._lys = np.log(xs_a).tolist(), np.log(ys_a).tolist()
        self._roofline = roofline

    @property
    def grid(self) -> np.ndarray:
        """The measured sizes."""
        return np.exp(self._lxs)

    @property
    def roofline(self) -> Callable[[float], float]:
        return self._roofline

    def _compute(self, x: float) -> float:
        if x < self.lo:
            return math.exp(self._lys[0]) * self._roofline(x) / self._roofline(self.lo)
        if x > self.hi:
            return math.exp(self._lys[-1]) * self._roofline(x) / self._roofline(self.hi)
        return log_interp(x, self._lxs, self._lys)

    def __call__(self, x: float) -> float:
        """Seconds at size x (0 → 0)."""
        return self._compute(x) if x > 0 else 0.0

    def extrapolated(self, x: float) -> bool:
        return self.static_extrapolated or x < self.lo or x > self.hi

    def values(self, xs: np.ndarray) -> np.ndarray:
        """Seconds at each of `xs` (> 0), vectorised; the roofline must accept arrays."""
        xs = np.asarray(xs, dtype=float)
        out = np.exp(np.interp(np.log(xs), self._lxs, self._lys))
        for mask, edge, ly in ((xs < self.lo, self.lo, self._lys[0]),
                               (xs > self.hi, self.hi, self._lys[-1])):
            if mask.any():
                out[mask] = math.exp(ly) * self._roofline(xs[mask]) / self._roofline(edge)
        return out

    def times(self, k: float) -> Curve:
        """This curve times a constant (k copies of the op run back to back)."""
        return Curve(np.exp(self._lxs), np.exp(self._lys) * k,
                     lambda x, r=self._roofline: r(x) * k, self.static_extrapolated)

    def scaled(self, factor: Callable[[float], float]) -> Curve:
        """This curve times `factor(x)` at each grid point, as a statically extrapolated curve
        (how a measured op stands in for one the table lacks)."""
        xs = np.exp(self._lxs)
        ys = np.exp(self._lys) * factor(xs)
        roofline = self._roofline
        return Curve(xs, ys, lambda x: roofline(x) * factor(x), static_extrapolated=True)


class Stage:
    """Several curves over the same size, summed: one list index per lookup.

    `seconds[x]` and `extrapolated[x]` (how many of the parts are extrapolated at x) are
    precomputed for x <= DENSE_MAX; beyond, the parts are evaluated one by one.
    """

    __slots__ = ("parts", "size", "seconds", "extrapolated", "_n")

    def __init__(self, parts: Sequence[Curve]) -> None:
        self.parts = tuple(parts)
        self.size = len(self.parts)  # lookups one evaluation makes
        self._n = DENSE_MAX if self.parts else 0
        xs = np.arange(1, self._n + 1, dtype=float)
        total = np.zeros(self._n + 1)
        ext = np.zeros(self._n + 1, dtype=np.int64)
        for c in self.parts:
            total[1:] += c.values(xs)
            ext[1:] += c.static_extrapolated | (xs < c.lo) | (xs > c.hi)
        self.seconds = array("d", total.tolist())
        self.extrapolated = array("B", ext.tolist())  # parts per stage stay far below 256

    def at(self, x: int) -> tuple[float, int]:
        """(seconds, extrapolated parts) at size x; x <= 0 costs nothing."""
        if x <= 0:
            return 0.0, 0
        if x <= self._n:
            return self.seconds[x], self.extrapolated[x]
        return sum(c(x) for c in self.parts), sum(c.extrapolated(x) for c in self.parts)


class Grid2:
    """Seconds of one op versus two sizes (batch, sequence), from a measured grid.

    `zs_s[i][j]` is the time at (xs1[i], xs2[j]); NaN where the table has no measurement. A
    missing cell is filled from the nearest measured batch of its column (same sequence) scaled
    by the roofline, and marked: a lookup that gives a filled point weight, or leaves the grid,
    counts as extrapolated.
    """

    __slots__ = ("static_extrapolated", "_l1", "_l2", "_lz", "_filled", "_near_filled",
                 "_roofline", "_lo1", "_hi1", "_lo2", "_hi2")

    def __init__(self, xs1: Sequence[float], xs2: Sequence[float], zs_s: np.ndarray,
                 roofline: Callable[[float, float], float],
                 static_extrapolated: bool = False) -> None:
        z = np.array(zs_s, dtype=float)
        filled = np.isnan(z)
        for j, x2 in enumerate(xs2):
            measured = np.flatnonzero(~np.isnan(z[:, j]))
            if len(measured) == 0:
                raise ValueError(f"no measurement at sequence {x2}")
            for i in np.flatnonzero(np.isnan(z[:, j])):
                k = measured[np.argmin(np.abs(measured - i))]
                z[i, j] = z[k, j] * roofline(xs1[i], x2) / roofline(xs1[k], x2)
        l1, l2 = np.log(xs1), np.log(xs2)
        if len(l1) == 1:  # one measured batch (or sequence): a flat second row keeps the maths
            l1, z, filled = np.append(l1, l1[0] + 1.0), np.vstack([z, z]), np.vstack([filled] * 2)
        if len(l2) == 1:
            l2, z = np.append(l2, l2[0] + 1.0), np.hstack([z, z])
            filled = np.hstack([filled, filled])
        self._l1, self._l2 = l1.tolist(), l2.tolist()
        self._lz = np.log(z).tolist()
        self._filled = filled.tolist()
        # cells (i, j) with an unmeasured corner: the only ones where the flags need a look
        near = filled[:-1, :-1] | filled[1:, :-1] | filled[:-1, 1:] | filled[1:, 1:]
        self._near_filled = near.tolist()
        self._roofline = roofline
        self._lo1, self._hi1 = float(xs1[0]), float(xs1[-1])
        self._lo2, self._hi2 = float(xs2[0]), float(xs2[-1])
        self.static_extrapolated = static_extrapolated

    def at(self, x1: float, x2: float) -> tuple[float, bool]:
        """(seconds, whether the answer is extrapolated) at (x1, x2)."""
        c1 = self._lo1 if x1 < self._lo1 else self._hi1 if x1 > self._hi1 else x1
        c2 = self._lo2 if x2 < self._lo2 else self._hi2 if x2 > self._hi2 else x2
        l1, l2 = self._l1, self._l2
        g1, g2 = math.log(c1), math.log(c2)
        i = bisect_right(l1, g1) - 1
        if i > len(l1) - 2:
            i = len(l1) - 2
        j = bisect_right(l2, g2) - 1
        if j > len(l2) - 2:
            j = len(l2) - 2
        w1 = (g1 - l1[i]) / (l1[i + 1] - l1[i])
        w2 = (g2 - l2[j]) / (l2[j + 1] - l2[j])
        row, nxt = self._lz[i], self._lz[i + 1]
        z = ((1 - w1) * ((1 - w2) * row[j] + w2 * row[j + 1])
             + w1 * ((1 - w2) * nxt[j] + w2 * nxt[j + 1]))
        seconds = math.exp(z)
        extra = self.static_extrapolated
        if not extra and self._near_filled[i][j]:
            f, g = self._filled[i], self._filled[i + 1]
            extra = ((f[j] and w1 < 1 and w2 < 1) or (f[j + 1] and w1 < 1 and w2 > 0)
                     or (g[j] and w1 > 0 and w2 < 1) or (g[j + 1] and w1 > 0 and w2 > 0))
        if c1 != x1 or c2 != x2:
            seconds *= self._roofline(x1, x2) / self._roofline(c1, c2)
            extra = True
        return seconds, bool(extra)
