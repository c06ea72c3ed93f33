"""Scatter and gather: uneven shards of nested batches, to and from any device, the CPU included."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..devices import Device, DeviceLike, parse_devices
from ..planning.plan import check_sizes
from ..tree import batch_length, flatten, leaf_paths, split_rows, to_device, unflatten


def scatter(inputs: Any, devices: Sequence[DeviceLike], sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """Cut a nested batch into shards of the given sizes, each moved to its device.

    :func:`torch.nn.parallel.scatter` with uneven sizes, any device and zero-size shards;
    0-dim tensors and other objects go to every device whole. Autograd flows through.

    Args:
        inputs: A tensor or a nest of tuples, lists, dicts, namedtuples, dataclasses.
        devices: One device per shard.
        sizes: Samples per shard, summing to the batch length.
        dim: The batch dimension.

    Returns:
        One shard per device, each with the structure of ``inputs``.

    Raises:
        ValueError: On unknown devices, sizes that do not fit the batch, tensors of
            different lengths, or ``dim`` out of range; all before any copy.
        TypeError: If a size or ``dim`` is not an integer (``True`` included).

    Example:
        >>> a, b = scatter(torch.arange(10), ["cpu", "cpu"], [8, 2])
        >>> b
        tensor([8, 9])
    """
    devs = parse_devices(devices)
    _check_dim(dim)
    if isinstance(sizes, str | bytes):
        raise TypeError(f"sizes must be a list of integers, one per device, got {sizes!r}")
    sizes = check_sizes(list(sizes), batch_length(inputs, dim), len(devs))
    return scatter_to(inputs, devs, sizes, dim)


def scatter_to(inputs: Any, devices: Sequence[Device], sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """:func:`scatter` for parsed devices and checked sizes (the engines' hot path)."""
    return split_rows(inputs, sizes, dim=dim, devices=[d.torch_device for d in devices])


def _check_dim(dim: object) -> None:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an integer, got {type(dim).__name__}: {dim!r}")


def concat_column(parts: Sequence[torch.Tensor], target: torch.device, dim: int, path: str) -> torch.Tensor:
    """Concatenate one output leaf's per-replica pieces on ``target`` (a ``ValueError`` naming ``path`` if not)."""
    moved = [to_device(t, target) for t in parts]
    try:
        return torch.cat(moved, dim=dim)
    except RuntimeError as e:
        shapes = [tuple(t.shape) for t in parts]
        raise ValueError(
            f"output {path}: the replicas' tensors of shapes {shapes} cannot be concatenated along dim {dim} "
            f"({e}); return tensors that differ only in the batch dimension"
        ) from e


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-device outputs on one device, the inverse of :func:`scatter`.

    0-dim tensors are stacked as ``nn.DataParallel`` does; other objects come back as a list of
    every output's value. Autograd flows through.

    Args:
        outputs: One output per device, all with the same structure.
        target_device: Where the result lives (any device, the CPU too).
        dim: The dimension to concatenate along.

    Returns:
        One output with the structure of each input.

    Raises:
        ValueError: If ``outputs`` is empty, their structures differ, or tensors
            cannot be concatenated (the message names the output's path).
    """
    if not outputs:
        raise ValueError("gather needs at least one output")
    _check_dim(dim)
    target = (
        target_device if isinstance(target_device, torch.device) else parse_devices([target_device])[0].torch_device
    )
    flat = [flatten(o) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(f"output {i} has a different structure from output 0: {s} vs {spec}")
    paths = leaf_paths(outputs[0])
    gathered: list[Any] = []
    for k, first in enumerate(flat[0][0]):
        column = [leaves[k] for leaves, _ in flat]
        if not isinstance(first, torch.Tensor):
            gathered.append(column)
        elif first.dim() == 0:
            gathered.append(torch.stack([to_device(t, target) for t in column]))
        else:
            gathered.append(concat_column(column, target, dim, paths[k]))
    return unflatten(gathered, spec)
