"""Sharded profile: each rank's step-time curve measured on the FSDP2 model in place, every rank in the same steps.

A rank past its cap or budget runs the stand-in while the others climb on. No out-of-memory probe
(a rank that ran out inside a collective would leave the others waiting): docs/torchrun.md.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import statistics
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, parse_device
from ..planning.profile import Profile
from ..planning.records import DeviceProfile, MemoryModel
from ..planning.sizes import has_batchnorm
from ..profiler import DeviceSteps, check_ladder, check_settings, default_ladder, model_record, profile
from ..timing import StepTimer, threads_for
from ._group import DistributedError, all_gather, group_info, guard
from .comm_hooks import paused
from .zero_share import STAND_IN


def profile_sharded(
    model: nn.Module,
    sample: Any,
    device: DeviceLike,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    memory_fraction: float = 0.9,
    optimizer: torch.optim.Optimizer | None = None,
    batch_size: int | None = None,
    group: Any = None,
    **settings: Any,
) -> Profile:
    """This rank's profile of a sharded model, every rank timed in the same steps (collective: every rank calls it).

    FSDP2's fixed work sets small batches' times, so every size up to an even share of
    ``batch_size`` is measured whatever the budget (and beyond while :meth:`_Turn.flat`).

    Args:
        memory_fraction: On CUDA, the share of the device's memory a step may be predicted to take.
        optimizer: The optimizer that will step the model: on CUDA its state's room is kept free.
        batch_size: The global batch the plan will split: the default ladder runs up to it.
        group: The process group (default: the world).
        **settings: :func:`hetsplit.profile`'s (``progress`` is ignored).

    Raises:
        ValueError: On bad settings, before any device work (the same on every rank).
        DistributedError: On every rank, if a rank cannot run the ladder's first size or its
            decision fails; at the group's timeout, if a step fails on one rank only.
    """
    # The profile's own signature: its defaults, and a TypeError for a name it does not take.
    bound = inspect.signature(profile).bind(model, sample, [device], loss_fn, **settings)
    bound.apply_defaults()
    given = types.SimpleNamespace(**bound.arguments)  # its progress is ignored: the steps are collective
    target, repeats, warmup, time_budget = given.target, given.repeats, given.warmup, given.time_budget
    dev = parse_device(device)
    batch_sizes = given.batch_sizes
    if batch_sizes is None and batch_size is not None:
        batch_sizes = default_ladder(max(batch_size, 2))
    ladder = check_ladder(batch_sizes, given.max_probe)
    check_settings(sample, target, repeats, warmup, time_budget)
    if not (isinstance(memory_fraction, int | float) and 0 < memory_fraction <= 1):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    rank, world = group_info(group)
    floor = STAND_IN  # what a rank that stopped climbing runs: the least any rank runs in a sharded step
    if has_batchnorm(model):  # BatchNorm cannot train on one sample (its maps are not traced: rank_plan)
        ladder = [b for b in ladder if b >= 2] or [2]
    turn = _Turn(model, dev, sample, target, loss_fn, given.find_memory_cap, memory_fraction)
    timer = turn.timer = StepTimer(dev, model)
    if turn.limit is not None and optimizer is not None and not optimizer.state:
        turn.limit -= optimizer_state_bytes(optimizer)  # state it holds already is in the steps' peaks
    turn.even = math.ceil(batch_size / world) if batch_size else 0
    what = "profiling the sharded model"
    with _untouched(model, dev, given.threads, what, group):
        try:
            # The first pass climbs the ladder (warm-up steps, then one timed step of each size); the
            # other repeats pass over the sizes it reached again, in rounds: a load that changes while
            # profiling then weighs on every size alike, not on the sizes measured while it lasted
            # (a plan compares one rank's large share with another's small one).
            climbing, sizes, mine = True, [], set()
            for b in ladder:
                # Each rank decides for itself, once stopped for good; a decision that fails is every
                # rank's error, not one rank's hang.
                wants = lambda b=b, on=climbing: on and turn.wants(b, time_budget, repeats + warmup)
                wanted = _decided(wants, what, group)
                if not any(wanted):
                    break
                climbing = wanted[rank]
                sizes.append(b)
                mine |= {b} if climbing else set()
                for i in range(warmup + 1):
                    turn.step(b if climbing else floor, record=climbing and i == warmup)
            for _ in range(repeats - 1):
                for b in sizes:
                    # A step that fails on one rank leaves the others in FSDP2's collectives: they stop
                    # at the group's timeout, each with one line (guard).
                    turn.step(b if b in mine else floor, record=b in mine)
        finally:
            timer.remove()
    empty = f"device {dev.name} cannot run even batch {ladder[0]} (out of memory)" if not turn.times else None
    failed = {r: e for r, e in enumerate(all_gather(empty, what, group)) if e}
    if failed:
        raise DistributedError(f"{what}: {failed}; give every rank a device that holds a batch of {ladder[0]}")
    return Profile([turn.entry()], model=model_record(model, sample, given.model_name), source="measured")


@contextlib.contextmanager
def sharded_steps(
    model: nn.Module,
    sample: Any,
    target: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    device: DeviceLike,
    size: int,
    *,
    group: Any = None,
) -> Iterator[Callable[[], float]]:
    """Training steps of ``size`` samples on the sharded ``model`` in place (collective); ``step()``: its compute."""
    dev = parse_device(device)
    turn = _Turn(model, dev, sample, target, loss_fn, find_memory_cap=False, memory_fraction=1.0)
    timer = turn.timer = StepTimer(dev, model)
    with _untouched(model, dev, None, "calibrating the sharded plan", group):
        try:
            yield lambda: turn.step(size)
        finally:
            timer.remove()


@contextlib.contextmanager
def _untouched(model: nn.Module, dev: Device, threads: int | None, what: str, group: Any) -> Iterator[None]:
    """Steps inside leave ``model`` as it was: parameters, gradients (none), buffers, modes and the RNG state."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    modes = [(m, m.training) for m in model.modules()]
    cuda = [dev.index] if dev.type == "cuda" else []
    with (
        threads_for([dev], threads),
        torch.random.fork_rng(devices=cuda),
        guard(what=what, group=group),
        paused(model),  # hetsplit's weighting hooks, if already on the model: these are no training steps
    ):
        model.train()
        try:
            yield
        finally:
            model.zero_grad(set_to_none=True)
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if name in buffers and buffers[name].shape == buffer.shape:  # a buffer made in forward stays
                        buffer.copy_(buffers[name])


def _decided(decide: Callable[[], bool], what: str, group: Any) -> list[bool]:
    """Every rank's own decision, on every rank; an exception in one is raised on every rank."""
    try:
        answer: Any = bool(decide())
    except Exception as e:  # sent to every rank, then raised there
        answer = f"{type(e).__name__}: {e}"
    answers = all_gather(answer, what, group)
    failed = {r: a for r, a in enumerate(answers) if isinstance(a, str)}
    if failed:
        raise DistributedError(f"{what}: {failed}")
    return answers


class _Turn(DeviceSteps):
    """This rank's steps of the sharded profile (the model in place), and when it stops climbing."""

    def __init__(
        self,
        model: nn.Module,
        dev: Device,
        sample: Any,
        target: Any,
        loss_fn: Callable[..., torch.Tensor] | None,
        find_memory_cap: bool,
        memory_fraction: float,
    ) -> None:
        super().__init__(model, dev, sample, target, loss_fn)
        self.cap: int | None = dev.max_batch if find_memory_cap else None
        self.limit: float | None = None
        self.even = 0  # sizes up to this one are measured whatever the budget
        if dev.type == "cuda" and find_memory_cap:
            self.limit = memory_fraction * torch.cuda.get_device_properties(dev.torch_device).total_memory

    def wants(self, b: int, budget: float, steps: int) -> bool:
        """Whether this rank goes on to ``b`` samples (its own decision; a rank that stops runs the stand-in)."""
        if self.dev.max_batch is not None and b > self.dev.max_batch:
            return False  # the emulated memory: known, no need to run out
        fits = self.memory_cap()
        if fits is not None and b > fits:
            self.cap = fits
            return False
        return b <= self.even or self.flat() or self.affordable(b, budget, steps)

    def flat(self) -> bool:
        """Whether the last doubling of the batch added less than half as much time: FSDP2's fixed work still rules."""
        if len(self.times) < 2:
            return False
        (small, t_small), (large, t_large) = [(b, statistics.median(t)) for b, t in sorted(self.times.items())[-2:]]
        return t_large - t_small < 0.5 * t_small * (large / small - 1)

    def memory_cap(self) -> int | None:
        """On CUDA, the largest batch whose fitted peak stays under the limit (``None``: the peaks do not grow)."""
        if self.limit is None or len(self.peaks) < 2:
            return None
        memory = MemoryModel.fit(sorted(self.peaks.items()))
        if memory.per_sample <= 0:
            return None
        return max(1, math.floor((self.limit - memory.base) / memory.per_sample))

    def entry(self, probed_to: int | None = None) -> DeviceProfile:
        """This rank's profile; a ladder the budget stopped still has its cap where the memory fit meets the limit."""
        if self.cap is None:
            self.cap = self.memory_cap()
        return super().entry(probed_to)


# Parameter-sized tensors of state per parameter, before an optimizer's first step has made them.
_STATE_PER_PARAMETER = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Adadelta": 2}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes ``optimizer``'s state takes on this rank: what it holds, else what its first step will make.

    An unknown class counts as Adam's 2 tensors per parameter, erring towards a smaller cap.
    """
    held = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    if held:  # FSDP2's state is sharded as its parameters are: count this rank's part
        return sum(_local(t).numel() * t.element_size() for t in held)
    total = 0
    for group in optimizer.param_groups:
        name = type(optimizer).__name__
        if name == "SGD":
            per = 1 if group.get("momentum", 0) else 0
        elif name == "RMSprop":
            per = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
        else:
            per = _STATE_PER_PARAMETER.get(name, 2)
        for p in group["params"]:
            total += per * _local(p).numel() * p.element_size()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
