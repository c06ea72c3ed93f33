"""Bench: what ``hetsplit bench`` runs: each device alone vs the even and the balanced split, and online rebalancing.

The results and their tables are in :mod:`~hetsplit.apps.bench_result`; docs/cli.md says how it calibrates.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import Device, DeviceLike, parse_device, parse_devices
from ..emulation import check_speed
from ..parallel.data_parallel import HeteroDataParallel
from ..planning.curve import holdout_error
from ..planning.plan import Plan, even_sizes, scaled_step
from ..planning.rebalance import Rebalancer
from ..planning.records import Measurement
from ..planning.sizes import batchnorm_minimum, with_minimum_shares
from ..planning.solver import plan_from_sizes, solve
from ..profiler import emulation_faults, emulation_warning, fault_note, held_to_declared_speed
from ..profiler import profile as run_profile
from .bench_result import BenchResult, RebalanceResult
from .models import ModelSpec, build_model, load_model, synthetic_batch

# Calibration steps at most, however short a step is.
_MAX_CALIBRATION_STEPS = 200


def keep_freed_memory() -> bool:
    """Keep memory freed by torch inside the process (glibc only); True if applied.

    glibc returns large blocks to the OS on free, so every step faults them in again: the same
    LeNet step varied 2.4-9 ms on a VM.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        # 32 MiB is glibc's largest mmap threshold on 64-bit; larger values are refused.
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def plain_step(model: nn.Module, dev: Device, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = x.to(dev.torch_device), y.to(dev.torch_device)

    def step() -> None:
        # Forward and backward are throttled as separate pieces, as in HeteroDataParallel.
        opt.zero_grad(set_to_none=True)
        with dev.throttle():
            loss = F.cross_entropy(model(x), y)
        with dev.throttle():
            loss.backward()
        opt.step()

    return step


def dp_step(
    dp: HeteroDataParallel, x: torch.Tensor, y: torch.Tensor, mode: str, busy: list[dict[str, float]] | None = None
) -> Callable[[], None]:
    opt = torch.optim.SGD(dp.parameters(), lr=1e-3)
    x, y = x.to(dp.output_device), y.to(dp.output_device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if mode == "local":
            dp.train_step(x, y, F.cross_entropy)
        else:
            F.cross_entropy(dp(x), y.to(dp.output_device)).backward()
        opt.step()
        if busy is not None:
            busy.append(dp.step_times)

    return step


def bench(
    model: str | ModelSpec = "lenet",
    devices: str | Sequence[DeviceLike] = "cpu,cpu@0.25",
    *,
    batch_size: int = 256,
    steps: int = 20,
    warmup: int = 3,
    mode: str = "gather",
    profile_budget: float = 20.0,
    calibrate: int = 5,
    calibrate_seconds: float = 2.0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> BenchResult:
    """Train ``steps`` steps each on every device alone, on the even split and on the balanced split.

    The balanced split comes from profiling the model on the devices first, then calibrating
    it inside the split (:func:`calibrate_plan`, ``calibrate`` steps at a time until
    ``calibrate_seconds``; 0: off). All runs use the same synthetic batch and an SGD step.
    """
    if mode not in ("gather", "local"):
        raise ValueError(f"mode must be 'gather' or 'local', got {mode!r}")
    if isinstance(calibrate, bool) or not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"calibrate must be a whole number of steps >= 0 (0: off), got {calibrate!r}")
    if not 0 <= calibrate_seconds < float("inf"):
        raise ValueError(f"calibrate_seconds must be a number of seconds >= 0, got {calibrate_seconds!r}")
    devs = parse_devices(devices)
    tuned = keep_freed_memory()
    if len(devs) < 2:
        raise ValueError(f"bench compares splits, so it needs two or more devices; got {[d.name for d in devs]}")
    spec = load_model(model) if isinstance(model, str) else model
    say = log or (lambda line: None)
    torch.manual_seed(seed)
    base = build_model(spec)
    x, y = synthetic_batch(spec, batch_size, seed=seed)
    home = home_device(devs)
    say(f"profiling {spec.name} on {', '.join(d.name for d in devs)} for the balanced split ...")
    ladder = [b for b in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < batch_size] + [batch_size]
    prof = run_profile(
        base,
        x[:16],
        devs,
        F.cross_entropy,
        ladder,
        target=y[:16],
        time_budget=profile_budget,
        progress=progress,
        model_name=spec.name,
        check_emulation=False,  # said in the result, with the calibration's factors (emulation_warning)
        threads=torch.get_num_threads(),  # the threads the configurations train with, whatever they are
    )
    # An emulated device that measured faster than its declared speed is planned at that speed
    # (held_to_declared_speed); the calibration below re-solves from the split's own steps.
    held = held_to_declared_speed(prof, emulation_faults(prof))
    plan = solve(held, batch_size, devices=[d.name for d in devs])  # a repeated device: its curve per copy
    # No share too small for BatchNorm's statistics (as every engine plans).
    minimum = batchnorm_minimum(base, (x[:16],), None, len(x[:16]))
    plan = with_minimum_shares(plan, minimum, profile=held)
    configs: dict[str, Callable[[], None]] = {}
    for dev in devs:
        configs[f"single:{dev.name}"] = plain_step(copy.deepcopy(base).to(dev.torch_device), dev, x, y)
    busy: dict[str, list[dict[str, float]]] = {"even": [], "balanced": []}
    even_dp = HeteroDataParallel(copy.deepcopy(base).to(home), devs, weights=[1] * len(devs), quiet=True)
    configs["even"] = dp_step(even_dp, x, y, mode, busy["even"])
    bal_dp = HeteroDataParallel(copy.deepcopy(base).to(home), devs, plan=plan, quiet=True)
    configs["balanced"] = dp_step(bal_dp, x, y, mode, busy["balanced"])
    calibration: dict[str, Any] = {}
    if calibrate > 0:
        say(f"calibrating the plan {plan.sizes} inside the split over {calibrate}+ steps ...")
        plan, calibration = calibrate_plan(
            prof, plan, configs["balanced"], busy["balanced"], devs, calibrate, warmup, seconds=calibrate_seconds,
            minimum=minimum, set_plan=bal_dp.set_plan,
        )  # fmt: skip
        bal_dp.set_plan(plan)
        busy["balanced"].clear()
    real = [d for d in devs if not d.emulated and d.torch_device == home]
    if real:
        one = HeteroDataParallel(copy.deepcopy(base).to(home), [real[0]], weights=[1], quiet=True)
        configs["one-device"] = dp_step(one, x, y, mode)
    say(f"timing {len(configs)} configurations round-robin, {steps} steps each (balanced split {plan.sizes}) ...")
    samples: dict[str, list[float]] = {}
    step_times = time_steps(configs, devs, steps, warmup, progress=progress, samples=samples)
    single = {d.name: batch_size / step_times[f"single:{d.name}"] for d in devs}
    timeline = {
        name: {d.name: statistics.median(b.get(d.name, 0.0) for b in busy[name]) for d in devs}
        for name in ("even", "balanced")
    }
    overhead = step_times["one-device"] / step_times[f"single:{real[0].name}"] - 1.0 if real else None
    predicted = {f"single:{d.name}": prof.step_time(d.name, batch_size) for d in devs}
    # The even split adds the calibration's time outside the devices' work to its curves; the
    # balanced one is predicted from the calibration steps themselves (see calibrate_plan).
    rest = calibration.get("rest", 0.0)
    predicted.update(even=plan.even_time + rest, balanced=calibration.get("step", plan.step_time))
    alone = predicted.get(f"single:{plan.single_device}") if plan.single_device else None
    noise = plan.noise_notes(step=predicted["balanced"], even=predicted["even"], single=alone)
    return BenchResult(
        devices=[d.name for d in devs],
        model=spec.name,
        batch_size=batch_size,
        mode=mode,
        single=single,
        even=batch_size / step_times["even"],
        balanced=batch_size / step_times["balanced"],
        plan=plan,
        step_times=step_times,
        overhead=overhead,
        busy=timeline,
        predicted={k: v for k, v in predicted.items() if v == v and v < float("inf")},
        holdout=_holdout_errors(prof),
        calibration=calibration,
        meta={
            "date": _dt.date.today().isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "steps": steps,
            "warmup": warmup,
            "data": "synthetic",
            "emulated": [d.name for d in devs if d.emulated],
            "emulation_warning": emulation_warning(prof, calibration.get("factors")),
            # What the plan line says of it: planned at the declared speed, or as calibrated in the split.
            "emulation_note": fault_note(
                emulation_faults(prof, calibration.get("factors")),
                calibrated=bool(calibration) and calibration["sizes"] != list(plan.sizes),
            ),
            "noise": noise,
            # Each configuration's steps' own ± (half their interquartile range over the median, as a
            # profile's): what an error of a prediction against their median is to be read beside.
            "step_noise": {name: Measurement(batch_size, times).spread for name, times in samples.items()},
            "allocator_kept_memory": tuned,
        },
    )


def _holdout_errors(prof: Any) -> dict[str, dict[str, float]]:
    """Per device of a profile, its curve's error at the middle measured size, refitted without it."""
    out = {}
    for entry in prof.entries:
        found = holdout_error([(m.batch, m.median) for m in entry.measurements], entry.curve.memory_cap)
        if found is not None:
            out[entry.name] = dict(zip(("batch", "predicted", "measured"), map(float, found)))
    return out


def home_device(devs: Sequence[Device]) -> torch.device:
    """Where the module lives: the first real CUDA device if any, else the first device."""
    for d in devs:
        if d.type == "cuda" and not d.emulated:
            return d.torch_device
    return devs[0].torch_device


def time_steps(
    steps_by_name: dict[str, Callable[[], None]],
    devices: Sequence[Device],
    steps: int,
    warmup: int,
    *,
    progress: bool = False,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each step function, timed round-robin (``samples``: every step's seconds).

    Taking turns step by step, a machine whose speed drifts (a shared VM, thermal throttling) slows
    them all alike instead of whichever ran last.
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

    The rule for moving is the :class:`~hetsplit.Rebalancer`'s; the predicted step is explained in docs/cli.md.

    Args:
        step: One balanced training step; appends the devices' busy seconds to ``busy``.
        seconds: Keep calibrating, ``steps`` at a time, until the steps took this long (0: exactly ``steps``).
        minimum: The fewest samples a share may hold (a BatchNorm model's).
        set_plan: Makes ``step`` run another plan. Given, a calibrated plan that runs another
            set of devices is predicted from a second round of its own steps, since scaling the
            first round's busy times missed by +22 %, +52 % and -27 %.

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

    At the end the final split and its neighbours (:func:`_neighbours`) are timed round-robin; the
    fastest is the optimum the run is judged against.

    Args:
        change: ``(device, speed, step)``: the emulated ``device`` runs at ``speed`` from
            ``step`` on (see :func:`parse_change`).
        settle: Steps after the start (or the change) counted as converging.
        sweep_steps: Timed steps per split in the final sweep.
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
