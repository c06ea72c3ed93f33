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

    The weighting hooks this module's forward; a ``self(x)`` inside ``training_step`` never reaches
    it, so ``weighting="outputs"`` scales the step's loss, not also its logits.
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
    ``accelerator="gpu", devices=2`` on two unequal GPUs (docs/integrations.md, Lightning). The
    plan is ``plan``, else solved from ``profile``, else profiled at the first training loader; the
    loaders are rebuilt on its shares and the gradients weighted by shard, so a step equals the
    full-batch step. The plan is not checkpointed: pass the same ``plan``/``profile`` to resume.

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
