"""Step: the parts of a HeteroDataParallel step its two modes share (scatter, cutting inputs, the direct path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device
from ..tree import move, to_device
from .micro import Step
from .replicas import module_device
from .scatter_gather import scatter_to
from .upstream import Upstream
from .writes import InputWrites, lone_tensor


def cut_upstream(
    step: Step, batch: tuple[tuple[Any, ...], dict[str, Any]], args: list[Any], kws: list[Any], dim: int
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """The shards the replicas run on, each with version counters of its own.

    An input that requires grad is cut into pieces connected to it (gather hands their
    gradients upstream); any other tensor of the batch into aliases (see :class:`InputWrites`).
    """
    whole = (tuple(batch[0]), dict(batch[1]))
    lone = lone_tensor(whole)
    shards = list(zip(args, kws))
    if lone is None or lone.requires_grad:  # a lone tensor without grad: none
        step.upstream = Upstream(whole, shards, dim)
        shards = step.upstream.shards
    step.writes = InputWrites(whole, shards, step.sizes, dim)
    step.shards = [(tuple(a), dict(k)) for a, k in step.writes.shards]
    return [a for a, _ in step.shards], [k for _, k in step.shards]


def engine_job(devices: Sequence[Device], output: torch.device) -> int | None:
    """Which backward job runs in the calling thread (the autograd engine's): ``None`` for none.

    The gathered outputs' backward runs in the autograd engine's thread for their device.
    On a GPU that thread is the only one the engine runs that GPU's work on, so a replica
    there must run its backward inline, or the engine waits on itself; no other job may.
    On the CPU it is the thread that called ``backward``, which would only wait: it runs
    the first CPU job itself (a GPU replica's backward stays in a worker, as it was tested).
    """
    kind = "cuda" if output.type == "cuda" else "cpu"
    target = output if kind == "cuda" else None
    return next(
        (k for k, d in enumerate(devices) if d.type == kind and (target is None or d.torch_device == target)), None
    )


def direct_device(step: Step, module: nn.Module, rebalancing: bool) -> torch.device | None:
    """The module's device when this step can simply run the module there, else ``None``.

    That is when one real device, the module's own, has the whole batch (a one-device
    wrapper, or a plan that leaves the other devices empty), as ``nn.DataParallel`` does
    with one device: no replica, no thread, no copy. Not while rebalancing: the
    rebalancer reads every step's busy times, which only the replicas' threads measure.
    Nor on a slowed device (``cpu@0.25``), whose throttle runs in the replica's thread; an
    emulated memory alone (``cpu:max64``) is checked here as on the replica path.
    Nor when the plan cuts the share into micro-batches (a memory cap): those run in a
    replica, one at a time.
    """
    if rebalancing or len(step.active) != 1 or step.devices[0].speed != 1.0 or step.split:
        return None
    home = module_device(module)
    return home if step.devices[0].torch_device == home else None


def batch_of(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The inputs as one tree; a lone tensor as itself (the common case, measured without walking a tree)."""
    lone = lone_tensor((inputs, kwargs))
    return lone if lone is not None else (inputs, kwargs)


def call_on(module: nn.Module, device: torch.device, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*inputs, **kwargs)`` with the inputs moved to ``device`` first."""
    lone = lone_tensor((inputs, kwargs))
    if lone is not None:
        return module(to_device(lone, device))
    inputs, kwargs = move((inputs, kwargs), device)
    return module(*inputs, **kwargs)


def scatter_inputs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, devices: Sequence[Device], sizes: Sequence[int], dim: int
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Positional and keyword inputs cut into shards on ``devices`` (forward's scatter)."""
    lone = lone_tensor((tuple(inputs), kwargs or {}))
    if lone is not None and lone.dim() > 0:
        pieces = lone.split(list(sizes), dim)  # one tensor, the common case: no tree walk
        return [(to_device(p, d.torch_device),) for p, d in zip(pieces, devices)], [{} for _ in pieces]
    shards = scatter_to((tuple(inputs), dict(kwargs or {})), devices, sizes, dim)
    return [tuple(a) for a, _ in shards], [dict(k) for _, k in shards]
