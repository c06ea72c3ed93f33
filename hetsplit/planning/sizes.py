"""Sizes: the one policy that turns whatever the user gave into a batch's per-device shares."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from .. import _torch
from ..devices import DeviceLike, canonical_name
from ..tree import tree_map
from . import checks
from .plan import Plan, sizes_from_weights
from .profile import Profile, fingerprint
from .solver import plan_from_sizes, solve


def check_source(arg: str, value: object, kinds: tuple[type, ...] = (Profile,), *, hint: str = "") -> None:
    """Refuse a ``plan=``/``profile=`` argument that is none of ``kinds`` (``None`` passes).

    A file name is refused with the way to load it, never silently ignored (which would fall
    back to a stored profile or a quick calibration). ``hint`` is appended to the message.
    """
    if value is None or isinstance(value, kinds):
        return
    load = "; load a file with hetsplit.Profile.load(path)" if isinstance(value, str | PurePath) else ""
    wanted = " or ".join(k.__name__ for k in kinds)
    raise TypeError(f"{arg} must be a hetsplit {wanted}, got {type(value).__name__}: {value!r}{load}{hint}")


def check_weights(weights: Sequence[float], n_devices: int) -> list[float]:
    """Validate relative throughputs (a sequence, 1-D array or tensor): one finite number >= 0 per device, not all 0."""
    if getattr(weights, "ndim", None) == 1 and hasattr(weights, "tolist"):  # a NumPy array or a tensor
        weights = weights.tolist()
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise TypeError(f"weights must be a list of numbers, one per device, got {type(weights).__name__}: {weights!r}")
    values = list(weights)
    bad = [w for w in values if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating)]
    if bad:
        raise TypeError(f"weights must be numbers, got {values!r}; e.g. weights=[4, 1] for an 80/20 split")
    if len(values) != n_devices:
        raise ValueError(f"got {len(values)} weights {values} for {n_devices} devices; give one weight per device")
    sizes_from_weights(1, values)  # finite, >= 0, not all zero
    return [float(w) for w in values]


def check_profile(profile: Profile, devices: Sequence[DeviceLike], model: Any = None) -> None:
    """Refuse a profile not recorded for these ``devices`` (and this ``model``, unless ``None``), before any work.

    Its curves would otherwise decide shares they know nothing about. A profile without a
    recorded fingerprint (timings taken elsewhere, a quick calibration) serves any model.
    """
    names = list(dict.fromkeys(canonical_name(d) for d in devices))
    missing = []
    for name in names:
        try:
            profile.entry(name)
        except KeyError:
            missing.append(name)
    if missing:
        raise ValueError(
            f"the profile has no timings of {', '.join(missing)} (it was recorded for {', '.join(profile.devices)}"
            f"{f' on {profile.host}' if profile.host else ''}); profile these devices "
            "(hetsplit.profile(model, sample, devices)), or pass plan= or weights="
        )
    recorded = profile.model.get("fingerprint")
    if model is None or not recorded:
        return

    mine = fingerprint(model)
    if mine != recorded:
        theirs = profile.model.get("name") or "a model"
        ours = type(_torch.uncompiled(model)).__name__
        raise ValueError(
            f"the profile was recorded for another model: {theirs} (fingerprint {recorded}), but this model is "
            f"{ours} (fingerprint {mine}); profile this model (hetsplit.profile(model, sample, "
            "devices)), or pass plan= or weights="
        )


def resolve_plan(
    batch: int,
    devices: Sequence[DeviceLike],
    *,
    plan: Plan | None = None,
    profile: Profile | None = None,
    weights: Sequence[float] | None = None,
    fallback: Callable[[], Profile] | None = None,
    accumulate: bool = False,
) -> Plan:
    """The plan for a batch of ``batch`` samples over ``devices``, from whatever was given: every engine asks here.

    Sources in order: ``plan`` if it splits exactly ``batch``; ``profile`` solved for ``batch``;
    ``weights`` (largest-remainder rounding); then a ``plan`` for another batch size is an
    error; else ``fallback()`` (a stored profile or a quick calibration), solved.
    """
    names = [canonical_name(d) for d in devices]
    checks.batch_size(batch, "the batch size")
    check_source("plan", plan, (Plan,))
    check_source("profile", profile, (Profile,))
    if weights is not None and (plan is not None or profile is not None):
        raise ValueError("give weights, or a plan and/or profile, not both")
    if plan is not None and list(plan.devices) != names:
        raise ValueError(f"the plan is for devices {plan.devices}, but the split is over {names}")
    if plan is not None and plan.batch_size == batch:
        return plan
    if profile is not None:
        check_profile(profile, names)
        return solve(profile, int(batch), devices=names, accumulate=accumulate)
    if weights is not None:
        return plan_from_sizes(None, names, sizes_from_weights(int(batch), check_weights(weights, len(names))))
    if plan is not None:
        raise ValueError(
            f"the plan splits {plan.batch_size} samples, but the batch has {batch} (its sizes {plan.sizes} sum to "
            f"{plan.batch_size}, but the batch has {batch}); pass profile= to solve every "
            "batch size, weights= to split any batch in proportion, or drop_last=True to the DataLoader"
        )
    if fallback is None:
        raise ValueError(f"nothing says how to split {batch} samples over {names}; give weights, a plan or a profile")
    return solve(fallback(), int(batch), devices=names, accumulate=accumulate)


# The fewest values a BatchNorm may normalise per channel in one share. With n values the
# normalised ones always have mean 0 and variance 1: at n = 2 each is -1 or +1 whatever the
# input, and the variance estimate is off by sqrt(2 / (n - 1)) on average (141 % at 2, 53 % at 8).
# Measured (ResNet-18 on 8x8 synthetic images, so 1x1 maps in its last stage; batch 32, 16 SGD
# steps; one share fixed at n samples; 3 seeds, n = 3 and up in 2): n = 2 diverged every time
# (accuracy 0.08-0.14, chance 0.1), n = 3 fell to 0.78 and 0.26 (unsplit 0.95 and 0.81), n = 4,
# 6 and 8 reached 0.73-0.96 (noisy after 16 steps). 8 is twice the least that trained every time.
MIN_BATCHNORM_VALUES = 8


def batchnorm_minimum(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, batch: int) -> int:
    """The fewest samples a share of ``model`` may hold: 1 without BatchNorm, else at least 2.

    Enough that every BatchNorm layer normalises at least :data:`MIN_BATCHNORM_VALUES` values
    per channel, the map sizes traced by one forward of ``model(*args, **kwargs)`` on the meta
    device; a model that cannot run there gets 2, with a warning.
    """
    if not has_batchnorm(model):
        return 1
    per_sample = _batchnorm_values(model, args, dict(kwargs or {}), batch)
    if per_sample is None:
        return 2
    return max(2, math.ceil(MIN_BATCHNORM_VALUES / per_sample))


def model_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A profiler's ``sample`` as ``(args, kwargs)``: ``**sample`` for a dict, ``*sample`` for a tuple or list."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)) and not hasattr(sample, "_fields"):
        return tuple(sample), {}
    return (sample,), {}


def _batchnorm_values(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int) -> float | None:
    """The fewest values per channel one sample gives any BatchNorm of ``model``, traced on the meta device."""
    import warnings

    import torch

    net = _torch.uncompiled(model)
    seen: list[int] = []

    def record(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] > 0:
            seen.append(x.numel() // x.shape[1])  # the values one channel is normalised over

    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    state = {n: meta(t) for n, t in [*net.named_parameters(), *net.named_buffers()]}
    hooks = [m.register_forward_pre_hook(record) for m in net.modules() if _torch.is_batchnorm(m)]
    try:
        on_meta = tree_map(meta, (args, kwargs))
        with torch.no_grad():
            torch.func.functional_call(net, state, tuple(on_meta[0]), dict(on_meta[1]))
    except Exception as e:  # data-dependent code (.item(), a branch on values) cannot run on meta tensors
        if not seen:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            warnings.warn(
                f"hetsplit: could not trace the model's BatchNorm map sizes on the meta device ({first}); "
                "every share holds at least 2 samples, however small its maps: set the shares yourself "
                "(plan= or weights=) if a small share's statistics matter",
                stacklevel=3,
            )
            return None
    finally:
        for h in hooks:
            h.remove()
    return min(seen) / batch if seen else None


def at_least(
    sizes: Sequence[int],
    caps: Sequence[float],
    minimum: int = 2,
    step_time: Callable[[list[int]], float] | None = None,
) -> tuple[list[int], list[tuple[int, str]]]:
    """``sizes`` with no share of fewer than ``minimum`` samples, where ``caps`` allow; and what moved.

    Each small share (smallest first) either gives its samples to the largest shares with room
    (the device sits out) or takes samples from the largest shares, each keeping the minimum:
    whichever ``step_time`` finds faster, else whichever moves fewer samples (giving away on a
    tie). A share with nowhere to go stays. The notes are ``(index, what became of it)``.
    """
    out = [int(s) for s in sizes]
    notes: list[tuple[int, str]] = []
    if sum(out) < 2:
        return out, notes
    for i in sorted((i for i, s in enumerate(out) if 0 < s < minimum), key=lambda i: out[i]):
        s = out[i]
        if not 0 < s < minimum:  # grown by another share's samples meanwhile
            continue
        options = [o for o in (_given_away(out, caps, i), _raised(out, caps, i, minimum)) if o is not None]
        if not options:
            notes.append((i, f"keeps {s} samples, under the minimum of {minimum}: no other device has room"))
            continue
        if step_time is not None:
            best = min(options, key=step_time)  # min keeps the first (giving away) on a tie
        else:
            best = min(options, key=lambda o: sum(abs(a - b) for a, b in zip(o, out)))
        out = best
        said = f"sits out (its {s} samples moved)" if out[i] == 0 else f"raised from {s} to {out[i]} samples"
        notes.append((i, said))
    return out, notes


def _given_away(sizes: list[int], caps: Sequence[float], i: int) -> list[int] | None:
    """``sizes`` with share ``i``'s samples moved, one at a time, to the largest shares with room; else ``None``."""
    out = list(sizes)
    while out[i] > 0:
        # Never into an empty share (that would make another small one), never over a cap.
        room = [j for j, s in enumerate(out) if j != i and s >= 1 and s + 1 <= caps[j]]
        if not room:
            return None
        j = max(room, key=lambda j: out[j])
        out[j], out[i] = out[j] + 1, out[i] - 1
    return out


def _raised(sizes: list[int], caps: Sequence[float], i: int, minimum: int) -> list[int] | None:
    """``sizes`` with share ``i`` raised to ``minimum`` from the largest shares, each keeping it; else ``None``."""
    if caps[i] < minimum:
        return None
    out = list(sizes)
    while out[i] < minimum:
        donors = [j for j, s in enumerate(out) if j != i and s - 1 >= minimum]
        if not donors:
            return None
        j = max(donors, key=lambda j: out[j])
        out[j], out[i] = out[j] - 1, out[i] + 1
    return out


def with_minimum_shares(
    plan: Plan,
    minimum: int = 2,
    *,
    profile: Profile | None = None,
    room: Sequence[float] | Mapping[str, int] | None = None,
    accumulate: bool = False,
) -> Plan:
    """``plan`` with no share under ``minimum`` samples (:func:`at_least`), re-planned, its notes saying why.

    The one BatchNorm rule of every engine. ``room`` caps each share (a number per share or
    caps by device name; default: the profile's memory caps); the profile's predicted step
    chooses between a small share sitting out and being raised.
    """
    if not any(0 < s < minimum for s in plan.sizes):
        return plan
    if room is None:
        room = {d: c for d, c in (profile.memory_caps() if profile is not None else {}).items() if c is not None}
    if isinstance(room, Mapping):
        caps = room
        room = [caps.get(d, math.inf) for d in plan.devices]

    def step_time(sizes: list[int]) -> float:
        return plan_from_sizes(profile, plan.devices, sizes, accumulate=accumulate).step_time

    sizes, changes = at_least(plan.sizes, list(room), minimum, step_time if profile is not None else None)
    why = (
        f"BatchNorm: a share under {minimum} samples normalises fewer than {MIN_BATCHNORM_VALUES} values per "
        "channel on the model's smallest map"
        if minimum > 2
        else "BatchNorm cannot train on one sample"
    )
    notes = [f"{plan.devices[i]} {said} ({why})" for i, said in changes]
    new = plan if sizes == list(plan.sizes) else plan_from_sizes(profile, plan.devices, sizes, accumulate=accumulate)
    return dataclasses.replace(new, notes=[*new.notes, *notes]) if notes else new


def has_batchnorm(model: Any) -> bool:
    """Whether ``model`` holds a BatchNorm layer (any subclass of torch's BatchNorm base)."""
    return model is not None and any(_torch.is_batchnorm(m) for m in model.modules())


def scaled_plan(plan: Plan, batch: int, devices: Sequence[DeviceLike] | None = None) -> Plan:
    """``plan``'s shares in proportion for a batch of ``batch`` samples, with no predicted times.

    What every loader of another batch than the planned one follows (evaluation, the last short
    batch); ``devices`` relabels the shares.
    """
    if batch == plan.batch_size and devices is None:
        return plan
    names = list(plan.devices) if devices is None else list(devices)
    if len(names) != len(plan.sizes):
        raise ValueError(f"{len(names)} devices {names} for a plan of {len(plan.sizes)} shares {list(plan.sizes)}")
    return resolve_plan(batch, names, weights=plan.sizes)


def even_plan(batch: int, devices: Sequence[DeviceLike]) -> Plan:
    """The even split of ``batch`` samples over ``devices``, no times: what an engine follows before it has a plan."""
    return resolve_plan(batch, devices, weights=[1.0] * len(devices))


def priced_stand_ins(plan: Plan, prof: Profile | None, stand_in: int) -> Plan:
    """``plan`` with each zero share's predicted time: its rank runs ``stand_in`` samples weighted 0.

    On a slow rank they can take longer than the fast ranks' whole shares (ResNet-18 at a
    quarter speed: 1.1 s against 0.4 s): counted as nothing, the prediction was 40-80 % low.
    """
    if prof is None or stand_in <= 0 or all(s > 0 for s in plan.sizes):
        return plan
    times = [
        prof.entry(plan.devices[i]).curve(stand_in) if s == 0 else t
        for i, (t, s) in enumerate(zip(plan.times, plan.sizes))
    ]
    return dataclasses.replace(plan, times=times)


def stand_ins_used(plan: Plan, prof: Profile | None, stand_in: int) -> Plan:
    """``plan`` with each zero share given the samples its rank runs as stand-ins anyway (torchrun).

    A zero share's rank runs ``stand_in`` samples all the same, so real samples there can take
    work off the busiest ranks (two equal CPUs, 8 samples: [8, 0] where [6, 2] is never slower).
    Samples move one at a time from the rank predicted slowest; kept only if the step (stand-ins
    priced) is no slower. Plans of several micro-batches per rank are left as solved.
    """
    if prof is None or stand_in <= 0 or 0 not in plan.sizes or max(map(len, plan.micro_batches)) > 1:
        return plan
    caps = prof.memory_caps()
    before = priced_stand_ins(plan, prof, stand_in).slowest
    sizes = list(plan.sizes)
    for i, s in enumerate(plan.sizes):
        if s != 0:
            continue
        room = min(stand_in, caps.get(plan.devices[i]) or stand_in)
        trial = list(sizes)
        for _ in range(room):  # a donor keeps more than stand_in: no new zero share, no single sample
            donors = [j for j, b in enumerate(trial) if j != i and b > stand_in]
            if not donors:
                break
            times = plan_from_sizes(prof, plan.devices, trial).times
            trial[max(donors, key=lambda j: times[j])] -= 1
            trial[i] += 1
        if trial[i] == room:  # all of them or none: a share of one sample would trip BatchNorm
            sizes = trial
    if sizes == list(plan.sizes):
        return plan
    moved = plan_from_sizes(prof, plan.devices, sizes)
    # (a tolerance: the curve and the packed table that plan_from_sizes evaluates round differently)
    if priced_stand_ins(moved, prof, stand_in).slowest > before * (1 + 1e-9):
        return plan
    return dataclasses.replace(moved, noise=plan.noise)
