"""Same batch: every rank must cut its share out of the same global batch — a check across ranks.

One random number drawn on one rank alone (an evaluation on rank 0) and every later drawn
batch differs across ranks, silently; :func:`check_same_batch` compares fingerprints.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..tree import flatten
from ._group import DistributedError, all_gather, group_info

# The global batches compared across ranks: the first CHECK_FIRST, then every CHECK_EVERY-th
# (counted from 0 per process group, one per hd.local_batch call): one small all-gather each.
CHECK_FIRST = 10
CHECK_EVERY = 100

# Values of each tensor the fingerprint reads, evenly spaced: enough to cover every row of a
# batch of token ids, little enough that the check stays a small copy to the CPU.
_SAMPLED = 4096

# Per process group: how many global batches this process has cut (the group is kept so that
# a new group, whose id might be an old one's, starts from 0).
_COUNTS: dict[int, tuple[Any, int]] = {}


def fingerprint(batch: Any) -> str:
    """A short digest of ``batch``'s tensors: shapes and up to 4096 evenly spaced values each, hashed on the CPU.

    No sum whose rounding differs by device: a GPU rank and a CPU rank get the same digest.
    """
    digest = hashlib.sha256()
    for leaf in flatten(batch)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        digest.update(repr(tuple(leaf.shape)).encode())
        flat = leaf.detach().reshape(-1)
        if flat.numel() > _SAMPLED:
            flat = flat[torch.linspace(0, flat.numel() - 1, _SAMPLED, device=flat.device).long()]
        digest.update(flat.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_same_batch(batch: Any, group: Any = None) -> None:
    """On a checked global batch, compare its fingerprint across ranks (collective: every rank, every batch).

    Raises:
        DistributedError: On every rank, naming the batch and the ranks whose batch differs from rank 0's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = group_info(group)
    if world < 2:
        return
    pg = group if group is not None else dist.group.WORLD
    held, count = _COUNTS.get(id(pg), (pg, 0))
    count = count if held is pg else 0
    _COUNTS[id(pg)] = (pg, count + 1)
    if count >= CHECK_FIRST and count % CHECK_EVERY:
        return
    prints = all_gather(fingerprint(batch), "comparing global batches", group, step=count)
    bad = [r for r, p in enumerate(prints) if p != prints[0]]
    if bad:
        raise DistributedError(
            f"rank {rank}: global batch {count} differs across ranks (ranks {bad} hold another batch than rank 0): "
            "the ranks' random generators drifted apart, most likely something drew random numbers on some ranks "
            "only (an evaluation on rank 0 drawing batches); draw training batches with "
            "hd.shared_batch(get_batch, ..., plan=plan), or make every rank draw the same",
            step=count,
        )
