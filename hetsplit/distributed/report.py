"""Report: what hetsplit says about a split — the shares and predicted step at the start, the measured step at the end.

One line each, on rank 0, the same from ``hd.plan`` and every integration; silenced with ``$HETSPLIT_QUIET``.
"""

from __future__ import annotations

import atexit
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence

from ..devices import label_device, parse_device
from ..planning.plan import Plan
from ..store import QUIET_ENV as QUIET_ENV  # the variable that silences every line here, as quiet=True does
from ..store import is_quiet as is_quiet

# The steps at a run's start that its measured step leaves out (warm-up), when there are more.
WARMUP_STEPS = 1


class SplitReport:
    """What hetsplit says about a split: one line when training starts, one when it ends (rank 0).

    A step is an optimizer step, however many global batches it accumulates (:meth:`batch`). The
    end line gives the median period from one step's start to the next on rank 0 (every rank
    waits in the all-reduce, so it is the job's), the first step left out (warm-up).

    Args:
        who: The class or script the user runs (each line starts with it).
        rank: This process's rank.
        quiet: Say nothing.
        clock: Seconds from some fixed point (default ``time.perf_counter``); a test passes its own.

    Example:
        >>> report = hd.SplitReport("train.py", rank)
        >>> report.step(plan)  # at the start of every optimizer step; report.end(plan) after the last
    """

    def __init__(self, who: str, rank: int, quiet: bool = False, clock: Callable[[], float] | None = None) -> None:
        self.who, self.on, self.clock = who, rank == 0 and not is_quiet(quiet), clock
        self.periods: list[float] = []  # the run's step times, start to start (the first one's included)
        self.batches: list[int] = []  # the global batches each of those steps accumulated
        self._count = 0  # the global batches of the running step (batch)
        self._ended = False  # the steps were timed start to end (step_end), not start to start
        self._last: float | None = None  # when the running step started (None: paused, or not started)
        self._first: Plan | None = None  # the plan of the run's first step (None: no run yet)
        self._plan: Plan | None = None  # the plan of the run's latest step
        self._said: Plan | None = None  # the plan whose split was said last (by announce)

    def announce(
        self, plan: Plan, devices: Sequence[str] | None = None, *, follow: bool = False, note: str = ""
    ) -> None:
        """Say the split of ``plan`` and its predicted step now; ``follow``: also its run's end."""
        if self.on:
            self._said = plan
            self._say(self._start_line(plan, devices) + (f"; {note}" if note else ""))
            if follow:
                _FOLLOWED[:] = [*_FOLLOWED[-7:], (plan, self)]
                _end_at_exit()

    @staticmethod
    def following(plan: Plan | None) -> SplitReport | None:
        """The report that said ``plan`` to follow its run (``announce(follow=True)``), else ``None``."""
        return next((report for said, report in reversed(_FOLLOWED) if said is plan), None)

    def note(self, line: str) -> None:
        """Say one more line about the split (a warning about its measurement), as the others are said."""
        if self.on:
            self._say(f"{self.who}: {line}")

    def step(self, plan: Plan | None, devices: Sequence[str] | None = None) -> None:
        """An optimizer step of ``plan`` starts (the run's first says the split; ``devices``: one name per rank)."""
        if not self.on or plan is None:
            return
        now = self._now()
        if self._first is None:
            self._first = plan
            if plan is not self._said:
                self._say(self._start_line(plan, devices))
        elif self._last is not None:
            self._timed(now - self._last, self._count)
        self._last, self._plan, self._count = now, plan, 0

    def batch(self) -> None:
        """A global batch of the running optimizer step starts (one of several accumulated into it)."""
        self._count += 1

    def step_end(self, batches: int | None = None) -> None:
        """The running step ended: its time since :meth:`step` is timed, and nothing until the next step.

        Args:
            batches: Global batches the step accumulated (default: those :meth:`batch` counted).
        """
        if not self.on or self._last is None:
            return
        self._timed(self._now() - self._last, self._count if batches is None else batches)
        self._last, self._ended = None, True

    def _timed(self, seconds: float, batches: int) -> None:
        self.periods.append(seconds)
        self.batches.append(max(batches, 1))  # a script that never calls batch(): one each

    def pause(self) -> None:
        """Training stops for a while (an evaluation runs): the time until the next :meth:`step` is not timed."""
        self._last = None

    def end(self, plan: Plan | None = None, measured: float | None = None) -> None:
        """The run ended: the measured step beside the prediction, once (a later :meth:`step` starts a new run).

        Args:
            plan: The plan in force at the end (default: the latest step's).
            measured: A step time in seconds measured by the caller, said instead of the median.
        """
        if not self.on:
            return
        plan = plan if plan is not None else self._plan
        if measured is not None:
            self._say(f"{self.who}: measured step {_ms(measured)} (yours){_against(plan, measured, self._first)}")
        elif self._first is None:
            return
        elif not self.periods:
            self._say(f"{self.who}: measured step: one step, none to time from start to start")
        else:
            # The first step's time holds the run's warm-up (allocations, lazy initialisation,
            # DDP's first buckets), which the prediction leaves out; with one step timed, it is all there is.
            warm = WARMUP_STEPS if len(self.periods) > WARMUP_STEPS else 0
            timed = self.periods[warm:]
            median = statistics.median(timed)
            # The global batches a step accumulated: the count most steps had (an epoch's last may have fewer).
            counts = self.batches[warm:]
            each = max(sorted(set(counts)), key=counts.count)
            which = f"median of {len(timed)} after {warm} warm-up" if warm else "1 step, warm-up included"
            span = "start to end" if self._ended else "start to start"
            accumulated = f"; {each} global batches accumulated each" if each > 1 else ""
            line = f"{self.who}: measured step {_ms(median)} ({which}, rank 0, {span}{accumulated})"
            self._say(line + _against(plan, median, self._first, each, _spread(timed)))
        self._last, self._first, self._plan, self.periods, self._ended = None, None, None, [], False
        self.batches, self._count = [], 0

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.perf_counter()

    def _start_line(self, plan: Plan, devices: Sequence[str] | None) -> str:
        names = list(devices) if devices is not None and len(devices) == len(plan.sizes) else list(plan.devices)
        line = f"{self.who}: global batch {plan.batch_size} split {split_text(plan, names)}"
        if any(len(parts) > 1 for parts in plan.micro_batches):
            line += f" (micro-batches {plan.micro_batches})"
        predicted = plan.step_time
        line += (
            f"; predicted step {_ms(predicted)}"
            if math.isfinite(predicted) and predicted > 0
            else f"; no predicted step ({_unpredicted(plan)})"
        )
        emulated = sorted({label_device(n) for n in names if _emulated(n)} | {label_device(n) for n in plan.emulated})
        if emulated:
            line += f"; emulated (a real device slowed down or capped, not real hardware): {', '.join(emulated)}"
        for note in plan.notes:  # shares the planner changed after solving, and why
            line += f"; {note}"
        return line

    @staticmethod
    def _say(line: str) -> None:
        print(f"hetsplit: {line}", flush=True)


# The plans hd.plan said in this process, each with the report that says the end of its run.
_FOLLOWED: list[tuple[Plan, SplitReport]] = []


def _end_runs() -> None:
    """At exit: each followed run that trained says its measured step (once: end() forgets the run)."""
    for _, report in _FOLLOWED:
        report.end()


@functools.cache  # once per process
def _end_at_exit() -> None:
    atexit.register(_end_runs)


def split_text(plan: Plan, names: Sequence[str] | None = None) -> str:
    """Each device's share with the time its curve predicts for it: ``cpu 205 (80%, 25.1 ms)``.

    A quick calibration's plan times another model, and says so (``calibration 25.1 ms``).
    """
    names = list(names) if names is not None else list(plan.devices)
    times = list(plan.times) if len(plan.times) == len(plan.sizes) else [math.nan] * len(plan.sizes)
    whose = "calibration " if plan.stand_in else ""
    parts = []
    for name, size, t in zip(names, plan.sizes, times):
        when = f", {whose}{_ms(t)}" if size > 0 and math.isfinite(t) and t > 0 else ""
        parts.append(f"{name} {size} ({size / plan.batch_size:.0%}{when})")
    return ", ".join(parts)


# Above this relative step-to-step noise (measured, or the profile's: Plan.noise), a
# predicted step is not said: a step then varies by more than the 10-40 % a balanced split
# typically wins, so a prediction could miss by 2x and no error against it means anything.
NOISE_LIMIT = 0.25


def unreliable_note(*noises: float) -> str:
    """``unreliable here (noise ±31%)`` where the largest known noise exceeds :data:`NOISE_LIMIT`, else ``""``."""
    known = [n for n in noises if math.isfinite(n) and n >= 0]
    if not known or max(known) <= NOISE_LIMIT:
        return ""
    return f"unreliable here (noise ±{max(known):.0%})"


def _spread(seconds: Sequence[float]) -> float:
    """The steps' relative step-to-step noise: their median absolute deviation over their median (NaN: too few)."""
    if len(seconds) < 3:
        return math.nan
    mid = statistics.median(seconds)
    return statistics.median(abs(s - mid) for s in seconds) / mid if mid > 0 else math.nan


def _against(plan: Plan | None, measured: float, first: Plan | None, batches: int = 1, noise: float = math.nan) -> str:
    """The prediction (times ``batches``) beside a measured step, or "unreliable" past :data:`NOISE_LIMIT`."""
    one = plan.step_time if plan is not None else math.nan
    unreliable = unreliable_note(noise, plan.noise if plan is not None else math.nan)
    if math.isfinite(one) and one > 0 and unreliable:
        line = f", predicted: {unreliable}"
    elif math.isfinite(one) and one > 0:
        predicted = one * batches
        # The error as every output states it: (predicted - measured) / measured, negative when
        # the step took longer than planned (the demo, bench, docs/benchmarks.md).
        # Beside it the measured steps' own step-to-step noise: an error inside it says nothing.
        spread = f", noise ±{noise:.0%}" if math.isfinite(noise) else ""
        error = f" (error {predicted / measured - 1:+.0%}{spread})" if measured > 0 else ""
        times = f"{batches} x {_ms(one)} = " if batches > 1 else ""
        line = f", predicted {times}{_ms(predicted)}{error}"
    else:
        line = f", no prediction ({_unpredicted(plan)})"
    if plan is not None and first is not None and list(plan.sizes) != list(first.sizes):
        line += f"; rebalanced to {list(plan.sizes)}"
    return line


def _unpredicted(plan: Plan | None) -> str:
    """Why a plan predicts no step: sizes by hand, or times of another model than the one trained."""
    if plan is not None and plan.stand_in:
        return f"split by a quick calibration of each device, which times {plan.stand_in}, not this model"
    return "shares set by hand, nothing profiled"


def _emulated(name: str) -> bool:
    try:
        return parse_device(label_device(name), check=False).emulated
    except ValueError:  # a free-form label of a hand-set plan
        return False


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
