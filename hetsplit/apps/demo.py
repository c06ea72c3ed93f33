"""Demo: in about a minute, how much of this machine an even split leaves idle, and what balancing wins back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..devices import DeviceLike, discover, parse_devices
from ..timing import cpu_threads
from .bench import bench
from .bench_result import BenchResult
from .models import ModelSpec


def demo_devices() -> list[str]:
    """Every local device; on a one-device machine, plus an emulated ``cpu@0.25`` to split against."""
    names = [info.name for info in discover()]
    if len(names) == 1:
        names.append("cpu@0.25")
    return names


def run_demo(
    devices: str | Sequence[DeviceLike] | None = None,
    *,
    model: str | ModelSpec = "cnn",
    batch_size: int = 128,
    steps: int = 15,
    profile_budget: float = 10.0,
    threads: int | None = None,
    processes: bool = True,
    progress: bool = False,
    say: Callable[[str], None] = print,
) -> BenchResult:
    """Profile a built-in model, train it on each device alone, the even and the balanced split, in both engines.

    The splits run in threads (:class:`~hetsplit.HeteroDataParallel`), then, with ``processes``, the
    balanced split once more in one torchrun rank per device (:func:`run_processes`); ``say`` gets
    the progress and, at the end, :func:`verdict`. Data is synthetic.

    Args:
        threads: Torch CPU threads (default: 1 when every device is the CPU, real or
            emulated, as they share its cores; else torch's choice).
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
    parts = 3 if processes else 2
    say(f"1/{parts} profiling each device (about {profile_budget:g} s) ...")
    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        if line.startswith("timing"):
            say(
                f"2/{parts} threads: training {steps} steps each on every device alone, the even split and the "
                "balanced split ..."
            )

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
    if processes:
        say(f"3/3 processes: the balanced split {result.plan.sizes} in {len(devs)} torchrun ranks (DDP, gloo) ...")
        spec = model if isinstance(model, ModelSpec) else None
        shape = spec.input_shape if spec is not None and ":" in spec.name else None
        result.processes = run_processes(
            [d.name for d in devs], name, result.plan.sizes, steps, torch.get_num_threads(), input_shape=shape
        )
    say("")
    say(verdict(result))
    return result


def run_processes(
    devices: Sequence[str],
    model: str,
    sizes: Sequence[int],
    steps: int,
    threads: int,
    *,
    input_shape: Sequence[int] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Train ``model`` on the split ``sizes`` in one torchrun rank per device; the timings of rank 0.

    The ranks run :mod:`hetsplit.apps.demo_ranks` through ``torch.distributed.run`` with
    the command line ``hetsplit launch`` builds, and their output is kept quiet.

    Returns:
        ``step`` (median seconds per step), ``steps``, ``allreduce`` (seconds of one
        all-reduce of the gradients), ``gradient_bytes``; or ``{"error": "..."}`` with
        the last line the ranks printed, when the job failed.

    Raises:
        ValueError: If ``sizes`` is not one count >= 0 per device with at least one
            sample, or the model is unknown; before any process starts.
    """
    from .models import load_model

    if len(sizes) != len(devices) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"sizes {list(sizes)} must be one whole count >= 0 for each of the devices {list(devices)}")
    if sum(sizes) < 1 or steps < 1:
        raise ValueError(f"the ranks need at least one sample and one step; got sizes {list(sizes)}, steps {steps}")
    load_model(model, tuple(input_shape) if input_shape else None)
    from . import demo_ranks
    from .launch import torchrun_args

    with tempfile.TemporaryDirectory(prefix="hetsplit-demo-") as tmp:
        out = Path(tmp) / "ranks.json"
        script_args = ["--model", model, "--sizes", ",".join(map(str, sizes)), "--steps", str(steps)]
        script_args += ["--threads", str(threads), "--out", str(out)]
        if input_shape:
            script_args += ["--input-shape", ",".join(map(str, input_shape))]
        argv, _ = torchrun_args(",".join(devices), demo_ranks.__file__, script_args)
        env = _rank_env(devices, threads)
        failure = ""
        for _attempt in range(2):  # once more if it fails: a standalone rendezvous can race for its port
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", *argv],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                return {"error": f"the ranks did not finish in {timeout:g} s"}
            if done.returncode == 0 and out.exists():
                break
            failure = _failure(done.stderr + done.stdout) or f"torchrun exited with status {done.returncode}"
        else:
            return {"error": failure}
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result


def _rank_env(devices: Sequence[str], threads: int) -> dict[str, str]:
    """The environment of the demo's ranks: this hetsplit importable, nothing shadowing the standard library.

    ``PYTHONSAFEPATH`` keeps the current directory off the front of their ``sys.path`` (a ``statistics.py``
    here was imported by both ranks); :func:`~hetsplit.apps.models.load_model` appends it at the end.
    """
    from ..distributed.setup import ENV_DEVICES, rank_devices
    from .launch import local_env

    env = {**os.environ, ENV_DEVICES: ",".join(rank_devices(devices, len(devices)))}
    env.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun would print a warning and set 1
    root = str(Path(__file__).resolve().parents[2])  # this hetsplit, also when run from a checkout
    # An installed hetsplit is found without it; site-packages named on PYTHONPATH as well
    # leaves torchrun's ranks without gloo ("Unknown c10d backend type GLOO", torch 2.15).
    if not _is_site_packages(root):
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONSAFEPATH"] = "1"
    local_env(env)
    return env


def _is_site_packages(folder: str) -> bool:
    """Whether ``folder`` is one of this interpreter's site-packages (where an installed hetsplit lives)."""
    import site
    import sysconfig

    found = {*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()}
    return os.path.realpath(folder) in {os.path.realpath(f) for f in found if isinstance(f, str)}


def verdict(result: BenchResult) -> str:
    """A few lines a person reads in ten seconds: the split, step times, speedup, efficiency, idle time."""
    from ..distributed.report import split_text, unreliable_note

    b = result.batch_size
    split = split_text(result.plan)
    if result.meta.get("emulation_note"):  # the measurements the split rests on were off: said in its line
        split += f"; {result.meta['emulation_note']}"
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
        cal = result.calibration
        how = f"calibrated over {cal['steps']} balanced steps" if cal else "from each device timed alone"
        unreliable = unreliable_note(result.plan.noise)
        line = (
            f"the plan's ({how}) balanced step: {unreliable}; measured {bal * 1e3:.1f} ms"
            if unreliable
            else f"the plan ({how}) predicted a balanced step of {guess * 1e3:.1f} ms; measured {bal * 1e3:.1f} ms "
            f"(error {guess / bal - 1:+.0%}{_noise(result, 'balanced')})"
        )
        alone = result.predicted.get(f"single:{fastest}")
        if alone and not unreliable:  # how far the machine itself drifted from its profile while these steps ran
            single = f"single:{fastest}"
            line += (
                f"; {fastest} alone, in the same run: {alone / result.step_times[single] - 1:+.0%}"
                f"{_noise(result, single)}"
            )
        lines.append(line)
    idle = []
    for name in ("even", "balanced"):
        step = result.step_times[name]
        parts = [f"{d} {max(0.0, 1 - result.busy[name].get(d, 0.0) / step):.0%}" for d in result.devices]
        idle.append(f"{name}: " + ", ".join(parts))
    lines.append("share of each step a device sits idle: " + "; ".join(idle))
    lines += _engines(result)
    if result.speedup_vs_single < 1:
        shared = " (emulated devices share the real one's cores and memory)" if result.meta.get("emulated") else ""
        lines.append(
            f"on this machine {fastest} alone is faster than all devices together{shared}: "
            "the other devices cost more than they add"
        )
    lines += result.meta.get("noise", [])
    if result.meta.get("emulation_warning"):
        lines.append(result.meta["emulation_warning"])
    if result.meta.get("emulated"):
        lines.append(f"(emulated: {', '.join(result.meta['emulated'])}; timings from this machine, synthetic data)")
    return "\n".join(lines)


def _engines(result: BenchResult) -> list[str]:
    """The threads-against-processes lines of the verdict: which engine wins here, and why."""
    proc = result.processes
    if not proc:
        return []
    if "error" in proc:
        return [f"processes: the torchrun ranks failed ({proc['error']}); threads only"]
    threads, procs = result.step_times["balanced"], float(proc["step"])
    # What each engine spends beyond the devices' own work: for threads, the balanced step
    # less its busiest device's time; for processes, below.
    outside = max(0.0, threads - max(result.busy["balanced"].values(), default=0.0))
    winner, loser = ("threads", "processes") if threads <= procs else ("processes", "threads")
    ratio = max(threads, procs) / min(threads, procs)
    head = (
        f"threads and processes are even on this machine (within {ratio - 1:.0%})"
        if ratio < 1.05
        else f"{winner} win on this machine, {ratio:.2f}x faster than {loser}"
    )
    # For processes, the step less the slowest rank's own work, of which one all-reduce timed alone;
    # DDP overlaps the all-reduce with backward, so it may exceed that difference: then only it is named.
    work = proc.get("work")
    beyond, rest = "", ""
    if work and procs - max(work) >= proc["allreduce"]:
        beyond = f" {(procs - max(work)) * 1e3:.1f} ms a step beyond the slowest rank's own work, of which"
        rest = " (the rest: DDP's hooks, ranks waiting on each other)"
    return [
        f"engines, balanced split: threads (HeteroDataParallel, one process) {threads * 1e3:.1f} ms a step; "
        f"processes (hetsplit launch, {len(result.devices)} gloo ranks, DDP) {procs * 1e3:.1f} ms",
        f"{head}: threads spend {outside * 1e3:.1f} ms a step outside the devices' work (hand-offs, gathering, "
        f"one interpreter's lock); processes spend{beyond} {proc['allreduce'] * 1e3:.1f} ms on an all-reduce of "
        f"{proc['gradient_bytes'] / 1e3:,.0f} kB of gradients{rest}",
    ]


def _failure(output: str) -> str:
    """The most telling line of a failed torchrun job's output: its last error, else its last words."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=-*").strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (errors or lines or [""])[-1][:300]


def _noise(result: Any, name: str) -> str:
    """``, noise ±4%``: the measured steps' own ± beside an error against their median (``""``: not measured)."""
    noise = result.meta.get("step_noise", {}).get(name)
    return f", noise ±{noise:.0%}" if noise is not None else ""
