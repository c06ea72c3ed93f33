"""Core: the decisions every integration (Lightning, accelerate, the HF Trainer) shares, made in one place.

Each framework keeps only its own wiring; what a rank's device is called, whether a
multi-process job runs on the CPU, which DataLoader settings a re-cut loader keeps, how
an emulated device is throttled, how the model is profiled for the plan, how ``rebalance``
becomes a rebalancer and which arguments are refused are decided here, so the three
cannot drift apart. A rank's micro-batches are cut in :mod:`hetsplit.distributed.accumulate`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import hetsplit.distributed as hd
from hetsplit.devices import Device
from hetsplit.planning import Plan, Profile, Rebalancer

# How gradients are weighted: "hook" (a DDP comm hook), "outputs" (the gradient into the
# model's outputs is scaled), "none" (DDP's plain mean, for a loss already normalised over
# the global batch; not every integration offers it).
WEIGHTINGS = ("hook", "outputs", "none")

# What hetsplit.distributed.plan is called with when the user does not say: a 10 s profile
# per rank and a short calibration (4 DDP steps), the same in every integration.
PLAN_KWARGS = {"time_budget": 10.0, "calibrate": 4}

# DataLoader settings a re-cut loader keeps from the user's (the sampler, batch size and
# drop_last are hetsplit's; collate_fn is passed on its own, as the zero share needs it).
CARRIED = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def launched_world() -> tuple[int, int]:
    """``(rank, world)`` of the job the launcher started (torchrun's ``RANK``/``WORLD_SIZE``; 0, 1 alone).

    Raises:
        ValueError: If ``RANK`` or ``WORLD_SIZE`` is not an integer (naming it).
    """
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        raw = os.environ.get(name, default)
        try:
            values[name] = int(raw)
        except ValueError as e:
            raise ValueError(f"{name} must be an integer, got {raw!r}; start the job with torchrun") from e
    return values["RANK"], values["WORLD_SIZE"]


def is_cpu_job(device: Device | None, world: int) -> bool:
    """Whether this rank of a multi-process job runs on the CPU: its device is one, or, without a
    device list, the machine has no CUDA.

    The frameworks run such a job as one multi-process CPU job only when told (accelerate's
    ``cpu=True``, the Trainer's ``use_cpu=True``); otherwise each process believes it is
    alone and trains its own copy. The integrations tell them.
    """
    if world <= 1:
        return False
    return device.type == "cpu" if device is not None else not torch.cuda.is_available()


def carried_settings(loader: DataLoader) -> dict[str, Any]:
    """The settings of ``loader`` a loader re-cut into hetsplit's shares keeps (:data:`CARRIED`)."""
    carried = {k: getattr(loader, k) for k in CARRIED if hasattr(loader, k)}
    if carried.get("num_workers", 0) > 0:
        carried["prefetch_factor"] = loader.prefetch_factor
    else:  # DataLoader refuses these without workers
        carried.pop("persistent_workers", None)
    return carried


def plan_kwargs(given: Any) -> dict[str, Any]:
    """The arguments for :func:`hetsplit.distributed.plan`: :data:`PLAN_KWARGS` updated with ``given``."""
    return {**PLAN_KWARGS, **(given or {})}


def throttle(device: Device | None) -> contextlib.AbstractContextManager[Any]:
    """Run the block at ``device``'s emulated speed (a real device: no change).

    Waiting for the other ranks in a collective is not work, so it is not slowed down as
    if it were (:func:`hetsplit.emulation.throttle`).
    """
    if device is None or not device.emulated:
        return contextlib.nullcontext()
    return device.throttle()


_FORWARDS_PAUSED = threading.local()


@contextlib.contextmanager
def forwards_unthrottled() -> Iterator[None]:
    """Leave the forwards :func:`throttle_forward` slows to an enclosing throttle (this thread).

    Profiling a model already prepared (FSDP2, sharded before its plan is made) throttles
    each whole step itself; a second throttle around the forward inside it would count the
    forward twice on a wall clock (an emulated GPU: ``1/speed**2`` instead of ``1/speed``).
    """
    before = getattr(_FORWARDS_PAUSED, "on", False)
    _FORWARDS_PAUSED.on = True
    try:
        yield
    finally:
        _FORWARDS_PAUSED.on = before


def throttle_forward(model: nn.Module, device: Device | None) -> None:
    """Run every forward of ``model`` at ``device``'s emulated speed, by :func:`throttle`'s rule.

    For a framework that calls the model itself (accelerate): its backward is throttled
    where the framework runs it. Not inside :func:`forwards_unthrottled`.
    """
    if device is None or not device.emulated:
        return
    open_: list[contextlib.AbstractContextManager[Any]] = []

    def before(module: nn.Module, args: Any) -> None:
        paused = getattr(_FORWARDS_PAUSED, "on", False)
        ctx = contextlib.nullcontext() if paused else throttle(device)
        ctx.__enter__()
        open_.append(ctx)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if open_:
            open_.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def profiled_plan(
    who: str,
    what: str,
    model: nn.Module,
    sample: Any,
    batch_size: int,
    *,
    device: Any,
    profile: Profile | None,
    plan_kwargs: Mapping[str, Any],
    hint: str,
    cuda: Sequence[torch.device] = (),
    **kwargs: Any,
) -> Plan:
    """The plan for every rank, each profiling ``model`` on its own device (:func:`hetsplit.distributed.plan`).

    Profiling draws batches and random numbers: the training run must not see that, so the
    random state (the CPU's and ``cuda``'s) is put back after. A failure other than a
    peer's (:class:`~hetsplit.distributed.DistributedError`) becomes one ``RuntimeError``
    naming ``who``, ``what`` was profiled, the device and the cause, then ``hint``.

    Args:
        who: The class the user made.
        what: What was profiled (``"the model"``, ``"training_step"``).
        model, sample, batch_size, device, profile: As for :func:`hetsplit.distributed.plan`.
        plan_kwargs: The other arguments of :func:`hetsplit.distributed.plan` (:func:`plan_kwargs`).
        hint: What the user can do instead.
        cuda: The GPUs whose random state to keep.
        **kwargs: ``loss_fn``, ``target``: as for :func:`hetsplit.distributed.plan`.
    """
    try:
        with torch.random.fork_rng(devices=list(cuda)):
            return hd.plan(model, sample, batch_size, device=device, profile=profile, **kwargs, **plan_kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, hd.DistributedError):
            raise
        raise RuntimeError(f"{who} could not profile {what} on {device} ({type(e).__name__}: {e}); {hint}") from e


def check_rebalance(who: str, plan: Plan | None, rebalance: int | Rebalancer) -> None:
    """Refuse ``rebalance`` with a plan that runs some rank's share as micro-batches (every rank, before any step).

    Raises:
        ValueError: Naming the rank, its micro-batches and the two ways out.
    """
    if not rebalance or plan is None or all(len(parts) <= 1 for parts in plan.micro_batches):
        return
    r = next(r for r, parts in enumerate(plan.micro_batches) if len(parts) > 1)
    given = f"Rebalancer(every={rebalance.every})" if isinstance(rebalance, Rebalancer) else rebalance
    raise ValueError(
        f"{who}(rebalance={given}) with a plan with micro-batches: the plan splits rank {r}'s share "
        f"{plan.sizes[r]} into micro-batches {plan.micro_batches[r]}, but the rebalancer re-solves and records "
        "whole shares (its first new plan would run a share over a device's memory cap whole, out of memory; "
        "with a capped profile the shares would never move). Pass rebalance=0 to keep these micro-batches, or "
        "solve the plan without accumulate (shares within the memory caps) to rebalance"
    )


def rebalancer(plan: Plan, rebalance: int | Rebalancer, **kwargs: Any) -> hd.DistributedRebalancer | None:
    """The :class:`~hetsplit.distributed.DistributedRebalancer` that ``rebalance`` asks for (``None`` for 0).

    ``rebalance`` is a number of steps between re-solves, or a :class:`~hetsplit.Rebalancer`
    policy; ``kwargs`` (``sampler``, ``gradients``, ``model``, ``device``) are passed on.
    """
    if not rebalance:
        return None
    policy = rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(every=rebalance)
    return hd.DistributedRebalancer(plan, policy, **kwargs)


def check_arguments(
    who: str,
    *,
    devices: Any = None,
    plan: Any = None,
    profile: Any = None,
    global_batch_size: Any = None,
    weighting: str = "hook",
    weightings: tuple[str, ...] = WEIGHTINGS,
    rebalance: Any = 0,
    plan_kwargs: Any = None,
) -> None:
    """The arguments every integration shares, checked the same way (same exceptions, same words).

    Args:
        who: The class the user made (named in every message).
        devices, plan, profile, global_batch_size, weighting, rebalance, plan_kwargs: As the user gave them.
        weightings: The weightings ``who`` offers.

    Raises:
        TypeError: ``devices`` neither a string nor a list of devices, ``plan`` not a
            :class:`~hetsplit.Plan`, ``profile`` not a :class:`~hetsplit.Profile`,
            ``plan_kwargs`` not a mapping.
        ValueError: An unknown ``weighting``; a ``global_batch_size`` that is not a
            positive integer or disagrees with the plan; a ``rebalance`` that is neither a
            number of steps >= 0 nor a :class:`~hetsplit.Rebalancer`.
    """
    if devices is not None and (isinstance(devices, bytes) or not isinstance(devices, str | Sequence)):
        raise TypeError(
            f"{who}(devices=...) must be a string such as 'cuda:0,cpu' or a list with one device per process, "
            f"got {type(devices).__name__}: {devices!r}"
        )
    if weighting not in weightings:
        raise ValueError(f"{who}(weighting={weighting!r}): use one of {', '.join(map(repr, weightings))}")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(
            f"{who}(plan=...) must be a hetsplit Plan, got {type(plan).__name__}: {plan!r}; for fixed shares use "
            "hetsplit.planning.plan_from_sizes(None, ['rank0', 'rank1'], [6, 2]) or plan_kwargs={'weights': [3, 1]}"
        )
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"{who}(profile=...) must be a hetsplit Profile, got {type(profile).__name__}: {profile!r}")
    if plan_kwargs is not None and not isinstance(plan_kwargs, Mapping):
        raise TypeError(f"{who}(plan_kwargs=...) must be a dict, got {type(plan_kwargs).__name__}: {plan_kwargs!r}")
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1
    ):
        raise ValueError(
            f"{who}(global_batch_size=...) must be a positive number of samples per step, got {global_batch_size!r}"
        )
    if plan is not None and global_batch_size is not None and plan.batch_size != global_batch_size:
        raise ValueError(
            f"{who}: global_batch_size={global_batch_size} but the plan splits {plan.batch_size}; "
            "leave global_batch_size out (the plan sets it) or solve the plan for it"
        )
    if not isinstance(rebalance, Rebalancer) and (
        isinstance(rebalance, bool) or not isinstance(rebalance, int) or rebalance < 0
    ):
        raise ValueError(
            f"{who}(rebalance={rebalance!r}): give a number of steps >= 1, 0 for no rebalancing, "
            "or a hetsplit.Rebalancer"
        )
    check_rebalance(who, plan, rebalance)
