"""Core: the building block every integration composes, one function per piece, in the order they run.

The order and how to wire it: docs/integrations.md, "Adding an integration or an engine".
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import hetsplit.distributed as hd
from hetsplit import emulation
from hetsplit.devices import Device, rank_label

# What each integration says about its split is hetsplit.distributed's report (hd.plan says it too).
from hetsplit.distributed.report import QUIET_ENV as QUIET_ENV
from hetsplit.distributed.report import SplitReport as SplitReport
from hetsplit.distributed.setup import ENV_DEVICES, launch_env, rank_devices
from hetsplit.planning import Plan, Profile, Rebalancer
from hetsplit.planning.rebalance import rebalanced_caps
from hetsplit.planning.sizes import even_plan, scaled_plan


def renamed(owner: object, old: str, new: str) -> AttributeError:
    """The one-line error for an integration's attribute ``old``, removed for ``new``."""
    return AttributeError(f"{type(owner).__name__!r} object has no attribute {old!r}; it was removed: use .{new}")


# ---------------------------------------------------------------------- 1. the rank's device
def launched_world() -> tuple[int, int]:
    """``(rank, world)`` of the job the launcher started (torchrun's ``RANK``/``WORLD_SIZE``; 0, 1 alone).

    Raises:
        ValueError: If ``RANK`` or ``WORLD_SIZE`` is not an integer (naming it).
    """
    env = launch_env()
    return env.rank, env.world


def device_names(devices: str | None, world: int) -> list[str] | None:
    """Every process's device name from ``devices``, else ``$HETSPLIT_DEVICES`` (``None``: neither is set).

    Raises:
        ValueError: As :func:`hetsplit.distributed.setup.rank_devices` (a list of another length).
    """
    spec = devices if devices is not None else os.environ.get(ENV_DEVICES)
    return rank_devices(spec, world) if spec else None


def labels(names: Sequence[str]) -> list[str]:
    """The plan's labels for every process's device: ``rank0:cuda:0``, ``rank1:cpu@0.25``."""
    return [rank_label(r, n) for r, n in enumerate(names)]


def is_cpu_job(device: Device | None, world: int) -> bool:
    """Whether this rank of a multi-process job runs on the CPU (its device, else no CUDA on the machine).

    The frameworks run such a job as one job only when told (accelerate's ``cpu=True``, the Trainer's
    ``use_cpu=True``); otherwise each process believes it is alone and trains its own copy.
    """
    if world <= 1:
        return False
    return device.type == "cpu" if device is not None else not torch.cuda.is_available()


# ---------------------------------------------------------------------- 2. the plan
def profiled_plan(
    who: str,
    what: str,
    model: nn.Module,
    loader: Any,
    batch_size: int,
    *,
    device: Any,
    profile: Profile | None,
    plan_kwargs: Mapping[str, Any],
    hint: str,
    inputs: Callable[[Any], tuple[Any, dict[str, Any]]] = lambda batch: ((batch,), {}),
    cuda: Sequence[torch.device] = (),
) -> Plan:
    """The plan for every rank, each profiling ``model`` on a batch of ``loader`` on its own device.

    The random state (the CPU's and ``cuda``'s) is put back after, so the training run draws what it
    would have. A failure other than a peer's becomes one ``RuntimeError`` naming ``who``, ``what``
    was profiled, the device and the cause, then ``hint``.

    Args:
        batch_size, device, profile: As for :func:`hetsplit.distributed.plan`.
        plan_kwargs: The other arguments of :func:`hetsplit.distributed.plan` (``HeteroOptions.plan_arguments``).
        inputs: ``(sample, keywords)`` for :func:`hetsplit.distributed.plan` from a batch
            (``loss_fn``, ``target``); default: the batch itself.
    """
    try:
        with torch.random.fork_rng(devices=list(cuda)):
            sample, keywords = inputs(next(iter(loader)))
            # quiet: the integration's own SplitReport says the split, under the class the user made.
            options = {"quiet": True, **keywords, **plan_kwargs}
            return hd.plan(model, sample, batch_size, device=device, profile=profile, **options)
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, hd.DistributedError):
            raise
        raise RuntimeError(f"{who} could not profile {what} on {device} ({type(e).__name__}: {e}); {hint}") from e


def shares_for(plan: Plan | None, batch_size: int, names: Sequence[str]) -> Plan:
    """``plan``'s shares of a global batch of ``batch_size``: the plan, its proportions, or even shares without one.

    ``names`` label a plan made here, one per process.
    """
    if plan is None:
        return even_plan(batch_size, list(names))
    return plan if batch_size == plan.batch_size else scaled_plan(plan, batch_size, list(names))


# ---------------------------------------------------------------------- 4. the weighting
def check_plan(
    who: str,
    plan: Plan | None,
    world: int | None,
    *,
    rebalance: int | Rebalancer = 0,
    whole_shares: str | None = None,
) -> None:
    """The one check of a plan against what runs it, one message in every integration (every rank, before any step).

    Args:
        world: The number of processes (``None``: not known yet).
        rebalance: Refused with a plan with micro-batches: the integrations do not follow re-cut
            micro-batches mid-run.
        whole_shares: Where each share runs as one batch (``weighting="none"``): its name, for the message.

    Raises:
        ValueError: A plan for another number of processes; micro-batches with
            ``rebalance`` or ``whole_shares`` (naming the process and its micro-batches).
    """
    if plan is None:
        return
    if world is not None and len(plan.sizes) != world:
        raise ValueError(
            f"{who}(plan=...) has {len(plan.sizes)} shares {list(plan.sizes)} but {world} processes run: "
            "give a plan with one share per process"
        )
    if rebalance:
        given = f"Rebalancer(every={rebalance.every})" if isinstance(rebalance, Rebalancer) else rebalance
        rebalanced_caps(plan, None, refuse=f"{who}(rebalance={given})")
    split = [(r, parts) for r, parts in enumerate(plan.micro_batches) if len(parts) > 1]
    if whole_shares is not None and split:
        r, parts = split[0]
        raise ValueError(
            f"{whole_shares} runs each process's share as one batch, but the plan splits process {r}'s share "
            f"{plan.sizes[r]} into micro-batches {parts}; solve without accumulate (a batch within the "
            "memory caps), use HeteroAccelerator's micro_batches with a weighting (or "
            "hetsplit.distributed.micro_batches in a torchrun loop), or HeteroTrainer, which follows them"
        )


# ---------------------------------------------------------------------- 5. the throttle
def throttler(device: Device | None) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What runs a block at ``device``'s emulated speed, decided once (a real device, or none: nothing).

    Waiting for the other ranks in a collective is not work, so it is not slowed down as
    if it were (:func:`hetsplit.emulation.throttle`).
    """
    if device is None or not device.emulated:
        return contextlib.nullcontext
    return functools.partial(emulation.throttle, device)


_FORWARDS_PAUSED = threading.local()


@contextlib.contextmanager
def forwards_unthrottled() -> Iterator[None]:
    """Leave the forwards :func:`throttle_forward` slows to an enclosing throttle (this thread).

    Profiling a prepared model throttles each whole step itself; a second throttle would slow its
    forward twice (``1/speed**2`` instead of ``1/speed``).
    """
    before = getattr(_FORWARDS_PAUSED, "on", False)
    _FORWARDS_PAUSED.on = True
    try:
        yield
    finally:
        _FORWARDS_PAUSED.on = before


def throttle_forward(model: nn.Module, device: Device | None) -> None:
    """Run every forward of ``model`` at ``device``'s emulated speed (not inside :func:`forwards_unthrottled`).

    For a framework that calls the model itself (accelerate); its backward is throttled where it runs.
    """
    if device is None or not device.emulated:
        return
    slowed = throttler(device)
    open_: list[contextlib.AbstractContextManager[Any]] = []

    def before(module: nn.Module, args: Any) -> None:
        ctx = contextlib.nullcontext() if getattr(_FORWARDS_PAUSED, "on", False) else slowed()
        ctx.__enter__()
        open_.append(ctx)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if open_:
            open_.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


# ---------------------------------------------------------------------- 7. the rebalancer
def rebalancer(plan: Plan, rebalance: int | Rebalancer, **kwargs: Any) -> hd.DistributedRebalancer | None:
    """The :class:`~hetsplit.distributed.DistributedRebalancer` that ``rebalance`` asks for (``None`` for 0).

    ``rebalance`` is a number of steps between re-solves, or a :class:`~hetsplit.Rebalancer`
    policy; ``kwargs`` (``sampler``, ``gradients``, ``model``, ``device``) are passed on.
    """
    if not rebalance:
        return None
    policy = rebalance if isinstance(rebalance, Rebalancer) else Rebalancer(every=rebalance)
    return hd.DistributedRebalancer(plan, policy, **kwargs)
