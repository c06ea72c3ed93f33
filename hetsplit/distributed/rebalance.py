"""Rebalance: online rebalancing for a torchrun job — all ranks' step times pooled, one switch step for all."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..devices import Device, DeviceLike, label_device, parse_device
from ..planning.plan import Plan
from ..planning.rebalance import PlanChange, Rebalancer, rebalanced_caps
from ..planning.solver import plan_from_sizes
from ..timing import Lap, PausableLap, StepTimer, exposed
from ._group import all_gather, group_info, guard, verify_plan
from .comm_hooks import WeightingState
from .sampler import HeteroDistributedSampler, plan_at
from .zero_share import STAND_IN


class DistributedRebalancer:
    """Online rebalancing for a torchrun job: all ranks' step times pooled, one switch step for all.

    Wrap each training step's work in :meth:`step`, which times the rank's compute apart from its
    waits (by the wall every rank is as slow as the slowest). docs/torchrun.md.

    Args:
        plan: The starting plan, the same on every rank (e.g. from :func:`plan`).
        rebalancer: The policy (default: ``Rebalancer()``).
        sampler: This rank's :class:`HeteroDistributedSampler`, to follow plan changes.
        gradients: The state from :func:`weight_gradients` with a plan, to follow plan changes.
        model: The model (DDP or FSDP2) whose step is timed: on CUDA its hooks mark the compute's end.
        device: This rank's device (default: from the plan's ``rank{r}:DEVICE`` label, else the CPU).
        group: The process group (default: the world).

    Attributes:
        steps: Steps completed on this rank.
        schedule: ``(first step, plan)`` pairs, oldest first.

    Example:
        >>> rb = hd.DistributedRebalancer(plan, sampler=sampler, gradients=state, model=ddp, device=dev)
        >>> for x, y in loader:
        ...     with rb.step():
        ...         loss = F.cross_entropy(ddp(x), y); opt.zero_grad(); loss.backward()
        ...     opt.step()
    """

    def __init__(
        self,
        plan: Plan,
        rebalancer: Rebalancer | None = None,
        *,
        sampler: HeteroDistributedSampler | None = None,
        gradients: WeightingState | None = None,
        model: nn.Module | None = None,
        device: DeviceLike | None = None,
        group: Any = None,
    ) -> None:
        self.rank, self.world = group_info(group)
        if len(plan.sizes) != self.world:
            raise ValueError(f"the plan has {len(plan.sizes)} shares for {self.world} ranks")
        if sampler is not None and sampler.plan_at(sampler.yielded).sizes != plan.sizes:
            raise ValueError(
                f"the sampler follows sizes {sampler.plan_at(sampler.yielded).sizes}, "
                f"the plan has {plan.sizes}; build both from the same plan"
            )
        self.rebalancer = rebalancer if rebalancer is not None else Rebalancer()
        self.rebalancer.stand_in = STAND_IN  # a rank with no share runs these (hetsplit.distributed.zero_share)
        if rebalanced_caps(plan, self.rebalancer.profile) is not None:  # what rebalancing may move: one rule
            self.rebalancer.accumulate = True  # as HeteroDataParallel sets it from its own
        self.sampler, self.gradients, self.group = sampler, gradients, group
        self.device = parse_device(device) if device is not None else _device_from_label(plan.devices[self.rank])
        self.schedule: list[tuple[int, Plan]] = [(0, plan)]
        self.steps = 0
        self._mine: dict[int, tuple[int, Lap | PausableLap, float]] = {}  # step -> (size, compute, wall)
        self._timer = StepTimer(self.device, model)
        self._exposed: deque[float] = deque(maxlen=self.rebalancer.window)  # each step's communication
        verify_plan(plan, group)

    @property
    def plan(self) -> Plan:
        """The plan in force for the current step (or the next one, between steps)."""
        return self.plan_at(self.steps)

    @property
    def history(self) -> list[PlanChange]:
        """The plan changes so far; each one's ``step`` is the first step that ran the new plan."""
        return self.rebalancer.history

    def plan_at(self, step: int) -> Plan:
        """The plan in force at step ``step``."""
        return plan_at(self.schedule, step)

    @contextlib.contextmanager
    def step(self) -> Iterator[Plan]:
        """Measure one training step on this rank; yields the plan in force for it.

        Every ``rebalancer.every`` steps the ranks exchange timings and may schedule a new plan.

        Raises:
            DistributedError: When a peer fails during the step or the exchange (as :class:`guard`).
        """
        current = self.plan
        if self.gradients is not None and self.gradients.weight is not None:
            self.gradients.set_plan(current)
        # A dead or hung peer in the step (DDP's all-reduce in backward, the comm hook)
        # becomes one DistributedError line naming this step.
        began = time.perf_counter()
        with guard(self.steps, group=self.group), self._timer.step() as lap:
            yield current
        self._mine[self.steps] = (current.sizes[self.rank], lap, time.perf_counter() - began)
        self.steps += 1
        if self.steps % self.rebalancer.every == 0:
            self._exchange()

    def _exchange(self) -> None:
        ready = {j: (size, lap.seconds(), wall) for j, (size, lap, wall) in self._mine.items() if lap.ready()}
        handed_out = self.sampler.yielded if self.sampler is not None else self.steps
        gathered = all_gather(
            {"times": ready, "next": max(handed_out, self.steps)},
            "exchanging step times",
            self.group,
            step=self.steps - 1,
        )
        common = sorted(set.intersection(*(set(g["times"]) for g in gathered)))
        names = self.plan.devices
        for j in common:
            sizes = [g["times"][j][0] for g in gathered]
            times = {names[r]: g["times"][j][1] for r, g in enumerate(gathered)}
            # The plan that ran, micro-batches included: [2, 2, 2] under a cap of 2 is not one batch of 6.
            ran = self.plan_at(j)
            self.rebalancer.record(ran if ran.sizes == sizes else plan_from_sizes(None, names, sizes), times)
            self._exposed.append(exposed([g["times"][j][2] for g in gathered], list(times.values())))
            self._mine.pop(j, None)
        if self._exposed:  # a busy machine only ever adds to a step: its least disturbed one shows the most
            self.rebalancer.communication = min(self._exposed)
        start = max(g["next"] for g in gathered)
        current = self.plan_at(start)
        new = self.rebalancer.propose(current, step=start)
        if new is None or new.sizes == current.sizes:
            return
        self.schedule = [(s, p) for s, p in self.schedule if s < start] + [(start, new)]
        if self.sampler is not None:
            self.sampler.set_plan(new, start)


def _device_from_label(label: str) -> Device:
    """``rank1:cuda:0`` → ``cuda:0``; a label without a device gives the CPU."""
    try:
        return parse_device(label_device(label))
    except ValueError:
        return parse_device("cpu")
