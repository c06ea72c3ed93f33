"""Group: the process group's rank and size, collectives that fail with one clear error."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..planning.plan import Plan

__all__ = ["DistributedError", "group_info", "collective", "all_gather", "verify_plan", "init_timeout"]


class DistributedError(RuntimeError):
    """Ranks disagree (versions, plans) or one of them died or hangs."""


def group_info(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group(...) first "
            "(torchrun sets the environment for it)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def collective(what: str, fn: Callable[[], Any], rank: int) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # gloo and NCCL report timeouts and dead peers as RuntimeError
        raise DistributedError(
            f"rank {rank}: {what} failed: {e}. Another rank died or hangs, or the process group's timeout "
            "(init_process_group(timeout=...)) ran out"
        ) from e


def all_gather(obj: Any, what: str, group: Any) -> list[Any]:
    rank, world = group_info(group)
    out: list[Any] = [None] * world
    collective(what, lambda: dist.all_gather_object(out, obj, group=group), rank)
    return out


def _plan_digest(p: Plan) -> str:
    payload = json.dumps({"devices": p.devices, "sizes": p.sizes, "batch": p.batch_size}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def verify_plan(p: Plan, group: Any = None) -> None:
    """Check that every rank holds the same plan; raise on all ranks if not.

    Raises:
        DistributedError: Naming the ranks whose plan differs from rank 0's.
    """
    digests = all_gather(_plan_digest(p), "comparing plans", group)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise DistributedError(
            f"ranks {bad} hold a different plan from rank 0; build the plan with "
            "hetsplit.distributed.plan(...) on every rank, or load the same plan file everywhere"
        )


def init_timeout(seconds: float) -> _dt.timedelta:
    """A process-group timeout (for ``init_process_group(timeout=...)``), validated."""
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return _dt.timedelta(seconds=seconds)
