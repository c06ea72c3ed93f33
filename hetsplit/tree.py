"""Tree: nested batches (tuples, lists, dicts, any Mapping, namedtuples, dataclasses) walked in one place.

hetsplit's only user of ``torch.utils._pytree``: every other module walks batches through here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

_TreeSpec = pytree.TreeSpec


def _is_unregistered_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def _is_unwalked_mapping(x: Any) -> bool:
    """A Mapping pytree keeps whole: a tokenizer's ``BatchEncoding``, a ``UserDict``, a dict subclass."""
    return isinstance(x, Mapping) and type(x) not in pytree.SUPPORTED_NODES


class _Keys:
    """The context of a walked Mapping: its keys, and one instance of its type to rebuild from.

    Two are equal when type and keys are (replicas' outputs are separate instances of one
    structure); the instance itself is never compared (a mapping of tensors has no truth value).
    """

    def __init__(self, like: Mapping[Any, Any], keys: list[Any]) -> None:
        self.like, self.keys = like, keys

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keys) and type(self.like) is type(other.like) and self.keys == other.keys

    def __hash__(self) -> int:
        return hash((type(self.like), len(self.keys)))

    def __repr__(self) -> str:
        return f"{type(self.like).__name__}{self.keys}"


class _Walked:
    """A Mapping pytree does not walk, stood in for while a batch is flattened: the mapping and its values."""

    __slots__ = ("like", "values")

    def __init__(self, like: Mapping[Any, Any], values: dict[Any, Any]) -> None:
        self.like, self.values = like, values


def _walked_flatten(node: _Walked) -> tuple[list[Any], _Keys]:
    keys = list(node.values)
    return [node.values[k] for k in keys], _Keys(node.like, keys)


def _walked_flatten_with_keys(node: _Walked) -> tuple[list[tuple[Any, Any]], _Keys]:
    values, context = _walked_flatten(node)
    return [(pytree.MappingKey(k), v) for k, v in zip(context.keys, values)], context


def _walked_unflatten(values: Any, context: _Keys) -> Any:
    return rebuilt(context.like, dict(zip(context.keys, values)))


# Registered once, for hetsplit's own stand-in type: Mapping types themselves are never
# registered with pytree (that would change how torch.compile and FSDP see them).
pytree.register_pytree_node(_Walked, _walked_flatten, _walked_unflatten, flatten_with_keys_fn=_walked_flatten_with_keys)


def rebuilt(like: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of ``like``'s type holding ``values``: the one way hetsplit rebuilds a Mapping.

    ``type(like)(values)`` (a ``BatchEncoding``'s per-row extras would no longer match cut
    rows); a type whose constructor takes no dict is copied and its items replaced; else a dict.
    """
    if type(like) is dict:
        return values
    # Mapping does not promise a constructor; the common Mapping types take a dict, else TypeError.
    mapping_type: Any = type(like)
    try:
        same_type: Mapping[Any, Any] = mapping_type(values)
        return same_type
    except TypeError:
        pass
    try:
        new = copy.copy(like)
        for key, value in values.items():
            new[key] = value  # type: ignore[index]
        return new
    except (TypeError, AttributeError, copy.Error):
        return values


def _walk(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[Any, list[Any], _TreeSpec]:
    """``tree`` with every Mapping pytree would keep whole stood in for, and its leaves and spec.

    Dataclass types are registered with pytree on first sight (torch's own scatter would
    hand a dataclass batch whole to every device). A batch with neither is flattened once.
    """
    while True:
        leaves, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
        free = [is_leaf is None or not is_leaf(x) for x in leaves]
        new = {type(x) for x, f in zip(leaves, free) if f and _is_unregistered_dataclass(x)}
        if not new:
            break
        for cls in new:
            try:
                pytree.register_dataclass(cls)
            except ValueError:  # registered meanwhile by another thread
                pass
    mappings = [f and _is_unwalked_mapping(x) for x, f in zip(leaves, free)]
    if not any(mappings):
        return tree, leaves, spec
    stood = [_Walked(x, {k: _walk(v, is_leaf)[0] for k, v in x.items()}) if m else x for x, m in zip(leaves, mappings)]
    tree = pytree.tree_unflatten(stood, spec)
    leaves, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
    return tree, leaves, spec


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], _TreeSpec]:
    """Flatten a nested batch into leaves and a spec, like ``torch.utils._pytree.tree_flatten``.

    Dataclasses and any ``Mapping`` (a tokenizer's ``BatchEncoding``) are containers too,
    rebuilt with their types (:func:`rebuilt`); ``is_leaf`` keeps what it accepts whole.
    """
    _, leaves, spec = _walk(tree, is_leaf)
    return leaves, spec


def unflatten(leaves: list[Any], spec: _TreeSpec) -> Any:
    """Rebuild a nest from :func:`flatten`'s leaves and spec."""
    return pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Apply ``fn`` to every leaf of a nest and rebuild it (dataclasses and Mappings with their types)."""
    leaves, spec = flatten(tree, is_leaf)
    return pytree.tree_unflatten([fn(x) for x in leaves], spec)


def leaf_paths(tree: Any) -> list[str]:
    """A readable path for every leaf of a nest, in :func:`flatten`'s order (``"[0]['loss']"``)."""
    walkable, _, _ = _walk(tree)
    try:
        return [pytree.keystr(path) or "<output>" for path, _ in pytree.tree_flatten_with_path(walkable)[0]]
    except ValueError:  # a node type registered without flatten_with_keys_fn (transformers' outputs before 5.11)
        return [path or "<output>" for path in _spec_paths(pytree.tree_flatten(walkable)[1])]


def _spec_paths(spec: _TreeSpec) -> list[str]:
    """The leaves' paths read off a spec: a node's context names its children where it lists one per child."""
    if spec.is_leaf():
        return [""]
    context = spec.context
    named = isinstance(context, list | tuple) and len(context) == spec.num_children
    keys = [f"[{k!r}]" for k in context] if named else [f"[{i}]" for i in range(spec.num_children)]
    return [key + rest for key, child in zip(keys, spec.children_specs) for rest in _spec_paths(child)]


def samples_in(tree: Any) -> int | None:
    """The samples in a batch as Lightning and accelerate count them for logging: its first tensor's length.

    1 for a 0-dim tensor, ``None`` when the batch holds no tensor (:func:`batch_length` wants all to agree).
    """
    if not isinstance(tree, torch.Tensor):
        tree = next((x for x in flatten(tree)[0] if isinstance(x, torch.Tensor)), None)
        if tree is None:
            return None
    return 1 if tree.dim() == 0 else len(tree)


def batch_length(tree: Any, dim: int = 0) -> int:
    """The common length along ``dim`` of every tensor in a nested batch (a ValueError lists differing ones)."""
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


def _batched(x: Any, dim: int, rows: int | None) -> bool:
    """Whether ``x`` is cut with the batch: a tensor with ``dim``, of length ``rows`` there when given (else whole)."""
    return isinstance(x, torch.Tensor) and -x.dim() <= dim < x.dim() and (rows is None or x.shape[dim] == rows)


def narrow(tree: Any, start: int, length: int, *, dim: int = 0, rows: int | None = None) -> Any:
    """Rows ``start`` to ``start + length`` along ``dim`` of a nested batch (views, no copy; :func:`_batched`)."""

    def cut(x: Any) -> Any:
        return x.narrow(dim, start, length) if _batched(x, dim, rows) else x

    return cut(tree) if isinstance(tree, torch.Tensor) else tree_map(cut, tree)


def split_rows(
    tree: Any,
    sizes: Sequence[int],
    *,
    dim: int = 0,
    rows: int | None = None,
    devices: Sequence[torch.device] | None = None,
) -> list[Any]:
    """``tree`` cut into consecutive pieces of ``sizes`` rows along ``dim`` (views, no copy; :func:`_batched`).

    The one cutter of a batch into shards or micro-batches; with ``devices`` (one per piece)
    each piece is moved to its device in the same walk.
    """
    leaves, spec = flatten(tree)
    counts = list(sizes)
    columns = [torch.split(x, counts, dim=dim) if _batched(x, dim, rows) else None for x in leaves]
    if devices is None:
        return [
            unflatten([x if c is None else c[j] for x, c in zip(leaves, columns)], spec) for j in range(len(counts))
        ]
    # The engines' hot path: cut and moved in one pass over the leaves.
    return [
        unflatten(
            [
                x if not isinstance(x, torch.Tensor) else to_device(x if c is None else c[j], target)
                for x, c in zip(leaves, columns)
            ],
            spec,
        )
        for j, target in enumerate(devices)
    ]


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
