"""Grads: the replicas' gradients, computed concurrently, handed to the module through autograd.

A step differentiates the module's parameters and the inputs that require grad (its
*targets*). Each replica stands for them with tensors of its own (an alias or copy of
each parameter, its piece of each input), and its backward *captures* the gradient at
those with ``torch.autograd.grad``: nothing is written into any ``.grad`` while the
replicas work, so a step that fails in any replica leaves nothing behind. The captured
gradients are summed per target (concatenated, for a split input) and handed to the
targets by torch's engine: returned from the gather's backward in gather mode, or given
to ``torch.autograd.backward`` in local-loss mode. Either way parameter hooks fire once
with the full-batch gradient, and ``autograd.grad`` sees exactly the plain module's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tree import to_device
from .replicas import _Replica
from .upstream import Upstream

Grads = list[torch.Tensor | None]


class StepGrads:
    """The targets of one step, and each replica's stand-ins for them.

    Args:
        params: The module's parameters (those that require grad become targets).
        replicas: The step's replicas, in the order of the active devices.
        upstream: The step's inputs that require grad, if any.
    """

    def __init__(self, params: Sequence[torch.Tensor], replicas: Sequence[_Replica], upstream: Upstream | None) -> None:
        graph = torch.is_grad_enabled()
        chosen = [k for k, p in enumerate(params) if graph and p.requires_grad]
        self.upstream = upstream if upstream is not None and upstream.sources else None
        sources = self.upstream.sources if self.upstream is not None else []
        self.targets: list[torch.Tensor] = [params[k] for k in chosen] + list(sources)
        self.n_params = len(chosen)
        self._chosen = chosen
        self.inputs: list[list[torch.Tensor]] = [self.stand_ins(r, j) for j, r in enumerate(replicas)]

    def stand_ins(self, replica: _Replica, j: int) -> list[torch.Tensor]:
        """What replica ``replica`` (at position ``j``) differentiates in place of the targets."""
        return [replica.params[k] for k in self._chosen] + (
            self.upstream.pieces[j] if self.upstream is not None else []
        )

    def capture(
        self,
        j: int,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        keep: bool,
        build: bool,
        inputs: list[torch.Tensor] | None = None,
    ) -> Grads:
        """Replica ``j``'s gradients at its stand-ins, from ``outputs`` (with ``grads``); run in its thread.

        Args:
            keep: Keep the replica's graph (``retain_graph``).
            build: Build a graph of the gradients (``create_graph``).
            inputs: Other stand-ins (a replica rebuilt for this backward), else replica ``j``'s.
        """
        inputs = self.inputs[j] if inputs is None else inputs
        if not inputs or not outputs:
            return [None] * len(inputs)
        reentrant, foreign = _walk(outputs, inputs)
        if foreign:
            shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:3])
            raise RuntimeError(
                f"the model computes with tensors that require grad but are neither parameters of the module nor "
                f"inputs of the wrapper (shape {shapes}): their gradients cannot reach them through the replicas; "
                "register each as an nn.Parameter of the module (or detach it, if it is not trained)"
            )
        if reentrant:
            # Reentrant checkpointing runs a backward of its own inside, which cannot stop at
            # stand-ins (torch refuses it under autograd.grad): the replica's gradients flow on
            # into the module's parameters, as with the plain module (docs/compatibility.md).
            # An input that requires grad is reached through each replica's piece of it: a
            # leaf accumulates them (under its own lock), but the graph in front of a
            # non-leaf would be walked by several replicas at once.
            if self.upstream is not None and not all(s.is_leaf for s in self.upstream.sources):
                raise RuntimeError(
                    "the model uses reentrant activation checkpointing (use_reentrant=True) and its input comes from "
                    "layers in front of the wrapper: that input's gradient cannot be gathered from the replicas; use "
                    "use_reentrant=False (torch's recommended setting)"
                )
            torch.autograd.backward(list(outputs), grads, retain_graph=keep, create_graph=build)
            return [None] * len(inputs)
        found = torch.autograd.grad(
            list(outputs), inputs, grads, retain_graph=keep, create_graph=build, allow_unused=True
        )
        return list(found)

    def reduce(self, per_replica: Sequence[Grads]) -> Grads:
        """One gradient per target: a parameter's summed over replicas on its device, an input's put back together."""
        out: Grads = []
        for k in range(self.n_params):
            device = self.targets[k].device
            out.append(_add_all([to_device(g[k], device) if g[k] is not None else None for g in per_replica]))
        if self.upstream is not None:
            out += self.upstream.combine([g[self.n_params :] for g in per_replica])
        return out

    def deliver(self, grads: Grads) -> None:
        """Hand ``grads`` to the targets through torch's engine (local-loss mode).

        Hooks fire, ``.grad`` accumulates, the caller's graph in front of the inputs is walked once.
        """
        pairs = [(t, g) for t, g in zip(self.targets, grads) if g is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _add_all(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the tensors among ``values`` (``None`` if none).

    Out of place: a captured gradient can be a tensor the caller still holds (the
    incoming gradient itself, for an output that is an input), and with
    ``create_graph=True`` the sum is part of a graph.
    """
    total = None
    for v in values:
        if v is not None:
            total = v if total is None else total + v
    return total


def add_into(totals: Grads, more: Grads) -> Grads:
    """Element-wise :func:`_add_all` of two gradient lists (a device's micro-batches, one after another)."""
    return [_add_all([a, b]) for a, b in zip(totals, more)]


def _walk(outputs: Sequence[torch.Tensor], stand_ins: Sequence[torch.Tensor]) -> tuple[bool, list[torch.Tensor]]:
    """What the replica's graph behind ``outputs`` holds short of its stand-ins (~40 us for ResNet-18).

    Returns whether it holds a reentrant checkpoint, and the leaves that require grad it
    reaches without passing a stand-in: tensors the model computes with that are neither
    the module's parameters nor the wrapper's inputs (a closure's learnable tensor, a plain
    attribute), whose gradients no replica could hand back.
    """
    stops = {t.grad_fn for t in stand_ins if t.grad_fn is not None}
    seen, stack, reentrant, foreign = set(), [t.grad_fn for t in outputs if t.grad_fn is not None], False, []
    while stack:
        node = stack.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        kind = type(node).__name__
        if kind == "CheckpointFunctionBackward":
            reentrant = True  # its own backward reaches the leaves: what lies behind is not walked here
            continue
        if kind == "AccumulateGrad":
            foreign.append(node.variable)
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return reentrant, foreign
