"""Tree: nested batches (tuples, lists, dicts, namedtuples, dataclasses) walked in one place.

This module is hetsplit's only user of ``torch.utils._pytree``: every other module
flattens, maps and rebuilds batches and outputs through the functions here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

_TreeSpec = pytree.TreeSpec


def _is_unregistered_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def flatten(tree: Any) -> tuple[list[Any], _TreeSpec]:
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


def unflatten(leaves: list[Any], spec: _TreeSpec) -> Any:
    """Rebuild a nest from :func:`flatten`'s leaves and spec."""
    return pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``fn`` to every leaf of a nest and rebuild it (dataclasses included)."""
    leaves, spec = flatten(tree)
    return pytree.tree_unflatten([fn(x) for x in leaves], spec)


def leaf_paths(tree: Any) -> list[str]:
    """A readable path for every leaf of a nest, in :func:`flatten`'s order (``"[0]['loss']"``)."""
    flatten(tree)  # registers dataclasses first
    return [pytree.keystr(path) or "<output>" for path, _ in pytree.tree_flatten_with_path(tree)[0]]


def batch_length(tree: Any, dim: int = 0) -> int:
    """The common length along ``dim`` of every tensor in a nested batch.

    Raises:
        ValueError: If there is no tensor, ``dim`` is out of range for a tensor, or the
            tensors' lengths differ (the message lists them).
    """
    if isinstance(tree, torch.Tensor) and -tree.dim() <= dim < tree.dim():
        return tree.shape[dim]  # the common case, without walking a tree
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


def take_rows(tree: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of every batched tensor in a nest, cycling through a shorter batch."""
    n = batch_length(tree)
    return tree_map(lambda x: x.index_select(0, index % n) if isinstance(x, torch.Tensor) and x.dim() > 0 else x, tree)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a tensor, non-blocking where that is safe (host to GPU, GPU to GPU)."""
    if x.device == device:
        return x
    # Device-to-host copies are not made non-blocking: the host could read the buffer
    # before the copy lands.
    return x.to(device, non_blocking=device.type == "cuda")


def move(tree: Any, device: torch.device) -> Any:
    """Every tensor of a nest moved to ``device`` (see :func:`to_device`)."""
    if isinstance(tree, torch.Tensor):
        return to_device(tree, device)
    return tree_map(lambda x: to_device(x, device) if isinstance(x, torch.Tensor) else x, tree)
