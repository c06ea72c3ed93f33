"""Split: `balanced_split`, one call from a batch to balanced shards on their devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .profiles import Profile
from .devices import DeviceLike, parse_devices
from .scatter_gather import batch_length, scatter
from .solver import Plan, check_sizes, sizes_from_weights, solve

__all__ = ["balanced_split", "split_sizes"]


def split_sizes(
    batch: int,
    devices: str | Sequence[DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    profile: Profile | Plan | None = None,
) -> list[int]:
    """The per-device sizes :func:`balanced_split` uses for a batch of ``batch`` samples.

    Sources, in order: ``weights`` (relative throughputs, largest-remainder rounding);
    a :class:`Plan` (its sizes, which must match the batch) or a :class:`Profile` (solved
    for this batch); else the newest stored profile covering the devices (see
    :func:`hetsplit.store.latest_profile`); else a quick built-in calibration.

    Raises:
        ValueError: If ``weights`` has the wrong length or invalid values, both weights
            and a profile are given, or a plan does not match the devices or batch.
    """
    devs = parse_devices(devices)
    names = [d.name for d in devs]
    if batch < 1:
        raise ValueError(f"the batch is empty (0 samples along the split dimension); nothing to split across {names}")
    if weights is not None and profile is not None:
        raise ValueError("give weights or profile, not both")
    if weights is not None:
        if len(weights) != len(devs):
            raise ValueError(f"got {len(weights)} weights {list(weights)} for {len(devs)} devices {names}")
        return sizes_from_weights(batch, weights)
    if isinstance(profile, Plan):
        if profile.devices != names:
            raise ValueError(f"the plan is for devices {profile.devices}, but the split is over {names}")
        return check_sizes(profile.sizes, batch, len(devs))
    if profile is None:
        from .store import latest_profile

        profile = latest_profile(names)
    if profile is None:
        from .profiler import calibrate

        profile = calibrate(devs)
    return solve(profile, batch, devices=names).sizes


def balanced_split(
    X: torch.Tensor,
    devices: str | Sequence[DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    profile: Profile | Plan | None = None,
    dim: int = 0,
) -> list[torch.Tensor]:
    """Cut ``X`` into shards sized to each device's speed, each moved to its device.

    The uneven counterpart of ``nn.parallel.scatter(X, devices)``: concatenating the
    shards (on one device) gives ``X`` back exactly. It always works with just
    ``(X, devices)``; see :func:`split_sizes` for where the sizes come from.

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
    n = batch_length(X, dim)
    sizes = split_sizes(n, devices, weights=weights, profile=profile)
    return scatter(X, devices, sizes, dim=dim)
