"""Core: the decisions every integration (Lightning, accelerate, the HF Trainer) shares, made in one place.

Each framework keeps only its own wiring; what a rank's device is called, whether a
multi-process job runs on the CPU, which DataLoader settings a re-cut loader keeps, how
an emulated device is throttled, how the model is profiled for the plan, how ``rebalance``
becomes a rebalancer, which arguments are refused and what each says about its split
(:class:`SplitReport`) are decided here, so the three cannot drift apart. A rank's
micro-batches are cut in :mod:`hetsplit.distributed.accumulate`.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import hetsplit.distributed as hd
from hetsplit.devices import Device, parse_device
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
    quiet: Any = False,
) -> None:
    """The arguments every integration shares, checked the same way (same exceptions, same words).

    Args:
        who: The class the user made (named in every message).
        devices, plan, profile, global_batch_size, weighting, rebalance, plan_kwargs, quiet: As the user gave them.
        weightings: The weightings ``who`` offers.

    Raises:
        TypeError: ``devices`` neither a string nor a list of devices, ``plan`` not a
            :class:`~hetsplit.Plan`, ``profile`` not a :class:`~hetsplit.Profile`,
            ``plan_kwargs`` not a mapping, ``quiet`` not a bool.
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
    if not isinstance(quiet, bool):
        raise TypeError(f"{who}(quiet=...) must be True or False, got {type(quiet).__name__}: {quiet!r}")
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


# The variable that silences every integration's split report, as quiet=True does.
QUIET_ENV = "HETSPLIT_QUIET"


def is_quiet(quiet: bool) -> bool:
    """``quiet``, or ``$HETSPLIT_QUIET`` set to anything but empty, ``0``, ``false``, ``no`` or ``off``."""
    flag = os.environ.get(QUIET_ENV, "").strip().lower()
    return bool(quiet) or flag not in ("", "0", "false", "no", "off")


class SplitReport:
    """What an integration says about its split: one line when training starts, one when it ends (rank 0).

    At the first training step, the split in force with its predicted step (the plan's
    slowest share) and which devices are emulated; at the end (:meth:`end`), the measured
    step beside the prediction: the median time from the start of one training step to
    the next on rank 0, where each step ends in the gradients' all-reduce every rank
    waits for, so rank 0's period is the job's. Nothing with ``quiet``
    (:func:`is_quiet`) or on another rank.

    Args:
        who: The class the user made (each line starts with it).
        rank: This process's rank.
        quiet: Say nothing.
    """

    def __init__(self, who: str, rank: int, quiet: bool = False) -> None:
        self.who, self.on = who, rank == 0 and not is_quiet(quiet)
        self.periods: list[float] = []
        self._last: float | None = None
        self._first: Plan | None = None

    def step(self, plan: Plan | None, devices: Sequence[str] | None = None) -> None:
        """A training step of ``plan`` starts (the first one says the split; ``devices``: one name per rank)."""
        if not self.on or plan is None:
            return
        now = time.perf_counter()
        if self._last is None:
            self._first = plan
            self._say(self._start_line(plan, devices))
        else:
            self.periods.append(now - self._last)
        self._last = now

    def end(self, plan: Plan | None) -> None:
        """Training ended (or a pass over the training loader): the measured step beside the prediction, once."""
        if not self.on or self._last is None:
            return
        if not self.periods:
            self._say(f"{self.who}: measured step: one step, none to time from start to start")
            self._last = None
            return
        measured = statistics.median(self.periods)
        line = f"{self.who}: measured step {_ms(measured)} (median of {len(self.periods)}, rank 0, start to start)"
        predicted = plan.step_time if plan is not None else math.nan
        if math.isfinite(predicted) and predicted > 0:
            line += f", predicted {_ms(predicted)} ({measured / predicted - 1:+.0%})"
        else:
            line += ", no prediction (shares set by hand)"
        if plan is not None and self._first is not None and list(plan.sizes) != list(self._first.sizes):
            line += f"; rebalanced to {list(plan.sizes)}"
        self._say(line)
        self._last, self.periods = None, []

    def _start_line(self, plan: Plan, devices: Sequence[str] | None) -> str:
        names = list(devices) if devices is not None and len(devices) == len(plan.sizes) else list(plan.devices)
        shares = ", ".join(f"{name} {size} ({size / plan.batch_size:.0%})" for name, size in zip(names, plan.sizes))
        line = f"{self.who}: global batch {plan.batch_size} split {shares}"
        if any(len(parts) > 1 for parts in plan.micro_batches):
            line += f" (micro-batches {plan.micro_batches})"
        predicted = plan.step_time
        line += (
            f"; predicted step {_ms(predicted)}"
            if math.isfinite(predicted) and predicted > 0
            else ("; no predicted step (shares set by hand, nothing profiled)")
        )
        emulated = sorted({_bare(n) for n in names if _emulated(n)} | {_bare(n) for n in plan.emulated})
        if emulated:
            line += f"; emulated (a real device slowed down or capped, not real hardware): {', '.join(emulated)}"
        return line

    @staticmethod
    def _say(line: str) -> None:
        print(f"hetsplit: {line}", flush=True)


def _bare(name: str) -> str:
    """``cpu@0.25`` for a plan's label ``rank1:cpu@0.25`` (a hand-set plan's ``rank1`` stays)."""
    head, _, rest = name.partition(":")
    return rest if head.startswith("rank") and head[4:].isdigit() and rest else name


def _emulated(name: str) -> bool:
    try:
        return parse_device(_bare(name), check=False).emulated
    except ValueError:  # a free-form label of a hand-set plan
        return False


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
