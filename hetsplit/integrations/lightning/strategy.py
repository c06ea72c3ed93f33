"""The strategy base: what every hetsplit Lightning strategy does, whatever synchronises the gradients.

Its subclasses (:mod:`.ddp`, :mod:`.model_parallel`) say how the gradients are weighted and how one micro-batch runs.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor, nn
from typing_extensions import override

import hetsplit.distributed as hd
from hetsplit.devices import Device, parse_device
from hetsplit.distributed.comm_hooks import WeightingState
from hetsplit.distributed.sampler import HeteroDistributedSampler
from hetsplit.distributed.setup import ENV_DEVICES
from hetsplit.distributed.sharded import is_sharded
from hetsplit.planning import Plan, plan_from_sizes
from hetsplit.tree import samples_in

from .. import core
from ..collectives import op_name, weighted_reduce
from ..loaders import lightning_order, rebuilt_loader, shares_sampler
from ..options import HeteroOptions
from .checks import check_micro_plan, rank_devices
from .logs import stand_in_logging
from .micro_batches import GradientsAside, run_training_step, share_micro_batches
from .profiling import profiled_plan


class HeteroStrategy(ParallelStrategy):
    """What every hetsplit Lightning strategy does, whatever synchronises the gradients.

    A strategy is ``class S(HeteroStrategy, DDPStrategy)``: this class's hooks come first and
    their ``super()`` calls reach the Lightning strategy's; a subclass defines :meth:`weighted_model`,
    :meth:`micro_model` and :meth:`run_micro_batch`.

    Its arguments are the subclasses' (:class:`~.ddp.HeteroDDPStrategy`).
    """

    who: ClassVar[str] = "HeteroStrategy"  # the class the user made, named in every message
    weightings: ClassVar[tuple[str, ...]] = ("hook", "outputs")  # the weightings the subclass offers

    if TYPE_CHECKING:  # what DDPStrategy and ModelParallelStrategy both have, and ParallelStrategy not
        num_nodes: int

        @property
        def num_processes(self) -> int: ...

        def set_world_ranks(self) -> None: ...

    def __init__(self, *, weighting: str, options: HeteroOptions | None = None, **strategy_kwargs: Any) -> None:
        options = HeteroOptions.take(self.who, options, strategy_kwargs)
        options.check(self.who, weighting, self.weightings)
        self.check_arguments(weighting, strategy_kwargs)
        self._rank_device: Device | None = None  # before super(): root_device reads it
        super().__init__(**strategy_kwargs)
        self.options = options
        self.device_list = options.device_list
        self.weighting, self.rebalance, self.global_batch_size = weighting, options.rebalance, options.global_batch_size
        self.profile, self.plan_kwargs, self.quiet = options.profile, options.plan_arguments, options.quiet
        self._plan = options.plan
        self._labels: list[str] = []
        self.gradients: WeightingState | None = None
        self.rebalancer: hd.DistributedRebalancer | None = None
        self.train_sampler: HeteroDistributedSampler | None = None
        self._eval_samplers: weakref.WeakKeyDictionary[HeteroDistributedSampler, int] = weakref.WeakKeyDictionary()
        self._samples: int | None = None  # this rank's samples in the step running now
        # The running batch's index and loader, as Lightning's loops number them (the step
        # hooks may take no batch_idx: Lightning passes only what their signature names).
        self._batch_index: int | None = None
        self._dataloader_idx = 0
        self._weighted: list[int] | None = None  # every rank's rows the gradients are weighted by now
        self._seen: dict[Any, int] = {}  # per stage: this rank's samples since its metrics were last reset
        self._callback = HeteroCallback(self)
        self._report: core.SplitReport | None = None  # made with the ranks known (setup)
        self.aside = GradientsAside()  # a micro-batched step's gradients, until Lightning's backward
        # Per-step questions, answered once: the throttle (with the device), whether the memory is capped,
        # the micro-batches of the plan in force, and the epoch's stand-ins and short batches (_EpochSteps).
        self._throttled: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self._memory_capped = False
        self._micro: tuple[Plan | None, list[int] | None] = (None, None)
        self._epoch = _EpochSteps()

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # Lightning pickles the strategy to spawn ranks
        state["_eval_samplers"] = None  # weak references do not pickle; samplers belong to one process
        return state

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._eval_samplers = weakref.WeakKeyDictionary()

    @property
    def plan(self) -> Plan | None:
        """The plan in force (the rebalancer's current one when rebalancing)."""
        return self.rebalancer.plan if self.rebalancer is not None else self._plan

    @property
    def rank_device(self) -> Device | None:
        """This rank's hetsplit device (known once the environment is set up)."""
        return self._rank_device

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule (attached before any hook that reads it runs)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{self.who} has no LightningModule yet: pass the strategy to a Trainer and fit")
        return module

    @property
    @override
    def root_device(self) -> torch.device:
        """The device this rank's model and batches live on: its entry in the device list."""
        if self._rank_device is not None:
            return self._rank_device.torch_device
        return self._lightning_root_device()

    def _lightning_root_device(self) -> torch.device:
        """The device the Lightning strategy would put this rank on (its accelerator's, by local rank)."""
        # super() reaches DDPStrategy or ModelParallelStrategy (after this class in the MRO), whose
        # root_device is concrete; mypy sees only ParallelStrategy's abstract one.
        device: torch.device = super().root_device  # type: ignore[safe-super]
        return device

    # ------------------------------------------------------------------ what a subclass says
    def check_arguments(self, weighting: str, strategy_kwargs: dict[str, Any]) -> None:
        """Refuse the Lightning strategy's arguments that cannot run with ``weighting`` (before any work)."""

    def weighted_model(self) -> nn.Module | None:
        """The module whose gradients :func:`hetsplit.distributed.weight_gradients` weights (``None``: not yet)."""
        raise NotImplementedError

    def micro_model(self) -> nn.Module:
        """The module :func:`hetsplit.distributed.micro_batches` synchronises once per step (DDP, or FSDP2's root)."""
        raise NotImplementedError

    def run_micro_batch(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one micro-batch's ``training_step`` (``call``) where the weighting sees it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        """Check the device list (and plan) against the world, on every rank, then join the process group."""
        self.set_world_ranks()
        self.check_devices()
        super().setup_environment()
        if self.world_size > 1:  # whatever the entry point (fit, validate, test, predict)
            hd.drain_at_exit()  # at exit, let gloo's workers finish with the last collective first

    def check_devices(self) -> None:
        """Find this rank's device in the device list, checked against the world on every rank.

        Raises:
            ValueError: As :func:`~.checks.rank_devices`, or for a plan for another world size.
        """
        spec = self.device_list or os.environ.get(ENV_DEVICES)
        if not spec:  # the Trainer's own devices, on every node
            spec = ",".join([str(d) for d in (self.parallel_devices or [])] * self.num_nodes)
        first = self.node_rank * self.num_processes
        here = range(first, first + self.num_processes)
        names = rank_devices(spec, self.world_size, self._lightning_root_device().type, here, who=self.who)
        core.check_plan(self.who, self._plan, self.world_size)
        self._rank_device = device = parse_device(names[self.global_rank])
        self._labels = core.labels(names)
        self._throttled = core.throttler(device)  # waits for other ranks are not slowed
        self._memory_capped = device.max_batch is not None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Install the strategy's callback (epochs, rebalancing), then set up as the Lightning strategy does."""
        # Set by Lightning's callback connector when the Trainer is made, not declared on the class.
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self._callback not in callbacks:
            callbacks.append(self._callback)
        self._report = core.SplitReport(self.who, self.global_rank, self.quiet)
        super().setup(trainer)

    def weight(self) -> None:
        """Weight the gradients by the plan's shares, once the plan and the model to weight both exist."""
        model = self.weighted_model()
        if self.gradients is None and self._plan is not None and model is not None:
            self.gradients = hd.weight_gradients(model, self._plan, method=self.weighting)
            self._weighted = list(self._plan.sizes)  # the sizes the gradients are weighted by

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Rebuild a training or evaluation loader on hetsplit's shares (predict loaders are left alone)."""
        trainer = self.module.trainer
        if trainer.state.fn == TrainerFn.PREDICTING:
            return dataloader
        if trainer.state.stage == RunningStage.TRAINING:
            return self._train_loader(dataloader)
        return self._eval_loader(dataloader, trainer)

    def _train_loader(self, loader: Any) -> Any:
        order = lightning_order(loader, "training", strict=True, who=self.who)
        assert order is not None  # strict: raised otherwise
        shuffle, seed = order
        if self._plan is None:
            batch = self.global_batch_size or self.world_size * loader.batch_size
            self._plan = self._profiled_plan(loader, batch)
        plan = self._plan if self.rebalancer is None else self.rebalancer.plan
        check_micro_plan(plan, self.module, self.rebalance, who=self.who)  # every rank, before any step
        # A last global batch short of B is served as it is, cut in the plan's proportions and each
        # rank's gradient weighted by its rows in it (_weigh_step). Rebalancing, micro-batches and
        # gradient accumulation weight by the plan's whole shares: those keep the padding.
        whole = all(len(parts) <= 1 for parts in plan.micro_batches)
        pad = bool(self.rebalance) or not whole or self.module.trainer.accumulate_grad_batches != 1
        new = rebuilt_loader(
            loader, plan, shuffle=shuffle, seed=seed, pad=pad, num_replicas=self.world_size, rank=self.global_rank
        )
        self.train_sampler = shares_sampler(new)
        # The fit loop makes the loader's iterator before on_train_epoch_start (the callback's
        # set_epoch), and with workers the iterator already draws the first indices: a fit
        # resumed at epoch e must start from e's order.
        self.epoch_started(self.module.trainer.current_epoch)
        self._micro = (None, None)
        self.weight()
        policy = self.rebalancer.rebalancer if self.rebalancer is not None else self.rebalance  # a reloaded loader
        self.rebalancer = core.rebalancer(
            plan, policy, sampler=self.train_sampler, gradients=self.gradients, model=self.model,
            device=self._rank_device,
        )  # fmt: skip
        return new

    def _profiled_plan(self, loader: Any, batch_size: int) -> Plan:
        """Profile the LightningModule's step on this rank's device on a batch of ``loader``; rank 0 solves."""
        return profiled_plan(
            self.module,
            self.precision_plugin.train_step_context,
            loader,
            batch_size,
            who=self.who,
            root=self.root_device,
            device=self._rank_device,
            profile=self.profile,
            plan_kwargs=self.plan_kwargs,
        )

    def _eval_loader(self, loader: Any, trainer: pl.Trainer) -> Any:
        """A validation or test loader rebuilt on shares of world × its ``batch_size`` in the plan's proportions.

        Nothing is added (a padded row would count twice in the logged metrics); a loader that cannot be
        rebuilt is returned as it is.
        """
        order = lightning_order(loader, str(trainer.state.stage), strict=False, who=self.who)
        if order is None:
            return loader
        shuffle, seed = order
        total = self.world_size * loader.batch_size
        if self._plan is None and self.profile is not None and trainer.state.fn != TrainerFn.FITTING:
            self._plan = hd.plan(self.module, None, total, device=self._rank_device, profile=self.profile, calibrate=0)
        new = rebuilt_loader(
            loader, self._eval_plan(total), shuffle=shuffle, seed=seed, pad=False, num_replicas=self.world_size,
            rank=self.global_rank,
        )  # fmt: skip
        self._eval_samplers[shares_sampler(new)] = total
        return new

    @override
    def on_validation_start(self) -> None:
        """Evaluation shares follow the plan in force (made after the sanity check, or rebalanced)."""
        super().on_validation_start()
        self.training_paused()  # mid-epoch (val_check_interval) too: the evaluation is no step's time
        self._follow_plan()
        self.count_samples()

    @override
    def on_test_start(self) -> None:
        """As :meth:`on_validation_start`."""
        super().on_test_start()
        self._follow_plan()
        self.count_samples()

    def _follow_plan(self) -> None:
        for sampler, total in list(self._eval_samplers.items()):
            new = self._eval_plan(total)
            if sampler.plan_at(sampler.yielded).sizes != new.sizes:  # from this rank's next step, as on every rank
                sampler.set_plan(new, sampler.yielded)

    def _eval_plan(self, total: int) -> Plan:
        """Shares of an evaluation batch of ``total`` in the plan's proportions (even without a plan)."""
        return core.shares_for(self.plan, total, self._labels)

    def _step_sampler(self) -> HeteroDistributedSampler | None:
        """The hetsplit sampler of the loader the running step's batch comes from, if it has one."""
        trainer = self.module.trainer
        if trainer.state.stage == RunningStage.TRAINING:
            return self.train_sampler
        loops = {
            TrainerFn.FITTING: trainer.fit_loop.epoch_loop.val_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
        }
        loop = loops.get(trainer.state.fn) if trainer.state.fn is not None else None
        # Lightning's loops keep their combined loader private; read where it is, without failing if it moves.
        combined = getattr(loop, "_combined_loader", None)
        loaders = combined.flattened if combined is not None else []
        index = self._dataloader_idx
        loader = loaders[index] if 0 <= index < len(loaders) else None
        sampler = getattr(loader, "batch_sampler", None)
        return sampler if isinstance(sampler, HeteroDistributedSampler) else None

    # ------------------------------------------------------------------ steps
    def batch_started(self, index: int, dataloader_idx: int = 0) -> None:
        """Lightning starts batch ``index`` of loader ``dataloader_idx`` (the strategy's callback says so)."""
        self._batch_index, self._dataloader_idx = index, dataloader_idx
        trainer = self.module.trainer
        if self._report is not None and trainer.state.stage == RunningStage.TRAINING:
            # A step is an optimizer step: Lightning accumulates `accumulate_grad_batches` batches
            # into each, from the epoch's first (its last may have fewer).
            if index % max(int(trainer.accumulate_grad_batches), 1) == 0:
                self._report.step(self.plan, self._labels)
            self._report.batch()

    def training_paused(self) -> None:
        """Training stops for a while (an epoch ended, an evaluation runs): the time until the next step is untimed."""
        if self._report is not None:
            self._report.pause()

    def training_ended(self) -> None:
        """Training ended: the measured step beside the predicted one (rank 0, one line)."""
        if self._report is not None:
            self._report.end(self.plan)

    def _weigh_step(self) -> None:
        """Weight this step's gradients by every rank's rows in it (a short last global batch), else by the plan.

        Set before the forward (the comm hook reads it in the backward), and reset only where the sizes change.
        """
        sampler, gradients, plan, index = self.train_sampler, self.gradients, self.plan, self._batch_index
        if sampler is None or gradients is None or plan is None or self.rebalancer is not None:
            return
        sizes = self._epoch.short.get(index, list(plan.sizes)) if isinstance(index, int) else list(plan.sizes)
        if sizes != self._weighted:
            gradients.set_plan(plan if sizes == list(plan.sizes) else plan_from_sizes(None, self._labels, sizes))
            self._weighted = sizes

    @contextlib.contextmanager
    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        batch = args[0] if args else kwargs.get("batch")
        rows = samples_in(batch)
        index = self._batch_index
        sampler = self._step_sampler()
        # A zero share's stand-in samples count for nothing, as in its gradient (evaluation adds no padding).
        stand_in = bool(rows) and isinstance(index, int) and sampler is not None and self._is_filler(sampler, index)
        self._samples = 0 if stand_in else rows
        module = self.module
        if self._samples is not None:
            trainer = module.trainer
            self._seen[trainer.state.stage] = self._seen.get(trainer.state.stage, 0) + self._samples
            # Lightning weights an on_epoch mean by the batch size it reads off the batch
            # (trainer._results.batch_size, reset at every batch start): the stand-in must count as nothing.
            results = trainer._results
            if stand_in and results is not None:
                results.batch_size = 0
        logging = stand_in_logging(module, rows) if stand_in and rows else contextlib.nullcontext()
        try:
            with self._throttled(), logging:
                yield
        finally:
            self._samples = None

    def _is_filler(self, sampler: HeteroDistributedSampler, index: int) -> bool:
        """Whether batch ``index`` of ``sampler`` is a zero share's stand-in (the training sampler: asked per epoch)."""
        if sampler is self.train_sampler and self.rebalancer is None:
            return index in self._epoch.fillers
        return sampler.is_filler(index)

    def epoch_started(self, epoch: int) -> None:
        """A training epoch starts: its shuffle for the shares, and its stand-ins and short batches asked once."""
        sampler = self.train_sampler
        if sampler is not None:
            sampler.set_epoch(epoch)
            self._epoch = _EpochSteps.of(sampler)

    def _micro_batches(self) -> list[int] | None:
        """This rank's micro-batches under the plan in force (``None``: one batch), asked once a plan."""
        plan = self.plan
        if plan is not self._micro[0]:
            sharded = is_sharded(self.micro_model())
            self._micro = (plan, share_micro_batches(plan, self.global_rank, self.module, sharded=sharded))
        return self._micro[1]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step`` at the rank's emulated speed and memory, as its micro-batches."""
        self._weigh_step()
        with self._step(args, kwargs):
            if self._micro_batches() is None and not self._memory_capped:  # the plain step: nothing to cut or check
                return super().training_step(*args, **kwargs)
            return run_training_step(self, super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, as :meth:`training_step`."""
        with self._step(args, kwargs):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step``, as :meth:`training_step`."""
        with self._step(args, kwargs):
            return super().test_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward as the Lightning strategy does, at the rank's emulated speed (waiting for others is not slowed).

        A micro-batched step's earlier gradients are put back first (:class:`~.micro_batches.GradientsAside`).
        """
        if self.aside.held is not None:
            self.aside.restore()
        with self._throttled():
            loss: Tensor = super().backward(closure_loss, optimizer, *args, **kwargs)
        return loss

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce across ranks; inside a ``*_step``, a mean is weighted by each rank's samples.

        ``self.log(..., sync_dist=True)`` reduces through here: an ``on_epoch`` mean is exact as Lightning
        keeps it, an ``on_step`` mean (a plain mean of the ranks' values) is weighted by the step's samples.
        Not weighted: means reduced in other hooks, a ``batch_size=`` given to ``self.log``.
        """
        # super() reaches the Lightning strategy's reduce (DDPStrategy's, ModelParallelStrategy's),
        # after this class in the MRO; mypy sees only Strategy's abstract one.
        plain = super().reduce  # type: ignore[safe-super]
        if not isinstance(tensor, Tensor) or not (dist.is_available() and dist.is_initialized()):
            return plain(tensor, group, reduce_op)
        if op_name(reduce_op) == "mean" and not tensor.is_floating_point() and not tensor.is_complex():
            # Lightning means an integer tensor in place, truncating: an epoch metric's count of
            # samples (11 + 10 over two ranks) became 10, not 10.5, and the metric 21/20 too large.
            # DistributedSampler's equal padded shares never give an odd total; uneven shares do.
            tensor = tensor.to(torch.float32 if tensor.device.type == "mps" else torch.float64)  # MPS: no float64
        if self._samples is not None:
            return weighted_reduce(tensor, self._samples, reduce_op, lambda t, op: plain(t, group, op))
        if op_name(reduce_op) in ("mean", "sum") and tensor.is_floating_point() and self._stage_seen() == 0:
            tensor = torch.nan_to_num(tensor, nan=0.0)  # sum(value * 0) of a rank without samples: NaN * 0
        return plain(tensor, group, reduce_op)

    def count_samples(self) -> None:
        """Start counting this rank's samples for the running stage (its epoch metrics start afresh)."""
        self._seen[self.module.trainer.state.stage] = 0

    def _stage_seen(self) -> int | None:
        try:
            return self._seen.get(self.module.trainer.state.stage)
        except (AttributeError, RuntimeError):  # no module, or not attached to a trainer
            return None


class _EpochSteps:
    """A training epoch's steps that differ from the plan, asked of its sampler once (without rebalancing).

    Attributes:
        fillers: The steps whose batch is a zero share's stand-in on this rank.
        short: Every rank's rows at the steps whose global batch is short of the plan's.
    """

    def __init__(self, fillers: frozenset[int] = frozenset(), short: dict[int, list[int]] | None = None) -> None:
        self.fillers, self.short = fillers, short or {}

    @classmethod
    def of(cls, sampler: HeteroDistributedSampler) -> _EpochSteps:
        """The epoch ``sampler`` is set to."""
        steps = range(len(sampler))
        short = {i: sizes for i in steps if (sizes := sampler.short_sizes(i)) is not None}
        return cls(frozenset(i for i in steps if sampler.is_filler(i)), short)


class HeteroCallback(pl.Callback):
    """Installed by every hetsplit strategy: each epoch's shuffle for the shares, and the rebalancer around each batch.

    Lightning calls ``set_epoch`` on a loader's ``sampler`` and ``batch_sampler.sampler`` only, not
    on a batch sampler itself; with ``rebalance=K`` every training batch runs inside
    :meth:`hetsplit.distributed.DistributedRebalancer.step`.
    """

    def __init__(self, strategy: HeteroStrategy) -> None:
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
        self.strategy.epoch_started(trainer.current_epoch)

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
