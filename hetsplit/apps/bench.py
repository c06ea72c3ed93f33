"""Bench: measure training throughput of single device vs even split vs balanced split."""

from __future__ import annotations

import copy
import datetime as _dt
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import timing
from ..devices import Device, DeviceLike, parse_devices
from ..parallel.data_parallel import HeteroDataParallel
from ..planning.curve import holdout_error
from ..planning.records import Measurement
from ..planning.sizes import batchnorm_minimum, with_minimum_shares
from ..planning.solver import solve
from ..profiler import emulation_faults, emulation_warning, fault_note, held_to_declared_speed
from ..profiler import profile as run_profile
from .bench_result import BenchResult
from .bench_timing import calibrate_plan, time_steps
from .models import ModelSpec, build_model, load_model, synthetic_batch


def cpu_threads(devices: Sequence[Device], requested: int | None = None) -> int:
    """Torch's intra-op threads for a run on ``devices``: the one rule of profile, bench and demo.

    See :func:`hetsplit.timing.cpu_threads` (``requested`` if given; else 1 when every
    device is the CPU, real or emulated; else torch's own choice).
    """
    return timing.cpu_threads(devices, requested or None)


def keep_freed_memory() -> bool:
    """Keep memory freed by torch inside the process (glibc only); True if applied.

    By default glibc serves large blocks (activations) with mmap and returns them to the
    OS on free, so every training step faults its activations in again. On virtual
    machines that report free pages to the host this makes CPU step times erratic
    (the same LeNet step varies 2.4-9 ms here). Benchmarks call this so that every
    configuration runs under the same, steady allocator; for your own CPU training the
    environment variables ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296``
    (or jemalloc/tcmalloc, as PyTorch's tuning guide suggests) do the same.
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

    The balanced split comes from profiling the model on the devices first (at the
    ladder 2..batch_size). All runs use the same synthetic batch and an SGD step.

    Args:
        model: A built-in model name, ``package.module:factory``, or a :class:`ModelSpec`.
        devices: The devices (two or more).
        batch_size: Samples per step.
        steps: Timed steps per configuration (the median is kept).
        warmup: Untimed steps first.
        mode: ``"gather"`` or ``"local"`` (see :class:`HeteroDataParallel`).
        profile_budget: Seconds for the profile behind the balanced split.
        calibrate: Balanced steps run before timing to calibrate the plan inside the
            split (0: off): each device's busy time there over its profile's prediction
            scales its curve, the split is solved again, and the predicted step adds the
            measured time outside the devices' work. A profile times each device alone;
            inside the split the devices share the host (cores, memory bandwidth, the
            interpreter), which is what these steps see.
        calibrate_seconds: Go on calibrating, ``calibrate`` steps at a time, until the
            calibration steps took this long (fewer steps leave more noise in the factors
            and the prediction; 0: exactly ``calibrate`` steps).
        seed: Seed of the model and the synthetic data.
        log: Called with a line of progress per configuration.
        progress: Show progress bars (tqdm) while profiling and training.

    Returns:
        The :class:`BenchResult`.
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
