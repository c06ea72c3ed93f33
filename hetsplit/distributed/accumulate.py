"""Accumulate: a rank's share run as the plan's micro-batches, all but the last under DDP's ``no_sync()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..devices import DeviceLike, parse_device
from ..parallel.scatter_gather import scatter_to
from ..planning.plan import Plan
from ..tree import batch_length, flatten
from . import sharded as _sharded
from ._group import group_info


def micro_batches(
    ddp_model: nn.Module,
    batch: Any,
    plan: Plan,
    *,
    rank: int | None = None,
    dim: int = 0,
    device: DeviceLike | None = None,
    group: Any = None,
) -> Iterator[Any]:
    """This rank's batch cut into ``plan.micro_batches[rank]``; all but the last yielded under ``no_sync()``.

    Run forward and backward of each micro-batch in the loop body: gradients accumulate
    locally and DDP all-reduces once, in the last micro-batch's backward. With
    :func:`~hetsplit.distributed.weight_gradients` and the same ``plan``, each
    micro-batch's gradient is weighted by its share of the rank's samples, so a mean
    loss per micro-batch still gives the full-batch gradient. A rank with no samples
    gets its batch (one sample weighted 0, or an empty batch) once, so it still takes
    part in the all-reduce.

    An FSDP2 model (``fully_shard``) gathers parameters in every forward and
    reduce-scatters in every backward, so every rank runs the same number of
    micro-batches, the plan's largest ``K``, each synchronising its (weighted)
    gradient: a rank with fewer runs its share as ``K`` smaller ones, a rank with fewer
    than ``K`` samples adds one real sample weighted 0 for each missing one. Nothing
    is kept gathered, so a rank holds its shards plus one micro-batch's activations and
    a layer or two gathered, as in a plain FSDP2 step; the price is ``K`` gathers and
    reduce-scatters per step instead of one (measurements: docs/torchrun.md). Leaving
    the loop early leaves the other ranks waiting in their next collective, as with
    DDP.

    Args:
        ddp_model: The ``DistributedDataParallel`` model (anything with ``no_sync()``),
            or the FSDP2 root module.
        batch: This rank's batch of ``plan.sizes[rank]`` samples (a tensor or a nest).
        plan: The plan every rank holds.
        rank: This rank (default: the process group's).
        dim: The batch dimension.
        device: This rank's device: an emulated memory (``cpu:max64``) raises
            ``torch.OutOfMemoryError`` for a micro-batch it cannot hold, as a GPU would.
        group: The process group (for the rank).

    Raises:
        ValueError: If the batch is not this rank's share of the plan.

    Example:
        >>> for xm, ym in hd.micro_batches(ddp, (x, y), plan):
        ...     F.cross_entropy(ddp(xm), ym).backward()
    """
    kind = _sharded.kind(ddp_model)
    if kind == "fsdp1":
        raise ValueError(f"{type(ddp_model).__name__} (FSDP1) is not supported; use FSDP2's fully_shard (or DDP)")
    if rank is None:
        rank, _ = group_info(group)
    sizes = _sharded.rank_micro(plan, rank, kind == "fsdp2")
    n = batch_length(batch, dim)
    if n != plan.sizes[rank] and not (plan.sizes[rank] == 0 and n <= 1):  # a zero share's one sample
        raise ValueError(
            f"rank {rank}: the batch has {n} samples but the plan gives this rank {plan.sizes[rank]}; "
            "pass this rank's share (hd.data_loader gives it)"
        )
    dev = parse_device(device) if device is not None else None
    if len(sizes) <= 1:
        if dev is not None:
            dev.check_batch(n)
        yield batch
        return
    if kind == "fsdp2":
        for piece, size in _sharded.micro_pieces(batch, sizes, dim):
            if dev is not None:
                dev.check_batch(max(size, 1))
            yield piece
        return
    pieces = scatter_to(batch, [_home(batch)] * len(sizes), sizes, dim)
    for j, (piece, size) in enumerate(zip(pieces, sizes)):
        if dev is not None:
            dev.check_batch(size)
        last = j == len(sizes) - 1
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            yield piece


def _home(batch: Any) -> Any:
    """The device the batch's tensors are on (pieces stay there)."""
    leaves, _ = flatten(batch)
    for leaf in leaves:
        if hasattr(leaf, "device"):
            return parse_device(leaf.device, check=False)
    return parse_device("cpu", check=False)
