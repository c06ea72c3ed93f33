"""Micro-batches: a device's time for a share run as near-equal micro-batches under its memory cap.

``b > c`` samples run as ``k >= ceil(b / c)`` micro-batches in ``T(b) = min_k (k - r) t(q) + r t(q + 1)``
(``b = q k + r``); :class:`MicroTable` evaluates and inverts ``T`` exactly for many devices at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .curve import CurveTable, rounded_bounds


def micro_sizes(batch: int, count: int) -> list[int]:
    """``batch`` samples as ``count`` near-equal micro-batches, larger first (``(191, 3)``: ``[64, 64, 63]``)."""
    if batch <= 0:
        return []
    count = max(1, min(int(count), int(batch)))
    q, r = divmod(int(batch), count)
    return [q + 1] * r + [q] * (count - r)


def micro_sizes_within(share: int, cap: int) -> list[int]:
    """``share`` as the fewest near-equal micro-batches of at most ``cap`` samples: the one rule for every engine."""
    return micro_sizes(share, -(-share // cap))


def _turning_points(v: np.ndarray, at: object) -> tuple[np.ndarray, np.ndarray]:
    """Of each row's sorted run ends ``v``, those where the best ``k`` can lie; and ``t`` there.

    The time of ``k`` micro-batches is linear in ``k`` on each piece of ``t``, with slope the
    piece's intercept ``a``: a best ``k`` sits where ``a`` turns from >= 0 below to <= 0 above,
    at 1 or at the cap. Keeping those (and any ambiguous one) keeps the optimum exact.
    """
    rows = np.arange(len(v))
    t = at(v, rows)[0]  # type: ignore[operator]
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (t[:, 1:] - t[:, :-1]) / (v[:, 1:] - v[:, :-1])
        a = t[:, :-1] - slope * v[:, :-1]  # intercept of each piece between consecutive ends
    a = np.where(np.isfinite(a), a, np.nan)  # a piece of zero length: undecided
    below = np.concatenate([np.full((len(v), 1), np.inf), a], axis=1)
    above = np.concatenate([a, np.full((len(v), 1), -np.inf)], axis=1)
    keep = ~(below < 0) & ~(above > 0)  # NaN keeps
    keep[:, 0] = keep[:, -1] = True  # 1 and the cap
    width = int(keep.sum(axis=1).max())
    order = np.argsort(~keep, axis=1, kind="stable")[:, :width]  # kept ends first, in order
    chosen = np.take_along_axis(v, order, 1)
    filled = np.arange(width)[None, :] < keep.sum(axis=1)[:, None]
    last = v[:, -1:]  # pad with the cap
    chosen = np.where(filled, chosen, last)
    return chosen, at(chosen, rows)[0]  # type: ignore[operator]


class MicroTable:
    """The accumulate=True step time ``T_i(b)`` of every device of a :class:`CurveTable`, read as a table.

    ``cap`` is unbounded unless a device cannot hold one sample; :meth:`times_and_counts`
    gives the micro-batch count behind each time.
    """

    def __init__(self, table: CurveTable) -> None:
        self.table, self.x = table, table.x
        cap = table.cap
        self.capped = np.isfinite(cap)
        self.cap = np.where(self.capped & (cap < 1), 0.0, np.inf)
        rows = np.flatnonzero(self.capped & (cap >= 1))
        self.rows = rows  # devices that may split their share
        self.all = np.arange(len(cap))
        self.where = np.full(len(cap), -1, dtype=np.int64)
        self.where[rows] = np.arange(len(rows))
        # The split devices' curves as arrays: knots, and each piece's line a + s x.
        x, y, c = table.x[rows], table.y[rows], cap[rows]
        self.X, self.Y, self.c = x, y, c
        self.tc = table.evaluate(c, rows) if len(rows) else c.copy()  # t at the cap, for _split_upper
        self._segment_lines(x, y, table.intercept[rows], table.slope[rows])
        # The micro sizes where a run of k ends: 1, the cap, and each knot (both sides when fractional).
        self.fractional = not np.array_equal(x, np.floor(x))
        knots = np.concatenate([np.floor(x), np.ceil(x)], axis=1) if self.fractional else x
        v = np.concatenate([np.ones((len(rows), 1)), c[:, None], np.minimum(knots, c[:, None])], axis=1)
        self.v = np.maximum(v, 1.0)
        self.tv = self._at(self.v, np.arange(len(rows)))[0]  # t at each of those sizes
        if not self.fractional and len(rows):
            self.v, self.tv = _turning_points(np.sort(self.v, axis=1), self._at)

    def _segment_lines(self, x: np.ndarray, y: np.ndarray, a: np.ndarray, s: np.ndarray) -> None:
        """Each split device's curve as ``m + 1`` lines through an anchor, flattened row after row.

        Piece ``p`` holds the sizes with ``p`` knots at or below them (0: from the intercept,
        ``m``: the fitted slope); precomputed, as the solver looks pieces up thousands of times.
        """
        n, m = x.shape
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = (y[:, 1:] - y[:, :-1]) / np.where(x[:, 1:] > x[:, :-1], x[:, 1:] - x[:, :-1], 1.0)
            below = (y[:, :1] - a[:, None]) / x[:, :1]
        self.PX = np.concatenate([np.zeros((n, 1)), x], axis=1).ravel()  # anchor sizes
        self.PY = np.concatenate([a[:, None], y], axis=1).ravel()  # anchor times
        self.PS = np.concatenate([below, inner, s[:, None]], axis=1).ravel()  # slopes
        # Inverting: a first piece that does not rise holds no size below the first knot's time.
        self.PI = self.PS.copy()
        self.PI[:: m + 1] = np.where(below[:, 0] > 0, below[:, 0], np.inf)
        self.width = m + 1

    def _segment_of(self, knots: np.ndarray, z: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Flat index of the piece holding ``z`` (one row per split device ``j``) by ``knots`` (X or Y)."""
        kj = knots[j]
        p = np.zeros(z.shape, dtype=np.int64)
        for col in range(kj.shape[1]):  # a handful of knots: a loop of 2-D compares beats a 3-D one
            p += kj[:, col : col + 1] <= z
        flat: np.ndarray = p + (j * self.width)[:, None]
        return flat

    def _at(self, q: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(t(q), t(q + 1) - t(q))`` on split devices ``j``, both on the piece that holds ``q``."""
        i = self._segment_of(self.X, q, j)
        xa, ya, s = self.PX[i], self.PY[i], self.PS[i]
        t = ya + s * (q - xa)
        step = s
        if self.fractional:
            nxt = np.where(i % self.width < self.width - 1, self.PX[np.minimum(i + 1, len(self.PX) - 1)], np.inf)
            exact = q + 1 > nxt  # q + 1 lies on the next piece
            if exact.any():
                rows = np.repeat(self.rows[j], q.shape[1])
                t1 = self.table.evaluate((q + 1).reshape(-1), rows).reshape(q.shape)
                step = np.where(exact, t1 - t, s)
        return t, step

    # -- time for b samples ----------------------------------------------------------------

    def _split_times(self, b: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(best time, its micro-batch count) for ``b >= 1`` samples on split devices ``j``."""
        k0 = np.ceil(b / self.c[j])
        ends = np.floor(b[:, None] / self.v[j])
        # ``v`` holds 1 and the cap, so ``b`` and ``k0`` are among these once clipped.
        k = np.concatenate([ends, ends + 1], axis=1)
        k = np.clip(k, k0[:, None], np.maximum(b, k0)[:, None])
        q = np.floor(b[:, None] / k)
        r = b[:, None] - q * k
        tq, step = self._at(q, j)
        with np.errstate(invalid="ignore"):  # q at the cap has r = 0 and no t(q + 1) (inf)
            f = k * tq + np.where(r > 0, r * step, 0.0)
        # Ties (equal up to rounding, e.g. a curve through the origin) go to the fewest micro-batches.
        low = f.min(axis=1, keepdims=True)
        best = np.argmin(np.where(f <= low + 1e-10 * np.abs(low), k, np.inf), axis=1)
        pick = np.arange(len(b))
        return f[pick, best], k[pick, best]

    def _times(self, b: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = self.table.evaluate(b, rows)
        counts = np.where(b > 0, 1.0, 0.0)
        j = self.where[rows]
        split = np.flatnonzero((j >= 0) & (b >= 1))
        if len(split):
            t[split], counts[split] = self._split_times(b[split], j[split])
        zero = (self.cap[rows] == 0) & (b > 0)  # a device that holds no sample
        return np.where(zero, np.inf, t), counts

    def whole_batch_time(self, batch: int) -> float:
        """Seconds in which some device surely runs all ``batch`` samples: the search's first upper bound."""
        plain = self.table.evaluate(np.full(len(self.cap), float(batch)))
        t = np.where(self.capped, np.inf, plain)
        if len(self.rows):
            t[self.rows] = self._split_upper(np.full(len(self.rows), float(batch)), plain[self.rows])
        return float(t.min())

    def _split_upper(self, bj: np.ndarray, t_whole: np.ndarray) -> np.ndarray:
        """An upper bound on the split devices' times: ``t(b)`` within the cap, else ``ceil(b / c) t(c)``."""
        c = self.c
        return np.where(bj <= c, t_whole, np.ceil(bj / c) * self.tc)

    def extreme(self, b: np.ndarray, *, largest: bool) -> tuple[float, int]:
        """The largest (or smallest) ``T_i(b_i)`` over all devices and its device, exactly.

        Split devices are evaluated only where bounds (``b`` times the best seconds per sample;
        :meth:`_split_upper`) leave the answer open: most are settled by them.
        """
        b = np.asarray(b, dtype=float)
        t = self.table.evaluate(b)
        t = np.where((self.cap == 0) & (b > 0), np.inf, t)
        j = self.rows
        if not len(j):
            i = int(np.argmax(t) if largest else np.argmin(t))
            return float(t[i]), i
        whole = np.ones(len(t), dtype=bool)
        whole[j] = False
        bj = b[j]
        with np.errstate(invalid="ignore"):
            low = bj * (self.tv / self.v).min(axis=1)
            high = self._split_upper(bj, t[j])
        # Slack for rounding: a bound computed another way may miss the exact time by an ulp.
        low, high = np.where(bj > 0, low * (1 - 1e-9), 0.0), np.where(bj > 0, high * (1 + 1e-9), 0.0)
        t_whole = np.where(whole, t, -np.inf if largest else np.inf)
        if largest:
            open_ = high >= max(float(t_whole.max()), float(low.max()))
        else:
            open_ = low <= min(float(t_whole.min()), float(high.min()))
        picked = j[open_]
        t[j] = np.where(open_, 0.0, -np.inf if largest else np.inf)  # settled: not the extreme
        if len(picked):
            t[picked] = self.evaluate(b[picked], picked)
        i = int(np.argmax(t) if largest else np.argmin(t))
        return float(t[i]), i

    def evaluate(self, b: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of device ``rows[j]`` for ``b[j]`` samples, micro-batched as best it can."""
        b = np.asarray(b, dtype=float)
        rows = self.all if rows is None else np.asarray(rows)
        return self._times(b, rows)[0]

    def times_and_counts(self, sizes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each device's time for ``sizes`` and the number of micro-batches behind it (0 for no samples)."""
        t, k = self._times(np.asarray(sizes, dtype=float), self.all)
        return t, k.astype(np.int64)

    # -- samples in T seconds --------------------------------------------------------------

    def _split_inverse(self, seconds: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Continuous capacities of the split devices per candidate micro-batch count, ``dx/dt``, and ``k`` caps.

        For ``k`` micro-batches: ``k`` times the curve's inverse at ``seconds / k``, at most
        ``k`` caps; the best ``k`` is at a run's end, so a row's largest ``floor`` is the answer.
        """
        tv = self.tv
        kv = np.floor(seconds / tv)
        kv = kv + ((kv + 1) * tv <= seconds) - ((kv * tv > seconds) & (kv > 0))
        k = np.minimum(np.maximum(np.concatenate([np.ones((len(self.rows), 1)), kv, kv + 1], axis=1), 1.0), 1e15)
        u = seconds / k  # seconds per micro-batch
        i = self._segment_of(self.Y, u, np.arange(len(self.rows)))
        with np.errstate(divide="ignore", invalid="ignore"):
            per = self.PX[i] + (u - self.PY[i]) / self.PI[i]
            rate = np.nan_to_num(1.0 / self.PI[i], nan=0.0, posinf=1e18)
        per = np.clip(np.nan_to_num(per, nan=0.0, posinf=1e18), 0.0, 1e18)
        # Not clipped at k caps here: whether t(cap) <= seconds / k is itself a question of rounding.
        return k * per, rate, k * self.c[:, None]

    def _split_capacity(self, seconds: float) -> np.ndarray:
        """Approximately the most samples each split device runs in ``seconds`` (exact up to rounding)."""
        v, _, top = self._split_inverse(seconds)
        capacity: np.ndarray = np.floor(np.minimum(v, top)).max(axis=1)
        return capacity

    def bounds(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """Capacities at ``seconds`` from below and above (:meth:`CurveTable.bounds`; exact with fractional knots)."""
        if self.fractional:
            c = self.capacity(seconds)
            return c, c
        low, high = self.table.bounds(seconds)
        low, high = np.where(self.cap == 0, 0, low), np.where(self.cap == 0, 0, high)
        if len(self.rows):
            v, rate, top = self._split_inverse(float(seconds))
            lo_j, hi_j = rounded_bounds(v, rate, seconds, top)
            low[self.rows], high[self.rows] = lo_j.max(axis=1), hi_j.max(axis=1)
        return low, high

    def capacity(self, seconds: float) -> np.ndarray:
        """For each device, the most samples whose micro-batched time is at most ``seconds`` (exact)."""
        c = self.table.capacity(seconds).astype(float)
        c = np.where(self.cap == 0, 0.0, c)
        if len(self.rows):
            c[self.rows] = np.minimum(self._split_capacity(float(seconds)), 1e18)
        if not len(self.rows):
            return c.astype(np.int64)
        j = self.rows  # only split devices can be off: the others come settled from the table
        cj = c[j]
        for _ in range(10_000):  # each pass moves by one; rounding leaves at most a few
            both = self.evaluate(np.concatenate([cj + 1, cj]), np.concatenate([j, j]))
            up = both[: len(j)] <= seconds
            down = (cj > 0) & (both[len(j) :] > seconds)
            if not (up.any() or down.any()):
                break
            cj = cj + up - down
        c[j] = cj
        return c.astype(np.int64)
