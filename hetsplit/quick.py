"""Quick: a model-agnostic profile of the devices in about a second, for when nothing better exists."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from . import store
from .devices import Device, DeviceLike, parse_devices
from .planning.curve import Curve
from .planning.profile import Profile, fingerprint, latest_profile
from .planning.records import DeviceProfile, Measurement
from .profiler import emulation_warning, profile
from .store import warn_at_caller

_QUICK: dict[str, DeviceProfile] = {}
_NOISY: dict[str, str] = {}  # device -> what was noisy in its calibration, when it stayed noisy
_EMULATION: dict[str, str] = {}  # emulated device -> '' (it ran 1/speed slower) or the line saying it did not
_NOTICE_SHOWN = False
_REASONS_SHOWN: set[str] = set()
# The calibration is trusted once, at every batch size, its two fastest repeats agree within
# this factor: the fastest is then no lucky outlier, and no hiccup hides in it either.
_STABLE = 1.25
_ROUNDS = 3  # calibrations at most, their repeats pooled, before the split is called uncertain


def default_profile(devices: str | Sequence[DeviceLike], model: nn.Module | str | None = None) -> Profile:
    """The profile used when nothing else says how to split: the newest stored one, else a quick one.

    A stored profile of this host and these devices, of ``model`` (an ``nn.Module`` or its
    fingerprint) when given: a profile of LeNet does not decide an MLP's split. Else
    :func:`quick_profile`, whose notice says why no stored profile applied.
    """
    devs = parse_devices(devices)
    names = [d.name for d in devs]
    if isinstance(model, nn.Module):
        model = fingerprint(model)
    found = latest_profile(names, model=model)
    if found is not None:
        return found
    reason = None
    if model is not None:
        others = store._stored_profiles(names)
        if others:
            measured = others[0].doc.get("model")
            what = measured.get("name") if isinstance(measured, dict) else None
            reason = (
                f"the stored profile {others[0].path} covers these devices but measured another model"
                + (f" ({what})" if what else "")
                + "; profile this one"
            )
    return quick_profile(devs, reason=reason)


def quick_profile(devices: str | Sequence[DeviceLike], *, reason: str | None = None) -> Profile:
    """A quick, model-agnostic profile of each device (a small MLP), cached for the process (docs/cli.md).

    Only real devices are timed; an emulated one gets its real device's curve slowed by its
    speed, and is timed once beside it to warn if it did not run ``1/speed`` slower. A busy
    machine is calibrated again (at most three times) until each point's two fastest repeats
    agree within 25 %, else a warning says the split is uncertain. The first call warns once
    that a profile of the real model is more accurate (with ``reason``: why none applied).
    """
    global _NOTICE_SHOWN
    devs = parse_devices(devices)
    bases = [parse_devices([d.base])[0] for d in dict.fromkeys(devs)]
    missing = [d for d in dict.fromkeys(bases) if d.name not in _QUICK]
    if missing:
        workload, sample = _workload()
        pooled: dict[str, DeviceProfile] = {}
        for _ in range(_ROUNDS):
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
            pooled = {e.name: _pooled(pooled.get(e.name), e) for e in prof.entries}
            noisy = {name: why for name, e in pooled.items() if (why := _noise(e))}
            if not noisy:
                break
        _QUICK.update({name: _throughput_fit(e) for name, e in pooled.items()})
        _NOISY.update(noisy)
        if noisy:
            shown = "; ".join(f"{name}: {why}" for name, why in noisy.items())
            warn_at_caller(
                f"hetsplit: the quick built-in timings stayed noisy after {_ROUNDS} tries ({shown}): the "
                "machine is busy, so this split is uncertain and may swing between runs; profile your model "
                "on a quieter machine ('hetsplit profile --threads 1') or pass weights="
            )
    unchecked = [d for d in dict.fromkeys(devs) if d.emulated and d.speed < 1 and d.name not in _EMULATION]
    if unchecked:
        _check_emulation(unchecked)
    if not _NOTICE_SHOWN or (reason is not None and reason not in _REASONS_SHOWN):
        _NOTICE_SHOWN = True
        why = ""
        if reason is not None:
            _REASONS_SHOWN.add(reason)
            why = f" ({reason})"
        warn_at_caller(
            f"hetsplit: splitting by a quick built-in calibration of each device{why}; a profile of your own "
            "model (hetsplit.profile(...) or 'hetsplit profile') gives a more accurate split"
        )
    entries = [_emulated_entry(_QUICK[b.name], d) for d, b in zip(dict.fromkeys(devs), bases)]
    source = "calibration (noisy)" if any(b.name in _NOISY for b in bases) else "calibration"
    if any(_EMULATION.get(d.name) for d in devs):
        source += " (emulation unreliable)"
    return Profile(entries, model={"name": "calibration-mlp"}, source=source)


def _workload() -> tuple[nn.Module, torch.Tensor]:
    """The calibration's model and sample, the same every time."""
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(64, 512, generator=gen)
    # Per-sample work (~3 MFLOP) large enough that a step's fixed cost (~0.5 ms of Python
    # and dispatch) is a few percent at batch 256, as in the models people train.
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)), sample


def _check_emulation(devices: Sequence[Device]) -> None:
    """Time each emulated device beside its real one for a moment; warn once if it is not 1/speed slower.

    On a machine too loaded for the throttle to hold, the split still follows the declared
    speeds but the steps will not balance: one line says so rather than a silent mismatch.
    """
    workload, sample = _workload()
    real = list(dict.fromkeys(parse_devices([d.base])[0] for d in devices))
    # One size (within every emulated memory), a few interleaved repeats: short even for a
    # device at a hundredth of the speed.
    batch = min([64, *(d.max_batch for d in devices if d.max_batch is not None)])
    prof = profile(
        workload,
        sample,
        [*real, *devices],
        batch_sizes=[batch],
        repeats=3,
        warmup=1,
        time_budget=60.0,
        find_memory_cap=False,
        progress=False,
        model_name="calibration-mlp",
        check_emulation=False,  # said below, as the quick calibration's
    )
    line = emulation_warning(prof) or ""
    _EMULATION.update({d.name: line for d in devices})
    if line:
        warn_at_caller(f"hetsplit: quick calibration: {line}")


def _pooled(before: DeviceProfile | None, entry: DeviceProfile) -> DeviceProfile:
    """``entry`` with the repeats of an earlier calibration of the same device added, batch by batch."""
    if before is None:
        return entry
    times = {m.batch: list(m.times) for m in before.measurements}
    for m in entry.measurements:
        times.setdefault(m.batch, []).extend(m.times)
    return dataclasses.replace(entry, measurements=[Measurement(b, ts) for b, ts in sorted(times.items())])


def _noise(entry: DeviceProfile) -> str:
    """Why ``entry``'s timings cannot be trusted ('' when they can): a point whose two fastest repeats disagree."""
    for m in entry.measurements:
        fastest = sorted(m.times)[:2]
        if len(fastest) == 2 and fastest[1] > _STABLE * fastest[0]:
            gap = fastest[1] / fastest[0] - 1
            return f"at batch {m.batch} the two fastest of {len(m.times)} steps differ by {gap:.0%}"
    return ""


def _throughput_fit(entry: DeviceProfile) -> DeviceProfile:
    """``entry`` with a curve proportional to the batch, at the device's best measured seconds per sample.

    A calibration knows each device's throughput, not the user's model's fixed cost per step
    (the noisiest number of all): fitted with it, small batches went by the curve's low end
    alone ([50, 0] for a CNN on cpu,cpu@0.25 whose own profile says [45, 5]). The best seconds
    per sample over sizes and repeats, as timing noise only ever adds time.
    """
    rate = min(min(m.times) / m.batch for m in entry.measurements)
    sizes = [float(m.batch) for m in entry.measurements]
    curve = Curve(sizes, [b * rate for b in sizes], 0.0, rate, entry.curve.memory_cap)
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
