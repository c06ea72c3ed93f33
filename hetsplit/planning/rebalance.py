"""Rebalance: follow devices whose speed changes during training, without oscillating."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..devices import DeviceInfo
from .curve import Curve
from .plan import Plan
from .profile import Profile
from .records import DeviceProfile
from .sizes import resolve_plan, stand_ins_used
from .solver import plan_from_sizes

# Steps kept per device to measure how far its estimate wanders by itself (Rebalancer._wander_of).
NOISE_STEPS = 50
# The wander's weight in the margin: at 1, a 2x slow-down on a noisy rank with a large fixed cost
# (tests/test_rebalance.py, FSDP2's case) was followed back 14 steps late.
WANDER_WEIGHT = 0.75


@dataclasses.dataclass
class PlanChange:
    """One switch of plan by a :class:`Rebalancer`.

    Attributes:
        step: The first step (counted from 0) that runs with the new plan.
        old_sizes: Shard sizes before.
        new_sizes: Shard sizes after.
        predicted_gain: Predicted step-time reduction, e.g. 0.25 for 25 % faster:
            ``old_time / new_time - 1``.
        factors: Each device's speed correction at the time (observed / profiled time).
        old_time: Predicted seconds of a step of the old plan as it ran (its micro-batches,
            the communication), by the corrected profile at the time.
        new_time: The same for the new plan: always below ``old_time``.
    """

    step: int
    old_sizes: list[int]
    new_sizes: list[int]
    predicted_gain: float
    factors: dict[str, float]
    old_time: float = math.nan
    new_time: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Return the change as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"step {self.step}: {self.old_sizes} -> {self.new_sizes} (predicted {self.predicted_gain:+.0%} faster)"


class Rebalancer:
    """Re-solve the split from measured step times, with hysteresis and bounded moves.

    A device's factor is the median of its last ``window`` corrections (log of observed over
    predicted time). Every ``every`` steps the profile scaled by the factors is re-solved, and
    plans switch only when the predicted gain exceeds ``threshold`` plus twice the estimate's
    uncertainty (the corrections' spread, or how far the estimate wandered by itself over 50
    steps, where larger: a loaded machine's load outlasts a window). Both plans are predicted
    as they run (micro-batches in turn, plus :attr:`communication`), so a switch is never
    worse by its own prediction. It must be fed each device's own compute time
    (:func:`hetsplit.timing.lap`): by the wall, every rank of a DDP step is as slow as the slowest.

    Args:
        profile: The devices' profile; without one, each device starts from the curve
            the first plan it sees was solved from (a plan from :func:`~hetsplit.distributed.plan`
            carries its curves), and without that from a model where time is proportional to
            its shard (learned from the first steps).
        every: Steps between re-solves.
        threshold: Minimum predicted gain (fraction of step time) to switch plans.
        max_move: Largest fraction of the batch moved between devices in one switch.
        window: Corrections kept per device (the factor is their median).
        on_change: Called with each :class:`PlanChange`.

    Attributes:
        accumulate: Re-solve with micro-batches on capped devices (set by the engine).
        communication: Seconds every step pays beyond its slowest device's compute, whatever
            the split: added to both predictions, so a gain is the step's, not the compute's alone.
        stand_in: Samples a device with a share of 0 runs all the same (0 in one process):
            priced in the predictions, and a zero share takes that many real samples where the
            step is no slower, so the device stays timed and its share can come back.

    Example:
        >>> dp = HeteroDataParallel(net, ["cpu", "cpu@0.25"], profile=prof, rebalance=True)
        >>> dp.rebalancer.history  # the plan changes so far
    """

    def __init__(
        self,
        profile: Profile | None = None,
        *,
        every: int = 10,
        threshold: float = 0.05,
        max_move: float = 0.5,
        window: int = 6,
        on_change: Callable[[PlanChange], None] | None = None,
    ) -> None:
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(f"the rebalancer's profile must be a Profile, got {type(profile).__name__}: {profile!r}")
        counts = (every, window)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in counts):
            raise TypeError(f"every and window must be integers, got {every!r}, {window!r}")
        if every < 1 or window < 1 or not 0 < max_move <= 1 or not 0 <= threshold < math.inf:
            raise ValueError(
                f"need every >= 1, window >= 1, 0 < max_move <= 1, threshold >= 0; "
                f"got {every}, {window}, {max_move}, {threshold}"
            )
        self.profile = profile
        self.every, self.threshold, self.max_move, self.window = every, threshold, max_move, window
        self.on_change = on_change
        self.corrections: dict[str, deque[float]] = {}
        # Each device's predicted seconds (log) of an even share after each of its recent steps.
        self._wander: dict[str, deque[float]] = {}
        self.log_factors: dict[str, float] = {}
        self.history: list[PlanChange] = []
        self.accumulate = False
        self.communication = 0.0
        self.stand_in = 0
        self.steps = 0
        self.seconds = 0.0  # time spent in the rebalancer itself, to report its overhead
        self._entries: dict[str, DeviceProfile] = {}
        # Without a profile: each device's observed steps (runs, samples, seconds), to which a
        # fixed per-run cost plus a cost per sample is fitted (see _fit).
        self._seen: dict[str, deque[tuple[int, int, float]]] = {}
        self._planned: dict[str, Curve] = {}  # without a profile: the curves of the first plan seen (see record)
        self._last_check: tuple[list[int], dict[str, float], float] | None = None

    def factors(self) -> dict[str, float]:
        """Each observed device's current correction: observed time over profiled time."""
        return {name: math.exp(v) for name, v in self.log_factors.items()}

    def corrected(self, devices: Sequence[str]) -> Profile:
        """The profile of ``devices`` with every curve scaled by its device's factor."""
        entries = []
        for name in dict.fromkeys(devices):
            base = self._entry(name)
            factor = math.exp(self.log_factors.get(name, 0.0))
            entries.append(dataclasses.replace(base, curve=base.curve.scaled(factor)))
        source = self.profile.source if self.profile is not None else "observed"
        return Profile(entries, source=f"{source}+rebalanced")

    def _entry(self, name: str) -> DeviceProfile:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = self._make_entry(name)
        return entry

    def _make_entry(self, name: str) -> DeviceProfile:
        if self.profile is not None:
            return self.profile.entry(name)
        planned = self._planned.get(name)
        if planned is not None:
            # The curve the first plan was solved from (a torchrun rank's profile travels in its
            # plan): its shape, fixed cost included, measured at several sizes, which the steps of
            # one split cannot show; the factor scales it to the speed the device runs at now.
            return DeviceProfile(DeviceInfo(name=name, kind="planned", description=name), [], planned)
        # No curve at all: time proportional to the shard, one second per sample, which the
        # factor then scales to the device's measured seconds per sample — until steps of
        # two sizes let _fit separate a fixed per-step cost from the cost per sample.
        return _observed(name, 0.0, 1.0)

    def observe(self, plan: Plan, step_times: Mapping[str, float]) -> Plan | None:
        """Record one step's measured busy seconds (:meth:`record`); every ``every`` steps, :meth:`propose`.

        Args:
            plan: The plan the step ran with.
            step_times: Busy seconds of each active device in that step.

        Returns:
            The plan to use from the next step on, or ``None`` to keep ``plan``.
        """
        self.record(plan, step_times)
        return self.propose(plan) if self.steps % self.every == 0 else None

    def record(self, plan: Plan, step_times: Mapping[str, float]) -> None:
        """Record one step's measured busy seconds, without deciding anything.

        Args:
            plan: The plan the step ran with (its devices and sizes).
            step_times: Busy seconds of each active device in that step; devices
                with no samples or no time are skipped.
        """
        started = time.perf_counter()
        self.steps += 1
        if self.profile is None and self.steps == 1:  # the first plan's curves: those it was solved from
            self._planned = {n: c for n, c in zip(plan.devices, plan.curves) if math.isfinite(c.slope) and c.slope > 0}
        for name, size, micro in zip(plan.devices, plan.sizes, plan.micro_batches):
            seconds = step_times.get(name)
            if size <= 0 or not seconds or seconds <= 0:
                continue
            if self.profile is None and name not in self._planned and self._fit(name, len(micro), size, seconds):
                continue
            curve = self._entry(name).curve
            base = sum(curve(m) for m in micro)  # the predicted time of what ran: its micro-batches
            if not 0 < base < math.inf:
                continue
            seen = self.corrections.setdefault(name, deque(maxlen=self.window))
            seen.append(math.log(seconds / base))
            self.log_factors[name] = statistics.median(seen)
        reference = max(1, plan.batch_size // len(plan.devices))
        for name, size in zip(plan.devices, plan.sizes):
            seconds = self._entry(name).curve(reference) if size > 0 and name in self.log_factors else 0.0
            if 0 < seconds < math.inf:
                self._wander.setdefault(name, deque(maxlen=NOISE_STEPS)).append(
                    math.log(seconds) + self.log_factors[name]
                )
        self.seconds += time.perf_counter() - started

    def _use(self, name: str, entry: DeviceProfile) -> None:
        """Make ``entry`` the device's model; a change of curve voids the last re-solve's proof."""
        old = self._entries.get(name)
        if old is None or old.curve != entry.curve:
            self._entries[name] = entry
            self._last_check = None  # the curve changed: the last re-solve proves nothing about it

    def _fit(self, name: str, runs: int, samples: int, seconds: float) -> bool:
        """Without a profile: fit ``t = a * runs + s * samples`` to the device's steps; ``True`` once fitted.

        Time taken as proportional to the shard makes a device with a fixed cost look slower per
        sample the smaller its share, and its share would creep down at every switch. Once steps
        ran at two sizes, the line is fitted over the last ``window`` steps and the corrections
        become the residuals against it.
        """
        # The same window as the corrections': a device whose speed changes is followed as fast.
        seen = self._seen.setdefault(name, deque(maxlen=self.window))
        seen.append((runs, samples, seconds))
        if len({n for _, n, _ in seen}) < 2:
            return False
        k = [float(r) for r, _, _ in seen]
        n = [float(b) for _, b, _ in seen]
        t = [v for _, _, v in seen]
        # Normal equations of the two-parameter least squares.
        kk, kn, nn = sum(x * x for x in k), sum(x * y for x, y in zip(k, n)), sum(y * y for y in n)
        kt, nt = sum(x * v for x, v in zip(k, t)), sum(y * v for y, v in zip(n, t))
        det = kk * nn - kn * kn
        a, slope = ((kt * nn - nt * kn) / det, (kk * nt - kn * kt) / det) if det > 0 else (0.0, 0.0)
        # The fixed cost is believed only where the steps show it: above twice its standard
        # error (close sizes and noisy times cannot separate it), with a positive slope.
        # Otherwise time is taken as proportional to the samples, as before any fit.
        dof = len(seen) - 2
        rss = sum((v - a * x - slope * y) ** 2 for x, y, v in zip(k, n, t))
        error = math.sqrt(rss / dof * nn / det) if dof > 0 and det > 0 else math.inf
        if not (slope > 0 and a > 2.0 * error):
            a, slope = 0.0, sum(t) / sum(n)
        self._use(name, _observed(name, a, slope))
        self.corrections[name] = deque(
            (math.log(v / (a * r + slope * b)) for r, b, v in seen if a * r + slope * b > 0), maxlen=self.window
        )
        self.log_factors[name] = statistics.median(self.corrections[name]) if self.corrections[name] else 0.0
        return True

    def propose(self, plan: Plan, step: int | None = None) -> Plan | None:
        """Re-solve now; return a better plan than ``plan`` (recorded in :attr:`history`), or ``None`` to keep it.

        Args:
            plan: The plan in force.
            step: The first step the new plan will run (default: the next one); kept in the
                :class:`PlanChange`.
        """
        if not all(d in self.log_factors for d, s in zip(plan.devices, plan.sizes) if s > 0):
            return None
        started = time.perf_counter()
        try:
            return self._maybe_switch(plan, self.steps if step is None else step)
        finally:
            self.seconds += time.perf_counter() - started

    def _settled(self, plan: Plan) -> bool:
        """Whether the last re-solve proves no switch can pay now, so solving again is wasted.

        If every factor moved by ``d_i`` (log) since a re-solve of the same sizes that found a ratio
        ``r0`` of current over optimal time, the ratio now is at most ``r0 * exp(max d - min d)``.
        """
        if self._last_check is None:
            return False
        sizes, factors, best = self._last_check
        if sizes != list(plan.sizes) or not math.isfinite(best):
            return False
        moved = [self.log_factors.get(n, 0.0) - factors.get(n, 0.0) for n in plan.devices]
        bound = best * math.exp(max(moved) - min(moved))
        if bound <= 1.0 + self.threshold:
            return True
        active = [n for n, s in zip(plan.devices, plan.sizes) if s > 0]
        return bound <= 1.0 + self.threshold + 2.0 * self.uncertainty(active)

    def uncertainty(self, devices: Sequence[str]) -> float:
        """Relative uncertainty of the factors of ``devices``, added in quadrature.

        Each device's is the standard error of its factor's median, or its wander where larger.
        """
        total = 0.0
        for name in dict.fromkeys(devices):
            seen = self.corrections.get(name)
            if not seen or len(seen) < 2:
                continue
            error = 1.2533 * _spread(seen) / math.sqrt(len(seen))  # standard error of a median
            # A loaded machine's noise comes in bursts longer than a window, in which the window's own
            # spread is small while its median is off: how far the factor itself wandered over the last
            # steps is the margin measured, whatever the bursts' length.
            error = max(error, self._wander_of(name))
            total += error**2
        return math.sqrt(total)

    def _wander_of(self, name: str) -> float:
        """How far ``name``'s estimate moves in a window's steps on its own: 0 until measured.

        The robust spread of its moves in the older and the newer half of its recent steps, the
        smaller half taken: a machine's load moves it in both, a real change of speed in one.
        """
        wander = list(self._wander.get(name, ()))[: -self.window]
        moves = [b - a for a, b in zip(wander, wander[self.window :])]
        half = len(moves) // 2
        if half < self.window:
            return 0.0
        return min(_spread(moves[:half]), _spread(moves[half:])) / math.sqrt(2.0) * WANDER_WEIGHT

    def _maybe_switch(self, plan: Plan, step: int) -> Plan | None:
        if self._settled(plan):
            return None
        profile = self.corrected(plan.devices)
        curves = [profile.entry(name).curve for name in plan.devices]

        def step_time(p: Plan) -> float:
            """The plan's step as it runs (each device's micro-batches in turn), communication included."""
            work = [
                sum(c(m) for m in micro) if micro else c(self.stand_in) if self.stand_in else 0.0
                for c, micro in zip(curves, p.micro_batches)
            ]
            return max(work, default=0.0) + self.communication

        target = resolve_plan(plan.batch_size, plan.devices, profile=profile, accumulate=self.accumulate)
        sizes = _bounded(plan.sizes, target.sizes, int(self.max_move * plan.batch_size))
        now = step_time(plan)
        best = (now - self.communication) / target.slowest if target.slowest > 0 else math.inf
        self._last_check = (list(plan.sizes), {n: self.log_factors.get(n, 0.0) for n in plan.devices}, best)
        if sizes == list(plan.sizes):
            return None
        # Under accumulate, a share beyond a device's cap runs as micro-batches, cut as solve() would:
        # the new plan is predicted as it will run, the old one as it ran.
        new = plan_from_sizes(profile, plan.devices, sizes, accumulate=self.accumulate)
        if self.stand_in:  # a zero share costs its stand-ins all the same: real samples there where no slower
            new = stand_ins_used(new, profile, self.stand_in)
            sizes = list(new.sizes)
            if sizes == list(plan.sizes):
                return None
        then = step_time(new)
        if not (math.isfinite(then) and 0 < then < now):  # never worse than the plan in force
            return None
        gain = now / then - 1.0 if math.isfinite(now) else math.inf
        active = [n for n, s in zip(plan.devices, plan.sizes) if s > 0]
        if gain <= self.threshold + 2.0 * self.uncertainty(active):
            return None
        change = PlanChange(step, list(plan.sizes), sizes, gain, self.factors(), now, then)
        self.history.append(change)
        if self.on_change is not None:
            self.on_change(change)
        return with_communication(new, self.communication)


def rebalanced_caps(plan: Plan, profile: Profile | None, *, refuse: str | None = None) -> dict[str, int] | None:
    """What rebalancing may move under ``plan``, decided once for every engine: ``None`` for whole shares.

    A plan running some share as micro-batches is re-solved with them, within the caps
    returned (the profile's, else its curves'); re-solved without, a capped device would get a
    share it cannot hold, mid-training. ``refuse`` names the engine and argument that cannot
    follow re-cut micro-batches (the integrations): refused then, as is a split share with no cap known.
    """
    split = [r for r, parts in enumerate(plan.micro_batches) if len(parts) > 1]
    if not split:
        return None
    r = split[0]
    if refuse is not None:
        raise ValueError(
            f"{refuse} with a plan with micro-batches: the plan splits rank {r}'s share "
            f"{plan.sizes[r]} into micro-batches {plan.micro_batches[r]}, but the rebalancer re-solves and records "
            "whole shares (its first new plan would run a share over a device's memory cap whole, out of memory; "
            "with a capped profile the shares would never move). Pass rebalance=0 to keep these micro-batches, or "
            "solve the plan without accumulate (shares within the memory caps) to rebalance"
        )
    if profile is not None:
        caps = profile.memory_caps()
    else:
        caps = {d: c.memory_cap for d, c in zip(plan.devices, plan.curves) if c.intercept > 0}
    blind = [plan.devices[r] for r in split if caps.get(plan.devices[r]) is None]
    if blind:
        raise ValueError(
            f"the plan runs the shares of {blind} as micro-batches {[plan.micro_batches[r] for r in split]}, "
            "but the rebalancer knows no memory cap for them and would hand them whole shares: give it "
            "the profile the plan was solved from (hetsplit.Rebalancer(profile)), or a plan without "
            "micro-batches"
        )
    return {d: c for d, c in caps.items() if c is not None}


def _spread(values: Sequence[float] | deque[float]) -> float:
    """A robust standard deviation: 1.4826 times the median absolute deviation."""
    mid = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - mid) for v in values)


def _observed(name: str, fixed: float, per_sample: float) -> DeviceProfile:
    """A device known only from its steps: ``fixed + per_sample * b`` seconds for ``b`` samples."""
    curve = Curve([1.0], [fixed + per_sample], fixed, per_sample)
    return DeviceProfile(DeviceInfo(name=name, kind="observed", description=name), [], curve)


def _bounded(old: Sequence[int], new: Sequence[int], budget: int) -> list[int]:
    """Move from ``old`` towards ``new`` shifting at most ``budget`` samples (same total)."""
    delta = [n - o for o, n in zip(old, new)]
    moving = sum(d for d in delta if d > 0)
    if moving <= budget:
        return list(new)
    scale = budget / moving
    out = [o + (math.floor(d * scale) if d > 0 else -math.floor(-d * scale)) for o, d in zip(old, delta)]
    # Rounding can leave the total off by a few samples: settle it on the largest receivers.
    diff = sum(old) - sum(out)
    order = sorted(range(len(out)), key=lambda i: -delta[i] if diff > 0 else delta[i])
    for i in order:
        if diff == 0:
            break
        step = 1 if diff > 0 else -1
        if out[i] + step >= 0:
            out[i] += step
            diff -= step
    return out


def with_communication(plan: Plan, seconds: float) -> Plan:
    """``plan`` with ``seconds`` of communication added to its predicted step (and to the even split's).

    Every working rank is in every collective; the shares stay as solved on compute, and the
    best single device alone has none.
    """
    if not (seconds > 0 and math.isfinite(seconds)):
        return plan
    times = [t + seconds if s > 0 else t for t, s in zip(plan.times, plan.sizes)]
    return dataclasses.replace(plan, times=times, even_time=plan.even_time + seconds)
