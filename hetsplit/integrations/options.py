"""Options: the arguments every integration shares, carried in one object and checked one way.

``weighting`` stays each integration's own: the Trainer weights its loss instead, FSDP2 only at its outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetsplit.planning import Plan, Profile, Rebalancer
from hetsplit.planning.sizes import check_source

from .core import check_plan

# How gradients are weighted: "hook" (a DDP comm hook), "outputs" (the gradient into the
# model's outputs is scaled), "none" (DDP's plain mean, for a loss already normalised over
# the global batch; not every integration offers it).
WEIGHTINGS = ("hook", "outputs", "none")

# What hetsplit.distributed.plan is called with when the user does not say: a 10 s profile
# per rank and a short calibration (4 DDP steps), the same in every integration.
PLAN_KWARGS: Mapping[str, Any] = {"time_budget": 10.0, "calibrate": 4}


@dataclass(frozen=True)
class HeteroOptions:
    """The arguments every hetsplit integration shares, as keywords of each or this object whole (``options=``).

    Args:
        devices: One device per process: ``"cuda:0,cpu@0.25"`` or a list (default
            ``$HETSPLIT_DEVICES``, set by ``hetsplit launch``, else the framework's own
            devices). Emulated devices run at their speed and memory.
        plan: The plan for every process (``plan.sizes[rank]`` samples per step); else one
            is profiled on every process's device at the first training loader.
        profile: A profile to solve the plan from instead of timing the model.
        global_batch_size: Samples per step over all processes (default: the framework's,
            processes × the loader's ``batch_size``).
        rebalance: Re-solve the shares from measured step times every this many steps (0:
            never), or a :class:`~hetsplit.Rebalancer` policy; not with a plan with micro-batches.
        plan_kwargs: Passed to :func:`hetsplit.distributed.plan` (``time_budget``,
            ``calibrate``, ``batch_sizes``, ``weights``, ``accumulate``, ...), over
            :data:`PLAN_KWARGS`.
        quiet: Rank 0 says nothing about the split and its steps (``HETSPLIT_QUIET=1`` too).

    Example:
        >>> options = HeteroOptions(devices="cpu,cpu@0.25", rebalance=20)
        >>> strategy = HeteroDDPStrategy(options=options)  # the same as the keywords
    """

    devices: str | Sequence[Any] | None = None
    plan: Plan | None = None
    profile: Profile | None = None
    global_batch_size: int | None = None
    rebalance: int | Rebalancer = 0
    plan_kwargs: Mapping[str, Any] | None = None
    quiet: bool = False

    @classmethod
    def take(cls, who: str, options: HeteroOptions | None, kwargs: dict[str, Any]) -> HeteroOptions:
        """The options of an integration made with ``options=`` or with the fields as keywords (popped from ``kwargs``).

        Raises:
            TypeError: As :meth:`given`.
        """
        keywords = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        return cls.given(who, options, **keywords)

    @classmethod
    def given(cls, who: str, options: HeteroOptions | None, **keywords: Any) -> HeteroOptions:
        """The options an integration was made with: ``options`` whole, or built from its ``keywords``.

        Raises:
            TypeError: If ``options`` is not a :class:`HeteroOptions`, or comes with a keyword
                it also holds set to something else than its default (naming them).
        """
        if options is None:
            return cls(**keywords)
        if not isinstance(options, HeteroOptions):
            raise TypeError(f"{who}(options=...) must be a HeteroOptions, got {type(options).__name__}: {options!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        both = [k for k, v in keywords.items() if not _is_default(v, defaults[k])]
        if both:
            raise TypeError(
                f"{who}: options= and {', '.join(f'{k}=' for k in both)} both given; pass the options object "
                f"alone (dataclasses.replace(options, {both[0]}=...) changes one of them) or the keywords alone"
            )
        return options

    @property
    def device_list(self) -> str | None:
        """``devices`` as one comma-separated string (``None`` when not given)."""
        if self.devices is None or isinstance(self.devices, str):
            return self.devices
        return ",".join(map(str, self.devices))

    @property
    def plan_arguments(self) -> dict[str, Any]:
        """The arguments for :func:`hetsplit.distributed.plan`: :data:`PLAN_KWARGS` updated with ``plan_kwargs``."""
        return {**PLAN_KWARGS, **(self.plan_kwargs or {})}

    def check(self, who: str, weighting: str = "hook", weightings: Sequence[str] = WEIGHTINGS) -> None:
        """Check every option (and ``weighting`` among ``weightings``) the same way in every integration.

        Args:
            who: The class the user made (named in every message).
            weightings: The weightings ``who`` offers.

        Raises:
            TypeError: ``devices`` neither a string nor a list of devices, ``plan`` not a
                :class:`~hetsplit.Plan`, ``profile`` not a :class:`~hetsplit.Profile`,
                ``plan_kwargs`` not a mapping, ``quiet`` not a bool.
            ValueError: An unknown ``weighting``; a ``global_batch_size`` that is not a
                positive integer or disagrees with the plan; a ``rebalance`` that is neither a
                number of steps >= 0 nor a :class:`~hetsplit.Rebalancer`, or one with a plan
                with micro-batches.
        """
        devices, plan, profile, batch = self.devices, self.plan, self.profile, self.global_batch_size
        if devices is not None and (isinstance(devices, bytes) or not isinstance(devices, str | Sequence)):
            raise TypeError(
                f"{who}(devices=...) must be a string such as 'cuda:0,cpu' or a list with one device per process, "
                f"got {type(devices).__name__}: {devices!r}"
            )
        if weighting not in weightings:
            raise ValueError(f"{who}(weighting={weighting!r}): use one of {', '.join(map(repr, weightings))}")
        check_source(
            f"{who}(plan=...)", plan, (Plan,), hint="; for fixed shares use hetsplit.planning.plan_from_sizes("
            "None, ['rank0', 'rank1'], [6, 2]) or plan_kwargs={'weights': [3, 1]}"
        )  # fmt: skip
        check_source(f"{who}(profile=...)", profile, (Profile,))
        if not isinstance(self.quiet, bool):
            raise TypeError(f"{who}(quiet=...) must be True or False, got {type(self.quiet).__name__}: {self.quiet!r}")
        if self.plan_kwargs is not None and not isinstance(self.plan_kwargs, Mapping):
            raise TypeError(
                f"{who}(plan_kwargs=...) must be a dict, got {type(self.plan_kwargs).__name__}: {self.plan_kwargs!r}"
            )
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(
                f"{who}(global_batch_size=...) must be a positive number of samples per step, got {batch!r}"
            )
        if plan is not None and batch is not None and plan.batch_size != batch:
            raise ValueError(
                f"{who}: global_batch_size={batch} but the plan splits {plan.batch_size}; "
                "leave global_batch_size out (the plan sets it) or solve the plan for it"
            )
        rebalance = self.rebalance
        if not isinstance(rebalance, Rebalancer) and (
            isinstance(rebalance, bool) or not isinstance(rebalance, int) or rebalance < 0
        ):
            raise ValueError(
                f"{who}(rebalance={rebalance!r}): give a number of steps >= 1, 0 for no rebalancing, "
                "or a hetsplit.Rebalancer"
            )
        check_plan(who, plan, None, rebalance=rebalance)


_FIELDS = tuple(f.name for f in dataclasses.fields(HeteroOptions))


def _is_default(value: Any, default: Any) -> bool:
    # `rebalance=0` and `quiet=False` are the defaults, `rebalance=False` is not (a bool is refused).
    return value is default or (type(value) is type(default) and value == default)
