"""Writes into the inputs: each replica's shard with a version counter of its own, in-place writes passed back.

A shard on the batch's own device is a view of the caller's tensor, and views share their
base's version counter: a model that writes into its input in place (``x.div_(255)``,
``nn.ReLU(inplace=True)`` on the input) moved, from one replica, the version of every
other replica's shard, and those that had saved theirs for backward failed with torch's
"modified by an inplace operation" — intermittently, as the threads interleaved. Each
shard is instead an alias with a counter of its own (same storage: the write still lands
in the caller's batch, as the plain module's does). After the forward a shard whose
version moved is passed back to the caller's tensor: copied into its rows when it lives on
another device, and the caller's version moved as the plain module's write moves it, so a
graph of the caller's that saved the batch refuses its backward as torch's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..tree import flatten, unflatten
from .upstream import shard_leaves


class InputWrites:
    """The tensors of one step's shards that stand for the caller's batch, and their versions.

    Args:
        batch: The step's inputs as given: ``(args, kwargs)``, or ``((args, kwargs), target)``.
        shards: One per active replica, with ``batch``'s structure.
        sizes: Each shard's samples.
        dim: The batch dimension the shards were cut along.

    After construction :attr:`shards` holds the shards to run: the same, except that a
    tensor sharing the caller's version counter (a view on the batch's device) is replaced
    by an alias with a counter of its own. An input that requires grad is left to
    :class:`~hetsplit.parallel.upstream.Upstream`, which gives each replica a copy.
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
        if piece.device == source.device and (piece is source or piece._base is not None):
            piece = piece.data  # same storage, a version counter of its own
        self._watched.append((source, piece, piece._version, start, rows))
        return piece

    def pass_back(self) -> None:
        """After the forward: the pieces a replica wrote into reach the caller's tensors, as in the plain module."""
        for source, piece, version, start, rows in self._watched:
            if piece._version == version:
                continue  # the common case: nothing wrote into the input
            with torch.no_grad():
                if piece.device == source.device and _same_storage(piece, source):
                    torch.autograd.graph.increment_version(source)  # written in place already
                else:
                    source.narrow(self.dim, start, rows).copy_(piece)


def lone_tensor(batch: Any) -> torch.Tensor | None:
    """The input of ``model(x)``: the tensor of a batch ``((x,), {})``, else ``None``.

    The common case, which a step handles without walking a tree.
    """
    args, kwargs = batch
    if isinstance(kwargs, dict) and not kwargs and isinstance(args, tuple) and len(args) == 1:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def versions(tree: Any) -> list[int]:
    """The versions of the tensors in a nest (to tell whether a forward wrote into its inputs)."""
    return [x._version for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]
