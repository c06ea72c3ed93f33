"""Demo: in about a minute, how much of this machine an even split leaves idle, and what balancing wins back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..devices import DeviceLike, discover, parse_devices
from .bench import BenchResult, bench, cpu_threads
from .models import ModelSpec

__all__ = ["demo_devices", "run_demo", "verdict"]


def demo_devices() -> list[str]:
    """Every local device; on a one-device machine, plus an emulated ``cpu@0.25`` to split against."""
    names = [info.name for info in discover()]
    if len(names) == 1:
        names.append("cpu@0.25")
    return names


def run_demo(
    devices: str | Sequence[DeviceLike] | None = None,
    *,
    model: str | ModelSpec = "lenet",
    batch_size: int = 256,
    steps: int = 30,
    profile_budget: float = 10.0,
    threads: int | None = None,
    progress: bool = False,
    say: Callable[[str], None] = print,
) -> BenchResult:
    """Profile a built-in model, then train it on the fastest device alone, the even split and the balanced split.

    Prints what it is doing and, at the end, :func:`verdict`. Data is synthetic.

    Args:
        devices: The devices (default: :func:`demo_devices`).
        model: A built-in model (``lenet``, ``mlp``, ``resnet18``) or ``package.module:factory``.
        batch_size: Samples per step.
        steps: Timed steps per configuration.
        profile_budget: Seconds for profiling.
        threads: Torch CPU threads (default: 1 when every device is the CPU, real or
            emulated, as they share its cores; else torch's choice).
        progress: Show progress bars.
        say: Where lines of output go.

    Returns:
        The :class:`~hetsplit.bench.BenchResult`.
    """
    devs = parse_devices(devices if devices is not None else demo_devices())
    if len(devs) < 2:
        raise ValueError(f"the demo compares splits, so it needs two or more devices; got {[d.name for d in devs]}")
    torch.set_num_threads(cpu_threads(devs, threads))
    emulated = [d.name for d in devs if d.emulated]
    name = model.name if isinstance(model, ModelSpec) else model
    say(
        f"hetsplit demo: {name} on {', '.join(d.name for d in devs)}, batch {batch_size}, synthetic data, "
        f"{torch.get_num_threads()} CPU thread{'s' if torch.get_num_threads() != 1 else ''}"
    )
    if emulated:
        say(
            f"emulated: {', '.join(emulated)} (the real device slowed down by sleeping, to show a split on a "
            "machine without mixed hardware; not real hardware)"
        )
    say(f"1/2 profiling each device (about {profile_budget:g} s) ...")
    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        if line.startswith("timing"):
            say(f"2/2 training {steps} steps each: every device alone, the even split, the balanced split ...")

    result = bench(
        model,
        devs,
        batch_size=batch_size,
        steps=steps,
        warmup=3,
        profile_budget=profile_budget,
        log=log,
        progress=progress,
    )
    say("")
    say(verdict(result))
    return result


def verdict(result: BenchResult) -> str:
    """A few lines a person reads in ten seconds: the split, step times, speedup, efficiency, idle time."""
    b = result.batch_size
    split = ", ".join(f"{d} {s} ({s / b:.0%})" for d, s in zip(result.plan.devices, result.plan.sizes))
    even, bal = result.step_times["even"], result.step_times["balanced"]
    fastest = result.fastest
    lines = [
        f"balanced split of {b}: {split}",
        f"step time: even split {even * 1e3:.1f} ms, balanced {bal * 1e3:.1f} ms, "
        f"{fastest} alone {result.step_times[f'single:{fastest}'] * 1e3:.1f} ms",
        f"balanced is {result.speedup_vs_even:.2f}x the even split and "
        f"{result.speedup_vs_single:.2f}x {fastest} alone; "
        f"{result.efficiency:.0%} of the ideal ({result.ideal:,.0f} samples/s, every device's own throughput summed)",
    ]
    guess = result.predicted.get("balanced")
    if guess:
        lines.append(
            f"the plan predicted a balanced step of {guess * 1e3:.1f} ms; measured {bal * 1e3:.1f} ms "
            f"({guess / bal - 1:+.0%}: the profile timed each device alone, the split runs them side by side)"
        )
    idle = []
    for name in ("even", "balanced"):
        step = result.step_times[name]
        parts = [f"{d} {max(0.0, 1 - result.busy[name].get(d, 0.0) / step):.0%}" for d in result.devices]
        idle.append(f"{name}: " + ", ".join(parts))
    lines.append("share of each step a device sits idle: " + "; ".join(idle))
    if result.speedup_vs_single < 1:
        shared = " (emulated devices share the real one's cores and memory)" if result.meta.get("emulated") else ""
        lines.append(
            f"on this machine {fastest} alone is faster than all devices together{shared}: "
            "the other devices cost more than they add"
        )
    if result.meta.get("emulated"):
        lines.append(f"(emulated: {', '.join(result.meta['emulated'])}; timings from this machine, synthetic data)")
    return "\n".join(lines)
