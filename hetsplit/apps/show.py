"""Show: pictures of profiles (curves, memory caps), splits, and per-device step timelines (matplotlib, optional)."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..planning import Plan, Profile, solve
from ..planning.plan import even_sizes

if TYPE_CHECKING:
    from .bench_result import BenchResult, RebalanceResult

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


class MissingPlotExtra(ImportError):
    """matplotlib is not installed (the optional ``plot`` extra)."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingPlotExtra(
            "pictures need matplotlib: pip install 'hetsplit[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def _label(name: str, emulated: bool) -> str:
    return f"{name} (emulated)" if emulated else name


def _save(plt: Any, fig: Any, out: str | Path) -> Path:
    """Write the figure atomically (a temporary file renamed into place), then close it."""
    from ..files import umask

    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix or ".png", dir=out.parent)
        os.close(fd)
        try:
            os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600 made pictures private while JSON followed the umask
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    finally:
        plt.close(fig)
    return out


def plot_profile(profile: Profile, out: str | Path, *, plan: Plan | None = None, batch_size: int | None = None) -> Path:
    """Draw a profile to ``out``: step time and throughput against batch size per device, and a split.

    The split is ``plan``'s, else ``batch_size`` solved on the profile (default: the largest measured batch).

    Raises:
        MissingPlotExtra: Without matplotlib, with the command that installs it.
    """
    plt = _pyplot()
    if plan is None:
        top = max((m.batch for e in profile.entries for m in e.measurements), default=256)
        plan = solve(profile, batch_size or top)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), gridspec_kw={"height_ratios": [3, 2]})
    ax_t, ax_thr, ax_split, ax_pred = axes.ravel()
    biggest = max([m.batch for e in profile.entries for m in e.measurements] + [plan.batch_size, 2])
    for k, e in enumerate(profile.entries):
        color = _COLORS[k % len(_COLORS)]
        label = _label(e.name, e.info.emulated)
        xs = [m.batch for m in e.measurements]
        meds = [m.median for m in e.measurements]
        for m in e.measurements:
            ax_t.scatter([m.batch] * len(m.times), [t * 1e3 for t in m.times], s=6, color=color, alpha=0.25)
        ax_t.scatter(xs, [t * 1e3 for t in meds], s=28, color=color, label=f"{label}: measured (median)")
        grid = np.unique(np.geomspace(1, biggest, 200).round())
        cap = e.curve.memory_cap
        grid = grid[grid <= cap] if cap is not None else grid
        fit = [e.curve(b) for b in grid]
        mem = e.memory
        note = f" (memory {mem.base / 2**20:.0f} MiB + {mem.per_sample / 2**20:.2f} MiB/sample)" if mem else ""
        ax_t.plot(grid, [t * 1e3 for t in fit], color=color, lw=1.5, label=f"{label}: fitted curve{note}")
        ax_thr.plot(grid, [b / t if t > 0 else math.nan for b, t in zip(grid, fit)], color=color, lw=1.5, label=label)
        ax_thr.scatter(xs, [b / t for b, t in zip(xs, meds)], s=28, color=color)
        if cap is not None:
            for ax in (ax_t, ax_thr):
                ax.axvline(cap, color=color, ls="--", lw=1)
            ax_t.annotate(
                f"memory cap {cap}",
                (cap, ax_t.get_ylim()[1]),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
                color=color,
            )
    for ax, ylabel, title in (
        (ax_t, "step time (ms)", "Training step time (forward + loss + backward)"),
        (ax_thr, "throughput (samples/s)", "Throughput"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (samples)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8, loc="upper left")
    ax_thr.legend(fontsize=8, loc="lower right")

    _draw_split(ax_split, ax_pred, plan)
    model = profile.model.get("name", "model")
    fig.suptitle(f"{model} on {profile.host} ({profile.created[:10]}); predictions from the fitted curves", fontsize=11)
    fig.tight_layout()
    return _save(plt, fig, out)


def _draw_split(ax_split: Any, ax_pred: Any, plan: Plan) -> None:
    """The split of ``plan`` as a stacked bar, and each device's predicted time at its share."""
    left = 0
    emulated = set(plan.emulated)
    for k, (name, size) in enumerate(zip(plan.devices, plan.sizes)):
        color = _COLORS[k % len(_COLORS)]
        ax_split.barh([0], [size], left=left, color=color, edgecolor="white", label=_label(name, name in emulated))
        if size:
            ax_split.text(
                left + size / 2,
                0,
                f"{size}\n({size / plan.batch_size:.0%})",
                ha="center",
                va="center",
                color="white",
                fontsize=9,
                fontweight="bold",
            )
        left += size
    ax_split.set_xlim(0, plan.batch_size)
    ax_split.set_yticks([])
    ax_split.set_xlabel("samples of the batch")
    ax_split.set_title(f"Balanced split of a batch of {plan.batch_size}")
    ax_split.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(4, len(plan.devices)))

    times = [t * 1e3 if math.isfinite(t) else 0.0 for t in plan.times]
    colors = [_COLORS[k % len(_COLORS)] for k in range(len(plan.devices))]
    ax_pred.bar(range(len(plan.devices)), times, color=colors)
    ax_pred.set_xticks(
        range(len(plan.devices)),
        [f"{_label(d, d in emulated)}\n{s} samples" for d, s in zip(plan.devices, plan.sizes)],
        fontsize=8,
    )
    ax_pred.axhline(plan.slowest * 1e3, color="black", ls=":", lw=1, label=step_words(plan).removeprefix("predicted "))
    if math.isfinite(plan.even_time):
        ax_pred.axhline(
            plan.even_time * 1e3, color="grey", ls="--", lw=1, label=f"even split {plan.even_time * 1e3:.2f} ms"
        )
    ax_pred.set_ylabel("predicted time (ms)")
    ax_pred.set_title("Predicted time per device at its share")
    ax_pred.legend(fontsize=8)


def step_words(plan: Plan) -> str:
    """``predicted step 1.20 ms``, or whose step it is when the times are a stand-in's (:attr:`Plan.stand_in`)."""
    if plan.stand_in:
        return f"predicted step of {plan.stand_in} {plan.slowest * 1e3:.2f} ms (a stand-in, not your model)"
    return f"predicted step {plan.step_time * 1e3:.2f} ms"


def plot_plan(plan: Plan, out: str | Path) -> Path:
    """Draw a plan file alone (``hetsplit plan --json``) to ``out``: its split and each device's predicted time.

    Raises:
        MissingPlotExtra: Without matplotlib, with the command that installs it.
    """
    plt = _pyplot()
    fig, (ax_split, ax_pred) = plt.subplots(1, 2, figsize=(12, 3.8))
    _draw_split(ax_split, ax_pred, plan)
    fig.suptitle(
        f"Split of a batch of {plan.batch_size}: {step_words(plan)} (predictions from the profile's fitted curves)",
        fontsize=11,
    )
    fig.tight_layout()
    return _save(plt, fig, out)


def plot_timeline(result: BenchResult, out: str | Path) -> Path:
    """Draw one training step per device for the even and the balanced split (from ``hetsplit bench``) to ``out``.

    Each device's bar: its busy time, its wait for the slowest device, then the step outside the replicas.

    Raises:
        MissingPlotExtra: Without matplotlib, with the command that installs it.
    """
    plt = _pyplot()
    configs = [("even", even_sizes(result.batch_size, len(result.devices))), ("balanced", result.plan.sizes)]
    fig, axes = plt.subplots(2, 1, figsize=(11, 2.2 + 1.1 * len(result.devices) * 2), sharex=True)
    emulated = set(result.meta.get("emulated", []))
    longest = max(result.step_times[name] for name, _ in configs) * 1e3
    for ax, (name, sizes) in zip(axes, configs):
        step = result.step_times[name] * 1e3
        busy = {d: result.busy.get(name, {}).get(d, 0.0) * 1e3 for d in result.devices}
        slowest = min(max(busy.values(), default=0.0), step)
        for row, d in enumerate(result.devices):
            b = min(busy[d], step)
            for left, right, color, label in (
                (0.0, b, "#2ca02c", "compute (forward + backward)"),
                (b, slowest, "#d9d9d9", "idle, waiting for the slowest device"),
                (slowest, step, "#ff7f0e", "scatter, gather, loss, optimizer (outside the replicas)"),
            ):
                ax.barh(row, right - left, left=left, color=color, label=label if row == 0 else None)
            ax.text(step + longest * 0.01, row, f"{b:.1f} ms busy of {step:.1f}", va="center", fontsize=8)
        labels = [f"{_label(d, d in emulated)}\n{s} samples" for d, s in zip(result.devices, sizes)]
        ax.set_yticks(range(len(result.devices)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name} split: {step:.1f} ms per step ({result.batch_size / step * 1e3:,.0f} samples/s)")
        ax.set_xlim(0, longest * 1.25)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("time within one training step (ms)")
    axes[-1].legend(fontsize=8, loc="center right")
    fig.suptitle(timeline_title(result), fontsize=11)
    fig.tight_layout()
    return _save(plt, fig, out)


def timeline_title(result: BenchResult) -> str:
    """The timeline's title: the balanced split against the even split *and* the fastest device alone.

    "1.26x the even split" alone read as a win while the CPU alone was faster.
    """
    alone = result.speedup_vs_single
    used = [name for name, size in zip(result.plan.devices, result.plan.sizes) if size > 0]
    if len(used) == 1:  # that device alone: a ratio to it would be the wrapper's overhead and noise
        verdict = f"the balanced split is {used[0]} alone (nothing split at this batch)"
    elif alone >= 1:
        verdict = f"{alone:.2f}x {result.fastest} alone"
    else:
        verdict = f"but {result.fastest} alone is faster ({1 / alone:.2f}x the balanced split)"
    return (
        f"{result.model}, batch {result.batch_size}, {result.meta.get('date', '')} on {result.meta.get('host', '')}: "
        f"balanced is {result.speedup_vs_even:.2f}x the even split, {verdict}"
    )


def plot_rebalance(result: RebalanceResult, out: str | Path) -> Path:
    """Draw a ``bench --rebalance`` run to ``out``: step times, each device's share, and every plan change."""
    plt = _pyplot()
    fig, (ax_time, ax_share) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = range(len(result.step_times))
    ax_time.plot(steps, [t * 1e3 for t in result.step_times], color="black", lw=1, label="step time")
    ax_time.axhline(result.optimum * 1e3, color="grey", ls="--", lw=1, label="best split of the final sweep")
    for k, name in enumerate(result.devices):
        ax_share.plot(steps, [s[k] for s in result.sizes], color=_COLORS[k % len(_COLORS)], label=name)
    for ax in (ax_time, ax_share):
        for change in result.changes:
            ax.axvline(change["step"], color="#9467bd", ls=":", lw=1)
        if result.change:
            ax.axvline(result.change["step"], color="red", lw=1)
    ax_time.set_ylabel("ms per step")
    ax_time.legend(fontsize=8)
    ax_share.set_ylabel(f"samples of {result.batch_size}")
    ax_share.set_xlabel("step (dotted: plan changes; red: the speed change)")
    ax_share.legend(fontsize=8)
    fig.suptitle(f"{result.model}: online rebalancing every {result.every} steps", fontsize=11)
    fig.tight_layout()
    return _save(plt, fig, out)
