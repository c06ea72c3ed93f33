"""Upstream: the inputs that require grad, each replica's piece of them, and their gradients put back together.

An input that requires grad (a leaf the user differentiates by, or the output of a layer
in front of the wrapper) is cut into one piece per replica. Each piece stays connected to
the input through autograd (a differentiable split and copy), so a gradient of a gradient
(``create_graph=True``) still reaches the input. The replicas' backward captures the
gradient at its own piece, and the engine hands the pieces' gradients, concatenated on
the input's device, to the input through autograd once: the caller's graph in front of
the wrapper is walked once, by torch's engine, as for the plain module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..tree import flatten, to_device, unflatten


def shard_leaves(
    batch: Any, shards: Sequence[Any], keep: Callable[[torch.Tensor], bool]
) -> tuple[list[Any], Any, list[int], list[list[Any]]] | None:
    """The batch's leaves, its structure, the tensor leaves ``keep`` selects, and each shard's leaves.

    ``None`` when no leaf is kept, or when a shard's structure is not the batch's (an
    overridden scatter with its own structure: its shards run as they are). The one walk
    both :class:`Upstream` and :class:`~hetsplit.parallel.writes.InputWrites` replace
    shard leaves by.
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
    """The differentiable inputs of one step and each shard's own piece of them.

    Args:
        batch: The step's whole input (any nest), as given to the wrapper.
        shards: Its shards, one per active replica, each with ``batch``'s structure.
        dim: The batch dimension the shards were cut along.

    After construction :attr:`shards` holds the shards to run (the same objects when
    nothing requires grad, so the common step pays one flatten), :attr:`sources` the
    inputs that require grad, and :attr:`pieces` ``[j]`` shard ``j``'s piece of each.

    Example:
        >>> up = Upstream(x, scatter(x, devices, sizes), 0)  # replicas run on up.shards
        >>> grads = [torch.autograd.grad(out_j, up.pieces[j], g_j) for ...]
        >>> up.combine(grads)  # one gradient per source
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
                if shard[k]._base is not None or shard[k] is leaves[k]:
                    shard[k] = shard[k].clone()
            self.sources.append(leaves[k])
            for j, shard in enumerate(new):
                self.pieces[j].append(shard[k])
        if self.sources:
            self.shards = [unflatten(shard, spec) for shard in new]

    def combine(self, grads: Sequence[Sequence[torch.Tensor | None]]) -> list[torch.Tensor | None]:
        """Each source's gradient from its pieces' gradients (``grads[j][s]``: shard ``j``, source ``s``).

        A split input's gradient is its pieces' gradients concatenated along ``dim`` on the
        input's device (zeros for a piece no gradient reached); a 0-dim input, given whole
        to every replica, gets their sum. ``None`` where no gradient reached any piece.
        """
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
