"""Micro-batches in one process: a device's shard run as micro-batches in its worker, and recovery from out of memory.

How each mode runs them: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from .. import _torch
from ..devices import Device
from ..emulation import is_out_of_memory, release_after_oom
from ..planning.memory import cap_after_oom
from ..planning.plan import Plan
from ..tree import split_rows
from .grads import add_into
from .inputs import versions

_LOG = logging.getLogger("hetsplit")
T = TypeVar("T")
Shard = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass
class Step:
    """What one step runs: the plan, the active devices (non-empty shards), their shards and micro-batches."""

    plan: Plan
    active: list[int]
    devices: list[Device]
    shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = dataclasses.field(default_factory=list)
    pieces: list[list[Any]] = dataclasses.field(default_factory=list)  # per active device, its micro-shards
    upstream: Any = None  # the inputs that require grad, and each shard's piece of them (parallel/inputs.py)
    writes: Any = None  # the other tensors of the batch, each shard's alias of them (parallel/inputs.py)
    built: list[Any] = dataclasses.field(default_factory=list)  # this step's replicas (parallel/replicas.py)
    finished: bool = False  # its backward ran: busy times logged
    # For a backward with create_graph=True, which runs the forwards again (data_parallel._rebuilt):
    graph_built: bool = False  # a backward of this step ran with create_graph=True
    random: bool = False  # the forward drew random numbers
    leaves: list[list[list[Any]]] = dataclasses.field(default_factory=list)  # per device, per micro-batch: outputs

    @property
    def sizes(self) -> list[int]:
        return [self.plan.sizes[i] for i in self.active]

    @property
    def micro(self) -> list[list[int]]:
        return [self.plan.micro_batches[i] for i in self.active]

    @property
    def split(self) -> bool:
        """Whether some device runs several micro-batches (outputs and weights are then per micro-batch)."""
        return any(len(self.plan.micro_batches[i]) > 1 for i in self.active)

    def flat(self) -> tuple[list[int], list[tuple[tuple[Any, ...], dict[str, Any]]], list[str]]:
        """Sizes, shards and labels of every piece that ran: a replica, or each of its micro-batches."""
        if not self.split:
            return self.sizes, self.shards, list(map(str, self.active))
        labels = [f"{i}.{m}" for i, sizes in zip(self.active, self.micro) for m in range(len(sizes))]
        return [m for sizes in self.micro for m in sizes], [p for parts in self.pieces for p in parts], labels


class StepOutOfMemory(torch.OutOfMemoryError):
    """A step ran out of memory again after re-planning, or where it cannot be re-run (in backward)."""


class OutOfMemoryAt(NamedTuple):
    """Where a replica's work ran out of memory: its device position and the micro-batch's samples."""

    position: int
    size: int


class MemoryLog:
    """Per wrapper: the micro-batch sizes that ran on each device, and the last failure (written from workers)."""

    def __init__(self) -> None:
        self.ran: dict[int, int] = {}  # device position -> largest micro-batch that ran there
        self.failed: OutOfMemoryAt | None = None  # the first OOM of the attempt
        self._lock = threading.Lock()

    def watch(self, i: int, size: int, fn: Callable[[], T], device: Device | None = None) -> T:
        """``fn()``, work on ``size`` samples on device position ``i`` (a forward when ``device`` is given)."""
        try:
            if device is not None:
                device.check_batch(size)
            return fn()
        except BaseException as e:
            if is_out_of_memory(e):
                with self._lock:
                    self.failed = self.failed or OutOfMemoryAt(i, size)
            raise

    def done(self, i: int, size: int) -> None:
        """A micro-batch of ``size`` samples has run forward and backward on device position ``i``."""
        if size > self.ran.get(i, 0):
            with self._lock:
                self.ran[i] = max(size, self.ran.get(i, 0))


def cut(shards: Sequence[Any], micro: Sequence[Sequence[int]], dim: int) -> list[list[Any]]:
    """Each active device's shard cut into its micro-batches along ``dim`` (views; one micro-batch: the shard)."""
    return [split_rows(shard, sizes, dim=dim) if len(sizes) > 1 else [shard] for shard, sizes in zip(shards, micro)]


def _generator_state(device: torch.device) -> torch.Tensor:
    """The state of the random generator ``device``'s work draws from (the CPU's, or that GPU's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _forward_pieces(
    replica: nn.Module,
    pieces: Sequence[Shard],
    sizes: Sequence[int],
    i: int,
    device: Device,
    log: MemoryLog,
    shared: bool,
) -> list[Any]:
    """The outputs of ``replica`` on each micro-batch, run in turn; checkpointed when there are several.

    Refused: drawing random numbers while another replica draws from the same generator (``shared``),
    or writing into the input, either of which would make the recompute differ from the forward.
    """
    outs = []
    for (args, kwargs), size in zip(pieces, sizes):
        if len(pieces) == 1:
            fn = lambda a=args, k=kwargs: replica(*a, **k)
        else:  # keep inputs and outputs only; backward recomputes this micro-batch alone
            fn = lambda a=args, k=kwargs: _torch.checkpoint(replica, *a, **k)
        before = _generator_state(device.torch_device) if shared and len(pieces) > 1 else None
        seen = versions((args, kwargs)) if len(pieces) > 1 else None
        outs.append(log.watch(i, size, fn, device))
        if seen is not None and seen != versions((args, kwargs)):
            raise RuntimeError(
                f"the model writes into its input in place (x.div_(...), nn.ReLU(inplace=True) on the input?) while "
                f"{device.name} runs its share as micro-batches that backward recomputes from their inputs: use "
                "train_step() (local-loss mode recomputes nothing), a plan without micro-batches (accumulate=False), "
                "or an operation that is not in place"
            )
        if before is not None and not torch.equal(before, _generator_state(device.torch_device)):
            raise RuntimeError(
                f"the model draws random numbers (dropout?) while {device.name}'s micro-batches are recomputed in "
                "backward and another replica draws from the same generator, so the recomputed masks would differ "
                "from the forward's: use train_step() (local-loss mode needs no recompute), a plan without "
                "micro-batches (accumulate=False), or devices that do not share a generator"
            )
    return outs


def forward_fns(replicas: Sequence[nn.Module], step: Step, log: MemoryLog) -> list[Callable[[], list[Any]]]:
    """Per active device, the work of its forward on its micro-shards (``step.pieces``): one output per micro-batch."""
    keys = [_generator_key(d.torch_device) for d in step.devices]
    return [
        functools.partial(_forward_pieces, r, parts, sizes, i, dev, log, shared=keys.count(key) > 1)
        for r, parts, sizes, i, dev, key in zip(replicas, step.pieces, step.micro, step.active, step.devices, keys)
    ]


def _generator_key(device: torch.device) -> tuple[str, int]:
    """Which random generator work on ``device`` draws from: one for the CPU, one per GPU."""
    return (device.type, device.index or 0) if device.type == "cuda" else ("cpu", 0)


def backward_fn(
    work: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]],
    sizes: Sequence[int],
    i: int,
    log: MemoryLog,
    capture: Callable[[list[torch.Tensor], list[torch.Tensor]], list[Any]],
) -> Callable[[], list[Any]]:
    """Backward of one device's micro-batches in turn; the sum of ``capture(outputs, grads)`` over them."""

    def run() -> list[Any]:
        total: list[Any] | None = None
        for (outs, grads), size in zip(work, sizes):
            if outs:
                found = log.watch(i, size, functools.partial(capture, outs, grads))
                total = found if total is None else add_into(total, found)
            log.done(i, size)
        return total if total is not None else capture([], [])

    return run


def with_recovery(run: Callable[[], T], log: MemoryLog, plans: Any, devices: Sequence[Device]) -> T:
    """``run()``; after each out-of-memory error, free the attempt, lower the failing device's cap, re-plan, run again.

    As ``find_executable_batch_size``, within the step, logging one line. Raises :class:`StepOutOfMemory`
    when a device cannot hold one sample or no plan fits; an OOM on an untracked device is re-raised.
    """
    first: str | None = None
    while True:
        try:
            out = run()
        except BaseException as e:
            if not recoverable(e, log, devices):
                raise
            release_after_oom(devices)
            if first is None:
                first = lower_cap(log, plans, devices, e, quiet=True)
            else:
                lower_cap_again(log, plans, devices, first, e)
            continue
        if first is not None:
            _LOG.warning("hetsplit: %s; the step then ran with micro-batches %s", first, plans.current.micro_batches)
        return out


def recoverable(error: BaseException, log: MemoryLog, devices: Sequence[Device]) -> bool:
    """Whether ``error`` is an out-of-memory error of a replica's forward on a device whose memory is tracked."""
    if not is_out_of_memory(error) or isinstance(error, StepOutOfMemory):  # the latter: handled, not to re-run
        return False
    if log.failed is None:
        return False
    device = devices[log.failed.position]
    if device.type == "cuda" or device.max_batch is not None:
        return True
    log.failed = None  # a real CPU does not raise this for lack of memory: the user's own error
    return False


def _oom_line(device: Device, i: int, plan: Plan, cap: int, new: Plan | None) -> str:
    """One line naming the device, its shard, the new cap and the new plan."""
    shard = f"device {i} {device.name}, shard of {plan.sizes[i]} as micro-batches {plan.micro_batches[i]}"
    if new is None:
        return f"out of memory on {shard}; its cap would be {cap} samples"
    return (
        f"out of memory on {shard}; cap lowered to {cap} samples; re-planned: sizes {new.sizes}, "
        f"micro-batches {new.micro_batches}"
    )


def lower_cap(log: MemoryLog, plans: Any, devices: Sequence[Device], error: BaseException, quiet: bool = False) -> str:
    """Give the device that ran out of memory the cap that last ran there; the line saying so (logged unless quiet).

    Raises:
        StepOutOfMemory: If the failing device is unknown or no plan fits the lowered cap.
    """
    plan = plans.current
    if log.failed is None:
        raise StepOutOfMemory(
            f"out of memory outside any replica's forward ({error}); nothing to re-plan around"
        ) from error
    i, size = log.failed
    log.failed = None
    cap = cap_after_oom(size, [log.ran.get(i, 0)])
    try:
        new = plans.lower_cap(devices[i].name, cap)
    except ValueError as e:
        raise StepOutOfMemory(f"{_oom_line(devices[i], i, plan, cap, None)}; no plan fits: {e}") from error
    line = _oom_line(devices[i], i, plan, cap, new)
    if not quiet:
        _LOG.warning("hetsplit: %s", line)
    return line


def backward_oom(log: MemoryLog, plans: Any, devices: Sequence[Device], error: BaseException) -> None:
    """Raise :class:`StepOutOfMemory` for an OOM in backward (forward has returned: no re-run), lowering the cap."""

    release_after_oom(devices)
    line = lower_cap(log, plans, devices, error)
    raise StepOutOfMemory(
        f"{line}; this happened in backward, after forward had returned, so the step could not be re-run: its "
        "gradients were discarded (the module's .grad is as before the step); run the step again (forward and "
        "backward), or use train_step(), which re-runs a step by itself"
    ) from error


def lower_cap_again(log: MemoryLog, plans: Any, devices: Sequence[Device], first: str, error: BaseException) -> None:
    """Lower the cap once more after another out-of-memory error in the same step, or give up naming both.

    Raises:
        StepOutOfMemory: When the failing device ran out on one sample, or no plan fits its lower cap.
    """
    assert log.failed is not None
    i, size = log.failed
    plan = plans.current
    if size <= 1:
        log.failed = None
        raise StepOutOfMemory(
            f"out of memory again on device {i} {devices[i].name} with a micro-batch of 1 sample (shard "
            f"{plan.sizes[i]}): it holds no sample; first: {_plan_hint(first)}"
        ) from error
    try:
        lower_cap(log, plans, devices, error, quiet=True)
    except StepOutOfMemory as e:
        raise StepOutOfMemory(
            f"out of memory again on device {i} {devices[i].name}: {e}; first: {_plan_hint(first)}"
        ) from error


def _plan_hint(first: str) -> str:
    return (
        f"{first}. Give that device a smaller cap (a profile with its memory cap, e.g. from "
        "hetsplit.profile on it) or a smaller batch"
    )
