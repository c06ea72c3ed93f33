"""Bench timing: the harness's round-robin step timer, and calibrating a plan inside the split."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..devices import Device
from ..planning.plan import Plan, scaled_step
from ..planning.rebalance import Rebalancer
from ..planning.sizes import with_minimum_shares
from ..planning.solver import plan_from_sizes

# Calibration steps at most, however short a step is.
_MAX_CALIBRATION_STEPS = 200


def time_steps(
    steps_by_name: dict[str, Callable[[], None]],
    devices: Sequence[Device],
    steps: int,
    warmup: int,
    *,
    progress: bool = False,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each step function, timed round-robin.

    The configurations take turns step by step, so a machine whose speed drifts (a
    shared VM, thermal throttling) slows them all alike instead of whichever ran last.

    Args:
        steps_by_name: One zero-argument step function per configuration.
        devices: Devices to synchronise after each step, so it is timed whole.
        steps: Timed steps per configuration.
        warmup: Untimed steps per configuration first.
        progress: Show a progress bar (tqdm).
        samples: If given, receives every step's seconds per configuration.
    """
    from tqdm.auto import tqdm

    total = (warmup + steps) * len(steps_by_name)
    with tqdm(total=total, disable=not progress, desc="training", unit="step", leave=False) as bar:
        for fn in steps_by_name.values():
            for _ in range(warmup):
                fn()
                bar.update()
        times: dict[str, list[float]] = {name: [] for name in steps_by_name}
        for _ in range(steps):
            for name, fn in steps_by_name.items():
                start = time.perf_counter()
                fn()
                for d in devices:
                    d.synchronize()
                times[name].append(time.perf_counter() - start)
                bar.update()
    if samples is not None:
        samples.update(times)
    return {name: statistics.median(ts) for name, ts in times.items()}


def calibrate_plan(
    prof: Any,
    plan: Plan,
    step: Callable[[], None],
    busy: list[dict[str, float]],
    devs: Sequence[Device],
    steps: int,
    warmup: int,
    *,
    seconds: float = 0.0,
    minimum: int = 1,
    set_plan: Callable[[Plan], None] | None = None,
) -> tuple[Plan, dict[str, Any]]:
    """Run ``step`` (balanced, on ``plan``) and re-solve from each device's busy time inside the split.

    The factors are the :class:`~hetsplit.Rebalancer`'s (the median over the steps of busy
    over predicted seconds, per device). The plan moves only when the rebalancer's rule
    says so: when the predicted gain beats both 1 % and twice the factors' own
    uncertainty, since a move inside the noise makes the step no faster while its
    prediction, taken from the luckiest steps, looks better than it is. ``rest`` is the
    median of each step's wall time beyond its busiest device (loss, gather, the optimizer,
    hand-offs), which the plan's curves do not hold.

    The predicted step is taken step by step: each calibration step's busy times, scaled
    to the new shares by the profile's curves, their longest, plus that step's rest; the
    median over the steps. A step lasts as long as its slowest device, and the slowest
    of several noisy devices is slower on average than the slowest of their medians.

    Args:
        prof: The devices' profile, which ``plan`` was solved from.
        plan: The plan ``step`` runs.
        step: One balanced training step; appends the devices' busy seconds to ``busy``.
        busy: Filled by ``step``, one dict per step (left holding the calibration steps').
        devs: Devices to synchronise after each step, so it is timed whole.
        steps: Calibration steps (at least).
        warmup: Untimed steps first.
        seconds: Keep calibrating, ``steps`` at a time, until the steps took this long
            (the factors' noise falls with the number of steps; 0: exactly ``steps``).
        minimum: The fewest samples a share may hold (a BatchNorm model's:
            :func:`~hetsplit.planning.sizes.batchnorm_minimum`); none smaller in the result.
        set_plan: Makes ``step`` run another plan. Given, a calibrated plan that runs
            another set of devices than the calibration steps did (a device dropped to 0,
            or one device left alone: the module's own step) is run for a second round of
            calibration steps, and predicted from those: with a device fewer, the others
            no longer share the cores with it (emulated devices on one CPU), and one
            device alone skips the scatter and gather, which scaling the first round's
            busy times cannot show (measured: +22 %, +52 % and -27 % off without it).

    Returns:
        The calibrated plan and what was measured (see ``BenchResult.calibration``).
    """
    if steps < 1:
        raise ValueError(f"calibration needs at least one step, got steps={steps!r}")
    walls = _calibration_steps(step, busy, devs, steps, warmup, seconds)
    rebalancer = Rebalancer(prof, every=1, threshold=0.01, max_move=1.0, window=max(1, len(busy)))
    # A plan that runs a share as micro-batches (a memory cap) is re-solved and re-cut alike.
    rebalancer.accumulate = any(len(m) > 1 for m in plan.micro_batches)
    for seen in busy:
        rebalancer.record(plan, seen)
    moved = rebalancer.propose(plan)
    corrected = moved or plan_from_sizes(
        rebalancer.corrected(plan.devices), plan.devices, plan.sizes, accumulate=rebalancer.accumulate
    )
    if minimum > 1:  # as HeteroDataParallel would for a plan it solved (planning.sizes)
        corrected = with_minimum_shares(
            corrected,
            minimum,
            profile=rebalancer.corrected(plan.devices),
            accumulate=rebalancer.accumulate,
        )
    ran, taken = plan, len(walls)
    if set_plan is not None and [s > 0 for s in corrected.sizes] != [s > 0 for s in plan.sizes]:
        set_plan(corrected)  # the steps that predict it run its own set of devices
        walls, ran = _calibration_steps(step, busy, devs, steps, warmup, seconds), corrected
        taken += len(walls)
    rests = [max(0.0, w - max(b.values(), default=w)) for w, b in zip(walls, busy)]
    info = {
        "steps": taken,
        "rounds": 1 if ran is plan else 2,
        "factors": rebalancer.factors(),
        "uncertainty": rebalancer.uncertainty(list(rebalancer.factors())),
        "rest": statistics.median(rests),
        "step": _predicted_step(prof, ran, corrected, busy, walls, rests),
        "sizes": list(plan.sizes),
        "predicted": plan.step_time,
    }
    return corrected, info


def _calibration_steps(
    step: Callable[[], None],
    busy: list[dict[str, float]],
    devs: Sequence[Device],
    steps: int,
    warmup: int,
    seconds: float,
) -> list[float]:
    """Warm up, then run ``step`` ``steps`` at a time until they took ``seconds``: their walls (``busy``: theirs)."""
    for _ in range(warmup):
        step()
    busy.clear()  # the warm-up steps' busy times are not calibration
    samples: dict[str, list[float]] = {}
    walls: list[float] = []
    while not walls or (sum(walls) < seconds and len(walls) < _MAX_CALIBRATION_STEPS):
        time_steps({"balanced": step}, devs, steps, 0, samples=samples)
        walls += samples["balanced"]
    return walls


def _predicted_step(
    prof: Any, plan: Plan, new: Plan, busy: list[dict[str, float]], walls: list[float], rests: list[float]
) -> float:
    """The calibration steps' wall time had they run ``new`` (:func:`~hetsplit.planning.plan.scaled_step`)."""
    if not any(busy):  # the module's own step (one active device): no busy times, the wall is the work
        return float(statistics.median(walls))
    # Per device, once: its profiled time on the old and the new share, micro-batch by micro-batch.
    scales = []
    for name, was, now in zip(plan.devices, plan.micro_batches, new.micro_batches):
        curve = prof.entry(name).curve
        before = sum(map(curve, was))
        scales.append(sum(map(curve, now)) / before if before > 0 else None)
    steps = [([seen.get(name) for name in plan.devices], rest) for seen, rest in zip(busy, rests)]
    return scaled_step(steps, scales, new.times)
