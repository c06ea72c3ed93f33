"""HeteroTrainer parts: counting a batch's items, cutting it into micro-batches, holding gradients at zero."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hetsplit.planning import Plan
from hetsplit.planning.micro import micro_sizes
from hetsplit.tree import tree_map

from .collectives import samples_in


def items_in(inputs: Mapping[str, Any], shifted: bool) -> torch.Tensor | int:
    """Items a mean loss averages over in ``inputs``: label tokens that count (not -100, a tensor), else samples.

    Args:
        inputs: A collated batch.
        shifted: Whether the loss predicts label ``i + 1`` at position ``i`` (a causal LM):
            position 0 of ``labels`` then never counts (``shift_labels`` are taken as given).

    Returns:
        A 0-dim tensor on the labels' device (no synchronisation), or the samples as an int.
    """
    labels = inputs.get("shift_labels", inputs.get("labels")) if isinstance(inputs, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        if shifted and "shift_labels" not in inputs and labels.dim() > 1:
            labels = labels[..., 1:]
        return labels.ne(-100).sum()
    return samples_in(inputs) or 0


def share_micro_sizes(plan: Plan | None, rank: int, rows: int) -> list[int]:
    """The micro-batch sizes to run ``rows`` rows of process ``rank``'s batch as (``[rows]``: whole).

    The plan's ``micro_batches[rank]`` when ``rows`` is that share; another number of rows
    (a loader cut in the plan's proportions) as near-equal pieces (:func:`micro_sizes`) no
    larger than the largest micro-batch the plan gives this process.
    """
    parts = plan.micro_batches[rank] if plan is not None else []
    if len(parts) <= 1 or rows <= 1:
        return [rows]
    if rows == sum(parts):
        return list(parts)
    return micro_sizes(rows, math.ceil(rows / max(parts)))


def row_range(inputs: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every tensor in ``inputs`` whose first dimension has ``rows``; other values whole."""

    def cut(x: Any) -> Any:
        return x[start:stop] if torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == rows else x

    if isinstance(inputs, Mapping):  # a plain dict: the tree walk would keep a BatchEncoding whole
        return {k: tree_map(cut, v) for k, v in inputs.items()}
    return tree_map(cut, inputs)


def piece_items(inputs: Any, sizes: list[int], shifted: bool, device: torch.device) -> torch.Tensor:
    """The items (:func:`items_in`) of each micro-batch of ``inputs``, ``sizes`` rows one after another.

    Returns:
        One float64 count per micro-batch, on ``device``, without a synchronisation.
    """
    rows, start, out = sum(sizes), 0, []
    for size in sizes:
        piece = inputs if len(sizes) == 1 else row_range(inputs, start, start + size, rows)
        out.append(torch.as_tensor(items_in(piece, shifted), dtype=torch.float64, device=device).reshape(1))
        start += size
    return torch.cat(out)


@contextlib.contextmanager
def zero_gradients(model: nn.Module) -> Iterator[None]:
    """Backward passes inside add an exact 0 to every parameter's gradient, whatever their loss computes.

    Weighting a mean over no items by 0 makes its value 0, not its backward: for
    ``(l * mask).sum() / mask.sum()`` that is 0 * (1/0), NaN in every parameter (and,
    through DDP's all-reduce, on every process). The backward still reaches every
    parameter it would, so DDP's reducer sees the same parameters ready as elsewhere.

    Args:
        model: The model (DDP-wrapped or not) whose parameters' gradients are held.
    """
    handles = [p.register_hook(torch.zeros_like) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
