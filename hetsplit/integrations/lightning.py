"""HeteroDDPStrategy: Lightning's DDP with every rank's share of each batch from one hetsplit plan.

What does not depend on how gradients are synchronised (devices, the plan, the re-cut
loaders, weighted metrics, micro-batches, emulated speed) is :class:`_HeteroStrategy`,
which :class:`HeteroDDPStrategy` and the FSDP2 strategy
(:class:`~hetsplit.integrations.lightning_sharded.HeteroModelParallelStrategy`) share.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import hetsplit.distributed as hd
from hetsplit.devices import Device, parse_device
from hetsplit.distributed._group import verify_dtypes
from hetsplit.distributed.comm_hooks import WeightingState
from hetsplit.distributed.sampler import HeteroBatchSampler
from hetsplit.distributed.setup import ENV_DEVICES
from hetsplit.planning import Plan, Profile, Rebalancer, plan_from_sizes, sizes_from_weights

from . import core
from .collectives import op_name, samples_in, weighted_reduce
from .core import throttle
from .lightning_micro import GradientsAside, run_training_step
from .lightning_parts import (
    HeteroCallback,
    StepModule,
    check_arguments,
    check_micro_plan,
    loader_settings,
    profiled_plan,
    rank_devices,
)
from .lightning_steps import eval_loader, stand_in_logging, step_sampler, weigh_step


class _HeteroStrategy:
    """What every hetsplit Lightning strategy does, whatever synchronises the gradients (a mixin).

    Placed before a Lightning strategy class (``DDPStrategy``, ``ModelParallelStrategy``),
    whose methods its ``super()`` calls reach. A subclass says how the gradients are
    weighted (:meth:`_weighted_model`) and how one micro-batch's step runs
    (:meth:`_micro_model`, :meth:`_run_piece`); the docstring of :class:`HeteroDDPStrategy`
    describes the behaviour.
    """

    _who = "HeteroDDPStrategy"  # the class the user made, named in every message

    def __init__(
        self,
        devices: str | Sequence[Any] | None = None,
        plan: Plan | None = None,
        profile: Profile | None = None,
        global_batch_size: int | None = None,
        weighting: str = "hook",
        rebalance: int | Rebalancer = 0,
        *,
        plan_kwargs: dict[str, Any] | None = None,
        quiet: bool = False,
        **strategy_kwargs: Any,
    ) -> None:
        given = {"devices": devices, "plan": plan, "profile": profile, "global_batch_size": global_batch_size}
        given.update(weighting=weighting, rebalance=rebalance, plan_kwargs=plan_kwargs, quiet=quiet)
        self._check_arguments(given, strategy_kwargs)
        self._rank_device: Device | None = None  # before super(): root_device reads it
        super().__init__(**strategy_kwargs)
        self.device_list = devices if devices is None or isinstance(devices, str) else ",".join(map(str, devices))
        self.weighting, self.rebalance, self.global_batch_size = weighting, rebalance, global_batch_size
        self.profile, self.plan_kwargs = profile, core.plan_kwargs(plan_kwargs)
        self._plan = plan
        self._labels: list[str] = []
        self.gradients: WeightingState | None = None
        self.rebalancer: hd.DistributedRebalancer | None = None
        self.train_sampler: HeteroBatchSampler | None = None
        self._eval_samplers: weakref.WeakKeyDictionary[HeteroBatchSampler, int] = weakref.WeakKeyDictionary()
        self._samples: int | None = None  # this rank's samples in the step running now
        # The running batch's index and loader, as Lightning's loops number them (the step
        # hooks may take no batch_idx: Lightning passes only what their signature names).
        self._batch_index: int | None = None
        self._dataloader_idx = 0
        self._weighted: list[int] | None = None  # every rank's rows the gradients are weighted by now
        self._seen: dict[Any, int] = {}  # per stage: this rank's samples since its metrics were last reset
        self._callback = HeteroCallback(self)
        self.quiet = quiet
        self._report: core.SplitReport | None = None  # made with the ranks known (setup)
        self.aside = GradientsAside()  # a micro-batched step's gradients, until Lightning's backward

    def _check_arguments(self, given: dict[str, Any], strategy_kwargs: dict[str, Any]) -> None:
        check_arguments(given, strategy_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # Lightning pickles the strategy to spawn ranks
        state["_eval_samplers"] = None  # weak references do not pickle; samplers belong to one process
        return state

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
    def root_device(self) -> torch.device:
        """The device this rank's model and batches live on: its entry in the device list."""
        if self._rank_device is not None:
            return self._rank_device.torch_device
        return super().root_device

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        """Check the device list (and plan) against the world, on every rank, then join the process group."""
        self.set_world_ranks()
        self._check_devices()
        super().setup_environment()
        if self.world_size > 1:  # whatever the entry point (fit, validate, test, predict)
            hd.drain_at_exit()  # at exit, let gloo's workers finish with the last collective first

    def _check_devices(self) -> None:
        spec = self.device_list or os.environ.get(ENV_DEVICES)
        if not spec:  # the Trainer's own devices, on every node
            spec = ",".join([str(d) for d in (self.parallel_devices or [])] * self.num_nodes)
        first = self.node_rank * self.num_processes
        here = range(first, first + self.num_processes)
        names = rank_devices(spec, self.world_size, super().root_device.type, here, who=self._who)
        if self._plan is not None and len(self._plan.sizes) != self.world_size:
            raise ValueError(
                f"{self._who}(plan=...) has {len(self._plan.sizes)} shares {list(self._plan.sizes)} for "
                f"{self.world_size} processes; solve a plan with one share per process"
            )
        self._rank_device = parse_device(names[self.global_rank])
        self._labels = [f"rank{r}:{n}" for r, n in enumerate(names)]

    def setup(self, trainer: pl.Trainer) -> None:
        """Install the strategy's callback (epochs, rebalancing), then set up as the Lightning strategy does."""
        if self._callback not in trainer.callbacks:
            trainer.callbacks.append(self._callback)
        self._report = core.SplitReport(self._who, self.global_rank, self.quiet)
        super().setup(trainer)

    def _weight(self) -> None:
        """Weight the gradients by the plan's shares, once the plan and the model to weight both exist."""
        model = self._weighted_model()
        if self.gradients is None and self._plan is not None and model is not None:
            self.gradients = hd.weight_gradients(model, self._plan, method=self.weighting)
            self._weighted = list(self._plan.sizes)  # the sizes the gradients are weighted by

    def _weighted_model(self) -> nn.Module | None:
        """The module whose gradients :func:`hetsplit.distributed.weight_gradients` weights (``None``: not yet)."""
        raise NotImplementedError

    def _micro_model(self) -> nn.Module:
        """The module :func:`hetsplit.distributed.micro_batches` synchronises once per step (DDP, or FSDP2's root)."""
        raise NotImplementedError

    def _run_piece(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one micro-batch's ``training_step`` (``call``) where the weighting sees it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """Rebuild a training or evaluation loader on hetsplit's shares (predict loaders are left alone)."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.PREDICTING:
            return dataloader
        if trainer.state.stage == RunningStage.TRAINING:
            return self._train_loader(dataloader)
        return eval_loader(self, dataloader, trainer)

    def _train_loader(self, loader: Any) -> Any:
        shuffle, seed, kwargs = loader_settings(loader, "training", strict=True)
        if self._plan is None:
            batch = self.global_batch_size or self.world_size * loader.batch_size
            self._plan = profiled_plan(self, loader, batch)
        plan = self.plan
        check_micro_plan(plan, self.lightning_module, self.rebalance, who=self._who)  # every rank, before any step
        # A last global batch short of B is served as it is, cut in the plan's proportions
        # (DistributedSampler adds no more than world - 1 samples either), and each rank's
        # gradient weighted by its rows in it (_weigh_step). Rebalancing, micro-batches and
        # gradient accumulation weight by the plan's whole shares: those keep the padding.
        whole = all(len(parts) <= 1 for parts in plan.micro_batches)
        pad = bool(self.rebalance) or not whole or self.lightning_module.trainer.accumulate_grad_batches != 1
        new = hd.data_loader(
            loader.dataset,
            plan,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            pad=pad,
            num_replicas=self.world_size,
            rank=self.global_rank,
            **kwargs,
        )
        self.train_sampler = new.batch_sampler
        self._weight()
        policy = self.rebalancer.rebalancer if self.rebalancer is not None else self.rebalance  # a reloaded loader
        self.rebalancer = core.rebalancer(
            plan, policy, sampler=self.train_sampler, gradients=self.gradients, model=self.model,
            device=self._rank_device,
        )  # fmt: skip
        return new

    def on_validation_start(self) -> None:
        """Evaluation shares follow the plan in force (made after the sanity check, or rebalanced)."""
        super().on_validation_start()
        self._follow_plan()
        self.count_samples()

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
        weights = self.plan.sizes if self.plan is not None else [1] * self.world_size
        return plan_from_sizes(None, self._labels, sizes_from_weights(total, weights))

    # ------------------------------------------------------------------ steps
    def batch_started(self, index: int, dataloader_idx: int = 0) -> None:
        """Lightning starts batch ``index`` of loader ``dataloader_idx`` (the strategy's callback says so)."""
        self._batch_index, self._dataloader_idx = index, dataloader_idx
        if self._report is not None and self.lightning_module.trainer.state.stage == RunningStage.TRAINING:
            self._report.step(self.plan, self._labels)

    def training_ended(self) -> None:
        """Training ended: the measured step beside the predicted one (rank 0, one line)."""
        if self._report is not None:
            self._report.end(self.plan)

    @contextlib.contextmanager
    def _step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        batch = args[0] if args else kwargs.get("batch")
        rows = samples_in(batch)
        index = self._batch_index
        sampler = step_sampler(self, self._dataloader_idx)
        # A zero share's stand-in samples count for nothing, as in its gradient (evaluation adds no padding).
        stand_in = bool(rows) and isinstance(index, int) and sampler is not None and sampler.is_filler(index)
        self._samples = 0 if stand_in else rows
        module = self.lightning_module
        if self._samples is not None:
            trainer = module.trainer
            self._seen[trainer.state.stage] = self._seen.get(trainer.state.stage, 0) + self._samples
            if stand_in and trainer._results is not None:
                # Lightning weights an on_epoch mean by the batch size it reads off the
                # batch (_ResultCollection.batch_size, reset at every batch start): the
                # stand-in samples must count as nothing in what is synced across ranks.
                trainer._results.batch_size = 0
        try:
            with throttle(self._rank_device), stand_in_logging(module, rows) if stand_in else contextlib.nullcontext():
                yield
        finally:
            self._samples = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step`` at the rank's emulated speed and memory (means weighted by samples).

        A share the plan splits runs as its micro-batches (:func:`~.lightning_micro.run_training_step`).
        """
        weigh_step(self, self._batch_index)
        with self._step(args, kwargs):
            return run_training_step(self, super().training_step, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, as :meth:`training_step`."""
        with self._step(args, kwargs):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step``, as :meth:`training_step`."""
        with self._step(args, kwargs):
            return super().test_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward as the Lightning strategy does, at the rank's emulated speed (waiting for others is not slowed).

        A micro-batched step's first micro-batches' gradients are put back first (:class:`GradientsAside`).
        """
        self.aside.restore()
        with throttle(self._rank_device):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce across ranks; inside a ``*_step``, a mean is weighted by each rank's samples (see the class).

        Args:
            tensor: The value to reduce (anything else is returned unchanged).
            group: The process group (default: the world).
            reduce_op: ``"mean"`` (default), ``"sum"``, ``"max"``, ``"min"`` or a ``ReduceOp``.

        Returns:
            The reduced tensor, the same on every rank.
        """
        if not isinstance(tensor, Tensor) or not (dist.is_available() and dist.is_initialized()):
            return super().reduce(tensor, group, reduce_op)
        plain = super().reduce
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
        self._seen[self.lightning_module.trainer.state.stage] = 0

    def _stage_seen(self) -> int | None:
        try:
            return self._seen.get(self.lightning_module.trainer.state.stage)
        except (AttributeError, RuntimeError):  # no module, or not attached to a trainer
            return None


class HeteroDDPStrategy(_HeteroStrategy, DDPStrategy):
    """Lightning's ``DDPStrategy`` with uneven per-rank batches from one hetsplit plan and exact gradients.

    Use it as ``L.Trainer(strategy=HeteroDDPStrategy(devices="cpu,cpu@0.25"), accelerator="cpu", devices=2)``
    (two emulated ranks on a CPU-only machine) or ``HeteroDDPStrategy()`` with
    ``accelerator="gpu", devices=2`` on two unequal GPUs. What it does:

    - **Devices**: ``devices`` lists one device per rank (default ``$HETSPLIT_DEVICES``,
      else the Trainer's devices). A list of another length than the world size, a
      device type the accelerator does not run (a ``cpu`` rank with
      ``accelerator="gpu"``), a device this node lacks or a ``plan`` for another world
      size is a ``ValueError`` on every rank before the process group starts. Emulated
      ranks (``cpu@0.25``) run ``training_step``, ``backward`` and the evaluation steps
      throttled to their speed.
    - **One plan**: ``plan``, else one solved from ``profile`` (this rank's, or a profile
      naming every rank's device), else one profiled when the training loader is first
      processed: each rank times a copy of the LightningModule (no trainer attached,
      ``self.log`` silenced) on its own device, ``training_step(batch, 0)`` on a batch of
      the user's loader being the loss (:func:`hetsplit.distributed.plan`; ``plan_kwargs``
      over the defaults ``{"time_budget": 10.0, "calibrate": 4}``).
    - **Global batch**: ``plan.batch_size`` with a plan, else ``global_batch_size``, else
      world size × the training loader's ``batch_size`` (the global batch of plain DDP).
    - **Loaders**: the training loader is rebuilt on hetsplit's shares
      (:func:`hetsplit.distributed.data_loader`: same dataset, ``collate_fn``, workers,
      pinning; shuffled if the loader or Lightning's ``DistributedSampler`` shuffles),
      whatever ``use_distributed_sampler`` says; an epoch has ``ceil(len(dataset) / B)``
      steps, the last one what is left of the data set cut in the plan's proportions
      (each rank's gradient weighted by its rows in it; padded by wrapping around instead
      with ``rebalance``, micro-batches or ``accumulate_grad_batches > 1``, whose weights
      are the plan's whole shares). A loader that is not a ``DataLoader`` over a
      map-style dataset with a ``batch_size`` is an error. Validation and test loaders
      get shares of world × their ``batch_size`` in the proportions of the plan in force
      when each evaluation starts (even shares before a plan exists, as in the sanity
      check), nothing added: the last batch is what is left, cut in proportion; loaders
      that cannot be rebuilt are left as Lightning made them; predict loaders are untouched.
    - **Micro-batches**: a plan that splits a rank's share (``plan.micro_batches``, from
      ``accumulate=True``) is followed exactly under automatic optimization: each micro-batch
      runs ``training_step`` once, all but the last with their backward inside the step (their
      gradients kept from ``zero_grad`` until Lightning's one backward), the step's loss is the
      share's mean and ``self.log`` logs once per step (:mod:`~hetsplit.integrations.lightning_micro`). An
      emulated memory (``cpu:max4``) raises ``torch.OutOfMemoryError`` for a training share or
      micro-batch beyond it. Refused with such a plan: ``rebalance``, SyncBatchNorm with uneven micro-batch
      counts (:func:`~.lightning_parts.check_micro_plan`), manual optimization (at the first training step).
    - **Gradients** are weighted by shard (:func:`hetsplit.distributed.weight_gradients`,
      ``weighting="hook"`` or ``"outputs"``), so a step equals the full-batch step; a
      share of 0 runs two real samples of the global batch, weighted 0 in the gradients and
      in synced metrics (never an empty batch). ``rebalance=K`` (or a
      :class:`hetsplit.Rebalancer` policy) re-solves the shares
      from measured step times every K steps (:class:`hetsplit.distributed.DistributedRebalancer`).
    - **Metrics** (``self.log(..., sync_dist=True)`` reduces through :meth:`reduce`). For an
      ``on_epoch`` mean, Lightning keeps ``sum(value * batch_size)`` and ``sum(batch_size)``
      per rank and divides their all-reduced means at epoch end (``_ResultMetric.update``
      and ``compute`` in ``lightning/pytorch/trainer/connectors/logger_connector/result.py``):
      weighted by batch size across ranks, exact with uneven shares as it is. An
      ``on_step`` value is synced on its own (``meta.sync(value)`` with ``"mean"``): a
      plain mean of the ranks' values, biased when batches differ. Here a mean reduced
      inside ``training_step``, ``validation_step`` or ``test_step`` is weighted by each
      rank's samples in that step (the first tensor's length, as Lightning counts
      ``batch_size``), so an ``on_step`` value is the mean over the global batch too.
      ``sum``/``max``/``min`` stay plain. A rank with no samples adds nothing (a NaN
      from its mean over an empty batch included); but a rank whose share moves between
      0 and more within an epoch (rebalancing) holds ``NaN * 0`` in Lightning's epoch sum
      of such a value, and that epoch mean is NaN. Not weighted: means reduced in other
      hooks (``on_train_batch_end``, ...) and a ``batch_size=`` given to ``self.log``
      (the step count is used); torchmetrics ``Metric`` objects sync their own states
      and are exact.
    - **Checkpoints** save and resume as with ``DDPStrategy`` (the plan is not saved:
      pass the same ``plan``/``profile`` to resume on the same shares).

    Args:
        devices: One device per rank: ``"cuda:0,cuda:1"``, ``"cpu,cpu@0.25"`` or a list.
            The strategy's ``rank_device`` is this rank's hetsplit device, and ``plan`` the
            plan in force (the rebalancer's current one when rebalancing).
        plan: The plan for all ranks (``plan.sizes[rank]`` samples per step).
        profile: A profile to solve the plan from instead of timing the model.
        global_batch_size: Samples per step over all ranks (default: world × loader batch size).
        weighting: ``"hook"`` (a DDP comm hook) or ``"outputs"`` (scales the step's output;
            leaves the comm hook free; automatic optimization only).
        rebalance: Re-solve the shares every this many steps (0: never), or a
            :class:`hetsplit.Rebalancer` to set the policy (``every``, ``threshold``, ...).
        plan_kwargs: Passed to :func:`hetsplit.distributed.plan` (``time_budget``,
            ``calibrate``, ``batch_sizes``, ``weights``, ``accumulate``, ...), over the
            defaults ``{"time_budget": 10.0, "calibrate": 4}`` (the same in every
            integration). ``profile_kwargs`` is its former name, deprecated.
        quiet: Say nothing about the split (else rank 0 prints the split and its predicted
            step when training starts, the measured step when it ends; ``HETSPLIT_QUIET=1`` too).
        **ddp_kwargs: Passed to ``DDPStrategy`` (``timeout``, ``find_unused_parameters``, ...).

    Raises:
        TypeError, ValueError: As :func:`hetsplit.integrations.core.check_arguments` (the
            same for every integration), and a ``ValueError`` for ``ddp_comm_hook`` with
            ``weighting="hook"``.
    """

    def __init__(
        self,
        devices: str | Sequence[Any] | None = None,
        plan: Plan | None = None,
        profile: Profile | None = None,
        global_batch_size: int | None = None,
        weighting: str = "hook",
        rebalance: int | Rebalancer = 0,
        *,
        plan_kwargs: dict[str, Any] | None = None,
        quiet: bool = False,
        profile_kwargs: dict[str, Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if profile_kwargs is not None:
            if plan_kwargs is not None:
                raise ValueError("HeteroDDPStrategy: pass plan_kwargs= only (profile_kwargs= is its former name)")
            warnings.warn(
                "HeteroDDPStrategy(profile_kwargs=...) is deprecated: use plan_kwargs=", DeprecationWarning, 2
            )
            plan_kwargs = profile_kwargs
        super().__init__(
            devices, plan, profile, global_batch_size, weighting, rebalance, plan_kwargs=plan_kwargs, quiet=quiet,
            **ddp_kwargs,
        )  # fmt: skip

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        """DDP over a :class:`StepModule` holding the LightningModule (so weighting sees one call per step).

        The ranks' dtypes are compared first: DDP's first broadcast would abort a rank on a mismatch.
        """
        verify_dtypes(model)
        return super()._setup_model(StepModule(model))

    def configure_ddp(self) -> None:
        """Wrap the model in DDP; weight its gradients by shard once the plan is known."""
        if self.weighting == "outputs" and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "weighting='outputs' scales the step's output after training_step, too late for manual "
                "optimization (manual_backward runs inside it): use weighting='hook'"
            )
        super().configure_ddp()
        self.gradients = self.rebalancer = self.train_sampler = None
        self._weight()

    def _weighted_model(self) -> nn.Module | None:
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    def _micro_model(self) -> nn.Module:
        return self.model

    def _run_piece(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        # Through DDP, whose StepModule runs ``call`` as its forward: the weighting and DDP see each micro-batch.
        with self.model.module.calling(call):
            return self.model(*args, **kwargs)
