"""Upstream: replicas run on detached leaf shards; their input gradients rejoin the caller's graph once.

An input that requires grad and is not a leaf (the output of a layer in front of the
wrapper) belongs to the caller's graph. If every replica's backward walked into that
graph through its own shard, the first would free it and the second fail ("backward
through the graph a second time"); even a leaf input would have its gradient summed from
several threads. So each replica gets its shard as a fresh leaf, and the gradients of
those leaves, put back together on the input's device, are handed to the caller's graph
in one backward: by the gather's autograd function in forward mode, by
:meth:`Upstream.backward` in local-loss mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..tree import flatten, to_device, unflatten

__all__ = ["Upstream"]


class Upstream:
    """The differentiable inputs of one step, cut from the caller's graph at the shards.

    Args:
        batch: The step's whole input (any nest), as given to the wrapper.
        shards: Its shards, one per active replica, each with ``batch``'s structure.
        dim: The batch dimension the shards were cut along.

    After construction :attr:`shards` holds the shards to run (the same objects when
    nothing requires grad, so the common step pays one flatten), and :attr:`sources`
    the inputs whose gradients :meth:`grads` returns.

    Example:
        >>> up = Upstream(x, scatter(x, devices, sizes), 0)  # replicas run on up.shards
        >>> ...  # each replica's backward
        >>> up.backward()  # the caller's graph in front of x, walked once
    """

    def __init__(self, batch: Any, shards: Sequence[Any], dim: int) -> None:
        self.shards, self.dim = list(shards), dim
        self.sources: list[torch.Tensor] = []
        self._cuts: list[list[torch.Tensor]] = []  # per source: its leaf in every shard
        if not torch.is_grad_enabled():
            return
        leaves, spec = flatten(batch)
        keys = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not keys:
            return
        flat = [flatten(s) for s in self.shards]
        if any(s != spec for _, s in flat):
            return  # an overridden scatter with its own structure: its shards run as they are
        new = [list(shard_leaves) for shard_leaves, _ in flat]
        for k in keys:
            if not all(isinstance(shard[k], torch.Tensor) for shard in new):
                continue
            cut = [shard[k].detach().requires_grad_() for shard in new]
            for shard, leaf in zip(new, cut):
                shard[k] = leaf
            self.sources.append(leaves[k])
            self._cuts.append(cut)
        if self.sources:
            self.shards = [unflatten(shard, spec) for shard in new]

    def grads(self) -> list[torch.Tensor | None]:
        """Each source's gradient from the replicas' backward (``None``: none reached it).

        A split input's gradient is its shards' gradients concatenated along ``dim`` on
        the input's device; a 0-dim input, given whole to every replica, gets their sum.
        The shard leaves' gradients are released.
        """
        out: list[torch.Tensor | None] = []
        for source, cut in zip(self.sources, self._cuts):
            got = [leaf.grad for leaf in cut]
            for leaf in cut:
                leaf.grad = None
            if all(g is None for g in got):
                out.append(None)
                continue
            parts = [
                to_device(g if g is not None else torch.zeros_like(leaf), source.device) for g, leaf in zip(got, cut)
            ]
            out.append(sum(parts[1:], parts[0]) if source.dim() == 0 else torch.cat(parts, dim=self.dim))
        return out

    def backward(self) -> None:
        """Walk the caller's graph once with the sources' gradients (local-loss mode)."""
        pairs = [(s, g) for s, g in zip(self.sources, self.grads()) if g is not None]
        if pairs:
            torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])
