"""Accumulate: a rank's share run as the plan's micro-batches, all but the last under DDP's ``no_sync()``.

The one place a rank's batch is cut into micro-batches: every engine and integration uses these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from ..devices import DeviceLike, parse_device
from ..planning.micro import micro_sizes_within
from ..planning.plan import Plan
from ..tree import batch_length, split_rows
from . import sharded as _sharded
from ._group import group_info
from .zero_share import IN_HAND, is_stand_in


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

    Run forward and backward of each in the loop body; :func:`~hetsplit.distributed.weight_gradients`
    weights each by its share. An FSDP2 model runs the plan's largest count on every rank
    (its steps are collective), padded with stand-ins weighted 0 (:mod:`.sharded`).

    Args:
        ddp_model: The DDP model (anything with ``no_sync()``), or the FSDP2 root module.
        batch: This rank's batch of ``plan.sizes[rank]`` samples (a tensor or a nest).
        plan: The plan every rank holds.
        rank: This rank (default: the process group's).
        dim: The batch dimension.
        device: This rank's device: an emulated memory (``cpu:max64``) raises OOM as a GPU would.
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
    short = IN_HAND.short  # an epoch's short last global batch (pad=False), as the loader cut it
    if short is not None and len(short) == len(plan.sizes) and len(sizes) > 1:
        raise ValueError(
            f"rank {rank}: an epoch's short last global batch {short} is not cut into this rank's micro-batches "
            f"{sizes}: build the loader with drop_last=True (or pad=True)"
        )
    if short is not None and len(short) == len(plan.sizes) and (n == short[rank] or is_stand_in(short[rank], n)):
        pass  # one micro-batch: the short share runs whole, weighted by the short batch's sizes
    elif n != plan.sizes[rank] and not is_stand_in(plan.sizes[rank], n):
        raise ValueError(
            f"rank {rank}: the batch has {n} samples but the plan gives this rank {plan.sizes[rank]}; "
            "pass this rank's share (hd.data_loader gives it)"
        )
    dev = parse_device(device) if device is not None else None
    if kind == "fsdp2" and len(sizes) > 1:
        for piece, size in _sharded.micro_pieces(batch, sizes, dim):
            if dev is not None:
                dev.check_batch(max(size, 1))
            yield piece
        return
    parts = list(sizes) if len(sizes) > 1 else [n]
    for piece, size in zip(all_reduce_once(ddp_model, row_pieces(batch, parts, dim)), parts):
        if dev is not None:
            dev.check_batch(size)
        yield piece


def micro_sizes_for(plan: Plan | None, rank: int, rows: int) -> list[int]:
    """The micro-batches ``rows`` rows of rank ``rank``'s batch run as (``[rows]``: whole).

    Another number of rows than the share: near-equal pieces within the plan's largest micro-batch (its cap).
    """
    parts = plan.micro_batches[rank] if plan is not None else []
    if len(parts) <= 1 or rows <= 1:
        return [rows]
    if rows == sum(parts):
        return list(parts)
    return micro_sizes_within(rows, max(parts))


def row_pieces(batch: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """``batch`` as consecutive pieces of ``sizes`` rows (views, as :func:`hetsplit.tree.split_rows` cuts)."""
    if len(sizes) <= 1:
        return [batch]
    return split_rows(batch, sizes, dim=dim, rows=sum(sizes))


def all_reduce_once(ddp_model: nn.Module, pieces: Sequence[Any]) -> Iterator[Any]:
    """Each of ``pieces``, all but the last inside ``ddp_model.no_sync()``: DDP all-reduces once, in the last."""

    sync = getattr(ddp_model, "no_sync", None)
    for j, piece in enumerate(pieces):
        with sync() if sync is not None and j < len(pieces) - 1 else contextlib.nullcontext():
            yield piece
