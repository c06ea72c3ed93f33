"""Reduce: combine per-device gradients and buffers weighted by shard size."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["shard_weights", "reduce_gradients", "average_buffers"]


def shard_weights(sizes: Sequence[int], reduction: str = "mean") -> list[float]:
    """Each shard's weight in the combined gradient.

    For a loss that is a mean over its shard, the full-batch gradient is
    ``sum_i b_i * g_i / B``, so shard ``i`` weighs ``b_i / B``; for a summed loss every
    shard weighs 1.

    Raises:
        ValueError: On an unknown ``reduction`` or an empty batch.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    total = sum(sizes)
    if total <= 0:
        raise ValueError(f"sizes {list(sizes)} hold no sample; nothing to weight")
    if reduction == "sum":
        return [1.0 if s > 0 else 0.0 for s in sizes]
    return [s / total for s in sizes]


@torch.no_grad()
def reduce_gradients(
    per_device_params: Sequence[Sequence[torch.Tensor]],
    sizes: Sequence[int],
    *,
    reduction: str = "mean",
) -> None:
    """All-reduce gradients across devices, weighted by shard size, in place.

    The weighted counterpart of the course's ``allreduce``: for every parameter
    position ``k`` the combined gradient ``sum_i w_i * grad(per_device_params[i][k])``
    (see :func:`shard_weights`) is written into that parameter's ``.grad`` on every
    device, the CPU included. A device with a 0-size shard contributes nothing and
    receives the result. After it, one optimizer step per device keeps the copies equal.

    Args:
        per_device_params: One list of parameters per device, in the same order.
        sizes: Each device's shard size.
        reduction: ``"mean"`` if each device's loss is a mean over its shard, ``"sum"``
            if it is a sum.

    Raises:
        ValueError: If the lists differ in length or shape, or do not match ``sizes``.

    Example:
        >>> # losses: l_i = loss_fn(net_i(x_i), y_i) with reduction="mean"; l_i.backward() on each device
        >>> reduce_gradients([list(net0.parameters()), list(net1.parameters())], [80, 20])
    """
    if len(per_device_params) != len(sizes):
        raise ValueError(f"got parameters of {len(per_device_params)} devices but {len(sizes)} sizes")
    lists = [list(ps) for ps in per_device_params]
    counts = {len(ps) for ps in lists}
    if len(counts) != 1:
        raise ValueError(f"every device needs the same parameters; got lists of lengths {[len(ps) for ps in lists]}")
    weights = shard_weights(sizes, reduction)
    for k, group in enumerate(zip(*lists)):
        shapes = {tuple(p.shape) for p in group}
        if len(shapes) != 1:
            raise ValueError(f"parameter {k} differs in shape across devices: {sorted(shapes)}")
        home = group[0]
        total = torch.zeros_like(home)
        for p, w in zip(group, weights):
            if w and p.grad is not None:
                total.add_(p.grad.to(home.device), alpha=w)
        for p in group:
            if p.grad is None:
                p.grad = total.to(p.device, copy=True)
            else:
                p.grad.copy_(total)


@torch.no_grad()
def average_buffers(target: dict[str, torch.Tensor], sources: Sequence[dict[str, torch.Tensor]],
                    weights: Sequence[float]) -> None:
    """Write the weighted average of each floating-point buffer into ``target``, in place.

    Integer buffers (such as BatchNorm's ``num_batches_tracked``) take the first
    source's value. ``weights`` are renormalised over the sources given.
    """
    total = float(sum(weights))
    if not sources or total <= 0:
        return
    for name, buf in target.items():
        if buf.is_floating_point() or buf.is_complex():
            acc = torch.zeros_like(buf)
            for src, w in zip(sources, weights):
                acc.add_(src[name].to(buf.device), alpha=w / total)
            buf.copy_(acc)
        else:
            buf.copy_(sources[0][name].to(buf.device))
