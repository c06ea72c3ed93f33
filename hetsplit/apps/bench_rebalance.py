"""Bench rebalance: train from the even split with online rebalancing, optionally changing a device's speed."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..devices import DeviceLike, parse_device, parse_devices
from ..emulation import check_speed
from ..parallel.data_parallel import HeteroDataParallel
from ..planning.plan import even_sizes
from ..planning.rebalance import PlanChange, Rebalancer
from .bench import dp_step, home_device, keep_freed_memory
from .bench_timing import time_steps
from .models import ModelSpec, load_model, synthetic_batch


def parse_change(text: str) -> tuple[str, float, int]:
    """Parse a speed change ``DEVICE=SPEED@STEP``: ``"cpu@1=0.25@30"`` slows ``cpu@1`` to 0.25x at step 30.

    Raises:
        ValueError: Naming the text, if it is not of that form or names a real device.
    """
    name, eq, rest = text.rpartition("=")
    speed, at, step = rest.partition("@")
    try:
        value, when = float(speed), int(step)
    except ValueError:
        raise ValueError(f"bad speed change {text!r}; write DEVICE=SPEED@STEP, e.g. cpu@1=0.25@30") from None
    if not eq or not at or not 0 < value <= 1 or when < 0:
        raise ValueError(f"bad speed change {text!r}; write DEVICE=SPEED@STEP with 0 < SPEED <= 1, e.g. cpu@1=0.25@30")
    check_speed(value, text)  # the emulation's own bound: a speed of 1e-7 would never finish a step
    dev = parse_device(name)
    if not dev.emulated:
        raise ValueError(f"{dev.name!r} in {text!r} is a real device; only emulated ones (e.g. cpu@1) change speed")
    return dev.name, value, when


@dataclasses.dataclass
class RebalanceResult:
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RebalanceResult:
        """Build the result from :meth:`to_dict` output (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict, derived figures included."""
        data = dataclasses.asdict(self)
        data.update(
            recovered_after=self.recovered_after,
            late_changes=self.late_changes,
            late_steps=self.late_steps,
            overhead=self.overhead,
        )
        return data

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


def bench_rebalance(
    model: str | ModelSpec = "lenet",
    devices: str | Sequence[DeviceLike] = "cpu,cpu@0.25",
    *,
    batch_size: int = 256,
    steps: int = 120,
    every: int = 5,
    change: tuple[str, float, int] | None = None,
    settle: int = 40,
    sweep_steps: int = 8,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> RebalanceResult:
    """Train with online rebalancing from an even split; optionally change a device's speed mid-run.

    ``HeteroDataParallel(..., rebalance=Rebalancer(every=every))`` starts from the even
    split (a deliberately wrong plan on unequal devices) without a profile. At the end,
    the final split and its neighbours (2.5-10 % of the batch moved between each pair of
    devices) are timed round-robin; the fastest is the optimum the run is judged against.

    Args:
        model: A built-in model name, ``package.module:factory``, or a :class:`ModelSpec`.
        devices: The devices (two or more).
        batch_size: Samples per step.
        steps: Training steps.
        every: Steps between re-solves.
        change: ``(device, speed, step)``: the emulated ``device`` runs at ``speed`` from
            ``step`` on (see :func:`parse_change`).
        settle: Steps after the start (or the change) counted as converging.
        sweep_steps: Timed steps per split in the final sweep.
        seed: Seed of the model and the synthetic data.
        log: Called with a line of progress now and then.

    Returns:
        The :class:`RebalanceResult`.
    """
    devs = parse_devices(devices)
    if len(devs) < 2:
        raise ValueError(f"rebalancing needs two or more devices; got {[d.name for d in devs]}")
    names = [d.name for d in devs]
    changed = None  # (the device, its new speed, the step it changes at)
    if change is not None:
        if change[0] not in names:
            raise ValueError(f"the speed change names {change[0]!r}, which is not among the devices {names}")
        changed = (devs[names.index(change[0])], change[1], change[2])
    tuned = keep_freed_memory()
    spec = load_model(model) if isinstance(model, str) else model
    say = log or (lambda line: None)
    torch.manual_seed(seed)
    x, y = synthetic_batch(spec, batch_size, seed=seed)
    home = home_device(devs)
    reb = Rebalancer(every=every, on_change=lambda c: say(f"plan change at {c}"))
    dp = HeteroDataParallel(spec.factory().to(home), devs, weights=[1] * len(devs), quiet=True)
    step = dp_step(dp, x, y, "gather")
    times: list[float] = []
    sizes: list[list[int]] = []
    try:
        step()  # warm up, unobserved
        dp.rebalancer = reb
        for k in range(steps):
            if changed is not None and k == changed[2]:
                device, speed, _ = changed
                device.set_speed(speed)
                say(f"step {k}: {device.name} now runs at {speed:g}x")
            sizes.append(list(dp.sizes_for(batch_size)))
            start = time.perf_counter()
            step()
            for d in devs:
                d.synchronize()
            times.append(time.perf_counter() - start)
        settled = dp.plan
        if settled is None:  # the wrapper has run steps, so it holds the plan they ran
            raise RuntimeError("the rebalanced wrapper holds no plan after its steps")
        say(f"sweeping splits around {settled.sizes} for the optimum ...")
        candidates = _neighbours(settled.sizes, batch_size)
        sweep = {}
        for cand in candidates:
            fixed = HeteroDataParallel(spec.factory().to(home), devs, weights=cand, quiet=True)
            sweep[str(cand)] = dp_step(fixed, x, y, "gather")
        medians = time_steps(sweep, devs, sweep_steps, 1)
    finally:
        if changed is not None:
            changed[0].set_speed(None)
    best = min(medians, key=medians.__getitem__)
    return RebalanceResult(
        devices=names,
        model=spec.name,
        batch_size=batch_size,
        every=every,
        change=None if change is None else {"device": change[0], "speed": change[1], "step": change[2]},
        step_times=times,
        sizes=sizes,
        changes=[c.to_dict() for c in reb.history],
        optimum=medians[best],
        optimum_sizes=json.loads(best),
        settle=settle,
        rebalancer_seconds=reb.seconds,
        meta={
            "date": _dt.date.today().isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "data": "synthetic",
            "emulated": [d.name for d in devs if d.emulated],
            "allocator_kept_memory": tuned,
            "start": even_sizes(batch_size, len(devs)),
        },
    )


def _neighbours(sizes: Sequence[int], batch: int) -> list[list[int]]:
    """``sizes`` and the splits moving 2.5, 5 or 10 % of the batch between any two devices."""
    out = [list(sizes)]
    for frac in (0.025, 0.05, 0.1):
        k = max(1, round(frac * batch))
        for i in range(len(sizes)):
            for j in range(len(sizes)):
                if i != j and sizes[i] >= k:
                    cand = list(sizes)
                    cand[i] -= k
                    cand[j] += k
                    if cand not in out:
                        out.append(cand)
    return out
