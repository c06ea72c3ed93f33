"""Same batch: every rank must cut its share out of the same global batch — a shared random stream, and a check.

A script that draws its own global batches (nanoGPT's ``get_batch``: random rows from
torch's generator) gets the same batch on every rank only while the ranks' generators
stay in step; one random number drawn on one rank alone (an evaluation on rank 0) and
every later batch differs, and the ranks train on rows nobody planned, silently.
:func:`shared_batch` draws from a stream of its own that only training draws use, and
:func:`check_same_batch` (run by :func:`~hetsplit.distributed.local_batch`) compares a
fingerprint of the global batch across ranks on the first :data:`CHECK_FIRST` batches and
every :data:`CHECK_EVERY`-th after.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..planning.plan import Plan
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
    """A short digest of ``batch``'s tensors: their shapes and up to 4096 evenly spaced values each, as float64.

    The values go to the CPU before they are hashed, so a rank on a GPU and a rank on the
    CPU holding the same batch get the same digest (no sum whose rounding differs by device).
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
    """On a checked global batch, compare its fingerprint across ranks; raise on every rank if they differ.

    Every rank must call it for every global batch (it is collective on the checked ones).

    Raises:
        DistributedError: On every rank, naming the batch (counted from 0) and the ranks
            whose batch differs from rank 0's.
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


# The shared stream's state, per seed: torch's CPU generator as it stands between training draws.
_STREAMS: dict[int, torch.Tensor] = {}


def shared_batch(
    draw: Callable[..., Any], *args: Any, plan: Plan | None, seed: int = 0, dim: int = 0, group: Any = None
) -> Any:
    """``draw(*args)``, the global batch, drawn from a random stream every rank shares; this rank's rows of it.

    While ``draw`` runs, torch's CPU generator (``torch.randint``, ``torch.randperm``, ...
    without ``generator=`` or a CUDA ``device=``) is swapped for a stream seeded with ``seed``
    that only these calls advance: every rank draws the same global batch, whatever else
    draws random numbers on some ranks only (an evaluation on rank 0, dropout). The
    generator is given back as it was. Then :func:`~hetsplit.distributed.local_batch` cuts
    this rank's rows and checks that every rank drew the same batch. A draw that uses
    another generator (NumPy's, Python's ``random``, a CUDA one) is not covered: the check
    then names the batch where the ranks differ. Without a plan (a one-process run) the
    whole batch comes back, drawn from the same stream, so a run of one process draws the
    batches a run of several does.

    Args:
        draw: Makes one global batch of ``plan.batch_size`` rows (nanoGPT's ``get_batch``).
        *args: Passed to ``draw`` (``"train"``).
        plan: The plan every rank holds, or ``None`` (one process: nothing cut, nothing checked).
        seed: The stream's seed, the same on every rank.
        dim: The batch dimension.
        group: The process group.

    Returns:
        This rank's rows of the global batch (the whole batch without a plan).

    Raises:
        DistributedError: On every rank, if the ranks drew different batches (a checked batch).
        ValueError: As :func:`~hetsplit.distributed.local_batch`.

    Example:
        >>> X, Y = hd.shared_batch(get_batch, "train", plan=plan)
    """
    from .sampler import local_batch  # sampler imports this module

    mine = torch.get_rng_state()
    stream = _STREAMS.get(seed)
    torch.set_rng_state(stream if stream is not None else torch.Generator().manual_seed(seed).get_state())
    try:
        batch = draw(*args)
    finally:
        _STREAMS[seed] = torch.get_rng_state()
        torch.set_rng_state(mine)
    return batch if plan is None else local_batch(batch, plan, dim=dim, group=group)
