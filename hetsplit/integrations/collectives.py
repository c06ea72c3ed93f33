"""Collectives for uneven shards: sample counts, shard-weighted reductions and uneven gathers (no framework)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hetsplit.tree import rebuilt, tree_map

_MAX_DIMS = 8  # the shape a gather exchanges first has room for this many dimensions


def op_name(reduce_op: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"``, ``"min"`` for the trainers' and torch's spellings of those reductions."""
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:  # torch.distributed.ReduceOp.SUM and friends
        name = str(getattr(reduce_op, "name", reduce_op)).rsplit(".", 1)[-1].lower()
    return {"avg": "mean", "average": "mean"}.get(name, name)


def weighted_reduce(
    tensor: torch.Tensor, samples: int, reduce_op: Any, plain: Callable[[torch.Tensor, Any], torch.Tensor]
) -> torch.Tensor:
    """Reduce a value computed on ``samples`` samples of this step, each rank weighted by its samples.

    A mean becomes ``sum_r b_r * v_r / sum_r b_r`` (one all-reduce through ``plain``, the trainer's own
    reduction); a rank without samples adds nothing, even a NaN, and the neutral value to sum, max, min.
    """
    op = op_name(reduce_op)
    if op == "mean":
        dtype = tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype()
        with torch.no_grad():
            flat = tensor.detach().to(dtype).reshape(-1)
            part = flat * samples if samples else torch.zeros_like(flat)
            total = plain(torch.cat([part, flat.new_tensor([float(samples)])]), "sum")
        return (total[:-1] / total[-1]).reshape(tensor.shape)
    neutral = {"sum": 0.0, "max": -math.inf, "min": math.inf}.get(op)
    if samples == 0 and neutral is not None and tensor.is_floating_point():
        tensor = torch.full_like(tensor, neutral)
    return plain(tensor, reduce_op)


def uneven_gather(data: Any, group: Any = None) -> Any:
    """Every rank's tensors concatenated along dim 0 in rank order, whatever each rank's length.

    A 0-dim tensor counts as one row; dicts, lists and tuples are walked; any other object is
    all-gathered as a list with one entry per rank.

    Raises:
        ValueError: If ranks give tensors whose trailing shapes differ (naming them).
    """
    if isinstance(data, Mapping):
        return rebuilt(data, {k: uneven_gather(v, group) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(uneven_gather(v, group) for v in data)
    world = dist.get_world_size(group)
    if not isinstance(data, torch.Tensor):
        out: list[Any] = [None] * world
        dist.all_gather_object(out, data, group=group)
        return out
    t = data if data.dim() else data.reshape(1)
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"cannot gather a tensor of {t.dim()} dimensions; at most {_MAX_DIMS}")
    # One small tensor gather of every rank's shape (no pickling: the Trainer gathers every
    # window): a mismatch is named here instead of failing inside the collective.
    mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.long, device=t.device)
    mine[0] = t.dim()
    mine[1 : t.dim() + 1] = torch.tensor(t.shape, dtype=torch.long)
    shapes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shapes, mine, group=group)
    meta = [tuple(int(v) for v in m[1 : int(m[0]) + 1]) for m in torch.stack(shapes).cpu()]
    if len({m[1:] for m in meta}) > 1:
        raise ValueError(
            f"cannot gather tensors of different trailing shapes across ranks: {dict(enumerate(meta))}; "
            "pad them to one shape first (e.g. accelerator.pad_across_processes)"
        )
    counts = [m[0] for m in meta]
    padded = t.new_zeros((max(counts), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def first_rows(data: Any, rows: int, real: int) -> Any:
    """The first ``real`` rows of everything in ``data`` with ``rows`` rows (tensors, lists of texts); the rest kept."""
    if real == rows:
        return data

    def per_row(x: Any) -> bool:
        return isinstance(x, list) and len(x) == rows and not any(isinstance(v, _NESTED) for v in x)

    def cut(x: Any) -> Any:
        if per_row(x) or (torch.is_tensor(x) and x.dim() and x.shape[0] == rows):
            return x[:real]
        return x

    return tree_map(cut, data, is_leaf=per_row)


_NESTED = (torch.Tensor, list, tuple, Mapping)


def all_tensors(data: Any) -> bool:
    """Whether ``data`` (dicts, lists, tuples walked) holds tensors only."""
    if isinstance(data, Mapping):
        return all(all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(all_tensors(v) for v in data)
    return torch.is_tensor(data)
