"""Inputs: each replica's shard of the caller's inputs, and what flows back to them.

An input that requires grad is cut into pieces connected to it through autograd
(:class:`Upstream`); every other tensor of the batch into aliases with version counters of
their own, whose in-place writes pass back to the caller's batch (:class:`InputWrites`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..devices import Device
from ..tree import flatten, move, to_device, unflatten
from .scatter_gather import scatter_to


def shard_leaves(
    batch: Any, shards: Sequence[Any], keep: Callable[[torch.Tensor], bool]
) -> tuple[list[Any], Any, list[int], list[list[Any]]] | None:
    """The batch's leaves, structure, the tensor leaves ``keep`` selects, and each shard's leaves.

    ``None`` when no leaf is kept or a shard's structure differs (an overridden scatter's: run as they are).
    """
    leaves, spec = flatten(batch)
    keys = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and keep(x)]
    if not keys:
        return None
    flat = [flatten(s) for s in shards]
    if any(s != spec for _, s in flat):
        return None
    return leaves, spec, keys, [list(shard) for shard, _ in flat]


class Upstream:
    """The differentiable inputs of one step (:attr:`sources`) and each shard's piece of them (:attr:`pieces`).

    Each piece stays connected to its input through autograd, so a gradient of a gradient still
    reaches it; the pieces' gradients reach the input once, so the caller's graph is walked once.
    :attr:`shards` holds the shards to run (the same objects when nothing requires grad).
    """

    def __init__(self, batch: Any, shards: Sequence[Any], dim: int) -> None:
        self.shards, self.dim = list(shards), dim
        self.sources: list[torch.Tensor] = []
        self.pieces: list[list[torch.Tensor]] = [[] for _ in self.shards]
        if not torch.is_grad_enabled():
            return
        found = shard_leaves(batch, self.shards, lambda x: x.requires_grad)
        if found is None:
            return
        leaves, spec, keys, new = found
        for k in keys:
            if not all(isinstance(shard[k], torch.Tensor) and shard[k].requires_grad for shard in new):
                continue
            # A piece on the input's own device is a view of it: a replica that wrote into its
            # input in place would rewrite the input's history from several threads at once.
            # It gets its own (differentiable) copy; a piece on another device is one already.
            for shard in new:
                if _torch.is_view(shard[k]) or shard[k] is leaves[k]:
                    shard[k] = shard[k].clone()
            self.sources.append(leaves[k])
            for j, shard in enumerate(new):
                self.pieces[j].append(shard[k])
        if self.sources:
            self.shards = [unflatten(shard, spec) for shard in new]

    def combine(self, grads: Sequence[Sequence[torch.Tensor | None]]) -> list[torch.Tensor | None]:
        """Each source's gradient from its pieces' (``grads[j][s]``): concatenated, or summed for a 0-dim input."""
        out: list[torch.Tensor | None] = []
        for s, source in enumerate(self.sources):
            got = [g[s] for g in grads]
            if all(g is None for g in got):
                out.append(None)
                continue
            parts = [
                to_device(g if g is not None else torch.zeros_like(p[s]), source.device)
                for g, p in zip(got, self.pieces)
            ]
            out.append(sum(parts[1:], parts[0]) if source.dim() == 0 else torch.cat(parts, dim=self.dim))
        return out


class InputWrites:
    """The tensors of one step's shards that stand for the caller's batch, each with a version counter of its own.

    Views share their base's counter: a model writing into its input (``x.div_(255)``) made other
    replicas fail intermittently with "modified by an inplace operation". :meth:`pass_back` moves
    the caller's version as the plain module's write does.
    """

    def __init__(self, batch: Any, shards: Sequence[Any], sizes: Sequence[int], dim: int) -> None:
        self.shards = list(shards)
        self.dim = dim
        # (the caller's tensor, the replica's piece of it, the piece's version, first row, rows)
        self._watched: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        graph, lone = torch.is_grad_enabled(), lone_tensor(batch)
        if lone is not None:  # the common case, without walking a tree
            if lone.dim() > 0 and not (graph and lone.requires_grad):
                self.shards = [((self._own(lone, a[0], s, n),), k) for (a, k), s, n in zip(shards, starts, sizes)]
            return
        found = shard_leaves(batch, self.shards, lambda x: x.dim() > 0 and not (graph and x.requires_grad))
        if found is None:
            return
        leaves, spec, keys, new = found
        for k in keys:
            for shard, start, n in zip(new, starts, sizes):
                shard[k] = self._own(leaves[k], shard[k], start, n)
        self.shards = [unflatten(shard, spec) for shard in new]

    def _own(self, source: torch.Tensor, piece: Any, start: int, rows: int) -> Any:
        """``piece`` of ``source`` with a version counter of its own, watched for writes."""
        if not isinstance(piece, torch.Tensor) or piece.dim() != source.dim():
            return piece
        if piece.device == source.device and (piece is source or _torch.is_view(piece)):
            piece = piece.data  # same storage, a version counter of its own
        self._watched.append((source, piece, _torch.version(piece), start, rows))
        return piece

    def pass_back(self) -> None:
        """After the forward: the pieces a replica wrote into reach the caller's tensors, as in the plain module."""
        for source, piece, version, start, rows in self._watched:
            if _torch.version(piece) == version:
                continue  # the common case: nothing wrote into the input
            with torch.no_grad():
                if piece.device == source.device and _same_storage(piece, source):
                    torch.autograd.graph.increment_version(source)  # written in place already
                else:
                    source.narrow(self.dim, start, rows).copy_(piece)


def lone_tensor(batch: Any) -> torch.Tensor | None:
    """The input of ``model(x)``: the tensor of a batch ``((x,), {})`` (handled without a tree walk), else ``None``."""
    args, kwargs = batch
    if isinstance(kwargs, dict) and not kwargs and isinstance(args, tuple) and len(args) == 1:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def versions(tree: Any) -> list[int]:
    """The versions of the tensors in a nest (to tell whether a forward wrote into its inputs)."""
    return [_torch.version(x) for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]


def cut_upstream(
    batch: tuple[tuple[Any, ...], dict[str, Any]], args: list[Any], kws: list[Any], sizes: Sequence[int], dim: int
) -> tuple[Upstream | None, InputWrites, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The :class:`Upstream` (``None`` for a lone tensor without grad), :class:`InputWrites` and each shard."""

    whole = (tuple(batch[0]), dict(batch[1]))
    lone = lone_tensor(whole)
    shards = list(zip(args, kws))
    upstream = None
    if lone is None or lone.requires_grad:  # a lone tensor without grad: none
        upstream = Upstream(whole, shards, dim)
        shards = upstream.shards
    writes = InputWrites(whole, shards, sizes, dim)
    return upstream, writes, [(tuple(a), dict(k)) for a, k in writes.shards]


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
