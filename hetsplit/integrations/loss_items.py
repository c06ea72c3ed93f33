"""Loss items: what a mean loss averages over in a batch (per micro-batch), and a backward held at exact zeros."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hetsplit.distributed.accumulate import row_pieces
from hetsplit.tree import samples_in


def items_in(inputs: Mapping[str, Any], shifted: bool) -> torch.Tensor | int:
    """Items a mean loss averages over in ``inputs``: label tokens that count (not -100, a tensor), else samples.

    With ``shifted`` (a causal LM) position 0 of ``labels`` never counts; ``shift_labels`` are taken as given.
    """
    labels = inputs.get("shift_labels", inputs.get("labels")) if isinstance(inputs, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        if shifted and "shift_labels" not in inputs and labels.dim() > 1:
            labels = labels[..., 1:]
        return labels.ne(-100).sum()
    return samples_in(inputs) or 0


def piece_items(inputs: Any, sizes: list[int], shifted: bool, device: torch.device) -> torch.Tensor:
    """The items (:func:`items_in`) of each micro-batch of ``inputs``, as float64 on ``device`` (no synchronisation)."""
    out = [items_in(piece, shifted) for piece in row_pieces(inputs, sizes)]
    return torch.cat([torch.as_tensor(n, dtype=torch.float64, device=device).reshape(1) for n in out])


@contextlib.contextmanager
def zero_gradients(model: nn.Module) -> Iterator[None]:
    """Backward passes inside add an exact 0 to every parameter's gradient, whatever their loss computes.

    Weighting a mean over no items by 0 makes its value 0, not its backward (``0 * (1/0)``: NaN, through
    DDP on every process); the backward still reaches every parameter, as DDP's reducer expects.
    """
    handles = [p.register_hook(torch.zeros_like) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
