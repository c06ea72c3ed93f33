"""Reduce: the one place where per-device gradients and buffers are combined, weighted by shard size."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shard_weights(sizes: Sequence[int], reduction: str = "mean") -> list[float]:
    """Each shard's weight in the combined gradient: ``b_i / B`` for a mean loss, 1 for a summed one.

    Raises:
        ValueError: On an unknown ``reduction``, a size that is not a non-negative
            integer, or an empty batch.
    """
    _check_reduction(reduction)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"size {i} must be an integer >= 0 (a shard's sample count), got {s!r} in {list(sizes)}")
    total = sum(sizes)
    if total <= 0:
        raise ValueError(f"sizes {list(sizes)} hold no sample; nothing to weight")
    return [shard_weight(s, total, reduction) for s in sizes]


def shard_weight(size: float, total: float, reduction: str = "mean") -> float:
    """One shard's weight (see :func:`shard_weights`) from its size and the total (0 when the total is), unchecked.

    Raises:
        ValueError: On an unknown ``reduction``.
    """
    if reduction == "sum":
        return 1.0 if size > 0 else 0.0
    _check_reduction(reduction)
    return size / total if total else 0.0


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _check_not_aliased(lists: Sequence[Sequence[torch.Tensor]]) -> None:
    """Refuse a tensor (storage) that appears in two devices' parameter lists."""
    owner: dict[tuple[torch.device, int], tuple[int, int]] = {}
    for i, params in enumerate(lists):
        for k, p in enumerate(params):
            if p.numel() == 0:
                continue
            key = (p.device, p.untyped_storage().data_ptr())
            seen = owner.setdefault(key, (i, k))
            if seen[0] != i:
                raise ValueError(
                    f"parameter {k} of device {i} shares its storage with parameter {seen[1]} of device {seen[0]}, "
                    "so every update would be applied to it twice: give each device its own copy with Device.copy "
                    "(hetsplit.parse_devices(devices)[i].copy(params, requires_grad=True)); p.to(device) returns p "
                    "itself when it is already there, as for 'cpu' and 'cpu@0.25'"
                )


@torch.no_grad()
def _weighted_sum(group: Sequence[torch.Tensor], weights: Sequence[float], k: int) -> torch.Tensor | None:
    home = group[0]
    total = None
    for i, (p, w) in enumerate(zip(group, weights)):
        if not w:
            continue
        if p.grad is None:
            raise ValueError(
                f"parameter {k} of device {i} has no gradient though its shard has samples; run backward on "
                "every device's loss before reducing (a missing gradient would silently count as zero)"
            )
        g = p.grad.to(home.device)
        total = g * w if total is None else total.add_(g, alpha=w)
    return total


@torch.no_grad()
def reduce_gradients(
    per_device_params: Sequence[Sequence[torch.Tensor]],
    sizes: Sequence[int],
    *,
    reduction: str = "mean",
) -> None:
    """All-reduce gradients across devices, weighted by shard size, in place.

    Every device's ``.grad`` gets ``sum_i w_i * grad_i`` (:func:`shard_weights`), so one optimizer
    step per device keeps the copies equal.

    Args:
        per_device_params: One list of parameters per device, in the same order; each
            device holds its own copy (shared tensors are refused).
        sizes: Each device's shard size.
        reduction: ``"mean"`` if each device's loss is a mean over its shard, ``"sum"``
            if it is a sum.

    Raises:
        ValueError: If the lists differ in length or shape, do not match ``sizes``,
            share a tensor between two devices, or a device with samples has a
            parameter without a gradient (where others have one); before any change.

    Example:
        >>> # losses: l_i = loss_fn(net_i(x_i), y_i) with reduction="mean"; l_i.backward() on each device
        >>> reduce_gradients([list(net0.parameters()), list(net1.parameters())], [80, 20])
    """
    if len(per_device_params) != len(sizes):
        raise ValueError(f"got parameters of {len(per_device_params)} devices but {len(sizes)} sizes")
    weights = shard_weights(list(sizes), reduction)
    lists = [list(ps) for ps in per_device_params]
    if len({len(ps) for ps in lists}) != 1:
        raise ValueError(f"every device needs the same parameters; got lists of lengths {[len(ps) for ps in lists]}")
    _check_not_aliased(lists)
    totals: list[torch.Tensor | None] = []
    for k, group in enumerate(zip(*lists)):
        shapes = {tuple(p.shape) for p in group}
        if len(shapes) != 1:
            raise ValueError(f"parameter {k} differs in shape across devices: {sorted(shapes)}")
        if all(p.grad is None for p in group):
            totals.append(None)  # unused by every device's loss: nothing to combine
            continue
        totals.append(_weighted_sum(group, weights, k))
    for group, total in zip(zip(*lists), totals):
        if total is None:
            continue
        for p in group:
            if p.grad is None:
                p.grad = total.to(p.device, copy=True)
            else:
                p.grad.copy_(total)
