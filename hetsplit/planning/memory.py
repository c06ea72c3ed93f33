"""Memory: device memory caps learned while training, applied to profiles and plans (re-planning after an OOM)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from .micro import micro_sizes_within
from .plan import Plan
from .profile import Profile
from .solver import solve


def _with_caps(profile: Profile, caps: Mapping[str, int]) -> Profile:
    """A copy of ``profile`` whose devices named in ``caps`` hold at most that many samples (a cap only lowers)."""
    entries = []
    for e in profile.entries:
        cap = caps.get(e.name)
        if cap is not None and (e.curve.memory_cap is None or cap < e.curve.memory_cap):
            curve = dataclasses.replace(e.curve, memory_cap=int(cap))
            e = dataclasses.replace(e, curve=curve, memory_cap=int(cap))
        entries.append(e)
    return dataclasses.replace(profile, entries=entries)


def fits(plan: Plan, caps: Mapping[str, int]) -> bool:
    """Whether every micro-batch of ``plan`` fits its device's cap."""
    return all(max(m, default=0) <= caps.get(d, math.inf) for d, m in zip(plan.devices, plan.micro_batches))


def capped_plan(
    plan: Plan, caps: Mapping[str, int], *, profile: Profile | None = None, accumulate: bool = True
) -> Plan:
    """``plan`` changed so that no micro-batch exceeds its device's cap in ``caps`` (by device name).

    With a profile the batch is solved again under the caps; without one a device over its
    cap runs its share as the fewest near-equal micro-batches that fit (``accumulate`` must be
    on). A ValueError names the devices and caps when they leave no split.
    """
    if fits(plan, caps):
        return plan
    if profile is not None:
        return solve(_with_caps(profile, caps), plan.batch_size, devices=plan.devices, accumulate=accumulate)
    over = [(d, caps[d]) for d, m in zip(plan.devices, plan.micro_batches) if max(m, default=0) > caps.get(d, math.inf)]
    if not accumulate or any(c < 1 for _, c in over):
        shown = ", ".join(f"{d}: {c}" for d, c in over)
        raise ValueError(
            f"the shares {plan.sizes} break the memory caps ({shown}) and without a profile they cannot be "
            "re-solved; pass accumulate=True (a device then runs its share as micro-batches) or a profile"
        )
    return micro_batched(plan, [caps.get(d) for d in plan.devices])


def micro_batched(plan: Plan, caps: Sequence[int | None]) -> Plan:
    """``plan`` with each share over its cap (one per share, ``None``: none) cut into micro-batches; shares stay."""
    micro = [
        micro_sizes_within(s, c) if c is not None and max(m, default=0) > c else list(m)
        for s, c, m in zip(plan.sizes, caps, plan.micro_batches)
    ]
    return dataclasses.replace(plan, micro_batches=micro)


def cap_after_oom(failed: int, succeeded: Sequence[int]) -> int:
    """The cap after ``failed`` samples ran out of memory: the largest smaller micro-batch that ran, else half."""
    below = [s for s in succeeded if 0 < s < failed]
    return max(below) if below else failed // 2
