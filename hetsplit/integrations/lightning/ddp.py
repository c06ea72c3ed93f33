"""HeteroDDPStrategy: Lightning's DDP with every rank's share of each batch from one hetsplit plan."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from hetsplit.distributed.dtypes import verify_dtypes

from ..options import HeteroOptions
from .checks import check_comm_hook
from .strategy import HeteroStrategy


class StepModule(nn.Module):
    """What DDP wraps: the LightningModule, called exactly once per step (or per micro-batch).

    hetsplit's gradient weighting hooks this module's forward. A ``self(x)`` inside
    ``training_step`` calls the LightningModule again, never this module, so the hooks
    see each step once (``weighting="outputs"`` scales the step's loss, not also its logits).
    State-dict keys of the LightningModule are unchanged (Lightning saves that module).
    A micro-batched step calls DDP once per micro-batch, each running ``call`` instead
    (see :meth:`calling`), so the hooks see each micro-batch once.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.call: Callable[..., Any] | None = None
        ignore = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
        if ignore:  # DDP reads these names from the module it wraps
            self._ddp_params_and_buffers_to_ignore = [f"module.{name}" for name in ignore]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule (Lightning's forward redirection makes that its ``*_step``), or ``call``."""
        if self.call is not None:
            return self.call(*args, **kwargs)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def calling(self, call: Callable[..., Any]) -> Iterator[None]:
        """Run ``call(*args, **kwargs)`` as this module's forward inside the block (one micro-batch's step)."""
        self.call = call
        try:
            yield
        finally:
            self.call = None


class HeteroDDPStrategy(HeteroStrategy, DDPStrategy):
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
      share's mean and ``self.log`` logs once per step (:mod:`~hetsplit.integrations.lightning.micro_batches`). An
      emulated memory (``cpu:max4``) raises ``torch.OutOfMemoryError`` for a training share or
      micro-batch beyond it. Refused with such a plan: ``rebalance``, SyncBatchNorm with uneven micro-batch
      counts (:func:`~.checks.check_micro_plan`), manual optimization (at the first training step).
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
        weighting: ``"hook"`` (a DDP comm hook) or ``"outputs"`` (scales the step's output;
            leaves the comm hook free; automatic optimization only).
        options: ``devices``, ``plan``, ``profile``, ``global_batch_size``, ``rebalance``,
            ``plan_kwargs``, ``quiet``: the arguments every integration shares, as keywords
            or one :class:`~hetsplit.integrations.options.HeteroOptions`. ``rank_device`` is
            then this rank's hetsplit device, ``plan`` the plan in force.
        **ddp_kwargs: Passed to ``DDPStrategy`` (``timeout``, ``find_unused_parameters``, ...).

    Raises:
        TypeError, ValueError: As :meth:`~hetsplit.integrations.options.HeteroOptions.check`
            (the same for every integration), and a ``ValueError`` for ``ddp_comm_hook`` with
            ``weighting="hook"``.
    """

    who = "HeteroDDPStrategy"

    def __init__(self, *, weighting: str = "hook", options: HeteroOptions | None = None, **ddp_kwargs: Any) -> None:
        if "profile_kwargs" in ddp_kwargs:  # else DDP itself would refuse it, late and without the new name
            raise TypeError("HeteroDDPStrategy: profile_kwargs= was removed: use plan_kwargs=")
        super().__init__(weighting=weighting, options=options, **ddp_kwargs)

    @override
    def check_arguments(self, weighting: str, strategy_kwargs: dict[str, Any]) -> None:
        check_comm_hook(weighting, strategy_kwargs)

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        """DDP over a :class:`StepModule` holding the LightningModule (so weighting sees one call per step).

        The ranks' dtypes are compared first: DDP's first broadcast would abort a rank on a mismatch.
        """
        verify_dtypes(model)
        return super()._setup_model(StepModule(model))

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP; weight its gradients by shard once the plan is known."""
        if self.weighting == "outputs" and not self.module.automatic_optimization:
            raise ValueError(
                "weighting='outputs' scales the step's output after training_step, too late for manual "
                "optimization (manual_backward runs inside it): use weighting='hook'"
            )
        super().configure_ddp()
        self.gradients = self.rebalancer = self.train_sampler = None
        self.weight()

    @override
    def weighted_model(self) -> nn.Module | None:
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    @override
    def micro_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("HeteroDDPStrategy runs micro-batches through its DDP model: set up first")
        return self.model

    @override
    def run_micro_batch(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        # Through DDP, whose StepModule runs ``call`` as its forward: the weighting and DDP see each micro-batch.
        model = self.micro_model()
        inner = model.module if isinstance(model, DistributedDataParallel) else None
        if not isinstance(inner, StepModule):
            raise RuntimeError(f"HeteroDDPStrategy runs micro-batches through DDP over a StepModule, got {model!r}")
        with inner.calling(call):
            return model(*args, **kwargs)
