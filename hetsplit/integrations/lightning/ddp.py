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

    ``L.Trainer(strategy=HeteroDDPStrategy(devices="cpu,cpu@0.25"), accelerator="cpu", devices=2)``
    (two emulated ranks on a CPU-only machine), or ``HeteroDDPStrategy()`` with
    ``accelerator="gpu", devices=2`` on two unequal GPUs. The guide is docs/integrations.md
    (Lightning); in short:

    - **Devices**: one per rank (default ``$HETSPLIT_DEVICES``, else the Trainer's), checked
      against the world, the accelerator and this node on every rank before the process
      group starts; emulated ranks run their steps and backward throttled.
    - **One plan**: ``plan``, else solved from ``profile``, else profiled at the first
      training loader (each rank times a detached copy's ``training_step(batch, 0)`` on its
      device; :mod:`.profiling`). The global batch is ``plan.batch_size``, else
      ``global_batch_size``, else world × the loader's ``batch_size``.
    - **Loaders** are rebuilt on the shares (:func:`~hetsplit.integrations.loaders.rebuilt_loader`):
      an epoch's last global batch is what is left, cut in the plan's proportions (padded by
      wrapping around with ``rebalance``, micro-batches or ``accumulate_grad_batches > 1``,
      whose weights are whole shares); evaluation loaders in the plan's proportions, nothing
      added; predict loaders untouched.
    - **Micro-batches** of a plan (``accumulate=True``) run inside one ``training_step``
      under automatic optimization (:mod:`.micro_batches`); refused with ``rebalance``,
      uneven counts with SyncBatchNorm (:func:`~.checks.check_micro_plan`), and manual
      optimization.
    - **Gradients** are weighted by shard (:func:`hetsplit.distributed.weight_gradients`), so
      a step equals the full-batch step; a share of 0 runs two real samples weighted 0.
    - **Metrics**: a mean reduced inside a ``*_step`` is weighted by each rank's samples
      (:meth:`~.strategy.HeteroStrategy.reduce`).
    - **Checkpoints** save and resume as with ``DDPStrategy`` (the plan is not saved: pass
      the same ``plan``/``profile`` to resume on the same shares).

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
