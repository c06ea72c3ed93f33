"""Curve: per-device step-time curves t(b) fitted to measurements, evaluated and inverted in bulk."""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from . import checks


@dataclasses.dataclass
class Curve:
    """A monotone step-time model ``t(b)`` in seconds for a batch of ``b`` samples (docs/how-it-works.md).

    Piecewise linear through the knots, falling linearly from the first knot to ``intercept``
    (the fixed per-step overhead), ``slope`` seconds per sample past the last knot, ``t(0) = 0``
    and infinite above ``memory_cap`` (``None``: unknown or unbounded).
    """

    batch: list[float]
    seconds: list[float]
    intercept: float
    slope: float
    memory_cap: int | None = None

    def __post_init__(self) -> None:
        numbers = [*self.batch, *self.seconds, self.intercept, self.slope]
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in numbers):
            raise ValueError(f"a curve's knots, intercept and slope must be finite numbers, got {numbers}")
        if self.memory_cap is not None and (isinstance(self.memory_cap, bool) or self.memory_cap < 0):
            raise ValueError(f"a curve's memory_cap must be None or a whole number >= 0, got {self.memory_cap!r}")
        if not self.batch or len(self.batch) != len(self.seconds):
            raise ValueError(f"a curve needs as many knot times as knot batches, got {self.batch} and {self.seconds}")
        if any(b2 <= b1 for b1, b2 in zip(self.batch, self.batch[1:])) or self.batch[0] < 1:
            raise ValueError(f"curve knots must be increasing batch sizes >= 1, got {self.batch}")
        if any(t2 < t1 for t1, t2 in zip(self.seconds, self.seconds[1:])):
            raise ValueError(f"curve times must be non-decreasing, got {self.seconds}")
        if not (0.0 <= self.intercept <= self.seconds[0]) or not self.slope > 0:
            raise ValueError(
                f"curve needs 0 <= intercept <= first time and slope > 0, got {self.intercept}, {self.slope}"
            )

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]], memory_cap: int | None = None) -> Curve:
        """Fit a curve to ``(batch size, seconds)`` measurements (batch >= 1, seconds > 0).

        Medians per batch size, made non-decreasing by isotonic regression; the overhead and
        the slope past the last point from a non-negative fit of ``t = a + s*b`` in relative
        error, so small batches count as much as large ones.
        """
        by_batch: dict[int, list[float]] = {}
        for b, t in points:
            if int(b) != b or b < 1:
                raise ValueError(f"measured batch sizes must be positive integers, got {b!r}")
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                raise ValueError(f"measured times must be positive finite seconds, got {t!r} at batch {b}")
            by_batch.setdefault(int(b), []).append(float(t))
        if not by_batch:
            raise ValueError(
                "cannot fit a step-time curve without measurements; give at least one (batch, seconds) pair"
            )
        xs = np.array(sorted(by_batch), dtype=float)
        ys = np.array([statistics.median(by_batch[int(b)]) for b in xs])
        from scipy.optimize import isotonic_regression  # here: scipy costs every process 0.4 s at import

        ys = isotonic_regression(ys, increasing=True).x
        if len(xs) == 1:
            # One point says nothing about fixed overhead: assume time proportional to batch.
            return cls([float(xs[0])], [float(ys[0])], 0.0, float(ys[0] / xs[0]), memory_cap)
        a_all, s_all = _affine(xs, ys)
        tail = max(2, len(xs) // 2)
        _, s_tail = _affine(xs[-tail:], ys[-tail:])
        intercept = min(max(a_all, 0.0), float(ys[0]))
        # The slope past the data: the larger of the whole-range and upper-range marginal
        # costs (an unsaturated GPU looks flat; it will not stay flat), never zero.
        slope = max(s_tail, s_all, float(ys[-1] / xs[-1]) * 1e-3)
        return cls([float(x) for x in xs], [float(y) for y in ys], float(intercept), float(slope), memory_cap)

    def __call__(self, b: float) -> float:
        """Predicted seconds for a batch of ``b`` samples (the same arithmetic as :meth:`evaluate`)."""
        b = float(b)
        if self.memory_cap is not None and b > self.memory_cap:
            return math.inf
        if b <= 0:
            return 0.0
        xs, ys = self.batch, self.seconds
        if b < xs[0]:
            return self.intercept + (ys[0] - self.intercept) * b / xs[0]
        k = bisect.bisect_right(xs, b) - 1
        if k == len(xs) - 1:
            return ys[k] + self.slope * (b - xs[k])
        return ys[k] + (ys[k + 1] - ys[k]) * (b - xs[k]) / (xs[k + 1] - xs[k])

    def evaluate(self, b: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`__call__` over an array of batch sizes."""
        b = np.asarray(b, dtype=float)
        flat = b.reshape(-1)
        return CurveTable([self]).evaluate(flat, np.zeros(flat.shape, dtype=np.int64)).reshape(b.shape)

    def capacity(self, seconds: float) -> int:
        """The largest integer batch whose predicted time is at most ``seconds``."""
        return int(CurveTable([self]).capacity(float(seconds))[0])

    def scaled(self, factor: float) -> Curve:
        """This curve with every time multiplied by ``factor`` (> 0)."""
        if not factor > 0:
            raise ValueError(f"a curve can only be scaled by a positive factor, got {factor}")
        return dataclasses.replace(
            self,
            seconds=[t * factor for t in self.seconds],
            intercept=self.intercept * factor,
            slope=self.slope * factor,
        )

    def repeated(self, count: int) -> Curve:
        """``count * t(b / count)``: ``b`` samples run as ``count`` back-to-back micro-batches of ``b / count``.

        Exact for the piecewise-linear model; the memory cap (per micro-batch) covers ``count``
        times the samples.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"a curve can only be repeated a whole number >= 1 of times, got {count!r}")
        return dataclasses.replace(
            self,
            batch=[b * count for b in self.batch],
            seconds=[t * count for t in self.seconds],
            intercept=self.intercept * count,
            memory_cap=None if self.memory_cap is None else self.memory_cap * count,
        )

    def shifted(self, seconds: float) -> Curve:
        """This curve with ``seconds`` (>= 0) of fixed overhead added to every used batch (``t(0)`` stays 0)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a curve can only be shifted by a finite overhead >= 0 seconds, got {seconds}")
        return dataclasses.replace(
            self, seconds=[t + seconds for t in self.seconds], intercept=self.intercept + seconds
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the curve as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Curve:
        """Build a curve from :meth:`to_dict` output, checking every number (a file may be damaged)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"the curve must be a mapping of knots, got {type(data).__name__}: {data!r}")
        knots = {}
        for key, top in (("batch", checks.MAX_BATCH), ("seconds", checks.MAX_SECONDS)):
            values = data[key]
            if not isinstance(values, list) or not values:
                raise ValueError(f"curve {key} must be a non-empty list of numbers, got {values!r}")
            knots[key] = [_number(v, f"curve {key}[{i}]", top) for i, v in enumerate(values)]
        return cls(
            batch=knots["batch"],
            seconds=knots["seconds"],
            intercept=_number(data["intercept"], "curve intercept", checks.MAX_SECONDS),
            slope=_number(data["slope"], "curve slope", checks.MAX_SECONDS),
            memory_cap=checks.memory_cap(data.get("memory_cap"), "curve memory_cap"),
        )


def _number(value: Any, what: str, top: float) -> float:
    """A stored number: finite, ``0 <= value <= top``, never a string or bool."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and 0 <= value <= top)
    ):
        raise ValueError(f"{what} must be a finite number from 0 to {top:g}, got {value!r}")
    return float(value)


class CurveTable:
    """Many curves packed into arrays, evaluated and inverted together (the solver's engine).

    Knot arrays are padded to a common length by repeating each curve's last knot, so one
    vectorised pass serves 10,000 devices.
    """

    def __init__(self, curves: Sequence[Curve]) -> None:
        n = len(curves)
        # A list per attribute, then arrays from the lists: measured faster than generators into
        # np.fromiter, or one attrgetter pass transposed with zip (10,000 curves: 3-6 ms vs 8-10 ms).
        batch, seconds = [c.batch for c in curves], [c.seconds for c in curves]
        intercept, slope, cap = [c.intercept for c in curves], [c.slope for c in curves], [c.memory_cap for c in curves]
        lengths = set(map(len, batch))
        if len(lengths) == 1:  # the common case: no padding, read straight from the lists
            (k,) = lengths
            self.x = np.fromiter(chain.from_iterable(batch), float, n * k).reshape(n, k)
            self.y = np.fromiter(chain.from_iterable(seconds), float, n * k).reshape(n, k)
        else:
            width = max(lengths, default=1)
            self.x = np.array([b + b[-1:] * (width - len(b)) for b in batch], dtype=float).reshape(n, width)
            self.y = np.array([s + s[-1:] * (width - len(s)) for s in seconds], dtype=float).reshape(n, width)
        self.intercept = np.asarray(intercept, dtype=float)
        self.slope = np.asarray(slope, dtype=float)
        self.cap = np.asarray([np.inf if c is None else c for c in cap], dtype=float).reshape(n)
        self._rows = np.arange(n)

    def evaluate(self, b: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of curve ``rows[j]`` at batch ``b[j]`` (default: all; ``b`` 2-D: a row per curve)."""
        b = np.asarray(b, dtype=float)
        if b.ndim == 2:
            rows2 = np.repeat(self._rows, b.shape[1])
            return self.evaluate(b.reshape(-1), rows2).reshape(b.shape)
        r = self._rows if rows is None else np.asarray(rows)
        x, y = self.x[r], self.y[r]
        last = x.shape[1] - 1
        k = np.clip((x <= b[:, None]).sum(axis=1) - 1, 0, last)
        k1 = np.minimum(k + 1, last)
        idx = np.arange(len(r))
        xk, yk, xk1, yk1 = x[idx, k], y[idx, k], x[idx, k1], y[idx, k1]
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = yk + (yk1 - yk) * (b - xk) / np.where(xk1 > xk, xk1 - xk, 1.0)
        beyond = yk + self.slope[r] * (b - xk)
        a = self.intercept[r]
        below = a + (y[:, 0] - a) * b / x[:, 0]
        t = np.where(b < x[:, 0], below, np.where(k == last, beyond, inner))
        t = np.where(b <= 0, 0.0, t)
        return np.where(b > self.cap[r], np.inf, t)

    def _inverse(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """Each curve's continuous inverse at ``seconds`` (ignoring its cap) and its slope ``dx/dt`` there."""
        x, y = self.x, self.y
        last = x.shape[1] - 1
        k = (y <= seconds).sum(axis=1) - 1  # -1: below the first knot
        kc = np.clip(k, 0, last)
        k1 = np.minimum(kc + 1, last)
        xk, yk, xk1, yk1 = x[self._rows, kc], y[self._rows, kc], x[self._rows, k1], y[self._rows, k1]
        with np.errstate(divide="ignore", invalid="ignore"):
            x0, y0, a = x[:, 0], y[:, 0], self.intercept
            rate = np.where(
                k < 0,
                np.where(seconds >= a, x0 / np.where(y0 > a, y0 - a, 1.0), 0.0),
                np.where(k >= last, 1.0 / self.slope, (xk1 - xk) / (yk1 - yk)),
            )
            inner = xk + (seconds - yk) * (xk1 - xk) / (yk1 - yk)
            beyond = xk + (seconds - yk) / self.slope
            below = np.where(seconds >= a, x0 * (seconds - a) / np.where(y0 > a, y0 - a, 1.0), 0.0)
        cont = np.where(k < 0, below, np.where(k >= last, beyond, inner))
        # Not clipped at the cap here: whether t(cap) <= seconds is itself a question of rounding.
        cont = np.clip(np.nan_to_num(cont, nan=0.0, posinf=1e18), 0.0, 1e18)
        return cont, np.nan_to_num(rate, nan=0.0, posinf=1e18)

    def capacity(self, seconds: float) -> np.ndarray:
        """For each curve, the largest integer batch with predicted time <= ``seconds`` (exact: :meth:`evaluate`)."""
        c = np.floor(np.minimum(self._inverse(seconds)[0], self.cap))
        # The closed-form inverse can be off by one in floating point: settle it against
        # evaluate(), which is what the solver's optimality is defined by.
        for _ in range(8):
            up = (self.evaluate(c + 1) <= seconds) & (c + 1 <= self.cap)
            down = (c > 0) & (self.evaluate(c) > seconds)
            if not (up.any() or down.any()):
                break
            c = c + up - down
        counts: np.ndarray = c.astype(np.int64)
        return counts

    def bounds(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """Capacities at ``seconds`` from below and above in one closed-form pass: a bracket of :meth:`capacity`."""
        cont, rate = self._inverse(seconds)
        return rounded_bounds(cont, rate, seconds, self.cap)


def rounded_bounds(
    cont: np.ndarray, rate: np.ndarray, seconds: float, cap: np.ndarray | float
) -> tuple[np.ndarray, np.ndarray]:
    """``floor`` of a continuous capacity ``cont`` from below and above, widened by its rounding error.

    The closed forms round like :meth:`CurveTable.evaluate` up to a few ulps of the time,
    which is ``rate = dx/dt`` times that in samples (large on a nearly flat piece): within that
    error of a whole number the two differ by one. Both are clipped at ``cap``.
    """
    tol = rate * (1e-12 * abs(seconds)) + 1e-9 * (1.0 + cont)
    top = np.minimum(cap, 1e18)
    low = np.minimum(np.floor(np.maximum(cont - tol, 0.0)), top)
    high = np.minimum(np.floor(cont + tol), top)
    return low.astype(np.int64), high.astype(np.int64)


def _affine(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """Non-negative least-squares fit of ``y = a + s*x`` in relative error."""
    design = np.stack([1.0 / ys, xs / ys], axis=1)
    from scipy.optimize import nnls  # here: scipy costs every process 0.4 s at import

    (a, s), _ = nnls(design, np.ones_like(ys))
    return float(a), float(s)


def holdout_error(
    points: Sequence[tuple[int, float]], memory_cap: int | None = None
) -> tuple[int, float, float] | None:
    """How well a curve predicts a size it was not fitted on: ``(batch, predicted, measured)`` of the middle point.

    The middle of ``points`` (sorted) is predicted by a curve fitted to the others; ``None``
    with fewer than three points.
    """
    ordered = sorted(points)
    if len(ordered) < 3:
        return None
    batch, measured = ordered[len(ordered) // 2]
    refit = Curve.fit([p for p in ordered if p[0] != batch], memory_cap)
    return batch, refit(batch), measured
