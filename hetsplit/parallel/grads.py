"""Grads: the replicas' gradients, computed concurrently, handed to the module through autograd.

Each replica captures its gradients with ``torch.autograd.grad`` (no ``.grad`` written: a failed
step leaves nothing behind); the sums reach the *targets* through torch's engine, hooks firing once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from ..tree import to_device
from .inputs import Upstream
from .replicas import _Replica

Grads = list[torch.Tensor | None]


class StepGrads:
    """The targets of one step, and each replica's stand-ins for them.

    ``outputs`` (gather mode): parameters no replica's outputs reach are left out of the targets,
    whose hooks torch would otherwise call with ``None``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        replicas: Sequence[_Replica],
        upstream: Upstream | None,
        names: Sequence[str] = (),
        outputs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self._names = {id(p): n for p, n in zip(params, names)}  # for error messages
        self._replicas, self._all_names = replicas, list(names)
        graph = torch.is_grad_enabled()
        chosen = [k for k, p in enumerate(params) if graph and p.requires_grad]
        self.upstream = upstream if upstream is not None and upstream.sources else None
        self._walked: list[tuple[bool, list[torch.Tensor]]] | None = None  # per replica, see _walk
        if outputs is not None and chosen:
            chosen = self._reached(chosen, outputs)
        sources = self.upstream.sources if self.upstream is not None else []
        self.targets: list[torch.Tensor] = [params[k] for k in chosen] + list(sources)
        self.n_params = len(chosen)
        self._chosen = chosen
        self.inputs: list[list[torch.Tensor]] = [self.stand_ins(r, j) for j, r in enumerate(replicas)]

    def _reached(self, chosen: list[int], outputs: Sequence[Sequence[torch.Tensor]]) -> list[int]:
        """The parameters among ``chosen`` some replica's ``outputs`` reach (all, behind a reentrant checkpoint)."""
        found: set[int] = set()
        self._walked = []
        for j, (replica, outs) in enumerate(zip(self._replicas, outputs)):
            pieces = self.upstream.pieces[j] if self.upstream is not None else []
            tensors = [t for t in outs if isinstance(t, torch.Tensor)]
            reentrant, foreign, reached = _walk(tensors, replica.params + pieces)
            self._walked.append((reentrant, foreign))
            found |= reached
        if any(reentrant for reentrant, _ in self._walked):
            return chosen
        return [k for k in chosen if k in found]

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
        *,
        retain_graph: bool,
        create_graph: bool,
        inputs: list[torch.Tensor] | None = None,
    ) -> Grads:
        """Replica ``j``'s gradients at its stand-ins (or ``inputs``: a rebuilt replica's), run in its thread."""
        walked = self._walked[j] if inputs is None and self._walked is not None else None
        inputs = self.inputs[j] if inputs is None else inputs
        if not inputs or not outputs:
            return [None] * len(inputs)
        reentrant, foreign = walked if walked is not None else _walk(outputs, inputs)[:2]
        if foreign:
            raise RuntimeError(self._foreign(foreign))
        if reentrant:
            return self._reentrant(outputs, grads, inputs, retain_graph=retain_graph, create_graph=create_graph)
        found = torch.autograd.grad(
            list(outputs), inputs, grads, retain_graph=retain_graph, create_graph=create_graph, allow_unused=True
        )
        return list(found)

    def _reentrant(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        inputs: list[torch.Tensor],
        *,
        retain_graph: bool,
        create_graph: bool,
    ) -> Grads:
        """A replica's gradients when its graph holds a reentrant checkpoint, read from its own leaves' ``.grad``.

        torch refuses a reentrant checkpoint under ``autograd.grad``; a non-leaf input's graph
        would be walked by several replicas at once, so it is refused.
        """
        if self.upstream is not None and not all(s.is_leaf for s in self.upstream.sources):
            raise RuntimeError(
                "the model uses reentrant activation checkpointing (use_reentrant=True) and its input comes from "
                "layers in front of the wrapper: that input's gradient cannot be gathered from the replicas; use "
                "use_reentrant=False (torch's recommended setting)"
            )
        torch.autograd.backward(list(outputs), grads, retain_graph=retain_graph, create_graph=create_graph)
        found: Grads = []
        for p in inputs[: self.n_params]:
            # A stand-in through autograd (a backward that builds a graph, on replicas of its own)
            # passed its gradient on into the module's parameter, as the plain module's would.
            found.append(p.grad if p.is_leaf else None)
            if p.is_leaf:
                p.grad = None  # taken: a second backward (retain_graph) starts from none again
        return found + [None] * (len(inputs) - self.n_params)

    def _foreign(self, leaves: Sequence[torch.Tensor]) -> str:
        """The refusal of a replica's graph that reaches tensors requiring grad other than its stand-ins."""
        own = [self._names[id(t)] for t in leaves if id(t) in self._names]
        if own:
            return (
                f"the model reaches the module's own parameter {own[0]!r}, not its replica's: its forward calls a "
                "callable bound to the original module (a method or closure stored on the module, or a compiled "
                "callable hetsplit did not carry over); call submodules through self, as the plain module's forward "
                "does"
            )
        shapes = ", ".join(str(tuple(t.shape)) for t in leaves[:3])
        return (
            f"the model computes with tensors that require grad but are neither parameters of the module nor "
            f"inputs of the wrapper (shape {shapes}): their gradients cannot reach them through the replicas; "
            "register each as an nn.Parameter of the module (or detach it, if it is not trained)"
        )

    def stray_check(self) -> Callable[[], None]:
        """A callable that raises if a gradient reached a replica's own parameter other than through the engine.

        Such a gradient (a loss on an activation a hook kept) never reaches the module. The
        parameters are held weakly: what keeps such a backward possible keeps them alive.
        """
        own = [(k, weakref.ref(t)) for r in self._replicas for k, t in enumerate(r.params) if t.is_leaf]
        own = [(k, ref) for k, ref in own if id(ref()) not in self._names]
        names = self._all_names
        return lambda: _check_stray([(k, t) for k, ref in own if (t := ref()) is not None], names)

    def reduce(self, per_replica: Sequence[Grads]) -> Grads:
        """One gradient per target: a parameter's summed over replicas on its device, an input's put back together."""
        out: Grads = []
        for k in range(self.n_params):
            device = self.targets[k].device
            out.append(_add_all([None if (grad := g[k]) is None else to_device(grad, device) for g in per_replica]))
        if self.upstream is not None:
            out += self.upstream.combine([g[self.n_params :] for g in per_replica])
        return out

    def deliver(self, grads: Grads) -> None:
        """Hand ``grads`` to the targets through torch's engine (local-loss mode): hooks fire, ``.grad`` accumulates."""
        pairs = [(t, g) for t, g in zip(self.targets, grads) if g is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _check_stray(params: Sequence[tuple[int, torch.Tensor]], names: Sequence[str]) -> None:
    """Raise for the first replica parameter ``(position, tensor)`` holding a ``.grad`` (see ``stray_check``)."""
    stray = [(k, t) for k, t in params if t.grad is not None]
    for _, t in stray:
        t.grad = None  # said once
    if stray:
        k = stray[0][0]
        name = names[k] if k < len(names) else str(k)
        raise RuntimeError(
            f"a gradient reached a replica's parameter {name!r} other than through the wrapper's output (a loss "
            "on an activation a forward hook kept, or on a tensor the model stored?): it cannot reach the module; "
            "return from forward what the loss needs, so that it is gathered"
        )


def _add_all(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the tensors among ``values`` (``None`` if none), out of place: the caller may hold them."""
    total = None
    for v in values:
        if v is not None:
            total = v if total is None else total + v
    return total


def add_into(totals: Grads, more: Grads) -> Grads:
    """Element-wise :func:`_add_all` of two gradient lists (a device's micro-batches, one after another)."""
    return [_add_all([a, b]) for a, b in zip(totals, more)]


def _walk(
    outputs: Sequence[torch.Tensor], stand_ins: Sequence[torch.Tensor]
) -> tuple[bool, list[torch.Tensor], set[int]]:
    """What the replica's graph behind ``outputs`` holds short of its stand-ins (~40 us for ResNet-18).

    Returns:
        Whether it holds a reentrant checkpoint, the leaves requiring grad it reaches without a
        stand-in (gradients no replica could hand back), and the positions of the stand-ins it reaches.
    """

    stops = {t.grad_fn: k for k, t in enumerate(stand_ins) if t.grad_fn is not None}
    leaves = {id(t): k for k, t in enumerate(stand_ins) if t.grad_fn is None}  # its AccumulateGrad is its own
    seen, stack, reentrant, foreign = set(), [t.grad_fn for t in outputs if t.grad_fn is not None], False, []
    reached: set[int] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in stops:
            reached.add(stops[node])
            continue
        kind = type(node).__name__
        if kind == "CheckpointFunctionBackward":
            reentrant = True  # its own backward reaches the leaves: what lies behind is not walked here
            continue
        if kind == "AccumulateGrad":
            # The leaf an AccumulateGrad node feeds; torch's stubs type every node as the base Node.
            leaf = node.variable  # type: ignore[attr-defined]
            k = leaves.get(id(leaf))
            if k is None:
                foreign.append(leaf)
            else:
                reached.add(k)
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return reentrant, foreign, reached
