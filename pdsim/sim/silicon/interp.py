"""Latency between and beyond measured grid points.

Inside a table's grid, log(latency) is interpolated over log(size) with a monotone cubic
(PCHIP, Fritsch-Carlson slopes): exact at grid points, monotone between two of them, and
following the bend from a kernel's launch floor into its power-law growth, which a straight
line between doubled sizes cuts (benchmarks/fidelity_components.py measures both). Outside the
grid, the nearest measured point is scaled by the ratio of a roofline estimate at the asked
size to the roofline at that point, and the lookup counts as extrapolated. A curve moved from a
measured shape, dtype or GPU count to one the table lacks (by the ratio of the two shapes'
rooflines, `Curve.scaled`) is transferred: its lookups inside the grid count as transferred.

A curve may interpolate relative to a reference (measured / reference, multiplied back) so that
steps the reference carries survive between grid points; `best_reference` picks one among
candidates by hiding each measured point in turn (`leave_one_out`).

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


REFINE = 8  # a 2-D grid gets this many sub-intervals per measured interval, by PCHIP


def _inner_slopes(h0: np.ndarray, h1: np.ndarray, m0: np.ndarray, m1: np.ndarray
                  ) -> np.ndarray:
    """Fritsch-Carlson slope at a point between intervals of widths h0, h1 and secants m0, m1:
    zero where the data turns, a weighted harmonic mean of the two secants elsewhere."""
    w1, w2 = 2 * h1 + h0, h1 + 2 * h0
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(m0 * m1 > 0, (w1 + w2) / (w1 / m0 + w2 / m1), 0.0)


def _end_slopes(h0: np.ndarray, h1: np.ndarray, m0: np.ndarray, m1: np.ndarray) -> np.ndarray:
    """Slope at an end point whose interval has width h0 and secant m0 (h1, m1: the next one
    in): the three-point estimate, kept to the secant's sign and to 3x it where the data turns."""
    slope = ((2 * h0 + h1) * m0 - h0 * m1) / (h0 + h1)
    slope = np.where(np.sign(slope) != np.sign(m0), 0.0, slope)
    return np.where((np.sign(m0) != np.sign(m1)) & (np.abs(slope) > 3 * np.abs(m0)),
                    3 * m0, slope)


def pchip_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fritsch-Carlson slopes at each point, so that each cubic piece stays monotone."""
    h = np.diff(x)
    m = np.diff(y) / h
    if len(x) == 2:
        return np.array([m[0], m[0]])
    d = np.zeros_like(y)
    d[1:-1] = _inner_slopes(h[:-1], h[1:], m[:-1], m[1:])
    d[0] = _end_slopes(h[0], h[1], m[0], m[1])
    d[-1] = _end_slopes(h[-1], h[-2], m[-1], m[-2])
    return d


def leave_one_out(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """For each interior point i, the monotone cubic through all the other points, at x[i]
    (vectorised: the same slopes `pchip_slopes` gives the data without point i)."""
    n = len(x)
    a = np.arange(n - 2)  # the neighbours a = i - 1 and b = i + 1 of each hidden point
    b = a + 2
    h = x[b] - x[a]
    m = (y[b] - y[a]) / h
    left, right = a >= 1, b <= n - 2  # whether a point lies beyond each neighbour
    hl = np.where(left, x[a] - x[np.maximum(a - 1, 0)], 1.0)
    ml = np.where(left, (y[a] - y[np.maximum(a - 1, 0)]) / hl, m)
    hr = np.where(right, x[np.minimum(b + 1, n - 1)] - x[b], 1.0)
    mr = np.where(right, (y[np.minimum(b + 1, n - 1)] - y[b]) / hr, m)
    da = np.where(left, _inner_slopes(hl, h, ml, m),
                  np.where(right, _end_slopes(h, hr, m, mr), m))
    db = np.where(right, _inner_slopes(h, hr, m, mr),
                  np.where(left, _end_slopes(h, hl, m, ml), m))
    t = (x[1:-1] - x[a]) / h
    t2, t3 = t * t, t * t * t
    return ((2 * t3 - 3 * t2 + 1) * y[a] + (t3 - 2 * t2 + t) * h * da
            + (3 * t2 - 2 * t3) * y[b] + (t3 - t2) * h * db)


def pchip(x: np.ndarray, y: np.ndarray, d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The monotone cubic through (x, y) with slopes d, at q (clamped into [x0, x-1]). `y` and
    `d` may hold one curve per column (shape (len(x), m)): the result is then (len(q), m)."""
    q = np.clip(np.asarray(q, dtype=float), x[0], x[-1])
    k = np.clip(np.searchsorted(x, q, side="right") - 1, 0, len(x) - 2)
    h = x[k + 1] - x[k]
    t = (q - x[k]) / h
    if y.ndim == 2:
        h, t = h[:, None], t[:, None]
    t2, t3 = t * t, t * t * t
    return ((2 * t3 - 3 * t2 + 1) * y[k] + (t3 - 2 * t2 + t) * h * d[k]
            + (3 * t2 - 2 * t3) * y[k + 1] + (t3 - t2) * h * d[k + 1])


Reference = Callable[[np.ndarray], np.ndarray]  # seconds-shaped, positive, over sizes


class Curve:
    """Seconds of one op versus one size `x` (tokens, usually), from measured points.

    xs, ys_s: the measured sizes (ascending, > 0) and seconds. roofline: seconds the analytic
    model gives at any size, used only to scale a measured point beyond the grid.
    transferred: the op's other dimensions (shape, dtype, GPU count) are not in the table, so
    every lookup rests on a roofline ratio: counted as transferred (inside the grid) or
    extrapolated (outside it).
    reference: when given, the cubic runs through measured / reference and the result is
    multiplied back, so a step the reference carries (a GEMM's tile quantisation) appears
    between grid points where the cubic alone would smooth it; still exact at grid points.
    """

    __slots__ = ("lo", "hi", "transferred", "_xs", "_lxs", "_lys", "_lrs", "_slopes",
                 "_roofline", "_reference")

    def __init__(self, xs: Sequence[float], ys_s: Sequence[float],
                 roofline: Callable[[float], float], transferred: bool = False,
                 reference: Reference | None = None) -> None:
        xs_a, ys_a = np.asarray(xs, dtype=float), np.asarray(ys_s, dtype=float)
        if len(xs_a) == 0 or np.any(np.diff(xs_a) <= 0) or np.any(xs_a <= 0) or np.any(ys_a <= 0):
            raise ValueError("a curve needs ascending positive sizes and positive latencies")
        self.lo, self.hi = float(xs_a[0]), float(xs_a[-1])
        self.transferred = transferred
        self._xs = xs_a  # as given: exp(log(512)) may round past a tile boundary
        self._lxs, self._lys = np.log(xs_a), np.log(ys_a)
        self._lrs = self._lys if reference is None else self._lys - np.log(reference(xs_a))
        self._slopes = pchip_slopes(self._lxs, self._lrs) if len(xs_a) > 1 else np.zeros(1)
        self._roofline = roofline
        self._reference = reference

    @property
    def grid(self) -> np.ndarray:
        """The measured sizes."""
        return self._xs

    @property
    def roofline(self) -> Callable[[float], float]:
        return self._roofline

    def __call__(self, x: float) -> float:
        """Seconds at size x (0 → 0)."""
        return float(self.values(np.array([x]))[0]) if x > 0 else 0.0

    def extrapolated(self, x: float) -> bool:
        """Whether size x lies outside the measured grid."""
        return x < self.lo or x > self.hi

    def values(self, xs: np.ndarray) -> np.ndarray:
        """Seconds at each of `xs` (> 0), vectorised; the roofline must accept arrays."""
        xs = np.asarray(xs, dtype=float)
        if len(self._lxs) == 1:
            out = np.full(xs.shape, math.exp(self._lys[0]))
        else:
            out = np.exp(pchip(self._lxs, self._lrs, self._slopes, np.log(xs)))
            if self._reference is not None:
                out *= self._reference(xs)
        for mask, edge, ly in ((xs < self.lo, self.lo, self._lys[0]),
                               (xs > self.hi, self.hi, self._lys[-1])):
            if mask.any():
                out[mask] = math.exp(ly) * self._roofline(xs[mask]) / self._roofline(edge)
        return out

    def times(self, k: float) -> Curve:
        """This curve times a constant (k copies of the op run back to back)."""
        return Curve(self._xs, np.exp(self._lys) * k,
                     lambda x, r=self._roofline: r(x) * k, self.transferred, self._reference)

    def scaled(self, factor: Callable[[float], float], transferred: bool = True) -> Curve:
        """This curve times `factor(x)` at each grid point, as a transferred curve (how a
        measured op stands in for one the table lacks: factor is the ratio of the two ops'
        rooflines), or flagged `transferred` as given."""
        roofline = self._roofline
        return self.moved(lambda t, x: t * factor(x), lambda x: roofline(x) * factor(x),
                          transferred)

    def moved(self, move: Callable[[np.ndarray, np.ndarray], np.ndarray],
              roofline: Callable[[float], float], transferred: bool = True) -> Curve:
        """A curve whose grid points are `move(seconds, x)` of this one's, with `roofline`
        beyond them (both vectorised); transferred unless told otherwise."""
        ys = move(np.exp(self._lys), self._xs)
        return Curve(self._xs, ys, roofline, transferred=transferred,
                     reference=self._reference)


def best_reference(xs: np.ndarray, ys_s: np.ndarray,
                   candidates: Sequence[Reference | None]) -> Reference | None:
    """The candidate reference (None: the plain cubic) under which `Curve` predicts the
    measured points best when each interior point is hidden in turn: the smallest mean
    |log(predicted / measured)|, the earliest candidate on a tie. A series too short to hide a
    point in keeps the first candidate."""
    xs = np.asarray(xs, dtype=float)
    lx, ly = np.log(xs), np.log(np.asarray(ys_s, dtype=float))
    if len(lx) < 3:
        return candidates[0]
    best, best_err = candidates[0], math.inf
    for ref in candidates:
        lr = ly if ref is None else ly - np.log(ref(xs))
        err = float(np.mean(np.abs(leave_one_out(lx, lr) - lr[1:-1])))
        if err < best_err - 1e-12:
            best, best_err = ref, err
    return best


class Stage:
    """Several curves over the same size, summed: one list index per lookup.

    `seconds[x]`, `transferred[x]` and `extrapolated[x]` (how many of the parts are transferred
    curves looked up inside their grid, and how many are looked up outside it, at x) are
    precomputed for x <= DENSE_MAX; beyond, the parts are evaluated one by one. `labels`:
    each part's (op name, table it was read from), for `pdsim explain`; ("op", "-") unnamed.
    `shares`: the weight of each part in the sum, 1 by default (a hybrid model's op that only
    some of its layers run counts at their share of the layers).
    """

    __slots__ = ("parts", "labels", "shares", "size", "seconds", "transferred", "extrapolated",
                 "_n")

    def __init__(self, parts: Sequence[Curve],
                 labels: Sequence[tuple[str, str]] | None = None,
                 shares: Sequence[float] | None = None) -> None:
        self.parts = tuple(parts)
        self.labels = tuple(labels) if labels is not None else (("op", "-"),) * len(self.parts)
        self.shares = tuple(shares) if shares is not None else (1.0,) * len(self.parts)
        self.size = len(self.parts)  # lookups one evaluation makes
        self._n = DENSE_MAX if self.parts else 0
        xs = np.arange(1, self._n + 1, dtype=float)
        total = np.zeros(self._n + 1)
        ext = np.zeros(self._n + 1, dtype=np.int64)
        moved = np.zeros(self._n + 1, dtype=np.int64)
        for c, share in zip(self.parts, self.shares):
            total[1:] += share * c.values(xs)
            outside = (xs < c.lo) | (xs > c.hi)
            ext[1:] += outside
            moved[1:] += c.transferred & ~outside
        self.seconds = array("d", total.tolist())
        # parts per stage stay far below 256
        self.transferred = array("B", moved.tolist())
        self.extrapolated = array("B", ext.tolist())

    def at(self, x: int) -> tuple[float, int, int]:
        """(seconds, transferred parts, extrapolated parts) at size x; x <= 0 costs nothing."""
        if x <= 0:
            return 0.0, 0, 0
        if x <= self._n:
            return self.seconds[x], self.transferred[x], self.extrapolated[x]
        outside = [c.extrapolated(x) for c in self.parts]
        return (sum(share * c(x) for c, share in zip(self.parts, self.shares)),
                sum(c.transferred and not o for c, o in zip(self.parts, outside)), sum(outside))


class Grid2:
    """Seconds of one op versus two sizes (batch, sequence), from a measured grid.

    `zs_s[i][j]` is the time at (xs1[i], xs2[j]); NaN where the table has no measurement. A
    missing cell is filled from the nearest measured batch of its column (same sequence) scaled
    by the roofline, and marked: a lookup that gives a filled point weight, or leaves the grid,
    counts as extrapolated. `transferred`: the grid was moved from a measured shape by the
    roofline ratio (its other lookups count as transferred).
    """

    __slots__ = ("transferred", "_l1", "_l2", "_lz", "_filled", "_near_filled",
                 "_roofline", "_lo1", "_hi1", "_lo2", "_hi2")

    def __init__(self, xs1: Sequence[float], xs2: Sequence[float], zs_s: np.ndarray,
                 roofline: Callable[[float, float], float],
                 transferred: bool = False) -> None:
        z = np.array(zs_s, dtype=float)
        filled = np.isnan(z)
        for j, x2 in enumerate(xs2):
            measured = np.flatnonzero(~np.isnan(z[:, j]))
            if len(measured) == 0:
                raise ValueError(f"no measurement at sequence {x2}")
            for i in np.flatnonzero(np.isnan(z[:, j])):
                k = measured[np.argmin(np.abs(measured - i))]
                z[i, j] = z[k, j] * roofline(xs1[i], x2) / roofline(xs1[k], x2)
        l1, l2 = np.log(np.asarray(xs1, dtype=float)), np.log(np.asarray(xs2, dtype=float))
        if len(l1) == 1:  # one measured batch (or sequence): a flat second row keeps the maths
            l1, z, filled = np.append(l1, l1[0] + 1.0), np.vstack([z, z]), np.vstack([filled] * 2)
        if len(l2) == 1:
            l2, z = np.append(l2, l2[0] + 1.0), np.hstack([z, z])
            filled = np.hstack([filled, filled])
        lz = np.log(z)
        l1, lz, filled = _refine(l1, lz, filled)
        l2, lzt, filled_t = _refine(l2, lz.T, filled.T)
        lz, filled = lzt.T, filled_t.T
        self._l1, self._l2 = l1.tolist(), l2.tolist()
        self._lz = lz.tolist()
        self._filled = filled.tolist()
        # cells (i, j) with an unmeasured corner: the only ones where the flags need a look
        near = filled[:-1, :-1] | filled[1:, :-1] | filled[:-1, 1:] | filled[1:, 1:]
        self._near_filled = near.tolist()
        self._roofline = roofline
        self._lo1, self._hi1 = float(xs1[0]), float(xs1[-1])
        self._lo2, self._hi2 = float(xs2[0]), float(xs2[-1])
        self.transferred = transferred

    @property
    def roofline(self) -> Callable[[float, float], float]:
        return self._roofline

    def scaled(self, factor: Callable[[float, float], float]) -> ScaledGrid:
        """This grid times `factor(x1, x2)` at every lookup, as a transferred grid."""
        roofline = self._roofline
        return ScaledGrid(self, lambda t, x1, x2: t * factor(x1, x2),
                          lambda x1, x2: roofline(x1, x2) * factor(x1, x2))

    def moved(self, move: Callable[[float, float, float], float],
              roofline: Callable[[float, float], float]) -> ScaledGrid:
        """This grid's lookups passed through `move(seconds, x1, x2)`, as a transferred grid
        of that `roofline`."""
        return ScaledGrid(self, move, roofline)

    def at(self, x1: float, x2: float) -> tuple[float, bool]:
        """(seconds, whether the answer is extrapolated: off the grid, or weighted on a filled
        cell) at (x1, x2)."""
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
        extra = False
        if self._near_filled[i][j]:
            f, g = self._filled[i], self._filled[i + 1]
            extra = ((f[j] and w1 < 1 and w2 < 1) or (f[j + 1] and w1 < 1 and w2 > 0)
                     or (g[j] and w1 > 0 and w2 < 1) or (g[j + 1] and w1 > 0 and w2 > 0))
        if c1 != x1 or c2 != x2:
            seconds *= self._roofline(x1, x2) / self._roofline(c1, c2)
            extra = True
        return seconds, bool(extra)


class ScaledGrid:
    """A `Grid2` whose lookups pass through `move(seconds, x1, x2)` (how a grid measured on one
    GPU prices another: its seconds times the ratio of the two GPUs' rooflines); its lookups
    count as transferred."""

    __slots__ = ("_grid", "_move", "roofline")
    transferred = True

    def __init__(self, grid: Grid2, move: Callable[[float, float, float], float],
                 roofline: Callable[[float, float], float]) -> None:
        self._grid, self._move, self.roofline = grid, move, roofline

    def at(self, x1: float, x2: float) -> tuple[float, bool]:
        seconds, extra = self._grid.at(x1, x2)
        return float(self._move(seconds, x1, x2)), extra


def _refine(l: np.ndarray, lz: np.ndarray, filled: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each interval of axis 0 into REFINE by the monotone cubic along that axis, so
    bilinear lookups on the finer grid follow it. A new point between a measured and a
    filled one is marked filled."""
    slopes = np.stack([pchip_slopes(l, lz[:, j]) for j in range(lz.shape[1])], axis=1)
    q = (l[:-1, None] + (l[1:] - l[:-1])[:, None] * np.arange(REFINE) / REFINE).ravel()
    marks = np.repeat(filled[:-1] | filled[1:], REFINE, axis=0)
    marks[::REFINE] = filled[:-1]
    return (np.concatenate([q, l[-1:]]), np.vstack([pchip(l, lz, slopes, q), lz[-1:]]),
            np.vstack([marks, filled[-1:]]))
