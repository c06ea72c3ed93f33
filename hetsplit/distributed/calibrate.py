"""Calibrate: real training steps on a plan's shares, and the step's collectives timed at their real sizes.

The profile times the bare model, not DDP's own work, which weighs most on a slow rank (docs/torchrun.md).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..devices import Device
from ..planning.curve import Curve
from ..planning.plan import Plan, scaled_step
from ..planning.profile import Profile
from ..profiler import train_step
from ..timing import StepTimer
from ..tree import move, take_rows
from . import sharded as _sharded
from ._group import DistributedError, all_gather, collective, guard
from .comm_hooks import weight_gradients
from .sharded_profile import sharded_steps
from .zero_share import STAND_IN

# Every rank's wall seconds and compute in one calibration step (all-gathered).
Steps = list[tuple[list[float], list[float]]]

_MAX_CALIBRATION_STEPS = 400  # a tiny model's 1 s of steps; its median settles well before


def calibration_steps(
    model: nn.Module,
    sample: Any,
    target: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    dev: Device,
    plan: Plan,
    *,
    sharded: bool,
    steps: int,
    seconds: float,
    group: Any,
    rank: int,
) -> tuple[list[float], Steps]:
    """Every rank's median compute in real steps of its share of ``plan``, and each step's walls and computes.

    ``steps`` steps after 2 warm-up ones, or more until they took ``seconds``. A sharded model runs
    its own steps in place; any other DDP steps of a copy with the weighting's comm hook, which
    costs a fifth to two fifths of a small model's CPU step (Llama 2×64: 30 ms to 37).

    Raises:
        DistributedError: On every rank, if a step fails on some rank (a sharded model's
            steps are collective: then at the group's timeout).
    """
    size = plan.sizes[rank] or STAND_IN  # a rank given 0 runs its stand-ins, weighted 0, as in training
    if sharded:
        with sharded_steps(model, sample, target, loss_fn, dev, size, group=group) as one:
            return _timed_steps(lambda _i: one(), dev, steps, seconds, group, rank)
    replica = copy.deepcopy(model).to(dev.torch_device).train()
    index = torch.arange(size)
    inputs = move(take_rows(sample, index), dev.torch_device)
    labels = move(take_rows(target, index), dev.torch_device) if target is not None else None

    try:  # one step alone first: a failing step is reported on every rank, not left hanging in DDP
        train_step(replica, inputs, labels, loss_fn)
        failure = None
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    failures = all_gather(failure, "calibrating the plan", group)
    if any(failures):
        bad = {r: f for r, f in enumerate(failures) if f}
        raise DistributedError(
            f"a DDP step on the planned shares failed on ranks {bad}; check the model runs "
            "on these batch sizes, or pass calibrate=0"
        )
    with guard(what="calibrating the plan (DDP setup)", group=group):
        ddp = nn.parallel.DistributedDataParallel(
            replica, device_ids=[dev.index] if dev.type == "cuda" else None, process_group=group
        )
    weighting = weight_gradients(ddp, plan, group=group)
    weighting.sum_checks = 0  # the user's loss is judged in training (once), not in these steps
    timer = StepTimer(dev, replica)

    def step(i: int) -> Any:
        replica.zero_grad(set_to_none=True)
        with guard(what=f"calibrating the plan (DDP step {i})", group=group), timer.step() as lap:
            train_step(ddp, inputs, labels, loss_fn, dev)  # waiting for other ranks is not slowed
        return lap  # read after the steps: on CUDA its events are done by then

    try:
        return _timed_steps(step, dev, steps, seconds, group, rank)
    finally:
        timer.remove()


def _timed_steps(
    step: Callable[[int], Any], dev: Device, steps: int, seconds: float, group: Any, rank: int
) -> tuple[list[float], Steps]:
    """Run calibration steps (``step(i)`` returns its compute: seconds, or a lap), each from a barrier."""
    laps: list[Any] = []
    walls: list[float] = []

    def run(first: int, count: int) -> None:
        for i in range(first, first + count):
            collective(f"calibrating the plan (step {i})", lambda: dist.barrier(group=group), rank, group)
            start = time.perf_counter()
            lap = step(i)
            dev.synchronize()
            if i >= 2:
                laps.append(lap)
                walls.append(time.perf_counter() - start)

    run(0, 2 + steps)
    # A machine's speed drifts by a tenth or more over seconds (measured here: the same
    # LeNet share 23 to 32 ms in three runs of 20 steps), so a small model's 16 steps
    # (0.2 s) catch one moment of it: more steps, up to ``seconds`` of them. Every rank
    # runs as many (the steps' collectives): the count is agreed from every rank's estimate.
    mine = math.ceil(min(seconds / max(statistics.median(walls), 1e-6), _MAX_CALIBRATION_STEPS))
    wanted = all_gather(mine, "calibrating the plan", group)
    run(2 + steps, max(0, max(wanted) - steps))
    computes = [float(x) if isinstance(x, float | int) else x.seconds() for x in laps]
    gathered = all_gather((walls, computes), "gathering calibration times", group)
    work = [float(statistics.median(g[1])) for g in gathered]
    per_step = [([float(g[0][i]) for g in gathered], [float(g[1][i]) for g in gathered]) for i in range(len(walls))]
    return work, per_step


def through_measured(prof: Profile, sizes: Sequence[int], work: Sequence[float]) -> Profile:
    """``prof`` with each rank's curve passing through its measured ``(size, work)`` (:func:`_through`)."""
    entries = [dataclasses.replace(e, curve=_through(e.curve, n, t)) for e, n, t in zip(prof.entries, sizes, work)]
    return dataclasses.replace(prof, entries=entries)


def _through(curve: Curve, size: int, seconds: float) -> Curve:
    """``curve`` through a measured ``(size, seconds)``: shifted by a per-step overhead, or scaled down."""
    predicted = curve(size)
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(predicted) and predicted > 0):
        return curve
    return curve.shifted(seconds - predicted) if seconds >= predicted else curve.scaled(seconds / predicted)


def _stepwise(plan: Plan, work: Sequence[float], steps: Steps) -> float:
    """The calibration ``steps`` as they would have run ``plan``: computes scaled by planned over ``work``."""
    scales = [p / w if w > 0 else None for p, w in zip(plan.times, work)]
    # Each rank keeps what it spent beyond its compute in that step. Not one figure for every
    # rank (the least, exposed()): a rank whose waits its compute absorbs (an emulated one; a
    # GPU behind its host) shows none, and the real CPU rank's own ~3 ms a step then went
    # unpredicted once rebalancing made it the slowest: DDP 7.6 % short, now 1.7 % (bench_predict).
    return scaled_step(
        [(computes, [w - c for w, c in zip(walls, computes, strict=True)]) for walls, computes in steps],
        scales,
        plan.times,
    )


def beyond_compute(
    plan: Plan, measured: tuple[list[float], Steps] | None, model: nn.Module, dev: Device, group: Any, *, sharded: bool
) -> float:
    """What a step of ``plan`` adds to its slowest rank's compute: the communication, and the steps' spread.

    From the calibration steps (``measured``) scaled to the new shares, else :func:`communication`.
    """
    micro = max(map(len, plan.micro_batches))
    if measured is not None and micro == 1:
        return _stepwise(plan, *measured) - max(plan.times)
    return communication(model, dev.torch_device, group) * (micro if sharded else 1)


def communication(model: nn.Module, device: torch.device, group: Any = None, *, repeats: int = 3) -> float:
    """Seconds of the collectives of one training step of ``model``, timed once at their real sizes (collective).

    DDP: all-reduces in its 25 MB buckets; FSDP2: each ``fully_shard`` module's all-gathers and
    reduce-scatter, counted as not overlapped (an upper bound on CUDA). The median of ``repeats``
    runs, the smallest over the ranks (the last to arrive waited least).
    """

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world <= 1:
        return 0.0
    ops: collections.Counter[tuple[str, int, torch.dtype]] = collections.Counter()  # (kind, numel, dtype): a step's
    fsdp = _sharded.fsdp2_module()
    if fsdp is not None and _sharded.holds_sharded(model):
        modules = [m for m in model.modules() if isinstance(m, fsdp)]
        for m in modules:
            owned = _own_parameters(m, fsdp)
            for dtype in dict.fromkeys(p.dtype for p in owned):
                shard = -(-sum(p.numel() for p in owned if p.dtype == dtype) // world)  # of the unsharded size
                ops["all_gather", shard, dtype] += 1 if m is modules[0] else 2
                ops["reduce_scatter", shard, dtype] += 1
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        for dtype in dict.fromkeys(p.dtype for p in params):
            numel = sum(p.numel() for p in params if p.dtype == dtype)
            bucket = _BUCKET // torch.empty((), dtype=dtype).element_size()
            full, rest = divmod(numel, bucket)
            ops["all_reduce", bucket, dtype] += full
            ops["all_reduce", rest, dtype] += 1 if rest else 0
    what, total = "timing the step's collectives", 0.0
    for (kind, numel, dtype), count in sorted(ops.items(), key=str):  # the same order on every rank
        if not count:
            continue
        piece = torch.zeros(numel, dtype=dtype, device=device)
        whole = torch.zeros(numel * world, dtype=dtype, device=device) if kind != "all_reduce" else piece
        runs = []
        for i in range(repeats + 1):  # the first run sets the collective up: not timed
            collective(what, lambda: dist.barrier(group=group), rank, group)
            start = time.perf_counter()
            collective(what, functools.partial(_run, kind, piece, whole, group), rank, group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                runs.append(time.perf_counter() - start)
        total += count * statistics.median(runs)
    return float(min(all_gather(total, what, group)))


_BUCKET = 25 * 2**20  # DDP's default bucket: its all-reduces are of this size


def _own_parameters(module: nn.Module, fsdp: type) -> list[torch.Tensor]:
    """The parameters ``module``'s own ``fully_shard`` manages: its own, less those of nested ones."""
    nested = {id(p) for m in module.modules() if m is not module and isinstance(m, fsdp) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def _run(kind: str, shard: torch.Tensor, full: torch.Tensor, group: Any) -> None:
    if kind == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, shard, group=group)
    elif kind == "reduce_scatter":  # the _single names where torch has them: the others are deprecated
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(shard, full, group=group)
    else:
        dist.all_reduce(shard, group=group)
