"""Profiling a LightningModule for the plan: its ``training_step`` timed on each rank's device, rank 0 solving."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn

from hetsplit.devices import Device
from hetsplit.distributed.sharded import holds_sharded
from hetsplit.planning import Plan, Profile

from .. import core


class _Shared:
    """A context factory that ``copy.deepcopy`` (the profiler copies the model) shares, never copies."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.factory = factory

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class LossModule(nn.Module):
    """A copy of a LightningModule whose forward is its ``training_step``: the loss the profiler times.

    The step runs in ``context`` (the precision plugin's: autocast for mixed precision); the copy has
    no trainer, so the warnings of its ``self.log`` are silenced.
    """

    def __init__(self, module: pl.LightningModule, context: Callable[[], Any] = contextlib.nullcontext) -> None:
        super().__init__()
        self.module = module
        self.context = _Shared(context)

    @classmethod
    def detached(cls, module: pl.LightningModule, context: Callable[[], Any] = contextlib.nullcontext) -> LossModule:
        """A :class:`LossModule` over a copy of ``module`` made without its trainer (``module`` keeps it)."""
        trainer = module.trainer
        module.trainer = None  # the copy must not drag the trainer along, nor log through it
        try:
            replica = copy.deepcopy(module)
        finally:
            module.trainer = trainer
        return cls(replica, context)

    def forward(self, batch: Any) -> torch.Tensor:
        """The loss of ``training_step(batch, 0)`` (its ``"loss"`` entry when it returns a dict).

        ``batch_idx`` only where the hook's signature takes one, as Lightning calls it.
        """
        step = self.module.training_step
        args = (batch, 0) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*`self\.log\(\)`.*")
            with self.context.factory():
                out = step(*args)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'; "
                "the strategy profiles the loss training_step returns: pass plan= or profile= instead"
            )
        return loss


def profiled_plan(
    module: pl.LightningModule,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    loader: Any,
    batch_size: int,
    *,
    who: str,
    root: torch.device,
    device: Device | None,
    profile: Profile | None,
    plan_kwargs: Mapping[str, Any],
) -> Plan:
    """Profile a detached copy of ``module`` on this rank's device (an FSDP2 one in place); rank 0 solves for all.

    ``root`` is the device the rank's model lives on (its random state is kept on a GPU).

    Raises:
        RuntimeError: If ``training_step`` cannot be profiled (naming the device and the cause).
    """

    def profiled(model: nn.Module) -> Plan:
        # The batch as the loader gives it (on the CPU): the profiler moves rows itself.
        return core.profiled_plan(
            who, "training_step", model, loader, batch_size, device=device, profile=profile,
            plan_kwargs=plan_kwargs, cuda=[root] if root.type == "cuda" else [],
            hint="fix the step, or pass plan= (or profile=) to skip profiling",
        )  # fmt: skip

    if not holds_sharded(module):
        return profiled(LossModule.detached(module, context))
    # torch refuses to copy an FSDP2 module: it is timed itself, the ranks in turns, detached from
    # the trainer meanwhile so the profile's self.log goes nowhere (and syncs nothing).
    trainer = module.trainer
    module.trainer = None
    try:
        return profiled(LossModule(module, context))
    finally:
        module.trainer = trainer
