"""Loaders: a user's DataLoader rebuilt on hetsplit's shares, the same way for Lightning, accelerate and the Trainer.

Each integration decides only the plan, the padding of a last short global batch, and the order's seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

import hetsplit.distributed as hd
from hetsplit.distributed.sampler import HeteroDistributedSampler
from hetsplit.planning import Plan

# DataLoader settings a rebuilt loader keeps from the user's (the sampler, batch size and
# drop_last are hetsplit's; collate_fn is passed on its own, as the zero share needs it).
CARRIED = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def carried_settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """The settings of ``loader`` a loader rebuilt on hetsplit's shares keeps (:data:`CARRIED`)."""
    carried = {k: getattr(loader, k) for k in CARRIED if hasattr(loader, k)}
    if carried.get("num_workers", 0) > 0:
        carried["prefetch_factor"] = loader.prefetch_factor
    else:  # DataLoader refuses these without workers
        carried.pop("persistent_workers", None)
    return carried


def rebuilt_loader(
    loader: DataLoader[Any],
    plan: Plan,
    *,
    shuffle: bool,
    seed: int,
    pad: bool,
    num_replicas: int,
    rank: int,
    zero_share: str = "sample",
    make: Callable[..., DataLoader[Any]] | None = None,
) -> DataLoader[Any]:
    """``loader`` rebuilt on this rank's shares of ``plan`` (:func:`hetsplit.distributed.data_loader`): the one re-cut.

    The same dataset, ``collate_fn``, ``drop_last`` and :func:`carried_settings`. ``make`` is the
    framework's loader class over the shares (accelerate's ``SharesLoader``); default: hetsplit's own.
    """
    shares = hd.data_loader(
        loader.dataset,
        plan,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
        pad=pad,
        zero_share=zero_share,
        num_replicas=num_replicas,
        rank=rank,
        collate_fn=loader.collate_fn,
        **carried_settings(loader),
    )
    if make is None:
        return shares
    return make(
        shares.dataset, batch_sampler=shares.batch_sampler, collate_fn=shares.collate_fn, **carried_settings(loader)
    )


def shares_sampler(loader: DataLoader[Any]) -> HeteroDistributedSampler:
    """The :class:`~hetsplit.distributed.sampler.HeteroDistributedSampler` of a loader :func:`rebuilt_loader` made."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, HeteroDistributedSampler):
        raise TypeError(f"expected a loader rebuilt on hetsplit's shares, got batch_sampler {sampler!r}")
    return sampler


def check_loader(loader: object, who: str, stage: str = "") -> None:
    """A loader ``who`` can rebuild on shares without changing what it means, else one clear error.

    Raises:
        ValueError: For anything but a ``DataLoader`` over a map-style dataset with
            ``batch_size`` and a random or sequential sampler.
    """
    problem = _problem(loader, distributed=False)
    if problem is not None:
        raise ValueError(_refusal(who, stage, problem))


def lightning_order(loader: object, stage: str, *, strict: bool, who: str) -> tuple[bool, int] | None:
    """Whether a loader Lightning hands a strategy shuffles, and with which seed (``None``: it cannot be rebuilt).

    Checked as :func:`check_loader` checks one, except that it may hold Lightning's ``DistributedSampler``
    (its shuffle and seed kept); else the seed is ``$PL_GLOBAL_SEED`` (``seed_everything``).

    Raises:
        ValueError: With ``strict``, as :func:`check_loader`.
    """
    problem = _problem(loader, distributed=True)
    if problem is not None:
        if strict:
            raise ValueError(_refusal(who, stage, problem))
        return None
    assert isinstance(loader, DataLoader)  # _problem said so
    if type(loader.sampler) is DistributedSampler:  # what Lightning puts in with use_distributed_sampler=True
        return bool(loader.sampler.shuffle), int(loader.sampler.seed)
    return isinstance(loader.sampler, RandomSampler), int(os.environ.get("PL_GLOBAL_SEED", 0))


def _problem(loader: object, *, distributed: bool) -> str | None:
    """Why ``loader`` cannot be rebuilt on shares (``None``: it can); ``distributed``: Lightning's sampler may stay."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch DataLoader; return a DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"its dataset {type(loader.dataset).__name__} is iterable, and shares are cut by index: use a map-style "
            "dataset (indexable, with __getitem__ and __len__)"
        )
    if loader.batch_size is None:
        return (
            f"it has no batch_size (its batches come from batch_sampler={type(loader.batch_sampler).__name__}, or "
            "batch_size=None) and the per-process batch comes from the plan: pass batch_size= (and shuffle=) "
            "instead of a batch sampler"
        )
    kept = isinstance(loader.sampler, RandomSampler | SequentialSampler)
    if not kept and not (distributed and type(loader.sampler) is DistributedSampler):
        return (
            f"its sampler {type(loader.sampler).__name__} cannot be kept (hetsplit replaces the sampler with "
            "per-process shares, cutting every global batch by index, and keeps only whether it shuffles): use "
            "shuffle=True or False, or weight the dataset itself"
        )
    return None


def _refusal(who: str, stage: str, problem: str) -> str:
    return f"{who} cannot shard the {stage + ' ' if stage else ''}loader: {problem}"
