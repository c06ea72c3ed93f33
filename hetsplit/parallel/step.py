"""Step: what one HeteroDataParallel step runs, and the helpers its two modes share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device
from ..planning.plan import Plan
from ..tree import move, to_device
from .outputs import ScalarPolicy, check_policy, policy_weights
from .replicas import module_device
from .scatter_gather import scatter_to
from .upstream import Upstream

__all__ = [
    "Step",
    "cut_upstream",
    "engine_job",
    "direct_device",
    "batch_of",
    "call_on",
    "check_one_device",
    "positions",
    "local_inputs",
    "local_step",
    "local_shards",
    "direct_local_step",
    "scatter_inputs",
]


@dataclasses.dataclass
class Step:
    """What one step runs: the plan, the active devices (non-empty shards) and their shards."""

    plan: Plan
    active: list[int]
    devices: list[Device]
    shards: list[tuple[tuple[Any, ...], dict[str, Any]]] = dataclasses.field(default_factory=list)
    upstream: Upstream | None = None  # the inputs that require grad, cut from the caller's graph

    @property
    def sizes(self) -> list[int]:
        return [self.plan.sizes[i] for i in self.active]


def cut_upstream(
    step: Step, batch: tuple[tuple[Any, ...], dict[str, Any]], args: list[Any], kws: list[Any], dim: int
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """The shards the replicas run on: leaves where they require grad (gather hands their gradients upstream)."""
    lone = batch[0][0] if len(batch[0]) == 1 and not batch[1] else None
    if isinstance(lone, torch.Tensor) and not lone.requires_grad:  # the common case: nothing to cut
        step.shards = list(zip(args, kws))
        return args, kws
    step.upstream = Upstream((tuple(batch[0]), dict(batch[1])), list(zip(args, kws)), dim)
    step.shards = [(tuple(a), dict(k)) for a, k in step.upstream.shards]
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
    """
    if rebalancing or len(step.active) != 1 or step.devices[0].emulated:
        return None
    home = module_device(module)
    return home if step.devices[0].torch_device == home else None


def batch_of(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The inputs as one tree; a lone tensor as itself (the common case, measured without walking a tree)."""
    return inputs[0] if len(inputs) == 1 and not kwargs and isinstance(inputs[0], torch.Tensor) else (inputs, kwargs)


def call_on(module: nn.Module, device: torch.device, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*inputs, **kwargs)`` with the inputs moved to ``device`` first."""
    if len(inputs) == 1 and not kwargs and isinstance(inputs[0], torch.Tensor):
        return module(to_device(inputs[0], device))
    inputs, kwargs = move((inputs, kwargs), device)
    return module(*inputs, **kwargs)


def check_one_device(module: nn.Module) -> None:
    homes = {t.device for t in (*module.parameters(), *module.buffers())}
    if len(homes) > 1:
        raise ValueError(
            f"the module's parameters and buffers are on several devices {sorted(map(str, homes))}; "
            "move the whole module to one device (e.g. module.to('cpu')) before wrapping it"
        )


def positions(devices: Sequence[Device], chosen: Sequence[Device]) -> list[int]:
    """Where each of ``chosen`` sits in ``devices``, taking repeated devices in order."""
    free = list(range(len(devices)))
    return [free.pop(next(k for k, i in enumerate(free) if devices[i] == d)) for d in chosen]


def local_inputs(
    inputs: Any, kwargs: dict[str, Any], loss_fn: Callable[..., torch.Tensor] | None, reduction: ScalarPolicy
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``train_step``'s inputs as (args, kwargs), its arguments checked before any device work."""
    check_policy(reduction, "reduction")
    if reduction == "stack" or loss_fn is None:
        raise ValueError(
            f"train_step needs loss_fn and a reduction of 'mean', 'sum' or a callable, "
            f"got loss_fn={loss_fn!r}, reduction={reduction!r}"
        )
    if isinstance(inputs, dict):
        return (), {**inputs, **kwargs}
    return (inputs if isinstance(inputs, tuple) else (inputs,)), dict(kwargs)


def local_step(
    replica: nn.Module, shard: Any, has_target: bool, loss_fn: Callable[..., torch.Tensor], weight: float
) -> torch.Tensor:
    """One replica's forward, loss and weighted backward in local-loss mode; its loss, detached."""
    (args, kwargs), target = shard
    out = replica(*args, **kwargs)
    loss = loss_fn(out, target) if has_target else loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it "
            "with .mean() or .sum() and say which with reduction="
        )
    (loss * weight).backward()
    return loss.detach()


def local_shards(step: Step, batch: Any, reduction: ScalarPolicy, dim: int) -> tuple[Upstream, list[float]]:
    """Local-loss mode's shards (as leaves where they require grad) and each one's loss weight."""
    upstream = Upstream(batch, scatter_to(batch, step.devices, step.sizes, dim), dim)
    step.shards = [(tuple(a), dict(k)) for (a, k), _ in upstream.shards]
    weights = policy_weights(reduction, step.sizes, step.shards)
    assert weights is not None  # "stack" was refused by local_inputs
    return upstream, weights


def direct_local_step(
    module: nn.Module,
    home: torch.device,
    batch: Any,
    has_target: bool,
    loss_fn: Callable[..., torch.Tensor],
    reduction: ScalarPolicy,
    output: torch.device,
) -> torch.Tensor:
    """Local-loss mode when the module's own device has the whole batch: the module's own step."""
    (args, kwargs), target = move(batch, home)
    (weight,) = policy_weights(reduction, [1], [(tuple(args), dict(kwargs))]) or [1.0]
    return to_device(local_step(module, ((args, kwargs), target), has_target, loss_fn, weight), output) * weight


def scatter_inputs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, devices: Sequence[Device], sizes: Sequence[int], dim: int
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Positional and keyword inputs cut into shards on ``devices`` (forward's scatter)."""
    if len(inputs) == 1 and not kwargs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() > 0:
        pieces = inputs[0].split(list(sizes), dim)  # one tensor, the common case: no tree walk
        return [(to_device(p, d.torch_device),) for p, d in zip(pieces, devices)], [{} for _ in pieces]
    shards = scatter_to((tuple(inputs), dict(kwargs or {})), devices, sizes, dim)
    return [tuple(a) for a, _ in shards], [dict(k) for _, k in shards]
