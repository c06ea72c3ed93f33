"""Outputs: the replicas' outputs combined into one, with each replica's backward run in its own thread."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from .. import _torch
from ..tree import flatten, leaf_paths, to_device, unflatten
from .reduce import shard_weights
from .scatter_gather import concat_column

# How 0-dim floating outputs of the replicas (per-shard losses) become one: a named rule,
# or a callable giving each replica's weight from its input shard (args, kwargs). None (the
# default): "mean", refusing values that are sums over their shards (see check_sums).
ScalarPolicy: TypeAlias = str | Callable[[tuple[Any, ...], dict[str, Any]], Any] | None
_SCALAR_POLICIES = ("mean", "sum", "stack")

# torch's loss functions save their reduction: at::Reduction::Sum.
_REDUCTION_SUM = 2

# torch's message for a backward through a graph already freed, as its own nodes raise it.
_FREED = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have already "
    "been freed). Saved intermediate values of the graph are freed when you call .backward() or autograd.grad(). "
    "Specify retain_graph=True if you need to backward through the graph a second time or if you need to access "
    "saved tensors after calling backward."
)

# Per replica its outputs and their gradients, whether to keep the graph and whether to
# build one (create_graph) -> one gradient per target (None: none reached it).
Backward = Callable[[list[tuple[list[torch.Tensor], list[torch.Tensor]]], bool, bool], list[torch.Tensor | None]]


def check_policy(policy: ScalarPolicy, what: str = "scalar_outputs") -> ScalarPolicy:
    """Return ``policy`` if it is ``None``, one of :data:`_SCALAR_POLICIES` or a callable, else a ``ValueError``."""
    if policy is None or callable(policy) or policy in _SCALAR_POLICIES:
        return policy
    raise ValueError(
        f"{what} must be None (the default), one of {', '.join(map(repr, _SCALAR_POLICIES))} or a callable "
        f"(args, kwargs) -> weight, got {policy!r}"
    )


def policy_weights(
    policy: ScalarPolicy, sizes: Sequence[int], shards: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]
) -> list[float] | None:
    """Each replica's weight: ``b_i / B`` (``"mean"``), 1 (``"sum"``), a callable's normalised; None for ``"stack"``.

    Raises:
        ValueError: If a callable returns a negative or non-finite weight, or all zero.
    """
    if policy == "stack":
        return None
    if policy == "sum":
        return [1.0] * len(sizes)
    if policy is None or policy == "mean":
        return shard_weights(list(sizes))
    assert callable(policy)
    raw: list[float] = [float(policy(args, kwargs)) for args, kwargs in shards]
    if any(not math.isfinite(w) or w < 0 for w in raw) or sum(raw) <= 0:
        raise ValueError(
            f"the scalar weighting returned {raw} for the replicas' shards; "
            "weights must be finite, >= 0 and not all zero"
        )
    raw_total = sum(raw)
    return [w / raw_total for w in raw]


def count_tokens(
    key: str | int = "labels", *, ignore_index: int = -100, shift: bool = True
) -> Callable[[tuple[Any, ...], dict[str, Any]], int]:
    """A scalar weighting that counts a shard's non-ignored label tokens (for a mean over tokens, docs/one-process.md).

    Args:
        key: The keyword argument holding the labels, or the index of a positional one.
        ignore_index: The label value that is not counted.
        shift: Drop the first position along dim 1, as a causal LM predicts token
            ``t + 1`` from token ``t`` (``False`` for masked-LM or token classification).
    """

    def weight(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        labels = args[key] if isinstance(key, int) else kwargs.get(key)
        if not isinstance(labels, torch.Tensor):
            raise ValueError(f"count_tokens: the shard has no label tensor under {key!r}; pass the labels there")
        if shift:
            labels = labels[:, 1:]
        return int((labels != ignore_index).sum())

    return weight


def sums_over_batch(value: torch.Tensor, size: int, dim: int) -> bool:
    """Whether a replica's 0-dim ``value`` is certainly a sum over its shard, read from the operation that made it."""
    node = value.grad_fn
    if node is None:
        return False
    reduction, sizes = _torch.sum_reduction(node)
    if reduction is not None:
        return reduction == _REDUCTION_SUM
    if type(node).__name__ not in ("SumBackward0", "SumBackward1") or sizes is None:
        return False
    return -len(sizes) <= dim < len(sizes) and sizes[dim] == size


def check_sums(values: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, what: str, setting: str) -> None:
    """Refuse (``ValueError``) per-shard ``values`` that are all sums over their shards, to be weighed as means."""
    if values and all(sums_over_batch(v, n, dim) for v, n in zip(values, sizes)):
        kind = type(values[0].grad_fn).__name__
        raise ValueError(
            f"{what} is a sum over each replica's shard ({kind}), which the default weighs as a mean (b_i / B): "
            f"pass {setting}='sum' for the full-batch sum, as the plain module computes it ({setting}='mean' if "
            "it is a mean after all)"
        )


class _Gather(torch.autograd.Function):
    """Combine replica outputs; on backward, compute every replica's gradients concurrently and return their sums.

    The forward takes *detached* outputs, so the engine never walks the replicas' graphs from the
    caller's thread (serially, unthrottled); its other inputs are the step's targets, whose
    gradients the engine delivers (hooks fire once; a failed replica hands nothing on).
    """

    @staticmethod
    def forward(ctx: Any, backward: Backward, layout: _Layout, *tensors: torch.Tensor) -> Any:
        # Nothing is saved (a saved-tensor hook of the caller's sees only the model's tensors):
        # a backward that does not keep the graph drops backward_, and a later one refuses.
        ctx.backward_, ctx.layout = backward, layout
        # An output the loss does not use gets no gradient (not zeros): the replicas' backward then
        # leaves the parameters only it reaches without one, as the plain module's would.
        ctx.set_materialize_grads(False)
        out = layout.combine(tensors[: layout.n_inputs])
        # An output no replica's graph reaches (an integer, a mask passed through) stays
        # without grad, as the plain module's would.
        ctx.mark_non_differentiable(
            *[t for t, c in zip(out, layout.columns) if not _differentiable(t) or not any(x.requires_grad for x in c)]
        )
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if ctx.backward_ is None:  # a second backward through a freed graph, with torch's own message
            raise RuntimeError(_FREED)
        keep = _torch.backward_keeps_graph()
        n_inputs = ctx.layout.n_inputs
        found = ctx.backward_(ctx.layout.split(grads), keep, torch.is_grad_enabled())
        if not keep:  # the step's replicas, shards and outputs are not needed again: let them go now
            ctx.backward_ = ctx.layout = None
        return (None, None) + (None,) * n_inputs + tuple(found)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Layout:
    """Where each replica's output tensors sit in the combined output, and how they combine."""

    def __init__(
        self,
        columns: list[list[torch.Tensor]],
        paths: Callable[[int], str],
        target: torch.device,
        dim: int,
        weights: Callable[[], list[float] | None],
        sums: Sequence[int] | None = None,
    ) -> None:
        # columns[k][j]: leaf k of replica j
        self.columns, self.paths, self.target, self.dim = columns, paths, target, dim
        floating = [c[0].dim() == 0 and (c[0].is_floating_point() or c[0].is_complex()) for c in columns]
        if sums is not None and len(sums) > 1:  # the default weighting: a sum over shards is refused, not averaged
            for k, column in enumerate(columns):
                if floating[k]:
                    check_sums(column, sums, dim, f"output {paths(k)}", "scalar_outputs")
        # The weights are asked for only when a floating scalar is there to combine (a
        # callable policy may cost a device sync per replica).
        self.weights = weights() if any(floating) else None
        self.floating = floating
        self.n_inputs = sum(len(c) for c in columns)

    def _weighted(self, k: int) -> bool:
        return self.floating[k] and self.weights is not None

    def combine(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out, pos = [], 0
        for k, column in enumerate(self.columns):
            parts = flat[pos : pos + len(column)]
            pos += len(column)
            if self._weighted(k):
                assert self.weights is not None
                # A replica weighted 0 (a shard without a labelled token) adds nothing, not its nan.
                terms = [to_device(t, self.target) * w for t, w in zip(parts, self.weights) if w]
                out.append(sum(terms[1:], terms[0]))
            elif column[0].dim() == 0:
                out.append(torch.stack([to_device(t, self.target) for t in parts]))
            else:
                try:
                    out.append(torch.cat([to_device(t, self.target) for t in parts], dim=self.dim))
                except RuntimeError:  # named by its path (walking the output for paths costs a step ~50 us)
                    concat_column(parts, self.target, self.dim, self.paths(k))
                    raise
        return out

    def split(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per replica: (its output tensors, the matching gradient pieces) that need backward."""
        work: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self.columns[0]]
        for k, (column, grad) in enumerate(zip(self.columns, grads)):
            if grad is None:
                continue
            if self._weighted(k):
                assert self.weights is not None
                pieces = [grad * w if w else None for w in self.weights]  # weight 0: no backward at all
            elif column[0].dim() == 0:
                pieces = list(grad.unbind(0))
            else:
                pieces = list(torch.split(grad, [t.shape[self.dim] for t in column], dim=self.dim))
            for j, (t, g) in enumerate(zip(column, pieces)):
                if t.requires_grad and g is not None:
                    work[j][0].append(t)
                    work[j][1].append(to_device(g, t.device))
        return work


def combine(
    outputs: Sequence[Any],
    target: torch.device,
    dim: int,
    weights: Callable[[], list[float] | None],
    backward: Backward | None,
    labels: Sequence[str],
    targets: Sequence[torch.Tensor] = (),
    sums: Sequence[int] | None = None,
) -> Any:
    """The replicas' outputs as one output on ``target``; its backward runs ``backward`` (see :class:`_Gather`).

    Tensors are concatenated along ``dim``; 0-dim floating ones combined with ``weights()`` (stacked
    for ``None``), other 0-dim ones stacked; other objects come back as a list per replica. ``sums``:
    each replica's samples, when sums over them must be refused (:func:`check_sums`).

    Raises:
        ValueError: If the replicas' outputs differ in structure or cannot be
            concatenated, naming the replica or the output's path.
    """
    flat = [flatten(o) for o in outputs]
    spec = flat[0][1]
    for j, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(
                f"replica {labels[j]} returned a different structure from replica {labels[0]}: {s} vs {spec}"
            )
    found: list[list[str]] = []

    def path(k: int) -> str:  # leaf k's path, for error messages only
        if not found:
            found.append(leaf_paths(outputs[0]))
        return found[0][k]

    leaves: list[Any] = [[leaves[k] for leaves, _ in flat] for k in range(len(flat[0][0]))]
    positions = [k for k, column in enumerate(leaves) if isinstance(column[0], torch.Tensor)]
    for k, column in enumerate(leaves):
        if k in positions and not all(isinstance(x, torch.Tensor) for x in column):
            raise ValueError(
                f"output {path(k)} is a tensor on some replicas and not on others: {[type(x).__name__ for x in column]}"
            )
    if not positions:
        return unflatten(leaves, spec)
    columns = [leaves[k] for k in positions]
    layout = _Layout(columns, lambda j: path(positions[j]), target, dim, weights, sums)
    if (
        backward is not None
        and targets
        and torch.is_grad_enabled()
        and any(t.requires_grad for c in columns for t in c)
    ):
        detached = [t.detach() for c in columns for t in c]
        combined = _Gather.apply(backward, layout, *detached, *targets)
    else:
        combined = layout.combine([t for c in columns for t in c])
    for k, value in zip(positions, combined):
        leaves[k] = value
    return unflatten(leaves, spec)
