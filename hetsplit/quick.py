"""Quick: a model-agnostic profile of the devices in about a second, for when nothing better exists."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from .devices import Device, DeviceLike, parse_devices
from .planning.curve import Curve
from .planning.profile import DeviceProfile, Measurement, Profile
from .profiler import profile
from .store import warn_at_caller

__all__ = ["quick_profile"]

_QUICK: dict[str, DeviceProfile] = {}
_NOTICE_SHOWN = False


def quick_profile(devices: str | Sequence[DeviceLike]) -> Profile:
    """A quick, model-agnostic profile of each device (a small MLP), cached for the process.

    Used by :func:`hetsplit.balanced_split` when neither weights nor a profile is given
    and no stored profile covers the devices. Only real devices are timed; an emulated
    one (``cpu@0.25``) gets its real device's curve slowed by its speed, which is what
    emulation does, without the noise of timing sleeps. When every device is the CPU,
    real or emulated, it times with one intra-op thread (the rule of ``hetsplit
    profile``, ``bench`` and ``demo``: such devices share the cores, and several threads
    on a busy machine time a step's fixed cost erratically, which would leave an emulated
    device nothing); torch's setting is restored afterwards. Each curve is fitted to the
    fastest of five repeats at each batch size, not their median (the measurements keep
    every repeat): a model-agnostic calibration wants capacity, and timing noise only
    adds time. The first call warns once, at the caller's line, that a profile of the
    real model is more accurate.
    """
    global _NOTICE_SHOWN
    devs = parse_devices(devices)
    bases = [parse_devices([d.base])[0] for d in dict.fromkeys(devs)]
    missing = [d for d in dict.fromkeys(bases) if d.name not in _QUICK]
    if missing:
        gen = torch.Generator().manual_seed(0)
        sample = torch.randn(64, 512, generator=gen)
        # Per-sample work (~3 MFLOP) large enough that a step's fixed cost (~0.5 ms of Python
        # and dispatch) is a few percent at batch 256, as in the models people train; with a
        # toy workload the fixed cost dominates and an emulated device's 4x-slowed share of it
        # would leave it nothing. The calibration still stays near a second.
        workload = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
        threads = torch.get_num_threads()
        if all(d.type == "cpu" for d in devs):
            torch.set_num_threads(1)
        try:
            prof = profile(
                workload,
                sample,
                missing,
                batch_sizes=[64, 256, 1024],
                repeats=5,
                warmup=1,
                time_budget=1.0 * len(missing),
                find_memory_cap=False,
                progress=False,
                model_name="calibration-mlp",
            )
        finally:
            torch.set_num_threads(threads)
        _QUICK.update({e.name: _fastest_fit(e) for e in prof.entries})
    if not _NOTICE_SHOWN:
        _NOTICE_SHOWN = True
        warn_at_caller(
            "hetsplit: splitting by a quick built-in calibration of each device; a profile of your own model "
            "(hetsplit.profile(...) or 'hetsplit profile') gives a more accurate split"
        )
    entries = [_emulated_entry(_QUICK[b.name], d) for d, b in zip(dict.fromkeys(devs), bases)]
    return Profile(entries, model={"name": "calibration-mlp"}, source="calibration")


def _fastest_fit(entry: DeviceProfile) -> DeviceProfile:
    """``entry`` with its curve fitted to each batch size's fastest repeat instead of the median.

    A model-agnostic calibration wants the device's capacity, and timing noise only ever
    adds time: one hiccup in the median at the smallest batch flattened the curve's low
    end, and an emulated 4x-slower device then got nothing (CI saw [256, 0]).
    """
    curve = Curve.fit([(m.batch, min(m.times)) for m in entry.measurements], entry.curve.memory_cap)
    return dataclasses.replace(entry, curve=curve)


def _emulated_entry(base: DeviceProfile, device: Device) -> DeviceProfile:
    """``base`` (a real device's entry) as ``device``: itself, or slowed by the emulated speed."""
    if not device.emulated:
        return base
    slow = 1.0 / device.speed
    info = dataclasses.replace(
        base.info, name=device.name, emulated=True, speed=device.speed,
        description=f"{base.info.description} (emulated at {device.speed:g}x: its curve x{slow:g})",
    )  # fmt: skip
    measured = [Measurement(m.batch, [t * slow for t in m.times]) for m in base.measurements]
    return dataclasses.replace(base, info=info, measurements=measured, curve=base.curve.scaled(slow))
