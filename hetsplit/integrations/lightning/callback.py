"""The strategy's callback: each epoch's shuffle for the shares, and the rebalancer around each batch."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import lightning.pytorch as pl
from typing_extensions import override

import hetsplit.distributed as hd
from hetsplit.distributed.sampler import HeteroDistributedSampler


class Driven(Protocol):
    """What the callback drives (:class:`~.strategy.HeteroStrategy` has it)."""

    @property
    def train_sampler(self) -> HeteroDistributedSampler | None: ...

    @property
    def rebalancer(self) -> hd.DistributedRebalancer | None: ...

    def count_samples(self) -> None: ...

    def batch_started(self, index: int, dataloader_idx: int = 0) -> None: ...

    def training_paused(self) -> None: ...

    def training_ended(self) -> None: ...


class HeteroCallback(pl.Callback):
    """Installed by every hetsplit strategy: each epoch's shuffle for the shares, and the rebalancer around each batch.

    Lightning calls ``set_epoch`` on a loader's ``sampler`` and ``batch_sampler.sampler``
    only, not on a batch sampler itself, so the strategy's batch sampler gets its epoch
    here. With ``rebalance=K`` every training batch (forward, backward, optimizer step)
    runs inside :meth:`hetsplit.distributed.DistributedRebalancer.step`.

    Args:
        strategy: The strategy whose sampler and rebalancer to drive.
    """

    def __init__(self, strategy: Driven) -> None:
        self.strategy = strategy
        self._steps = contextlib.ExitStack()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Say the measured step beside the predicted one (rank 0)."""
        self.strategy.training_ended()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An epoch ended: the time until the next epoch's first step is no step's (the split report)."""
        self.strategy.training_paused()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Shuffle the shares of this epoch (the same order on every rank); count its samples afresh."""
        self.strategy.count_samples()
        if self.strategy.train_sampler is not None:
            self.strategy.train_sampler.set_epoch(trainer.current_epoch)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Tell the strategy which batch runs; open the rebalancer's step."""
        self.strategy.batch_started(batch_idx)
        if self.strategy.rebalancer is not None:
            self._steps.enter_context(self.strategy.rebalancer.step())

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Tell the strategy which batch of which loader runs (a step may take no ``batch_idx``)."""
        self.strategy.batch_started(batch_idx, dataloader_idx)

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """As :meth:`on_validation_batch_start`."""
        self.strategy.batch_started(batch_idx, dataloader_idx)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the step: its time is recorded; every K steps the ranks exchange times."""
        self._steps.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Drop an open step without exchanging (a failed rank must not wait for the others)."""
        self._steps.pop_all()
