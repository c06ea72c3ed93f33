"""Loaders: a user's DataLoader rebuilt on hetsplit's shares, the same way for Lightning, accelerate and the Trainer.

Each integration decides only which plan the loader follows, whether a last short global
batch is padded, and how it orders the data (the framework's seed); which loaders can
be rebuilt, which of their settings are kept and the rebuilding itself are here. The
Trainer's loaders are rebuilt by its accelerator (``HeteroAccelerator.prepare_data_loader``).
"""

from __future__ import annotations

import os
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
) -> DataLoader[Any]:
    """``loader`` rebuilt on this rank's shares of ``plan`` (:func:`hetsplit.distributed.data_loader`).

    The same dataset, ``collate_fn``, ``drop_last`` and :func:`carried_settings`; the
    order is ``shuffle`` with ``seed``, every rank cutting the same global batches.

    Args:
        loader: The user's loader (checked by :func:`check_loader` or :func:`lightning_order`).
        plan: The shares of its global batch.
        shuffle, seed, pad, num_replicas, rank, zero_share: As for :func:`hetsplit.distributed.data_loader`.
    """
    return hd.data_loader(
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


def shares_sampler(loader: DataLoader[Any]) -> HeteroDistributedSampler:
    """The :class:`~hetsplit.distributed.sampler.HeteroDistributedSampler` of a loader :func:`rebuilt_loader` made."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, HeteroDistributedSampler):
        raise TypeError(f"expected a loader rebuilt on hetsplit's shares, got batch_sampler {sampler!r}")
    return sampler


def check_loader(loader: DataLoader[Any], who: str = "HeteroAccelerator") -> None:
    """A loader ``who`` can rebuild on shares without changing what it means, else one clear error.

    Raises:
        ValueError: For an iterable dataset, no ``batch_size`` (a custom batch sampler), or a
            sampler other than random or sequential.
    """
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"{who} needs a map-style dataset (indexable, with a length), got the iterable "
            f"{type(loader.dataset).__name__}: wrap the data in a map-style Dataset"
        )
    if loader.batch_size is None:
        raise ValueError(
            f"{who} needs a DataLoader with batch_size, got batch_sampler="
            f"{type(loader.batch_sampler).__name__}: pass batch_size= (and shuffle=) instead of a batch sampler"
        )
    if not isinstance(loader.sampler, RandomSampler | SequentialSampler):
        raise ValueError(
            f"{who} replaces the loader's sampler with per-process shares and keeps only its order "
            f"(shuffled or sequential); got {type(loader.sampler).__name__}: use shuffle=True or False instead"
        )


def lightning_order(loader: object, stage: str, *, strict: bool, who: str) -> tuple[bool, int] | None:
    """Whether a loader Lightning hands a strategy shuffles, and with which seed (``None``: it cannot be rebuilt).

    The sampler Lightning may have put in (``DistributedSampler``, with its own shuffle
    and seed) or the user's ``RandomSampler``/``SequentialSampler`` only says whether to
    shuffle; the seed is otherwise ``$PL_GLOBAL_SEED`` (``seed_everything``).

    Args:
        loader: The loader Lightning hands the strategy.
        stage: ``"training"``, ``"validation"``, ... (for the message).
        strict: Raise when the loader cannot be sharded by index; else return ``None``.
        who: The strategy's class (named in the message).

    Raises:
        ValueError: With ``strict``, for anything but a ``DataLoader`` over a map-style
            dataset with ``batch_size`` and a random, sequential or plain distributed sampler.
    """
    problem = None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    shuffle = False
    if not isinstance(loader, DataLoader):
        problem = f"it is a {type(loader).__name__}, not a torch DataLoader; return a DataLoader"
    elif isinstance(loader.dataset, IterableDataset):
        problem = (
            f"its dataset {type(loader.dataset).__name__} is iterable; shares are cut by index, "
            "so use a map-style Dataset (with __getitem__ and __len__)"
        )
    elif loader.batch_size is None:
        problem = (
            "it has no batch_size (its batches come from a batch_sampler, or batch_size=None); the per-rank "
            "batch comes from the plan: pass batch_size= (and shuffle=) instead of a batch sampler"
        )
    elif isinstance(loader.sampler, RandomSampler):
        shuffle = True
    elif type(loader.sampler) is DistributedSampler:  # what Lightning puts in with use_distributed_sampler=True
        shuffle, seed = bool(loader.sampler.shuffle), int(loader.sampler.seed)
    elif not isinstance(loader.sampler, SequentialSampler):
        problem = (
            f"its sampler {type(loader.sampler).__name__} cannot be kept (hetsplit cuts every global batch by index "
            "and only shuffles or not): use shuffle=True/False, or weight the dataset itself"
        )
    if problem is not None:
        if strict:
            raise ValueError(f"{who} cannot shard the {stage} loader: {problem}")
        return None
    return shuffle, seed
