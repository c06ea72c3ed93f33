"""Dtypes: every rank's parameters and batch in the same dtypes, checked before DDP or FSDP2 move them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..tree import flatten
from ._group import DistributedError, all_gather


def verify_dtypes(model: torch.nn.Module | None, batch: Any = None, group: Any = None) -> None:
    """Check that every rank's floating parameters and batch have the same dtypes; raise on all ranks if not.

    A float64 rank beside a float32 one aborts a process inside gloo (signal 6) or hangs.

    Raises:
        DistributedError: Naming each rank's dtypes and what to do.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return

    def kinds(tensors: Any) -> str:
        names = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if torch.is_floating_point(t)})
        return "+".join(names) or "-"

    params = model.parameters() if model is not None else ()
    leaves = flatten(batch)[0] if batch is not None else []
    mine = (kinds(params), kinds(x for x in leaves if isinstance(x, torch.Tensor)))
    every = [tuple(d) for d in all_gather(mine, "comparing dtypes", group)]
    if len(set(every)) > 1:
        said = "; ".join(f"rank {r}: parameters {p}, batch {b}" for r, (p, b) in enumerate(every))
        raise DistributedError(
            f"the ranks hold tensors of different dtypes ({said}); DDP and FSDP2 move them as bytes of one "
            "size and would abort or hang: use one dtype on every rank (e.g. model.double() and float64 batches "
            "everywhere)"
        )
