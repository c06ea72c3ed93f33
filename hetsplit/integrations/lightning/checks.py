"""Checks every rank runs before any step: the device list, a plan with micro-batches, DDP's comm hook."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from hetsplit.devices import parse_device
from hetsplit.distributed.setup import rank_devices as _rank_devices
from hetsplit.planning import Plan, Rebalancer

from .. import core


def check_comm_hook(weighting: str, ddp_kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``ddp_comm_hook`` of the user's where hetsplit's comm hook weights the gradients.

    Raises:
        ValueError: For ``ddp_comm_hook`` with ``weighting="hook"`` (DDP takes one hook).
    """
    if weighting == "hook" and ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ValueError(
            "weighting='hook' registers hetsplit's DDP comm hook and DDP takes one: "
            "use weighting='outputs' to keep your ddp_comm_hook"
        )


def check_micro_plan(
    plan: Plan | None, module: nn.Module, rebalance: int | Rebalancer, *, who: str = "HeteroDDPStrategy"
) -> None:
    """Refuse what a plan with micro-batches cannot run with; every rank checks the same plan before any step.

    Raises:
        ValueError: If the plan splits some rank's share and ``rebalance`` is set
            (:func:`~hetsplit.integrations.core.check_plan`), or ranks run different
            numbers of micro-batches and ``module`` holds a ``torch.nn.SyncBatchNorm`` (its
            collectives would not match across ranks).
    """
    core.check_plan(who, plan, None, rebalance=rebalance)
    if plan is None or all(len(parts) <= 1 for parts in plan.micro_batches):
        return
    r = next(r for r, parts in enumerate(plan.micro_batches) if len(parts) > 1)
    split = f"the plan splits rank {r}'s share {plan.sizes[r]} into micro-batches {plan.micro_batches[r]}"
    counts = [max(1, len(parts)) for parts in plan.micro_batches]  # a share that runs whole is one forward
    sync = next((name or "the model" for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
    if sync is not None and len(set(counts)) > 1:
        raise ValueError(
            f"the model has a SyncBatchNorm ({sync}, e.g. from Trainer(sync_batchnorm=True)) and {split}, while "
            f"the ranks run {counts} micro-batches: SyncBatchNorm's collectives run in every micro-batch's forward, "
            "so ranks with different counts would wait on each other forever. Use a plan "
            "without micro-batches (solve without accumulate), one giving every rank the same number of "
            "micro-batches, or plain BatchNorm (Trainer(sync_batchnorm=False))"
        )


def rank_devices(
    spec: str, world: int, accelerator: str, here: Sequence[int], *, who: str = "HeteroDDPStrategy"
) -> list[str]:
    """The canonical per-rank device names of ``spec``, checked against the world, accelerator and this node.

    Every rank runs the same checks on the same values, so each raises the same error; ``here`` are
    the ranks of this node, whose devices must exist here.

    Raises:
        ValueError: On a list of another length, a device of another type than the
            accelerator's (a CPU with ``accelerator="gpu"``), or one this node lacks.
    """
    try:
        names = _rank_devices(spec, world)
    except ValueError as e:
        raise ValueError(f"{who}(devices={spec!r}) with {world} processes (Trainer devices × num_nodes): {e}") from None
    wrong = [f"rank {r}: {n}" for r, n in enumerate(names) if parse_device(n, check=False).type != accelerator]
    if wrong:
        kind = {"cuda": "'gpu'", "cpu": "'cpu'"}.get(accelerator, repr(accelerator))
        raise ValueError(
            f"Trainer(accelerator={kind}) runs every rank on {accelerator}, but {who}(devices={spec!r}) "
            f"lists {', '.join(wrong)}. Lightning runs all ranks on one accelerator: list only {accelerator} devices "
            "(emulated ranks such as 'cpu,cpu@0.25' with accelerator='cpu'), or start a CPU rank among GPUs "
            "with 'hetsplit launch' and hetsplit.distributed"
        )
    for r in here:
        if r < world:
            try:
                parse_device(names[r])
            except ValueError as e:
                raise ValueError(f"{who}: rank {r}'s device {names[r]!r}: {e}") from None
    return names
