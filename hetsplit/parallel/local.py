"""Local-loss mode: each device's shard (or micro-batches) runs forward, weighted loss and backward in its worker."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device
from .grads import add_into
from .micro import MemoryLog, Step
from .outputs import ScalarPolicy, check_policy, check_sums

LossFn = Callable[..., torch.Tensor]
# One replica's gradients at its stand-ins for the step's targets, from (outputs, their gradients).
_Capture = Callable[[list[torch.Tensor], Any], list[Any]]
_Make = Callable[[Sequence[float], LossFn, bool, Sequence[_Capture], bool], list[Callable[[], Any]]]


def local_inputs(
    inputs: Any, kwargs: dict[str, Any], loss_fn: LossFn | None, reduction: ScalarPolicy
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``train_step``'s inputs as (args, kwargs), its arguments checked before any device work."""
    check_policy(reduction, "reduction")
    if reduction == "stack" or loss_fn is None:
        raise ValueError(
            f"train_step needs loss_fn and a reduction of None, 'mean', 'sum' or a callable, "
            f"got loss_fn={loss_fn!r}, reduction={reduction!r}"
        )
    if isinstance(inputs, dict):
        return (), {**inputs, **kwargs}
    return (inputs if isinstance(inputs, tuple) else (inputs,)), dict(kwargs)


def shard_loss(loss_fn: LossFn, out: Any, target: Any, has_target: bool) -> torch.Tensor:
    """``loss_fn(out[, target])``; a loss that is not 0-dim is a ``ValueError`` naming its shape."""
    loss = loss_fn(out, target) if has_target else loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it "
            "with .mean() or .sum() and say which with reduction="
        )
    return loss


def _run_pieces(
    replica: nn.Module,
    pieces: Sequence[tuple[tuple[tuple[Any, ...], dict[str, Any]], Any]],
    sizes: Sequence[int],
    weights: Sequence[float],
    i: int,
    device: Device,
    log: MemoryLog,
    loss_of: Callable[[Any, Any], torch.Tensor],
    capture: _Capture,
    sums: int | None,
) -> tuple[list[torch.Tensor], list[Any]]:
    """Forward, weighted loss and backward of each micro-batch in turn: the losses (detached) and the gradients.

    Each backward frees its micro-batch's graph before the next is built: one micro-batch's activations
    at a time. ``sums``: the batch dimension, when a loss that sums over its micro-batch is refused.
    """
    losses, total = [], None
    for ((args, kwargs), target), size, w in zip(pieces, sizes, weights):

        def step(
            a: tuple[Any, ...] = args, k: dict[str, Any] = kwargs, t: Any = target, w: float = w, n: int = size
        ) -> Any:
            loss = loss_of(replica(*a, **k), t)
            if sums is not None:
                check_sums([loss], [n], sums, "loss_fn's loss", "reduction")
            # Weighted 0 (a shard without a labelled token): no backward, so its nan cannot spread.
            found = capture([loss * w] if loss.requires_grad and w else [], None)
            return loss.detach(), found

        loss, found = log.watch(i, size, step, device)
        losses.append(loss)
        total = found if total is None else add_into(total, found)
        log.done(i, size)
    return losses, total if total is not None else []


def local_fns(replicas: Sequence[nn.Module], step: Step, log: MemoryLog, dim: int) -> _Make:
    """``make(weights, loss_fn, has_target, captures, refuse_sums)``: each active device's work on its micro-shards.

    ``weights`` is flat, one per micro-batch; each callable returns its device's losses and gradients.
    """

    def make(
        weights: Sequence[float], loss_fn: LossFn, has_target: bool, captures: Sequence[_Capture], refuse_sums: bool
    ) -> list[Callable[[], Any]]:
        loss_of = lambda out, t: shard_loss(loss_fn, out, t, has_target)
        sums = dim if refuse_sums and len(weights) > 1 else None  # one piece: its weight is 1 either way
        fns: list[Callable[[], Any]] = []
        pos = 0
        for r, parts, sizes, i, dev, c in zip(replicas, step.pieces, step.micro, step.active, step.devices, captures):
            ws = list(weights[pos : pos + len(parts)])
            pos += len(parts)
            fns.append(functools.partial(_run_pieces, r, parts, sizes, ws, i, dev, log, loss_of, c, sums))
        return fns

    return make
