"""Rank plan: one plan for all ranks — each profiles its own device, rank 0 solves, DDP steps calibrate it."""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..devices import Device, DeviceLike, parse_device
from ..planning import checks
from ..planning.curve import Curve
from ..planning.memory import micro_batched
from ..planning.plan import Plan, scaled_step
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
from ..profiler import EmulationFault, describe_faults, emulation_faults, fault_note, held_to_declared_speed, train_step
from ..profiler import profile as run_profile
from ..timing import WorkTimer
from ..tree import batch_length, move, take_rows
from ..version import __version__
from . import sharded as _sharded
from ._group import DistributedError, all_gather, collective, group_info, guard
from .comm_hooks import weight_gradients
from .dtypes import verify_dtypes
from .report import SplitReport
from .setup import launch_env, rank_devices
from .sharded_profile import profile_sharded, sharded_steps
from .step_time import communication, exposed
from .zero_share import STAND_IN


def rank_device(devices: str | Sequence[DeviceLike], rank: int | None = None, *, world: int | None = None) -> str:
    """This rank's device from a per-rank list: ``"cuda:0,cpu@0.25"`` gives rank 1 ``cpu@0.25``.

    The list must name exactly one device per rank (repeat a device to put several
    ranks on it): a list longer or shorter than the world is an error, never a device
    silently dropped or shared. Call it before ``init_process_group`` to fail before any
    rendezvous: ``rank`` and ``world`` default to the process group's, else to torchrun's
    ``RANK`` and ``WORLD_SIZE``.

    Raises:
        ValueError: If the list is empty or malformed, its length is not the world size
            (naming both), or the rank or world size cannot be found.
    """
    spec = devices if isinstance(devices, str) else ",".join(str(d) for d in devices)
    if rank is None or world is None:
        if dist.is_available() and dist.is_initialized():
            here, size = group_info(None)
        else:
            try:
                here, size, _ = launch_env(required=True)
            except ValueError as e:
                raise ValueError(f"no process group: {e}, or pass rank= and world=") from e
        rank = here if rank is None else rank
        world = size if world is None else world
    names = rank_devices(spec, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is out of range for {world} ranks")
    return names[rank]


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
    """One plan for all ranks: each profiles its own device, rank 0 solves, all receive it.

    Every rank calls this collectively. Each rank profiles ``model`` on its own
    ``device`` (or contributes the given ``profile``); the profiles and hetsplit versions
    are all-gathered; rank 0 solves the global batch and broadcasts the plan. Devices in
    the plan are labelled ``rank{r}:{device}`` in rank order, so ``plan.sizes[rank]`` is
    each rank's local batch.

    The profile times the bare model; a DDP step also pays DDP's own per-step work (its
    forward, gradient bucketing, the all-reduce's CPU time), which weighs most on a slow
    rank. With ``calibrate`` steps, every rank then runs that many real DDP steps of a
    copy of ``model`` on its planned share, its work timed up to its last gradient
    (waiting for other ranks is not work); each rank's curve is corrected to pass
    through its median (work beyond the profile is added as a fixed per-step overhead,
    work short of it scales the curve down) and the plan is solved again. ``model`` is
    not touched.

    Every time here is a rank's compute, apart from its waits for the others
    (:mod:`hetsplit.distributed.step_time`): the shares are solved on compute. The
    communication is added to the plan's predicted step, which is then the slowest rank's
    compute plus the communication. Calibrated, the predicted step is the calibration
    steps' median, each step scaled to the new shares and as long as its slowest rank plus
    what it lasted beyond that rank's work; otherwise the step's collectives (DDP's
    all-reduce; FSDP2's all-gathers and reduce-scatters, once per micro-batch) are timed
    once at their real sizes.

    A sharded model (FSDP2's ``fully_shard``, checked across ranks as :func:`weight_gradients`
    does) is profiled as the user sharded it, every rank climbing the same ladder of batch
    sizes in the same steps (an FSDP2 forward is collective;
    :func:`~hetsplit.distributed.sharded_profile.profile_sharded`), each rank timed by its
    own compute (its waits in the collectives are the other ranks' time), and
    no device ever holds the whole model; the model is left as it was. Its memory cap: an
    emulated one (``cpu:max8``) as given; on CUDA where the fitted peak of the sharded step
    reaches 90 % of the device (``memory_fraction``) less the room of ``optimizer``'s state
    when it is passed (``profile_kwargs`` of a sharded model: ``memory_fraction``,
    ``optimizer``). Its calibration steps run the sharded model itself, in place, as its
    profile did (no rank holds a copy of the whole model); the model is left as it was.
    With ``accumulate=True`` its shares are solved for what FSDP2 runs: every rank as
    many micro-batches as the others (:func:`hetsplit.planning.solver.solve_lockstep`),
    so a fast rank's extra micro-batches are priced in, not only the capped rank's.

    Given the ``DistributedDataParallel`` model itself, its module is planned and its
    gradients are weighted by the plan, as :func:`weight_gradients` ``(ddp, plan)`` does
    (one line for both; call :func:`weight_gradients` yourself for its state, which
    :class:`DistributedRebalancer` takes).

    Args:
        model: The model (unwrapped, the module inside DDP, an FSDP2 root module, or a
            module holding one), or the DDP model (its gradients then weighted by the plan).
        sample: Example input for the profiler (see :func:`hetsplit.profile`).
        batch_size: The global batch: samples per step across all ranks.
        device: This rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available,
            else ``cpu``).
        loss_fn, target: As for :func:`hetsplit.profile`.
        profile: This rank's profile, to skip profiling (one device, or the device
            named by ``device``).
        weights: Hand-set shares instead of profiling: one relative throughput per
            rank (``[4, 1]``: 80 % of every global batch to rank 0, 20 % to rank 1), as
            ``HeteroDataParallel(weights=)``. Every rank must pass the same weights (they
            are checked); nothing is profiled or calibrated. A share above its rank's
            emulated memory (``cpu:max2``) runs as micro-batches with ``accumulate``, and is
            refused (``ValueError``, every rank) without it.
        accumulate: Let a rank with a memory cap run its share as micro-batches
            (``plan.micro_batches``; run them with :func:`micro_batches`). A plan with
            micro-batches is not calibrated (calibration runs whole shares).
        calibrate: Training steps to calibrate the plan with (after 2 warm-up steps): DDP
            steps of a copy of the model, or the sharded model's own steps; 0 skips it
            (for a job without DDP or FSDP2, or a large model's start-up; a plan with a
            share of 0 or with micro-batches is not calibrated).
        calibrate_seconds: Calibrate with more steps than ``calibrate``, until they took
            this long (at most 400 steps): a machine's speed drifts over seconds, and a
            short calibration catches one moment of it; 0: exactly ``calibrate`` steps.
        group: The process group (default: the world).
        quiet: Say nothing. Otherwise rank 0 says, in one line, the split chosen and its
            predicted step (:class:`~hetsplit.distributed.report.SplitReport`; also
            silenced by ``$HETSPLIT_QUIET``), and in one more line when a rank's emulated
            device (``cpu@0.25``) measured more than 1.3x off its speed against a rank of
            its real device. To say the measured step beside the prediction at the end,
            ``hd.SplitReport(who, rank).end(plan, measured=seconds)``.
        **profile_kwargs: Passed to :func:`hetsplit.profile` (``time_budget``, ...).

    Returns:
        The same :class:`Plan` on every rank.

    Raises:
        ValueError: On a negative ``calibrate`` or ``calibrate_seconds``, ``weights`` with ``profile``, or
            ``weights`` of another length than the world or not positive and finite,
            before anything else runs.
        DistributedError: If ``weights`` differ across ranks, hetsplit versions differ across ranks, a calibration step
            fails on some rank (a sharded model's steps are collective: then at the group's
            timeout), or a rank dies or hangs past the group's timeout.
    """
    if isinstance(calibrate, bool) or not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"calibrate must be a number of steps >= 0, got {calibrate!r}")
    if (
        isinstance(calibrate_seconds, bool)
        or not isinstance(calibrate_seconds, (int, float))
        or not (0 <= calibrate_seconds < math.inf)
    ):
        raise ValueError(f"calibrate_seconds must be a number of seconds >= 0, got {calibrate_seconds!r}")
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
    if profile is None and sharded:  # collective forwards: every rank in the same steps (sharded_profile.py)
        profile = profile_sharded(
            model, sample, dev, loss_fn, target=target, batch_size=batch_size, group=group, **profile_kwargs
        )
    elif profile is None:
        profile = run_profile(model, sample, [dev], loss_fn, target=target, progress=False, **profile_kwargs)
    entry = profile.entry(dev.name) if len(profile.entries) > 1 else profile.entries[0]
    gathered = all_gather({"entry": entry.to_dict(), "model": profile.model}, "gathering profiles", group)
    combined: Profile | None = None  # every rank's profile, on rank 0 (which solves)
    if rank == 0:
        entries = []
        for r, item in enumerate(gathered):
            e = DeviceProfile.from_dict(item["entry"])
            e.info.name = f"rank{r}:{e.info.name}"
            entries.append(e)
        combined = Profile(entries, model=gathered[0]["model"], host="torchrun", source="distributed")
    gathered_profile = combined  # as measured, before calibration corrects it (rank 0)
    # Only the profiles are checked: a rank's calibration step holds DDP's own work (the
    # weighting hook, the buckets' copies), which its profile does not, and a quarter-speed
    # rank with 2 samples of 32 spends much of its step there; compared as the thread engine's
    # factors are, 7 of 14 quiet plans said "unreliable", a gap that DDP's own work explains.
    faults = _emulation_faults(gathered_profile) if gathered_profile is not None else []
    if combined is not None:  # an emulated rank faster than declared is planned at its declared speed
        combined = held_to_declared_speed(combined, faults)

    def solve(prof: Profile) -> Plan:
        if sharded and accumulate:
            # Every rank of a sharded model runs as many micro-batches as the others: solve for that.
            return solve_lockstep(prof, batch_size)
        return _no_single(
            resolve_plan(batch_size, prof.devices, profile=prof, accumulate=accumulate),
            profile=prof, accumulate=accumulate, minimum=minimum,
        )  # fmt: skip

    result = _broadcast_plan(solve, group, rank, world, combined, minimum)
    calibrated = bool(calibrate and min(result.sizes) > 0 and max(map(len, result.micro_batches)) == 1)
    if calibrated:
        if sharded:  # the user's sharded model in place, as its profile ran (no rank holds a whole copy)
            with sharded_steps(model, sample, target, loss_fn, dev, result.sizes[rank], group=group) as one:
                work, steps = _timed_steps(lambda _i: one(), dev, calibrate, calibrate_seconds, group, rank)
        else:
            work, steps = _calibration_work(
                model, sample, target, loss_fn, dev, result, calibrate, calibrate_seconds, group, rank
            )
        if combined is not None:  # rank 0
            combined = dataclasses.replace(
                combined,
                entries=[
                    dataclasses.replace(e, curve=_through(e.curve, size, t))
                    for e, size, t in zip(combined.entries, result.sizes, work)
                ],
            )
        result = _broadcast_plan(solve, group, rank, world, combined, minimum)
    micro = max(map(len, result.micro_batches))
    if calibrated and micro == 1:
        # The shares are solved on compute; the predicted step is the calibration steps',
        # each scaled to the new shares (what the plan adds to its slowest rank's compute:
        # the communication, the same whatever the split, and the steps' spread).
        seconds = _stepwise(result, work, steps) - max(result.times)
    else:
        # Not calibrated, or solved again into micro-batches (a step the calibration did not
        # run): the step's collectives timed once at their real sizes, every rank the same
        # number; FSDP2's run once per micro-batch.
        seconds = communication(model, dev.torch_device, group) * (micro if sharded else 1)
    result = with_communication(result, seconds)
    # The plan carries rank 0's note on flagged measurements, so every line that says it (the
    # integrations' own reports too, which plan quietly) says it; every rank holds the same plan.
    note = all_gather(fault_note(faults, calibrated), "gathering the plan's notes", group)[0]
    if note:
        result = dataclasses.replace(result, notes=[*result.notes, note])
    report = SplitReport("hd.plan", rank, quiet)
    report.announce(result, follow=True)  # weight_gradients times the run on it; its end is said at exit
    unreliable = describe_faults(faults)
    if unreliable:
        report.note(unreliable)
    return result


def _emulation_faults(prof: Profile) -> list[EmulationFault]:
    """:func:`hetsplit.profiler.emulation_faults` across ranks: each emulated rank against a real twin rank.

    The profiles' devices are labelled ``rank{r}:{device}``; the profiler's check pairs a
    ``cpu@0.25`` with a ``cpu`` by name, so each emulated rank is checked in a profile of two:
    it and the first rank of its real device, both without their rank labels. Each fault
    names the emulated rank by its label.
    """

    def bare(e: DeviceProfile) -> DeviceProfile:
        name = e.info.name.partition(":")[2] if e.info.name.startswith("rank") else e.info.name
        return dataclasses.replace(e, info=dataclasses.replace(e.info, name=name))

    faults = []
    for e in prof.entries:
        if not e.info.emulated:
            continue
        mine = bare(e)
        base = parse_device(mine.name, check=False).base
        twin = next((bare(r) for r in prof.entries if not r.info.emulated and bare(r).name == base), None)
        if twin is None:
            continue
        faults += [f._replace(name=e.name) for f in emulation_faults(dataclasses.replace(prof, entries=[twin, mine]))]
    return faults


def _emulation_warning(prof: Profile) -> str | None:
    """The warning line of :func:`_emulation_faults` (``None``: every emulated rank near its speed)."""
    return describe_faults(_emulation_faults(prof))


def _minimum_share(model: Any, sample: Any) -> int:
    """The fewest samples a rank's share of ``model`` may hold (:func:`~hetsplit.planning.sizes.batchnorm_minimum`).

    A sharded model's maps are not traced (its forward gathers parameters across ranks, which
    a trace on one rank must not start), nor those of a model planned without a sample (the
    Lightning strategy's, from a given profile): a BatchNorm there gets the floor of 2.
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
    """``plan`` with no share under ``minimum`` samples (:func:`_minimum_share`; 1: as it is).

    A sample moves only where a rank's memory holds it: ``room`` per rank, else the profile's caps.
    """
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

    Its devices are labelled as a profiled plan's, ``rank{r}:{device}`` (each rank's
    ``device_name``, gathered), so reports and the rebalancer name them alike.

    A share above its rank's emulated memory (``cap``, ``cpu:max2``) runs as micro-batches
    with ``accumulate``, and is refused without it (on every rank: the caps are gathered).
    For a BatchNorm model a share under ``minimum`` samples moves to another rank first, only
    where that rank's memory holds it (anywhere with ``accumulate``: micro-batches are cut after).
    """
    if profile is not None:
        raise ValueError("pass weights= or profile=, not both: weights set the shares without a profile")
    values = list(weights)
    if len(values) != world:
        raise ValueError(f"weights={values} has {len(values)} entries for {world} ranks; give one weight per rank")
    # Every rank checks the same list, so a bad one raises everywhere before any collective.
    labels = [f"rank{r}" for r in range(world)]
    result = resolve_plan(batch_size, labels, weights=values)
    _check_versions(group)
    theirs = all_gather({"weights": values, "cap": cap, "device": device_name}, "comparing weights", group)
    if any(t["weights"] != values for t in theirs):
        given = {r: t["weights"] for r, t in enumerate(theirs)}
        raise DistributedError(f"the ranks pass different weights: {given}; pass the same weights= on every rank")
    labels = [f"rank{r}:{t['device']}" if t["device"] else f"rank{r}" for r, t in enumerate(theirs)]
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


def _through(curve: Curve, size: int, seconds: float) -> Curve:
    """``curve`` corrected to pass through a measured ``(size, seconds)``.

    Work beyond the prediction is a fixed per-step overhead (what DDP adds to a step);
    work short of it scales the curve down.
    """
    predicted = curve(size)
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(predicted) and predicted > 0):
        return curve
    return curve.shifted(seconds - predicted) if seconds >= predicted else curve.scaled(seconds / predicted)


def _with_stand_ins(plan: Plan, prof: Profile | None) -> Plan:
    """``plan`` with each zero share priced as the ``STAND_IN`` samples its rank runs (planning.sizes)."""
    return priced_stand_ins(plan, prof, STAND_IN)


def _stand_ins_used(plan: Plan, prof: Profile | None, minimum: int = 1) -> Plan:
    """``plan`` with each zero share given the samples its rank runs anyway (planning.sizes).

    Not where they are fewer than ``minimum`` (a BatchNorm model's smallest share).
    """
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


def _calibration_work(
    model: nn.Module,
    sample: Any,
    target: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    dev: Device,
    plan: Plan,
    steps: int,
    seconds: float,
    group: Any,
    rank: int,
) -> tuple[list[float], list[tuple[list[float], list[float]]]]:
    """Every rank's median seconds of work in a real DDP step on its share of ``plan``, and
    each step's every rank's wall seconds (from a barrier) and work (all-gathered): ``steps``
    steps, or more until they took ``seconds``.

    The step is the one training runs: DDP with the shard weighting's comm hook
    (:func:`~hetsplit.distributed.weight_gradients`), whose Python hook costs a rank a fifth
    to two fifths of a small model's step on the CPU (measured: Llama 2×64, 30 ms to 37 on
    the real CPU's share, 33 to 47 on a quarter-speed rank's two samples): calibrated on
    plain DDP, every plan predicted its step that much too short.
    """
    size = plan.sizes[rank]
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
    timer = WorkTimer(dev, replica)

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
) -> tuple[list[float], list[tuple[list[float], list[float]]]]:
    """Run calibration steps (``step(i)`` returns its compute: seconds, or a lap) on every rank.

    Two warm-up steps, then ``steps``, then more until they took ``seconds``; each from a
    barrier that starts every rank together. Returns every rank's median compute, and each
    step's every rank's wall seconds and compute (all-gathered).
    """
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


def _stepwise(plan: Plan, work: Sequence[float], steps: Sequence[tuple[list[float], list[float]]]) -> float:
    """The calibration ``steps`` (every rank's wall and compute) as they would have run ``plan``.

    :func:`~hetsplit.planning.plan.scaled_step`: each rank's compute scaled by its planned
    over its median compute (``work``; the plan's curves pass through it, so the ratio
    carries the new share), the slowest, plus what the step lasted beyond its slowest rank's
    compute (:func:`~hetsplit.distributed.step_time.exposed`: gloo's all-reduces in DDP's
    buckets, the hook's waits).
    """
    scales = [p / w if w > 0 else None for p, w in zip(plan.times, work)]
    return scaled_step([(computes, exposed(walls, computes)) for walls, computes in steps], scales, plan.times)


_MAX_CALIBRATION_STEPS = 400  # a tiny model's 1 s of steps; its median settles well before


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{launch_env().local_rank % torch.cuda.device_count()}"
    return "cpu"
