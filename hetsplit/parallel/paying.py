"""Paying: whether a split beats its fastest device alone, measured step by step; one line, once, when it does not."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..planning.plan import Plan


class _Timed(Protocol):
    """A lap as the check reads it (:class:`hetsplit.timing.Lap`)."""

    def ready(self) -> bool: ...

    def seconds(self) -> float: ...


class PayCheck:
    """Whether the split pays: each step's measured time against its fastest device alone, predicted.

    The prediction leaves out what a step alone still spends beyond its device's work, and a
    GPU step ends when its backward is queued: a split step can look shorter, never longer, so
    in doubt the check stays quiet. ``clock``: seconds (default ``time.perf_counter``); a test
    sets its own. :attr:`settled` is the last plan whose steps decided (not timed again).
    """

    WARMUP = 1  # a plan's first steps (allocations, lazy initialisation): not timed
    STEPS = 5  # the steps of one plan that decide
    MARGIN = 0.05  # the smallest gap said, whatever the noise: a tie is no reason to change anything
    PLANS = 8  # plans followed at once (a run with batches of many sizes keeps the latest)

    def __init__(self, who: str = "HeteroDataParallel", clock: Callable[[], float] | None = None) -> None:
        self.who, self.clock = who, clock
        self.said = False
        self._started: tuple[object, float] | None = None
        self.unread: deque[tuple[Plan, float, Mapping[str, Sequence[_Timed]]]] = deque()
        self.settled: Plan | None = None
        self._seen: dict[tuple[int, ...], list[tuple[float, dict[str, float]]]] = {}
        self._done: set[tuple[int, ...]] = set()

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.perf_counter()

    def start(self, step: object) -> None:
        """A split step begins (``step``: anything that names it at :meth:`end`)."""
        if not self.said:
            self._started = (step, self._now())

    def end(self, step: object, plan: Plan, laps: Mapping[str, Sequence[_Timed]]) -> None:
        """``step``, begun at :meth:`start` and running ``plan``, ended; ``laps`` are read later (:meth:`take`)."""
        started, self._started = self._started, None
        if self.said or started is None or started[0] is not step or not laps:
            return
        if len(set(plan.devices)) != len(plan.devices):  # one device twice: its laps are summed under one name
            self.settled = plan  # never read
            return
        self.unread.append((plan, self._now() - started[1], laps))

    def take(self) -> str | None:
        """The line saying that the split does not pay, once, when the steps read now show it; else ``None``."""
        while not self.said and self.unread and all(lap.ready() for laps in self.unread[0][2].values() for lap in laps):
            plan, wall, laps = self.unread.popleft()
            key = (plan.batch_size, *plan.sizes)
            if key in self._done:
                continue
            if key not in self._seen and len(self._seen) >= self.PLANS:
                self._seen.pop(next(iter(self._seen)))  # the oldest plan followed
            steps = self._seen.setdefault(key, [])
            steps.append((wall, {name: sum(lap.seconds() for lap in parts) for name, parts in laps.items()}))
            if len(steps) < self.WARMUP + self.STEPS:
                continue
            self._done.add(key)
            del self._seen[key]
            self.settled = plan  # its steps still unread are passed over (_done)
            line = unpaid_line(self.who, plan, steps[self.WARMUP :], self.MARGIN)
            if line is not None:
                self.said = True
                self.unread.clear()
                self._seen.clear()
                return line
        return None


def alone_times(plan: Plan, busy: Mapping[str, float]) -> dict[str, float]:
    """Each active device's predicted seconds for the whole batch alone, scaled from its busy seconds on its share."""
    out = {}
    for i, (name, size) in enumerate(zip(plan.devices, plan.sizes)):
        seconds = busy.get(name)
        if size <= 0 or seconds is None or not seconds > 0:
            continue
        scale = plan.batch_size / size
        if plan.curves:
            whole, part = plan.curves[i](plan.batch_size), plan.curves[i](size)
            if math.isfinite(whole) and part > 0:
                scale = whole / part
        out[name] = seconds * scale
    return out


def unpaid_line(who: str, plan: Plan, steps: Sequence[tuple[float, Mapping[str, float]]], margin: float) -> str | None:
    """One line when the fastest device alone beats the measured steps of ``plan`` beyond their noise, else ``None``.

    Beyond: the medians differ by more than the steps' spread and more than ``margin``.
    ``steps``: per step, its seconds and each device's busy seconds.
    """
    used = [n for n, s in zip(plan.devices, plan.sizes) if s > 0]
    if len(used) < 2 or not steps:
        return None
    alone = [alone_times(plan, busy) for _, busy in steps]
    if any(set(a) != set(used) for a in alone):
        return None
    fastest = min(used, key=lambda n: statistics.median(a[n] for a in alone))
    walls, predicted = [w for w, _ in steps], [a[fastest] for a in alone]
    step, single = statistics.median(walls), statistics.median(predicted)
    noise = max(_spread(walls), _spread(predicted))
    if not (step > 0 and 1 - single / step > max(noise, margin)):
        return None
    share = plan.sizes[plan.devices.index(fastest)]
    others = ", ".join(n for n in used if n != fastest)
    return (
        f"{who}: {fastest} alone would be faster than this split of batch {plan.batch_size} {list(plan.sizes)}: "
        f"a step took {_ms(step)} (median of {len(walls)}, ±{noise:.0%} step to step), {fastest} alone "
        f"{_ms(single)} (predicted from its busy time on its {share} samples); train on {fastest} alone "
        f"(drop {others} from the devices) or set the shares with weights="
    )


def _spread(values: Sequence[float]) -> float:
    """Half the interquartile range over the median, as ``Measurement.spread``; 0 for one value."""
    median = statistics.median(values)
    if len(values) < 2 or not median > 0:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2 / median


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
