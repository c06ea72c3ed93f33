"""Core: the decisions every integration (Lightning, accelerate, the HF Trainer) shares, made in one place.

Each framework keeps only its own wiring; the launched world, whether a multi-process
job runs on the CPU, how an emulated device is throttled, how the model is profiled for
the plan, how ``rebalance`` becomes a rebalancer and what each says about its split
(:class:`SplitReport`) are decided here, so the three cannot drift apart. Their shared
arguments are :mod:`.options`, their rebuilt loaders :mod:`.loaders`; a rank's
micro-batches are cut in :mod:`hetsplit.distributed.accumulate`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import hetsplit.distributed as hd
from hetsplit.devices import Device

# What each integration says about its split is hetsplit.distributed's report (hd.plan says it too).
from hetsplit.distributed.report import QUIET_ENV as QUIET_ENV
from hetsplit.distributed.report import SplitReport as SplitReport
from hetsplit.distributed.report import is_quiet as is_quiet
from hetsplit.distributed.setup import launch_env
from hetsplit.planning import Plan, Profile, Rebalancer


def renamed(owner: object, old: str, new: str) -> AttributeError:
    """The one-line error for an integration's attribute ``old``, removed for ``new``."""
    return AttributeError(f"{type(owner).__name__!r} object has no attribute {old!r}; it was removed: use .{new}")


def launched_world() -> tuple[int, int]:
    """``(rank, world)`` of the job the launcher started (torchrun's ``RANK``/``WORLD_SIZE``; 0, 1 alone).

    Raises:
        ValueError: If ``RANK`` or ``WORLD_SIZE`` is not an integer (naming it).
    """
    env = launch_env()
    return env.rank, env.world


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
        plan_kwargs: The other arguments of :func:`hetsplit.distributed.plan` (``HeteroOptions.plan_arguments``).
        hint: What the user can do instead.
        cuda: The GPUs whose random state to keep.
        **kwargs: ``loss_fn``, ``target``: as for :func:`hetsplit.distributed.plan`.
    """
    try:
        with torch.random.fork_rng(devices=list(cuda)):
            # quiet: the integration's own SplitReport says the split, under the class the user made.
            options = {"quiet": True, **kwargs, **plan_kwargs}
            return hd.plan(model, sample, batch_size, device=device, profile=profile, **options)
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
