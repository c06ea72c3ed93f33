"""Scatter and gather: uneven shards of nested batches, to and from any device, the CPU included."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from .devices import DeviceLike, parse_devices
from .solver import check_sizes

__all__ = ["scatter", "gather", "batch_length", "flatten", "to_device"]


def _is_unregistered_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """Flatten a nested batch into leaves and a spec, like ``torch.utils._pytree.tree_flatten``.

    Tuples, lists, dicts, namedtuples and anything torch registers are containers; so are
    dataclass instances, whose types are registered with pytree on first sight (torch's
    own scatter would hand a dataclass batch whole to every device).
    """
    while True:
        leaves, spec = pytree.tree_flatten(tree)
        new = {type(x) for x in leaves if _is_unregistered_dataclass(x)}
        if not new:
            return leaves, spec
        for cls in new:
            try:
                pytree.register_dataclass(cls)
            except ValueError:  # registered meanwhile by another thread
                pass


def batch_length(tree: Any, dim: int = 0) -> int:
    """The common length along ``dim`` of every tensor in a nested batch.

    Raises:
        ValueError: If there is no tensor, ``dim`` is out of range for a tensor, or the
            tensors' lengths differ (the message lists them).
    """
    leaves, _ = flatten(tree)
    lengths = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if not -leaf.dim() <= dim < leaf.dim():
                raise ValueError(
                    f"dim {dim} is out of range for tensor {i} of shape {tuple(leaf.shape)}; "
                    "every tensor in the batch needs that dimension"
                )
            lengths.append(leaf.shape[dim])
    if not lengths:
        raise ValueError(f"the batch holds no tensor to split (got {type(tree).__name__}); pass tensors")
    if len(set(lengths)) > 1:
        raise ValueError(f"tensors in the batch differ in length along dim {dim}: {lengths}; they must all match")
    return lengths[0]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a tensor, non-blocking where that is safe (host to GPU, GPU to GPU)."""
    if x.device == device:
        return x
    # Device-to-host copies are not made non-blocking: the host could read the buffer
    # before the copy lands.
    return x.to(device, non_blocking=device.type == "cuda")


def scatter(inputs: Any, devices: Sequence[DeviceLike], sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """Cut a nested batch into shards of the given sizes, each moved to its device.

    Like :func:`torch.nn.parallel.scatter`, but with uneven sizes, any device (the CPU
    too), zero-size shards and dataclass batches. Every tensor is split along ``dim``;
    0-dim tensors are copied to every device, other objects are handed to every device
    as they are. Autograd flows through.

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
        TypeError: If a size is not an integer.

    Example:
        >>> a, b = scatter(torch.arange(10), ["cpu", "cpu"], [8, 2])
        >>> b
        tensor([8, 9])
    """
    devs = [d.torch_device for d in parse_devices(devices)]
    total = batch_length(inputs, dim)
    sizes = check_sizes(list(sizes), total, len(devs))
    leaves, spec = flatten(inputs)
    pieces = [_pieces(leaf, sizes, dim, len(devs)) for leaf in leaves]
    shards = []
    for j, device in enumerate(devs):
        shard_leaves = [to_device(p[j], device) if p is not None else leaf for leaf, p in zip(leaves, pieces)]
        shards.append(pytree.tree_unflatten(shard_leaves, spec))
    return shards


def _pieces(leaf: Any, sizes: list[int], dim: int, n: int) -> Sequence[torch.Tensor] | None:
    if not isinstance(leaf, torch.Tensor):
        return None
    if leaf.dim() == 0:
        return [leaf] * n  # a scalar tensor cannot be split: every device gets it
    return torch.split(leaf, sizes, dim=dim)


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-device outputs on one device, the inverse of :func:`scatter`.

    Tensors are concatenated along ``dim`` (zero-size pieces included); 0-dim tensors,
    such as per-replica losses, are stacked into a vector as ``nn.DataParallel`` does;
    other objects are taken from the first output. Autograd flows through.

    Args:
        outputs: One output per device, all with the same structure.
        target_device: Where the result lives (any device, the CPU too).
        dim: The dimension to concatenate along.

    Returns:
        One output with the structure of each input.

    Raises:
        ValueError: If ``outputs`` is empty or their structures differ.
    """
    if not outputs:
        raise ValueError("gather needs at least one output")
    target = target_device if isinstance(target_device, torch.device) else parse_devices([target_device])[0].torch_device
    flat = [flatten(o) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(f"output {i} has a different structure from output 0: {s} vs {spec}")
    gathered = []
    for k, first in enumerate(flat[0][0]):
        column = [leaves[k] for leaves, _ in flat]
        if isinstance(first, torch.Tensor):
            moved = [to_device(t, target) for t in column]
            gathered.append(torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim=dim))
        else:
            gathered.append(first)
    return pytree.tree_unflatten(gathered, spec)
