"""Rank plan: one plan for all ranks — check, profile each rank's device, solve on rank 0, calibrate, report."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..devices import Device, DeviceLike, parse_device, rank_label
from ..planning import checks
from ..planning.memory import micro_batched
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.rebalance import with_communication
from ..planning.records import DeviceProfile
from ..planning.sizes import (
    batchnorm_minimum,
    has_batchnorm,
    model_call,
    priced_stand_ins,
    resolve_plan,
    stand_ins_used,
    with_minimum_shares,
)
from ..planning.solver import solve_lockstep
from ..profiler import describe_faults, emulation_faults, fault_note, held_to_declared_speed
from ..profiler import profile as run_profile
from ..tree import batch_length
from ..version import __version__
from . import sharded as _sharded
from ._group import DistributedError, all_gather, collective, group_info
from .calibrate import beyond_compute, calibration_steps, through_measured
from .comm_hooks import weight_gradients
from .dtypes import verify_dtypes
from .report import SplitReport
from .setup import launch_env
from .sharded_profile import profile_sharded
from .zero_share import STAND_IN


def plan(
    model: nn.Module,
    sample: Any,
    batch_size: int,
    *,
    device: DeviceLike | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
    profile: Profile | None = None,
    weights: Sequence[float] | None = None,
    calibrate: int = 16,
    calibrate_seconds: float = 1.0,
    accumulate: bool = False,
    group: Any = None,
    quiet: bool = False,
    **profile_kwargs: Any,
) -> Plan:
    """One plan for all ranks: each profiles its own device, rank 0 solves, all receive it (collective).

    Stages: check, profile, solve on rank 0, calibrate and solve again, report (docs/torchrun.md).
    The plan's devices are ``rank{r}:{device}``, so ``plan.sizes[rank]`` is this rank's local batch.

    Args:
        model: The model (unwrapped, the module inside DDP, an FSDP2 root module, or a
            module holding one), or the DDP model (its gradients then weighted by the plan).
        sample: Example input for the profiler (see :func:`hetsplit.profile`).
        batch_size: The global batch: samples per step across all ranks.
        device: This rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available, else ``cpu``).
        loss_fn, target: As for :func:`hetsplit.profile`.
        profile: This rank's profile, to skip profiling (one device, or the device named by ``device``).
        weights: Hand-set relative throughputs, one per rank (``[4, 1]``: 80 % to rank 0): nothing profiled.
        calibrate: Training steps to calibrate with (after 2 warm-up steps); 0 skips it.
        calibrate_seconds: More steps until they took this long (at most 400); 0: exactly ``calibrate``.
        accumulate: Let a rank with a memory cap run its share as micro-batches (not calibrated).
        group: The process group (default: the world).
        quiet: Say nothing; otherwise rank 0 says the split and its predicted step in one line.
        **profile_kwargs: Passed to :func:`hetsplit.profile` (``time_budget``, ...; a sharded
            model's also ``memory_fraction`` and ``optimizer``).

    Returns:
        The same :class:`Plan` on every rank.

    Raises:
        ValueError: Before anything runs: a negative ``calibrate`` or ``calibrate_seconds``,
            ``weights`` with ``profile``, ``weights`` not one positive finite number per
            rank, or a share above its rank's emulated memory without ``accumulate``.
        DistributedError: If ``weights`` or hetsplit versions differ across ranks, a
            calibration step fails on some rank, or a rank dies or hangs past the group's timeout.
    """
    _check_calibration(calibrate, calibrate_seconds)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        chosen = plan(
            model.module, sample, batch_size, device=device, loss_fn=loss_fn, target=target, profile=profile,
            weights=weights, calibrate=calibrate, calibrate_seconds=calibrate_seconds, accumulate=accumulate,
            group=group, quiet=quiet, **profile_kwargs,
        )  # fmt: skip
        weight_gradients(model, chosen, group=group)
        return chosen
    checks.materialised(model, "hd.plan")  # every rank alike, before any collective
    rank, world = group_info(group)
    verify_dtypes(model, sample, group)  # before DDP or FSDP2 meet them (a mismatch aborts a process)
    minimum = _minimum_share(model, sample)  # no rank's share too small for BatchNorm's statistics
    if weights is not None:
        mine = parse_device(device if device is not None else _default_device(), check=False)
        chosen = _weighted_plan(
            batch_size, weights, profile, rank, world, group, mine.max_batch, accumulate, minimum, mine.name
        )
        SplitReport("hd.plan", rank, quiet).announce(chosen, follow=True)
        return chosen
    dev = parse_device(device if device is not None else _default_device())
    _check_versions(group)
    sharded = _sharded.holds_sharded(model)  # the FSDP2 root, or a module around it (a LightningModule's loss)
    if sharded:
        _sharded.check_sharded(model, group)

    gathered = _gathered_profile(
        model, sample, dev, loss_fn, target, profile, sharded, batch_size, group, rank, profile_kwargs
    )
    # Only the profiles are checked: a rank's calibration step holds DDP's own work (the
    # weighting hook, the buckets' copies), which its profile does not, and a quarter-speed
    # rank with 2 samples of 32 spends much of its step there; compared as the thread engine's
    # factors are, 7 of 14 quiet plans said "unreliable", a gap that DDP's own work explains.
    faults = emulation_faults(gathered) if gathered is not None else []
    # An emulated rank faster than declared is planned at its declared speed (rank 0 holds the profiles).
    combined = held_to_declared_speed(gathered, faults) if gathered is not None else None
    solve = functools.partial(_solve, batch_size=batch_size, sharded=sharded, accumulate=accumulate, minimum=minimum)
    result = _broadcast_plan(solve, group, rank, world, combined, minimum)

    # A rank given 0 calibrates on the stand-ins it runs (DDP; a sharded model's steps run whole shares):
    # uncalibrated, its stand-in step under DDP's all-reduce ran 1.4-2x its profile (ResNet-18 on cpu@0.25).
    calibrated = bool(
        calibrate and min(result.sizes) >= (1 if sharded else 0) and max(map(len, result.micro_batches)) == 1
    )
    measured = None
    if calibrated:
        measured = calibration_steps(
            model, sample, target, loss_fn, dev, result, sharded=sharded, steps=calibrate,
            seconds=calibrate_seconds, group=group, rank=rank,
        )  # fmt: skip
        ran = [size or STAND_IN for size in result.sizes]
        combined = through_measured(combined, ran, measured[0]) if combined is not None else None
        result = _broadcast_plan(solve, group, rank, world, combined, minimum)
    result = with_communication(result, beyond_compute(result, measured, model, dev, group, sharded=sharded))

    # The plan carries rank 0's note on flagged measurements, so every line that says it (the
    # integrations' own reports too, which plan quietly) says it; every rank holds the same plan.
    note = all_gather(fault_note(faults, calibrated), "gathering the plan's notes", group)[0]
    if note:
        result = dataclasses.replace(result, notes=[*result.notes, note])
    report = SplitReport("hd.plan", rank, quiet)  # weight_gradients times the run on it; its end is said at exit
    report.announce(result, follow=True)
    unreliable = describe_faults(faults)
    if unreliable:
        report.note(unreliable)
    return result


def _check_calibration(calibrate: Any, calibrate_seconds: Any) -> None:
    if isinstance(calibrate, bool) or not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"calibrate must be a number of steps >= 0, got {calibrate!r}")
    if (
        isinstance(calibrate_seconds, bool)
        or not isinstance(calibrate_seconds, (int, float))
        or not (0 <= calibrate_seconds < math.inf)
    ):
        raise ValueError(f"calibrate_seconds must be a number of seconds >= 0, got {calibrate_seconds!r}")


def _gathered_profile(
    model: nn.Module,
    sample: Any,
    dev: Device,
    loss_fn: Callable[..., torch.Tensor] | None,
    target: Any,
    profile: Profile | None,
    sharded: bool,
    batch_size: int,
    group: Any,
    rank: int,
    profile_kwargs: dict[str, Any],
) -> Profile | None:
    """This rank's profile (``profile``, or measured here), every rank's gathered on rank 0 (``None`` elsewhere)."""
    if profile is None and sharded:  # collective forwards: every rank in the same steps (sharded_profile.py)
        profile = profile_sharded(
            model, sample, dev, loss_fn, target=target, batch_size=batch_size, group=group, **profile_kwargs
        )
    elif profile is None:
        profile = run_profile(model, sample, [dev], loss_fn, target=target, progress=False, **profile_kwargs)
    entry = profile.entry(dev.name) if len(profile.entries) > 1 else profile.entries[0]
    gathered = all_gather({"entry": entry.to_dict(), "model": profile.model}, "gathering profiles", group)
    if rank != 0:
        return None
    entries = []
    for r, item in enumerate(gathered):
        e = DeviceProfile.from_dict(item["entry"])
        e.info.name = rank_label(r, e.info.name)
        entries.append(e)
    return Profile(entries, model=gathered[0]["model"], host="torchrun", source="distributed")


def _solve(prof: Profile, *, batch_size: int, sharded: bool, accumulate: bool, minimum: int) -> Plan:
    """Rank 0's plan of every rank's profile ``prof``."""
    if sharded and accumulate:
        # Every rank of a sharded model runs as many micro-batches as the others: solve for that.
        return solve_lockstep(prof, batch_size)
    return _no_single(
        resolve_plan(batch_size, prof.devices, profile=prof, accumulate=accumulate),
        profile=prof, accumulate=accumulate, minimum=minimum,
    )  # fmt: skip


def _minimum_share(model: Any, sample: Any) -> int:
    """The fewest samples a rank's share of ``model`` may hold (:func:`~hetsplit.planning.sizes.batchnorm_minimum`).

    A sharded model is not traced (its forward is collective), nor one without a sample: BatchNorm gets 2.
    """
    if not has_batchnorm(model):
        return 1
    if sample is None or _sharded.holds_sharded(model):
        return 2
    args, kwargs = model_call(sample)
    return batchnorm_minimum(model, args, kwargs, batch_length((args, kwargs)))


def _no_single(
    plan: Plan, *, profile: Profile | None, accumulate: bool, minimum: int, room: Sequence[float] | None = None
) -> Plan:
    """``plan`` with no share under ``minimum`` samples, moved only where ``room`` (or the caps) holds them."""
    if minimum <= 1:
        return plan
    return with_minimum_shares(plan, minimum, profile=profile, room=room, accumulate=accumulate)


def _check_versions(group: Any) -> None:
    versions = all_gather(__version__, "comparing hetsplit versions", group)
    if len(set(versions)) > 1:
        raise DistributedError(
            f"hetsplit versions differ across ranks: {dict(enumerate(versions))}; "
            "install the same version on every node"
        )


def _weighted_plan(
    batch_size: int,
    weights: Sequence[float],
    profile: Profile | None,
    rank: int,
    world: int,
    group: Any,
    cap: int | None = None,
    accumulate: bool = False,
    minimum: int = 1,
    device_name: str = "",
) -> Plan:
    """The plan of hand-set ``weights`` (one per rank), the same on every rank; nothing is profiled.

    Devices are labelled ``rank{r}:{device}`` as a profiled plan's. A share above its rank's emulated
    memory (``cap``) runs as micro-batches with ``accumulate``, and is refused on every rank without it.
    """
    if profile is not None:
        raise ValueError("pass weights= or profile=, not both: weights set the shares without a profile")
    values = list(weights)
    if len(values) != world:
        raise ValueError(f"weights={values} has {len(values)} entries for {world} ranks; give one weight per rank")
    # Every rank checks the same list, so a bad one raises everywhere before any collective.
    labels = [rank_label(r) for r in range(world)]
    result = resolve_plan(batch_size, labels, weights=values)
    _check_versions(group)
    theirs = all_gather({"weights": values, "cap": cap, "device": device_name}, "comparing weights", group)
    if any(t["weights"] != values for t in theirs):
        given = {r: t["weights"] for r, t in enumerate(theirs)}
        raise DistributedError(f"the ranks pass different weights: {given}; pass the same weights= on every rank")
    labels = [rank_label(r, t["device"]) for r, t in enumerate(theirs)]
    result = dataclasses.replace(result, devices=labels)
    caps = [t["cap"] for t in theirs]
    # Before the caps are checked and micro-batches cut (with accumulate any rank has room).
    room = [math.inf if accumulate or c is None else c for c in caps]
    result = _no_single(result, profile=None, accumulate=False, minimum=minimum, room=room)
    over = [(r, s, c) for r, (s, c) in enumerate(zip(result.sizes, caps)) if c is not None and s > c]
    if over and not accumulate:
        r, s, c = over[0]
        raise ValueError(
            f"weights={values} give rank {r} {s} samples of {batch_size} but its memory holds {c} a forward: "
            "pass accumulate=True to run its share as micro-batches, or weight it less"
        )
    if over:
        result = micro_batched(result, caps)
    return result


def _with_stand_ins(plan: Plan, prof: Profile | None) -> Plan:
    """``plan`` with each zero share priced as the ``STAND_IN`` samples its rank runs (planning.sizes)."""
    return priced_stand_ins(plan, prof, STAND_IN)


def _stand_ins_used(plan: Plan, prof: Profile | None, minimum: int = 1) -> Plan:
    """``plan`` with each zero share given the samples its rank runs anyway, unless under ``minimum``."""

    return plan if minimum > STAND_IN else stand_ins_used(plan, prof, STAND_IN)


def _broadcast_plan(
    solve: Callable[[Profile], Plan], group: Any, rank: int, world: int, prof: Profile | None, minimum: int = 1
) -> Plan:
    """Rank 0 solves ``prof``, every rank's profile (zero shares' stand-ins used and timed); every rank receives it."""
    holder: list[Any] = [None]
    if rank == 0:
        if prof is None:
            raise RuntimeError("rank 0 holds no gathered profile to solve; this is a bug in hetsplit")
        holder = [_with_stand_ins(_stand_ins_used(solve(prof), prof, minimum), prof).to_dict()]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    collective("broadcasting the plan", lambda: dist.broadcast_object_list(holder, src=src, group=group), rank)
    result = Plan.from_dict(holder[0])
    if len(result.devices) != world:
        raise DistributedError(f"the plan has {len(result.devices)} devices for {world} ranks")
    return result


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{launch_env().local_rank % torch.cuda.device_count()}"
    return "cpu"
