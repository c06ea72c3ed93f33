"""The loader HeteroAccelerator prepares: accelerate's DataLoaderShard over hetsplit's shares, and its epochs.

Its epoch is kept in a checkpoint, so a resumed run draws the orders the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import DataLoaderShard
from torch.utils.data import DataLoader

from hetsplit.distributed.sampler import HeteroDistributedSampler
from hetsplit.tree import samples_in


# accelerate ships no type information: its classes are Any to mypy.
class SharesLoader(DataLoaderShard):  # type: ignore[misc]
    """accelerate's ``DataLoaderShard`` over hetsplit's shares, knowing what each yielded batch holds.

    Attributes:
        current_samples: The samples of the current batch the gradient weighting counts
            (0 for a zero share's stand-in), ``None`` outside a loop.
        origin: The loader this one was cut from by ``skip_first_batches``: its epoch
            counter moves on with this one's, so the next epoch draws the next order.
        step_context: Makes the context each batch is handed out in, from its yield to the next.
        pass_ended: Called when a pass over the loader ends.
    """

    current_samples: int | None = None
    origin: SharesLoader | None = None
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    pass_ended: Callable[[], None] | None = None
    _index: int = 0  # the current batch's index from the epoch's first (skipped ones included)
    _rows: int = 0  # its rows

    @property
    def shares(self) -> HeteroDistributedSampler:
        """The batch sampler that cuts every global batch into the plan's shares."""
        sampler = self.batch_sampler
        assert isinstance(sampler, HeteroDistributedSampler), "made over hetsplit's shares"
        return sampler

    @property
    def rows(self) -> int:
        """This process's rows in the current batch (padding and a zero share's stand-in included)."""
        return self._rows

    def __iter__(self) -> Iterator[Any]:
        self._index = self.skip_batches - 1
        for batch in super().__iter__():
            self._index += 1
            self._rows = samples_in(batch) or 0
            self.current_samples = 0 if self.shares.is_filler(self._index) else self._rows
            with self.step_context() if self.step_context is not None else contextlib.nullcontext():
                yield batch
        self.current_samples = None
        if self.origin is not None:
            self.origin.iteration = max(self.origin.iteration, self.iteration)
        if self.pass_ended is not None:
            self.pass_ended()

    def real_rows(self) -> int:
        """This process's rows of the current batch that are data counted once (no padding, no zero-share stand-in)."""
        return min(self._rows, self.shares.real_rows(self._index))

    def padded(self) -> bool:
        """Whether the current global batch holds padding on some process (the same answer on every one)."""
        return self.shares.padded(self._index)

    def resumed(self, skip: int, **settings: Any) -> SharesLoader:
        """This loader from its ``skip``-th batch on (resuming mid-epoch): the same shares, order and epoch."""
        loader = SharesLoader(
            self.dataset,
            device=self.device,
            batch_sampler=self.batch_sampler,
            collate_fn=self.collate_fn,
            skip_batches=skip,
            iteration=self.iteration,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            **settings,
        )
        loader.origin, loader.step_context, loader.pass_ended = self, self.step_context, self.pass_ended
        loader._is_accelerate_prepared = True
        return loader

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps: the epoch counter (the shuffle of epoch ``e`` is ``seed + e``)."""
        return {"iteration": int(self.iteration)}


def shuffle_seed(loader: DataLoader[Any], data_seed: int | None, processes: int) -> int:
    """The seed every process shuffles with: ``data_seed``, else process 0's (its loader's generator or torch's)."""
    if data_seed is not None:
        return int(data_seed)
    generator = getattr(loader, "generator", None) or getattr(loader.sampler, "generator", None)
    seed = [int(generator.initial_seed()) if generator is not None else int(torch.initial_seed())]
    if processes > 1:
        dist.broadcast_object_list(seed, src=0)
    return seed[0] % (1 << 63)


# The file beside accelerate's checkpoint that keeps each prepared loader's epoch.
LOADERS_FILE = "hetsplit_loaders.json"


def save_epochs(loaders: list[Any], location: str) -> None:
    """Write each :class:`SharesLoader`'s epoch counter beside the checkpoint at ``location``."""
    states = [loader.state() for loader in loaders if isinstance(loader, SharesLoader)]
    (Path(location) / LOADERS_FILE).write_text(json.dumps(states))


def load_epochs(loaders: list[Any], location: str) -> None:
    """Give each :class:`SharesLoader` the epoch saved at ``location`` (nothing for a checkpoint without it)."""
    saved = Path(location) / LOADERS_FILE
    if not saved.exists():  # a checkpoint of accelerate's own, or from before hetsplit kept it
        return
    mine = [loader for loader in loaders if isinstance(loader, SharesLoader)]
    for loader, state in zip(mine, json.loads(saved.read_text())):
        loader.iteration = int(state["iteration"])
