"""Lightning steps: which sampler a batch came from, evaluation loaders, each step's weights (gradients, logs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

import hetsplit.distributed as hd
from hetsplit.distributed.sampler import HeteroBatchSampler
from hetsplit.planning import plan_from_sizes

from .lightning_micro import LOG_SIGNATURE, log_replaced
from .lightning_parts import loader_settings


def step_sampler(strategy: Any, dataloader_idx: int) -> HeteroBatchSampler | None:
    """The hetsplit sampler of the loader the running step's batch comes from, if it has one.

    Evaluation loaders are found where Lightning keeps what ``process_dataloader``
    returned, in order (each loop's combined loader), by the step's ``dataloader_idx``.
    """
    trainer = strategy.lightning_module.trainer
    if trainer.state.stage == RunningStage.TRAINING:
        return strategy.train_sampler
    loop = {
        TrainerFn.FITTING: trainer.fit_loop.epoch_loop.val_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
    }.get(trainer.state.fn)
    combined = getattr(loop, "_combined_loader", None)
    loaders = combined.flattened if combined is not None else []
    loader = loaders[dataloader_idx] if 0 <= dataloader_idx < len(loaders) else None
    sampler = getattr(loader, "batch_sampler", None)
    return sampler if isinstance(sampler, HeteroBatchSampler) else None


def eval_loader(strategy: Any, loader: Any, trainer: pl.Trainer) -> Any:
    """A validation or test loader rebuilt on shares of world × its ``batch_size`` in the plan's proportions.

    Nothing is added: the last batch is what is left, cut in proportion (a padded row
    would count twice in the logged metrics). A loader that cannot be rebuilt is
    returned as it is.
    """
    settings = loader_settings(loader, str(trainer.state.stage), strict=False)
    if settings is None:
        return loader
    shuffle, seed, kwargs = settings
    total = strategy.world_size * loader.batch_size
    if strategy._plan is None and strategy.profile is not None and trainer.state.fn != TrainerFn.FITTING:
        strategy._plan = hd.plan(
            strategy.lightning_module, None, total, device=strategy.rank_device, profile=strategy.profile, calibrate=0
        )
    new = hd.data_loader(
        loader.dataset, strategy._eval_plan(total), shuffle=shuffle, seed=seed, drop_last=loader.drop_last,
        pad=False, num_replicas=strategy.world_size, rank=strategy.global_rank, **kwargs,
    )  # fmt: skip
    strategy._eval_samplers[new.batch_sampler] = total
    return new


def weigh_step(strategy: Any, index: Any) -> None:
    """Weight this step's gradients by every rank's rows in it (a short last global batch), else by the plan.

    Set before the step's forward and kept through its backward (the comm hook reads it
    there); every rank computes the same sizes from the same sampler state. Only where
    the sizes change (an epoch's last step and the one after) is the weighting reset.
    """
    sampler, gradients, plan = strategy.train_sampler, strategy.gradients, strategy.plan
    if sampler is None or gradients is None or plan is None or strategy.rebalancer is not None:
        return
    sizes = sampler.step_sizes(index) if isinstance(index, int) else list(plan.sizes)
    if sizes != strategy._weighted:
        gradients.set_plan(plan if sizes == list(plan.sizes) else plan_from_sizes(None, strategy._labels, sizes))
        strategy._weighted = sizes


@contextlib.contextmanager
def stand_in_logging(module: pl.LightningModule, rows: int) -> Iterator[None]:
    """``self.log`` in a zero share's stand-in step: nothing in what is synced, the rank's own mean elsewhere.

    A value logged with ``sync_dist=True`` counts for nothing (batch size 0: each real
    sample once across ranks). One logged without it is this rank's own, as under plain
    DDP, where each rank means over what it ran: here the ``rows`` stand-in samples, so a
    rank that holds no real sample never logs NaN (0 of 0) into what the user monitors
    (``EarlyStopping(monitor=...)`` on every rank).
    """
    plain = module.log

    def log(*args: Any, **kwargs: Any) -> None:
        options = dict(LOG_SIGNATURE.bind(module, *args, **kwargs).arguments)
        options.pop("self", None)
        if options.get("sync_dist", False):
            options["batch_size"] = 0
        elif options.get("batch_size") is None:
            options["batch_size"] = rows
        plain(**options)

    with log_replaced(module, log):
        yield
