"""Sizes: a batch's per-device shares for the single-process engines, and ``balanced_split``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, parse_devices
from ..planning.memory import capped_plan
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.rebalance import Rebalancer
from ..planning.sizes import (
    batchnorm_minimum,
    check_profile,
    check_source,
    check_weights,
    has_batchnorm,
    resolve_plan,
    with_minimum_shares,
)
from ..quick import default_profile
from ..tree import batch_length, flatten
from .scatter_gather import scatter_to


def split_sizes(
    batch: int,
    devices: str | Sequence[DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    profile: Profile | Plan | None = None,
) -> list[int]:
    """The per-device sizes :func:`balanced_split` uses for a batch of ``batch`` samples.

    As :func:`~hetsplit.planning.sizes.resolve_plan`, falling back on the stored profile or a quick calibration.

    Raises:
        TypeError: If ``profile`` is neither a :class:`Profile` nor a :class:`Plan` (a
            file name, say), or ``weights`` is not a list of numbers (``"41"``).
        ValueError: As :func:`~hetsplit.planning.sizes.resolve_plan`.
    """
    devs = parse_devices(devices)
    check_source("profile", profile, (Profile, Plan))  # a Plan too: balanced_split follows one
    plan = profile if isinstance(profile, Plan) else None
    prof = profile if isinstance(profile, Profile) else None
    return resolve_plan(
        batch, devs, plan=plan, profile=prof, weights=weights, fallback=lambda: default_profile(devs)
    ).sizes


def balanced_split(
    X: torch.Tensor,
    devices: str | Sequence[DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    profile: Profile | Plan | None = None,
    dim: int = 0,
) -> list[torch.Tensor]:
    """Cut ``X`` into shards sized to each device's speed, each moved to its device (sizes: :func:`split_sizes`).

    Args:
        X: The batch (a tensor, or a nest of tensors of equal length along ``dim``).
        devices: ``"cuda:0,cpu"`` or a list of device specs.
        weights: Relative throughputs, e.g. ``[4, 1]`` splits 100 rows 80/20.
        profile: A :class:`Profile` to solve, or a :class:`Plan` to follow.
        dim: The dimension to split.

    Returns:
        One shard per device, in order (a shard may be empty).

    Example:
        >>> [s.shape[0] for s in balanced_split(torch.zeros(100, 3), ["cpu", "cpu@0.25"], weights=[4, 1])]
        [80, 20]
    """
    devs = parse_devices(devices)
    sizes = split_sizes(batch_length(X, dim), devs, weights=weights, profile=profile)
    return scatter_to(X, devs, sizes, dim)


class BatchPlans:
    """The plan of every batch size an engine meets: given, solved once per size, or learned.

    :attr:`caps` holds the memory caps learned from out-of-memory errors; :attr:`current` the plan
    :meth:`for_batch` handed out last (while :attr:`minimum` is 1, what it would hand out again).
    """

    def __init__(
        self,
        devices: Sequence[Device],
        *,
        plan: Plan | None = None,
        profile: Profile | None = None,
        weights: Sequence[float] | None = None,
        rebalancer: Rebalancer | None = None,
        accumulate: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
        # An emulated memory (cpu@0.25:max8) stands in for a GPU's: like it, it is learned from a
        # profile or from running out, not read off the device name.
        self.accumulate = accumulate
        self.caps: dict[str, int] = {}
        if weights is not None and (plan is not None or profile is not None):
            both = plan is not None and profile is not None
            given = "plan= and profile=" if both else "plan=" if plan is not None else "profile="
            raise ValueError(
                f"got weights= together with {given}: give one source of shares (weights= splits every batch in "
                "proportion; profile= solves every batch size; plan= fixes one batch size)"
            )
        check_source("profile", profile, (Profile, Plan))
        check_source("plan", plan, (Plan,))
        if isinstance(profile, Plan):
            raise TypeError("profile must be a Profile; pass a Plan as plan=")
        self.devices, self.names = list(devices), [d.name for d in devices]
        if profile is not None:  # another model's or another device set's profile: refused now, not at a step
            check_profile(profile, self.names, model)
        self.weights = check_weights(weights, len(self.devices)) if weights is not None else None
        self.profile, self.rebalancer, self.model = profile, rebalancer, model
        self.given: Plan | None = None  # a plan the user gave (plan= or set_plan): followed for its size
        self.current: Plan | None = None
        self.by_batch: dict[int, Plan] = {}
        # The fewest samples a share may hold: 2 for a BatchNorm model until a batch shows its maps
        # (trace), 1 without BatchNorm.
        self.batchnorm = has_batchnorm(model)
        self.minimum = 2 if self.batchnorm else 1
        self._traced: object = None  # the per-sample input shapes the minimum was traced for
        if plan is not None:
            self.set(plan)

    def trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> None:
        """Set :attr:`minimum` from a batch the model is about to run (once per per-sample input shape)."""
        if not self.batchnorm:
            return
        leaves = [x for x in flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
        key = [tuple(x.shape[:dim]) + tuple(x.shape[dim + 1 :]) if -x.dim() <= dim < x.dim() else None for x in leaves]
        if key == self._traced:
            return
        self._traced = key
        minimum = batchnorm_minimum(self.model, args, kwargs, batch_length((args, kwargs), dim))
        if minimum != self.minimum:
            self.minimum = minimum
            self.by_batch = {k: p for k, p in self.by_batch.items() if p is self.given}

    def set(self, plan: Plan) -> None:
        """Follow ``plan`` for its batch size from now on; other sizes keep their source (profile or weights).

        Raises:
            ValueError: If the plan's devices are not these devices.
        """
        if list(plan.devices) != self.names:
            raise ValueError(f"the plan is for devices {plan.devices}, but this wrapper runs on {self.names}")
        self.given, self.current, self.by_batch = plan, plan, {plan.batch_size: plan}

    def for_batch(self, batch: int) -> Plan:
        """The plan for a batch of ``batch`` samples (made once per size), which becomes :attr:`current`."""

        plan = self.by_batch.get(batch)
        if plan is None:
            profile = self._profile_in_use()
            if profile is None and self.weights is None and self.given is None:
                # Found once, for every size: a stored profile of this model, else the quick
                # calibration, which times training steps also when this batch came under no_grad.
                with torch.enable_grad():
                    profile = self.profile = default_profile(self.devices, self.model)
            plan = self.by_batch[batch] = resolve_plan(
                batch,
                self.devices,
                plan=self.given if profile is None and self.weights is None else None,
                profile=profile,
                weights=self.weights if profile is None else None,
                accumulate=self.accumulate,
            )
            if self.caps:
                plan = self.by_batch[batch] = self.capped(plan)
        if plan is not self.given and any(0 < s < self.minimum for s in plan.sizes):  # also a rebalancer's plan
            # The caps are the profile's and those learned from running out; the plan is
            # re-wrapped with the profile in use.
            plan = self.by_batch[batch] = with_minimum_shares(
                plan, self.minimum, profile=self._profile_in_use(), room=self._all_caps(), accumulate=self.accumulate
            )
        self.current = plan
        return plan

    def _profile_in_use(self) -> Profile | None:
        """The rebalancer's corrected profile once it has learned, else the given (or found) one."""
        if self.rebalancer is not None and self.rebalancer.log_factors:
            return self.rebalancer.corrected(self.names)
        return self.profile

    def _all_caps(self) -> dict[str, int]:
        """The memory caps by device name: the profile's, lowered by those learned from running out."""
        caps = {n: c for n, c in (self.profile.memory_caps() if self.profile else {}).items() if c is not None}
        for name, cap in self.caps.items():
            caps[name] = min(cap, caps.get(name, cap))
        return caps

    def _within_caps(self, plan: Plan) -> Plan | None:
        try:
            return capped_plan(plan, self._all_caps(), accumulate=True)
        except ValueError:  # a share on a device that holds nothing: keep the plan in force
            return None

    def capped(self, plan: Plan) -> Plan:
        """``plan`` within the learned :attr:`caps` (re-solved with the profile, if there is one)."""
        return capped_plan(plan, self.caps, profile=self._profile_in_use(), accumulate=self.accumulate)

    def lower_cap(self, name: str, cap: int) -> Plan:
        """Remember that ``name`` holds at most ``cap`` samples; the current batch's plan within it.

        Raises:
            ValueError: If no plan fits the caps (see :func:`~hetsplit.planning.memory.capped_plan`).
        """
        assert self.current is not None
        self.caps[name] = min(cap, self.caps.get(name, cap))
        plan = self.capped(self.current)
        self.by_batch = {k: v for k, v in self.by_batch.items() if k == plan.batch_size}
        self.by_batch[plan.batch_size] = self.current = plan
        return plan

    def observe(self, steps: Iterable[tuple[Plan, dict[str, float]]]) -> None:
        """Feed finished steps' busy times to the rebalancer; adopt the plan it proposes."""
        if self.rebalancer is None:
            return
        self.rebalancer.accumulate = self.accumulate  # also for a rebalancer assigned later
        new = None
        for plan, times in steps:
            new = self.rebalancer.observe(plan, times) or new
        if new is not None and self.accumulate:  # the rebalancer's shares, in micro-batches within the caps
            new = self._within_caps(new)
        if new is not None and (self.current is None or new.sizes != self.current.sizes):
            self.current, self.by_batch = new, {new.batch_size: new}
