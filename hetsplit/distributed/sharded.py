"""Sharded: FSDP2 (``fully_shard``) in the torchrun pieces — what is refused, the micro-batches every rank runs.

Every rank runs the same number of micro-batches (FSDP2's steps are collective); keeping the
parameters gathered across them instead (``unshard()``) would hold the whole model on every
rank, which a model larger than the smallest device cannot afford (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planning.micro import micro_sizes
from ..planning.plan import Plan
from ..tree import narrow
from ._group import DistributedError, all_gather, collective
from .zero_share import stand_in_batch

_WORKS = (
    "FSDP2's fully_shard on a 1-D device mesh (the default: every rank in one shard group), the same on every rank, "
    "or DDP"
)


def fsdp2_module() -> type | None:
    """torch's ``FSDPModule`` (what ``fully_shard`` makes a module), ``None`` in a torch without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def _fsdp1_module() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def kind(model: nn.Module) -> str:
    """``"fsdp2"`` (``fully_shard`` at the root), ``"fsdp1"`` (``FullyShardedDataParallel``), else ``"ddp"``."""
    fsdp2, fsdp1 = fsdp2_module(), _fsdp1_module()
    if fsdp2 is not None and isinstance(model, fsdp2):
        return "fsdp2"
    if fsdp1 is not None and isinstance(model, fsdp1):
        return "fsdp1"
    return "ddp"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded (FSDP2 or FSDP1): it needs :func:`check_sharded`, not DDP's paths."""
    return kind(model) != "ddp"


def holds_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded or holds a sharded module (a LightningModule around FSDP2 layers)."""
    return any(is_sharded(m) for m in model.modules())


def _describe(model: nn.Module) -> dict[str, Any]:
    """This rank's sharding: the ``fully_shard`` modules and their meshes, or why it is refused."""
    if kind(model) == "fsdp1":
        return {"refused": f"{type(model).__name__} (FSDP1, torch.distributed.fsdp.FullyShardedDataParallel)"}
    fsdp2 = fsdp2_module()
    layout = [name or "<root>" for name, m in model.named_modules() if fsdp2 is not None and isinstance(m, fsdp2)]
    for name, p in model.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.ndim != 1:
            shape = tuple(mesh.shape)
            return {"refused": f"hybrid sharding (HSDP): parameter {name!r} is sharded on a {mesh.ndim}-D mesh {shape}"}
    return {"layout": layout}


def check_sharded(model: nn.Module, group: Any = None) -> None:
    """Check a sharded model on every rank at once: one all-gather, the same error everywhere.

    Refused: FSDP1, hybrid sharding (HSDP's replicas would each need their own shares), and a
    model sharded differently on different ranks (a hang, not an error).

    Raises:
        DistributedError: One line naming the rank and what works, on every rank.
    """
    mine = _describe(model)
    theirs = all_gather(mine, "comparing how the ranks shard the model", group)
    for r, item in enumerate(theirs):
        if "refused" in item:
            raise DistributedError(f"rank {r}: {item['refused']} is not supported; use {_WORKS}")
    differ = [r for r, item in enumerate(theirs) if item["layout"] != theirs[0]["layout"]]
    if differ:
        ours = {r: theirs[r]["layout"] for r in (0, differ[0])}
        raise DistributedError(
            f"ranks {differ} shard the model differently from rank 0 (fully_shard modules {ours}); "
            f"apply the same fully_shard calls on every rank ({_WORKS})"
        )


def rank_micro(plan: Plan, rank: int, sharded: bool) -> list[int]:
    """The micro-batches rank ``rank`` runs under ``plan``: the plan's, or for a sharded model :func:`_even_micro`'s."""
    return _even_micro(plan)[rank] if sharded else list(plan.micro_batches[rank])


def micro_for_rows(plan: Plan, rank: int, rows: int) -> list[int]:
    """Rank ``rank``'s micro-batches for a batch of ``rows`` rows of a sharded model: as many as every rank runs."""
    if rows == plan.sizes[rank]:
        return _even_micro(plan)[rank]
    return _cut_into(rows, max([1, *map(len, plan.micro_batches)]))


def _even_micro(plan: Plan) -> list[list[int]]:
    """Every rank's micro-batches for a sharded model: the plan's largest count, each no larger (so under any cap)."""
    count = max([1, *map(len, plan.micro_batches)])
    return [
        list(own) if count > 1 and len(own) == count else _cut_into(size, count)
        for size, own in zip(plan.sizes, plan.micro_batches)
    ]


def _cut_into(rows: int, count: int) -> list[int]:
    """``rows`` as ``count`` near-equal micro-batches, or one row each then a ``0`` (a filler) per missing one."""
    if count == 1:
        return [rows]
    return micro_sizes(rows, count) if rows >= count else [1] * rows + [0] * (count - rows)


def micro_pieces(batch: Any, sizes: Sequence[int], dim: int) -> Iterator[tuple[Any, int]]:
    """``batch`` cut into the real ``sizes``, then a zero share's stand-in for each ``0``; yields ``(piece, size)``."""
    start = 0
    for size in sizes:
        yield (narrow(batch, start, size, dim=dim) if size > 0 else stand_in_batch(batch, dim)), size
        start += size


def exchanged_total(local: int, model: nn.Module, group: Any, rank: int) -> int:
    """The step's global batch, every rank's count summed in the forward (collective, as FSDP2's forward is)."""
    count = torch.tensor([float(local)], dtype=torch.float64, device=_device(model))
    collective("exchanging the step's sample counts", lambda: dist.all_reduce(count, group=group), rank, group)
    return round(count.item())


def _device(model: nn.Module) -> torch.device:
    """The device of this rank's shards (what the process group's backend moves for it)."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        return local.device
    return torch.device("cpu")
