"""Bench: measure training throughput of single device vs even split vs balanced split."""

from __future__ import annotations

import copy
import dataclasses
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

from .devices import Device, DeviceLike, parse_devices
from .models import ModelSpec, load_model, synthetic_batch
from .parallel import HeteroDataParallel
from .profiler import profile as run_profile
from .rebalance import PlanChange, Rebalancer
from .solver import Plan, even_sizes, solve

__all__ = ["BenchResult", "RebalanceResult", "bench", "bench_rebalance", "parse_change", "time_steps",
           "keep_freed_memory"]


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


@dataclasses.dataclass
class BenchResult:
    """Measured throughput of each way to train on the devices.

    Attributes:
        devices: The devices (emulated ones keep their ``@speed`` suffix).
        model: The model's name.
        batch_size: Samples per step.
        mode: ``"gather"`` (loss on gathered outputs) or ``"local"`` (loss per device).
        single: Samples/s of each device alone at the full batch.
        even: Samples/s of the even split.
        balanced: Samples/s of the balanced split.
        plan: The balanced plan used (solved from the profile).
        step_times: Median seconds per step of each configuration.
        overhead: HeteroDataParallel's step time on one real device over the plain
            module's, minus 1 (``None`` when no real device is in the set).
        busy: For ``"even"`` and ``"balanced"``: each device's median busy seconds in a
            step (its forward and backward; the rest of the step it waits, or the caller
            scatters, gathers, computes the loss and steps the optimizer).
        meta: Date, host, torch version, threads, steps.
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """Build the result from :meth:`to_dict` output (derived figures are recomputed)."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        fields["plan"] = Plan.from_dict(fields["plan"])
        return cls(**fields)

    @property
    def fastest(self) -> str:
        """The fastest single device."""
        return max(self.single, key=self.single.__getitem__)

    @property
    def ideal(self) -> float:
        """The ideal: the sum of the devices' single-device throughputs."""
        return sum(self.single.values())

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

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict, derived figures included."""
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_dict()
        data.update(fastest=self.fastest, ideal=self.ideal, speedup_vs_single=self.speedup_vs_single,
                    speedup_vs_even=self.speedup_vs_even, efficiency=self.efficiency)
        return data

    def table(self) -> str:
        """A plain-text table of the results."""
        rows = [(f"{name} alone" + (" (emulated)" if "@" in name else ""), self.single[name],
                 self.step_times[f"single:{name}"]) for name in self.devices]
        rows += [("even split", self.even, self.step_times["even"]),
                 (f"balanced split {self.plan.sizes}", self.balanced, self.step_times["balanced"]),
                 ("ideal (sum of single devices)", self.ideal, self.batch_size / self.ideal)]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'configuration'.ljust(width)}  samples/s  step (ms)", f"{'-' * width}  ---------  ---------"]
        lines += [f"{name.ljust(width)}  {thr:9.0f}  {1e3 * t:9.2f}" for name, thr, t in rows]
        lines.append("")
        lines.append(f"balanced vs {self.fastest} alone: {self.speedup_vs_single:.2f}x; vs even: "
                     f"{self.speedup_vs_even:.2f}x; efficiency vs ideal: {self.efficiency:.0%}")
        if self.overhead is not None:
            lines.append(f"HeteroDataParallel overhead on one device at the same batch: {self.overhead:+.1%}")
        return "\n".join(lines)


def time_steps(
    steps_by_name: dict[str, Callable[[], None]], devices: Sequence[Device], steps: int, warmup: int,
    *, progress: bool = False, samples: dict[str, list[float]] | None = None,
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


def _plain_step(model: nn.Module, dev: Device, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
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


def _dp_step(dp: HeteroDataParallel, x: torch.Tensor, y: torch.Tensor, mode: str,
             busy: list[dict[str, float]] | None = None) -> Callable[[], None]:
    opt = torch.optim.SGD(dp.parameters(), lr=1e-3)
    x, y = x.to(dp.home), y.to(dp.home)

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
    sync: str = "copy",
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
        sync: Replica synchronisation (see :class:`HeteroDataParallel`).
        seed: Seed of the model and the synthetic data.
        log: Called with a line of progress per configuration.
        progress: Show progress bars (tqdm) while profiling and training.

    Returns:
        The :class:`BenchResult`.
    """
    if mode not in ("gather", "local"):
        raise ValueError(f"mode must be 'gather' or 'local', got {mode!r}")
    devs = parse_devices(devices)
    tuned = keep_freed_memory()
    if len(devs) < 2:
        raise ValueError(f"bench compares splits, so it needs two or more devices; got {[d.name for d in devs]}")
    spec = load_model(model) if isinstance(model, str) else model
    say = log or (lambda line: None)
    torch.manual_seed(seed)
    base = spec.factory()
    x, y = synthetic_batch(spec, batch_size, seed=seed)
    home = _home_device(devs)
    say(f"profiling {spec.name} on {', '.join(d.name for d in devs)} for the balanced split ...")
    ladder = [b for b in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < batch_size] + [batch_size]
    prof = run_profile(base, x[:16], devs, F.cross_entropy, ladder, target=y[:16], time_budget=profile_budget,
                       progress=progress, model_name=spec.name)
    plan = solve(prof, batch_size)
    configs: dict[str, Callable[[], None]] = {}
    for dev in devs:
        configs[f"single:{dev.name}"] = _plain_step(copy.deepcopy(base).to(dev.torch_device), dev, x, y)
    busy: dict[str, list[dict[str, float]]] = {"even": [], "balanced": []}
    even_dp = HeteroDataParallel(copy.deepcopy(base).to(home), devs, weights=[1] * len(devs), sync=sync)
    configs["even"] = _dp_step(even_dp, x, y, mode, busy["even"])
    bal_dp = HeteroDataParallel(copy.deepcopy(base).to(home), devs, plan=plan, sync=sync)
    configs["balanced"] = _dp_step(bal_dp, x, y, mode, busy["balanced"])
    real = [d for d in devs if not d.emulated and d.torch_device == home]
    if real:
        one = HeteroDataParallel(copy.deepcopy(base).to(home), [real[0]], sync=sync, weights=[1])
        configs["one-device"] = _dp_step(one, x, y, mode)
    say(f"timing {len(configs)} configurations round-robin, {steps} steps each (balanced split {plan.sizes}) ...")
    step_times = time_steps(configs, devs, steps, warmup, progress=progress)
    single = {d.name: batch_size / step_times[f"single:{d.name}"] for d in devs}
    timeline = {
        name: {d.name: statistics.median(b.get(d.name, 0.0) for b in busy[name]) for d in devs}
        for name in ("even", "balanced")
    }
    overhead = step_times["one-device"] / step_times[f"single:{real[0].name}"] - 1.0 if real else None
    return BenchResult(
        devices=[d.name for d in devs], model=spec.name, batch_size=batch_size, mode=mode, single=single,
        even=batch_size / step_times["even"], balanced=batch_size / step_times["balanced"], plan=plan,

        step_times=step_times, overhead=overhead, busy=timeline,
        meta={"date": _dt.date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup, "sync": sync,
              "data": "synthetic", "emulated": [d.name for d in devs if d.emulated],
              "allocator_kept_memory": tuned},
    )


def _home_device(devs: Sequence[Device]) -> torch.device:
    """Where the module lives: the first real CUDA device if any, else the first device."""
    for d in devs:
        if d.type == "cuda" and not d.emulated:
            return d.torch_device
    return devs[0].torch_device


def parse_change(text: str) -> tuple[str, float, int]:
    """Parse a speed change ``DEVICE=SPEED@STEP``: ``"cpu@1=0.25@30"`` slows ``cpu@1`` to 0.25x at step 30.

    Raises:
        ValueError: Naming the text, if it is not of that form or names a real device.
    """
    from .devices import parse_device

    name, eq, rest = text.rpartition("=")
    speed, at, step = rest.partition("@")
    try:
        value, when = float(speed), int(step)
    except ValueError:
        raise ValueError(f"bad speed change {text!r}; write DEVICE=SPEED@STEP, e.g. cpu@1=0.25@30") from None
    if not eq or not at or not 0 < value <= 1 or when < 0:
        raise ValueError(f"bad speed change {text!r}; write DEVICE=SPEED@STEP with 0 < SPEED <= 1, e.g. cpu@1=0.25@30")
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

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict, derived figures included."""
        data = dataclasses.asdict(self)
        data.update(recovered_after=self.recovered_after, late_changes=self.late_changes, late_steps=self.late_steps,
                    overhead=self.overhead)
        return data

    def table(self) -> str:
        """Plan changes, step times per stretch of 10 steps, and the verdict, as text."""
        lines = ["plan changes:"]
        lines += [f"  {PlanChange(**c)}" for c in self.changes] or ["  none"]
        lines.append("")
        lines.append("steps      median step (ms)  split")
        for a in range(0, len(self.step_times), 10):
            block = self.step_times[a : a + 10]
            lines.append(f"{a:4d}-{a + len(block) - 1:<4d}  {1e3 * statistics.median(block):16.2f}  {self.sizes[a + len(block) - 1]}")
        lines.append("")
        lines.append(f"best split found by a sweep at the end: {self.optimum_sizes}, {1e3 * self.optimum:.2f} ms/step")
        rec = self.recovered_after
        what = f"the change at step {self.change['step']}" if self.change else "the start"
        lines.append("within 10% of it " + (f"{rec} steps after {what}" if rec is not None else f"never after {what}"))
        lines.append(f"plan changes after settling ({self.settle} steps): {self.late_changes} in {self.late_steps} steps; "
                     f"rebalancer cost {self.overhead:.3%} of step time")
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
    changed = None
    if change is not None:
        if change[0] not in names:
            raise ValueError(f"the speed change names {change[0]!r}, which is not among the devices {names}")
        changed = devs[names.index(change[0])]
    tuned = keep_freed_memory()
    spec = load_model(model) if isinstance(model, str) else model
    say = log or (lambda line: None)
    torch.manual_seed(seed)
    x, y = synthetic_batch(spec, batch_size, seed=seed)
    home = _home_device(devs)
    reb = Rebalancer(every=every, on_change=lambda c: say(f"plan change at {c}"))
    dp = HeteroDataParallel(spec.factory().to(home), devs, weights=[1] * len(devs))
    step = _dp_step(dp, x, y, "gather")
    times: list[float] = []
    sizes: list[list[int]] = []
    try:
        step()  # warm up, unobserved
        dp.rebalancer = reb
        for k in range(steps):
            if changed is not None and k == change[2]:  # type: ignore[index]
                changed.set_speed(change[1])  # type: ignore[index]
                say(f"step {k}: {changed.name} now runs at {change[1]:g}x")  # type: ignore[index]
            sizes.append(list(dp.sizes_for(batch_size)))
            start = time.perf_counter()
            step()
            for d in devs:
                d.synchronize()
            times.append(time.perf_counter() - start)
        say(f"sweeping splits around {dp.plan.sizes} for the optimum ...")
        candidates = _neighbours(dp.plan.sizes, batch_size)
        sweep = {}
        for cand in candidates:
            fixed = HeteroDataParallel(spec.factory().to(home), devs, weights=cand)
            sweep[str(cand)] = _dp_step(fixed, x, y, "gather")
        medians = time_steps(sweep, devs, sweep_steps, 1)
    finally:
        if changed is not None:
            changed.set_speed(None)
    best = min(medians, key=medians.__getitem__)
    return RebalanceResult(
        devices=names, model=spec.name, batch_size=batch_size, every=every,
        change=None if change is None else {"device": change[0], "speed": change[1], "step": change[2]},
        step_times=times, sizes=sizes, changes=[c.to_dict() for c in reb.history], optimum=medians[best],
        optimum_sizes=json.loads(best), settle=settle, rebalancer_seconds=reb.seconds,
        meta={"date": _dt.date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "data": "synthetic", "emulated": [d.name for d in devs if d.emulated],
              "allocator_kept_memory": tuned, "start": even_sizes(batch_size, len(devs))},
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
