"""Bench results: what ``hetsplit bench`` (and ``bench --rebalance``) measured, as data and as a table."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections import Counter
from typing import Any, ClassVar, TypeVar, cast

from ..planning.plan import Plan
from ..planning.rebalance import PlanChange


class _Result:
    """What both results share: to and from a JSON-ready dict, their derived figures (``_DERIVED``) included."""

    _DERIVED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any]) -> _R:
        """Build the result from :meth:`to_dict` output (derived figures are recomputed, unknown keys ignored)."""
        fields = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cast(Any, cls))}}
        if "plan" in fields:
            fields["plan"] = Plan.from_dict(fields["plan"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict, derived figures included."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(cast(Any, self))}
        if isinstance(data.get("plan"), Plan):
            data["plan"] = data["plan"].to_dict()
        data.update({name: getattr(self, name) for name in self._DERIVED})
        return copy.deepcopy(data)


_R = TypeVar("_R", bound=_Result)


@dataclasses.dataclass
class BenchResult(_Result):
    """Measured throughput of each way to train on the devices.

    Attributes:
        devices: The devices (emulated ones keep their ``@speed`` suffix).
        model: The model's name.
        batch_size: Samples per step.
        mode: ``"gather"`` (loss on gathered outputs) or ``"local"`` (loss per device).
        single: Samples/s of each device alone at the full batch.
        even: Samples/s of the even split.
        balanced: Samples/s of the balanced split.
        plan: The balanced plan used: solved from the profile, calibrated inside the split
            unless ``calibration`` is empty.
        step_times: Median seconds per step of each configuration.
        overhead: HeteroDataParallel's step time on one real device over the plain
            module's, minus 1 (``None`` when no real device is in the set).
        busy: For ``"even"`` and ``"balanced"``: each device's median busy seconds in a
            step (its forward and backward).
        meta: Date, host, torch version, threads, steps.
        predicted: The predicted seconds per step of each configuration (docs/cli.md says how).
        holdout: Per device, the profile's error at a measured size left out of its fit
            (``batch``, ``predicted``, ``measured``).
        processes: The demo's process engine on the balanced split (``step``, ``steps``, ``allreduce``,
            ``gradient_bytes``, and ``work``: each rank's own step without the all-reduce).
        calibration: How the balanced plan was calibrated inside the split (empty: not
            calibrated): ``steps``, each device's ``factors`` (busy seconds in the split over
            the profile's prediction) and their ``uncertainty``, ``rest`` (seconds outside the
            devices' work), ``step``, and the profile-alone plan's ``sizes`` and ``predicted`` step.
    """

    devices: list[str]
    model: str
    batch_size: int
    mode: str
    single: dict[str, float]
    even: float
    balanced: float
    plan: Plan
    step_times: dict[str, float]
    overhead: float | None
    busy: dict[str, dict[str, float]]
    meta: dict[str, Any]
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    holdout: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    processes: dict[str, Any] = dataclasses.field(default_factory=dict)
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)

    _DERIVED = ("fastest", "ideal", "speedup_vs_single", "speedup_vs_even", "efficiency", "ideal_in_split")

    @property
    def fastest(self) -> str:
        """The fastest single device."""
        return max(self.single, key=self.single.__getitem__)

    @property
    def ideal(self) -> float:
        """The ideal: the sum of the devices' single-device throughputs."""
        return sum(self.single.values())

    @property
    def ideal_in_split(self) -> float | None:
        """The ideal at the speeds the devices showed inside the split (``None`` uncalibrated).

        What the devices can reach while they share the host: the engine's own losses show against it.
        """
        factors = self.calibration.get("factors") if self.calibration else None
        if not factors:
            return None
        return float(sum(thr / factors.get(name, 1.0) for name, thr in self.single.items()))

    @property
    def speedup_vs_single(self) -> float:
        """Balanced over the fastest single device."""
        return self.balanced / self.single[self.fastest]

    @property
    def speedup_vs_even(self) -> float:
        """Balanced over the even split."""
        return self.balanced / self.even

    @property
    def efficiency(self) -> float:
        """Balanced throughput as a fraction of the ideal."""
        return self.balanced / self.ideal

    def table(self) -> str:
        """A plain-text table of the results."""
        rows = [
            (
                f"{name} alone" + (" (emulated)" if "@" in name else ""),
                self.single[name],
                self.step_times[f"single:{name}"],
            )
            for name in dict.fromkeys(self.devices)  # a device listed twice is one device alone
        ]
        rows += [
            ("even split", self.even, self.step_times["even"]),
            (f"balanced split {self.plan.sizes}", self.balanced, self.step_times["balanced"]),
            ("ideal (sum of single devices)", self.ideal, self.batch_size / self.ideal),
        ]
        keys = [f"single:{name}" for name in dict.fromkeys(self.devices)] + ["even", "balanced", ""]
        width = max(len(r[0]) for r in rows)
        lines = [
            f"{'configuration'.ljust(width)}  samples/s  step (ms)  predicted (ms)",
            f"{'-' * width}  ---------  ---------  --------------",
        ]
        for (name, thr, t), key in zip(rows, keys):
            guess = self.predicted.get(key)
            tail = f"  {1e3 * guess:9.2f} ({guess / t - 1:+.0%})" if guess else ""
            lines.append(f"{name.ljust(width)}  {thr:9.0f}  {1e3 * t:9.2f}{tail}")
        for name, h in self.holdout.items():
            lines.append(
                f"profile of {name} at batch {h['batch']:.0f}, left out of its fit: predicted "
                f"{1e3 * h['predicted']:.2f} ms, measured {1e3 * h['measured']:.2f} ms "
                f"({h['predicted'] / h['measured'] - 1:+.0%})"
            )
        cal = self.calibration
        if cal:
            # No factors: the plan ran on one device (the module's own step), nothing was split.
            factors = ", ".join(f"{name} x{f:.2f}" for name, f in cal["factors"].items()) or "none"
            lines.append(
                f"calibrated in the split over {cal['steps']} steps: busy / profile {factors}; "
                f"{1e3 * cal['rest']:.2f} ms a step outside the devices' work; the profile alone planned "
                f"{cal['sizes']} at {1e3 * cal['predicted']:.2f} ms"
            )
            if self.ideal_in_split is not None:
                lines.append(
                    f"ideal at those in-split speeds: {self.ideal_in_split:.0f} samples/s; balanced reaches "
                    f"{self.balanced / self.ideal_in_split:.0%} of it"
                )
        copies = {name: n for name, n in Counter(self.devices).items() if n > 1}
        if copies:
            listed = ", ".join(f"{name} {n} times" for name, n in copies.items())
            lines.append(f"listed {listed}: copies of a device share it, so it counts once in the ideal")
        lines.append("")
        used = [name for name, size in zip(self.plan.devices, self.plan.sizes) if size > 0]
        if len(used) == 1:
            # "balanced [8, 0]" is that device alone through the wrapper: a speedup over it
            # would be the wrapper's overhead and noise, not a split.
            lines.append(
                f"the balanced split {self.plan.sizes} is {used[0]} alone: at a batch of {self.batch_size} the other "
                "devices would only slow the step, so nothing is split (a larger --batch-size shows a split); "
                f"vs even: {self.speedup_vs_even:.2f}x; efficiency vs ideal: {self.efficiency:.0%}"
            )
        else:
            lines.append(
                f"balanced vs {self.fastest} alone: {self.speedup_vs_single:.2f}x; vs even: "
                f"{self.speedup_vs_even:.2f}x; efficiency vs ideal: {self.efficiency:.0%}"
            )
        if self.overhead is not None:
            lines.append(f"HeteroDataParallel overhead on one device at the same batch: {self.overhead:+.1%}")
        return "\n".join(lines)


@dataclasses.dataclass
class RebalanceResult(_Result):
    """What online rebalancing did in a run, and how close it came to the best split.

    Attributes:
        devices: The devices.
        model: The model's name.
        batch_size: Samples per step.
        every: Steps between re-solves.
        change: ``{"device", "speed", "step"}`` of the mid-run speed change, or ``None``.
        step_times: Seconds of every step.
        sizes: The split each step ran with.
        changes: The plan changes (:meth:`PlanChange.to_dict`).
        optimum: Median step time of the best split found by a sweep at the end.
        optimum_sizes: That split.
        settle: Steps counted as converging (from the start, or from the change).
        rebalancer_seconds: Time spent in the rebalancer's own code.
        meta: Date, host, torch version, threads.
    """

    devices: list[str]
    model: str
    batch_size: int
    every: int
    change: dict[str, Any] | None
    step_times: list[float]
    sizes: list[list[int]]
    changes: list[dict[str, Any]]
    optimum: float
    optimum_sizes: list[int]
    settle: int
    rebalancer_seconds: float
    meta: dict[str, Any]

    _DERIVED = ("recovered_after", "late_changes", "late_steps", "overhead")

    @property
    def recovered_after(self) -> int | None:
        """Steps after the change (or the start) until 5 steps' median is within 10 % of the optimum."""
        start = self.change["step"] if self.change else 0
        times = self.step_times
        for k in range(start, len(times) - 4):
            if statistics.median(times[k : k + 5]) <= 1.1 * self.optimum:
                return k - start
        return None

    @property
    def late_changes(self) -> int:
        """Plan changes after the settling steps (after the change, when there is one)."""
        start = (self.change["step"] if self.change else 0) + self.settle
        return sum(1 for c in self.changes if c["step"] >= start)

    @property
    def late_steps(self) -> int:
        """Steps after the settling steps."""
        return max(0, len(self.step_times) - (self.change["step"] if self.change else 0) - self.settle)

    @property
    def overhead(self) -> float:
        """The rebalancer's own time as a fraction of the run's step time."""
        return self.rebalancer_seconds / sum(self.step_times)

    def table(self) -> str:
        """Plan changes, step times per stretch of 10 steps, and the verdict, as text."""
        lines = ["plan changes:"]
        lines += [f"  {PlanChange(**c)}" for c in self.changes] or ["  none"]
        lines.append("")
        lines.append("steps      median step (ms)  split")
        for a in range(0, len(self.step_times), 10):
            block = self.step_times[a : a + 10]
            lines.append(
                f"{a:4d}-{a + len(block) - 1:<4d}  {1e3 * statistics.median(block):16.2f}  "
                f"{self.sizes[a + len(block) - 1]}"
            )
        lines.append("")
        lines.append(f"best split found by a sweep at the end: {self.optimum_sizes}, {1e3 * self.optimum:.2f} ms/step")
        rec = self.recovered_after
        what = f"the change at step {self.change['step']}" if self.change else "the start"
        lines.append("within 10% of it " + (f"{rec} steps after {what}" if rec is not None else f"never after {what}"))
        lines.append(
            f"plan changes after settling ({self.settle} steps): {self.late_changes} in {self.late_steps} steps; "
            f"rebalancer cost {self.overhead:.3%} of step time"
        )
        return "\n".join(lines)
