"""Profiler: time a real training step of the user's model on each device over a ladder of batch sizes."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from . import _torch, emulation, timing
from .devices import Device, DeviceLike, describe, label_device, parse_device, parse_devices
from .emulation import is_out_of_memory, release_after_oom
from .planning import checks
from .planning.curve import Curve
from .planning.profile import Profile, fingerprint
from .planning.records import DeviceProfile, Measurement, MemoryModel
from .planning.sizes import model_call
from .tree import batch_length, flatten, move, take_rows

MAX_PROBE = 1 << 16  # the largest batch a profile tries (the default max_probe, the sharded profile's too)

LossFn = Callable[..., torch.Tensor]


def default_ladder(max_batch: int = 256) -> list[int]:
    """Powers of two from 2 up to ``max_batch`` (and ``max_batch`` itself): BatchNorm cannot train on one sample."""
    ladder, b = [], 2
    while b < max_batch:
        ladder.append(b)
        b *= 2
    return [*ladder, max_batch]


def check_ladder(batch_sizes: Sequence[int] | None, max_probe: int = MAX_PROBE) -> list[int]:
    """The ladder a profile climbs: ``batch_sizes`` sorted and deduplicated (default :func:`default_ladder`).

    None above ``max_probe``, checked before any device work: a batch of a billion would take
    minutes and gigabytes before failing.
    """
    if batch_sizes is None:
        return default_ladder()
    if isinstance(batch_sizes, str | bytes) or not isinstance(batch_sizes, Sequence):
        raise ValueError(f"batch sizes must be a list of positive integers, got {batch_sizes!r}")
    ladder = sorted({checks.batch_count(b, "a batch size in the ladder") for b in batch_sizes})
    if not ladder:
        raise ValueError("batch sizes must be positive integers, got an empty list")
    if ladder[-1] > max_probe:
        raise ValueError(
            f"batch size {ladder[-1]:,} is above max_probe={max_probe:,}, the largest batch a profile tries; "
            "profile at the shard sizes you will use (raise max_probe for larger ones)"
        )
    return ladder


def _default_loss(output: Any) -> torch.Tensor:
    leaves, _ = flatten(output)
    parts = [
        t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not parts:
        raise ValueError("the model's output has no differentiable tensor; pass loss_fn=... that returns a scalar loss")
    return torch.stack(parts).sum()


def train_step(
    model: nn.Module,
    inputs: Any,
    target: Any = None,
    loss_fn: LossFn | None = None,
    device: Device | None = None,
) -> torch.Tensor:
    """One training step without the optimizer: forward, loss, backward. Returns the loss.

    ``inputs`` as :func:`~hetsplit.planning.sizes.model_call` spreads them; the loss is
    ``loss_fn(output, target)`` (``loss_fn(output)`` without a target), by default the sum of
    the output's floating-point tensors. An emulated ``device`` throttles forward and backward.
    """
    throttle = device.throttle if device is not None else contextlib.nullcontext
    with throttle():
        args, kwargs = model_call(inputs)
        output = model(*args, **kwargs)
        if loss_fn is None:
            loss = _default_loss(output)
        else:
            loss = loss_fn(output, target) if target is not None else loss_fn(output)
    with throttle():
        loss.backward()
    return loss


class DeviceSteps:
    """One device's timed training steps over a ladder of batch sizes, and what they measured.

    Both the one-process :func:`profile` (a copy of the model per device) and the sharded one
    (the model in place) climb their ladders with these steps; a batch of ``b`` takes ``b``
    rows of ``sample``, cycled.
    """

    def __init__(self, model: nn.Module, dev: Device, sample: Any, target: Any, loss_fn: LossFn | None) -> None:
        self.model, self.dev, self.sample, self.target, self.loss_fn = model, dev, sample, target, loss_fn
        self.timer: timing.StepTimer | None = None  # None: timing.lap (the sharded profile sets its own)
        self.times: dict[int, list[float]] = {}  # the timed steps of each batch size
        self.peaks: dict[int, int] = {}  # CUDA: peak bytes allocated by a step of each batch size
        self.cap: int | None = None  # the largest batch that fits (None: no limit found)

    def step(self, batch: int, *, throttled: bool = True, record: bool = False) -> float:
        """One training step of ``batch`` rows: its compute in seconds, kept as a measurement with ``record``.

        Unthrottled (warm-up) steps run an emulated device at its real speed.
        """
        device = self.dev.torch_device
        index = torch.arange(batch)
        inputs = move(take_rows(self.sample, index), device)
        target = move(take_rows(self.target, index), device) if self.target is not None else None
        self.model.zero_grad(set_to_none=True)
        self.dev.synchronize()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        # The device's compute time (timing.lap): on a loaded machine the wait for a core
        # counts, as it slows the real work, but nothing blocked (a lock, a sleep) does.
        with self.timer.step() if self.timer is not None else timing.lap(self.dev) as work:
            train_step(self.model, inputs, target, self.loss_fn, self.dev if throttled else None)
            self.dev.synchronize()
        if cuda:
            self.peaks[batch] = max(self.peaks.get(batch, 0), int(torch.cuda.max_memory_allocated(device)))
        seconds = work.seconds()
        if record:
            self.times.setdefault(batch, []).append(seconds)
        return seconds

    def affordable(self, batch: int, budget: float, steps: int) -> bool:
        """Whether the profile, with ``batch`` added (priced at the largest size's time per sample), fits ``budget``."""
        if len(self.times) < 2:
            return True
        last = max(self.times)
        per_sample = statistics.median(self.times[last]) / last
        projected = sum(statistics.median(t) for t in self.times.values()) + per_sample * batch
        return projected * steps <= budget

    def entry(self, probed_to: int | None = None) -> DeviceProfile:
        """The device's profile: its measurements, the curve fitted to them, its :attr:`cap` and memory fit."""
        measured = [Measurement(b, ts) for b, ts in sorted(self.times.items())]
        memory = MemoryModel.fit(sorted(self.peaks.items())) if self.peaks else None
        curve = Curve.fit([(m.batch, m.median) for m in measured], self.cap)
        probed = measured[-1].batch if probed_to is None else probed_to
        return DeviceProfile(
            describe(self.dev), measured, curve, memory_cap=self.cap, memory_probed_to=probed, memory=memory
        )


class _Runner(DeviceSteps):
    """The one-process profile's steps on one device: a copy of the model, probed for its largest batch."""

    def __init__(self, model: nn.Module, dev: Device, sample: Any, target: Any, loss_fn: LossFn | None) -> None:
        super().__init__(copy.deepcopy(model).to(dev.torch_device).train(), dev, sample, target, loss_fn)
        self.refused = False  # a probing step failed for another reason than memory (warned once)

    def try_step(self, batch: int, *, probing: bool = False) -> bool:
        """Run one untimed step; False if it ran out of memory.

        ``probing`` (a size past the ladder): any error after a smaller batch ran marks the
        device's limit, in one warning, as a kernel can refuse a batch that memory would hold
        (measured on an H200: PyTorch's efficient attention above 65,535 sequences).
        """
        try:
            self.dev.check_batch(batch)  # an emulated memory runs out here, as a GPU's would in the step
            self.step(batch, throttled=False)
        except Exception as e:
            if probing and not is_out_of_memory(e):
                if not self.refused:  # once per device: the bisection may meet it again
                    warnings.warn(
                        f"hetsplit.profile: {self.dev.name} failed a step of {batch} samples while probing for "
                        f"its largest batch ({type(e).__name__}: {e}); its cap is taken below that size",
                        stacklevel=2,
                    )
                self.refused = True
            elif not is_out_of_memory(e):
                hint = "check the model runs on this sample and the loss fits its output"
                if batch < 2 and any("BatchNorm" in type(m).__name__ for m in self.model.modules()):
                    hint = "BatchNorm needs batches of 2 or more"  # only then: it misled a loss error
                raise RuntimeError(
                    f"a training step of batch {batch} failed on {self.dev.name}: {type(e).__name__}: {e}; {hint}"
                ) from e
        else:
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()  # the next, larger size meets the memory a fresh process would
            return True
        self.model.zero_grad(set_to_none=True)
        release_after_oom([self.dev])
        return False


def profile(
    model: nn.Module,
    sample: Any,
    devices: str | Sequence[DeviceLike],
    loss_fn: LossFn | None = None,
    batch_sizes: Sequence[int] | None = None,
    *,
    target: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    time_budget: float = 60.0,
    find_memory_cap: bool = True,
    max_probe: int = MAX_PROBE,
    progress: bool | None = None,
    model_name: str | None = None,
    threads: int | None = None,
    check_emulation: bool = True,
) -> Profile:
    """Measure a full training step (forward, loss, backward) of ``model`` on each device.

    A copy of the model per device is timed over a ladder of batch sizes, climbed while the
    device's projected cost fits its share of ``time_budget``; the model and the RNG state are
    left as they were. How and why: docs/how-it-works.md, "Profiler".

    Args:
        model: The model to profile.
        sample: Example input: a tensor or a nest of tensors with the batch on dim 0
            (one row or many; rows are cycled to build larger batches).
        devices: Devices to profile, e.g. ``"cuda:0,cpu"`` or ``["cpu", "cpu@0.25"]``; a
            device listed twice is profiled once (its curve serves every copy).
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` without a target);
            default: the sum of the output's floating-point tensors.
        batch_sizes: The ladder (default: 2, 4, 8, ..., 256).
        target: Example targets matching ``sample`` row for row.
        repeats: Timed steps per batch size.
        warmup: Untimed steps before timing each batch size.
        time_budget: Seconds for the whole profile, shared equally by the devices.
        find_memory_cap: Probe CUDA devices (and emulated memories, ``cpu:max64``) for their
            largest batch, and fit CUDA's peak memory (``DeviceProfile.memory``).
        max_probe: Largest batch tried when probing for the memory cap.
        progress: Show a progress bar (default: when stderr is a terminal).
        model_name: Name recorded in the profile (default: the model's class name).
        threads: Torch CPU threads while timing, restored afterwards (default: 1 when every
            device is the CPU; :func:`hetsplit.timing.cpu_threads`).
        check_emulation: Warn in one line (:func:`emulation_warning`) when an emulated device
            measured more than 1.3x off its speed (``False``: the caller says it).

    Returns:
        The :class:`Profile`, with raw measurements and fitted curves.

    Raises:
        ValueError: On invalid devices, batch sizes or sample, before any device work.
    """
    devs = list(dict.fromkeys(parse_devices(devices)))  # each distinct device once
    checks.materialised(model, "hetsplit.profile")
    ladder = check_ladder(batch_sizes, max_probe)
    check_settings(sample, target, repeats, warmup, time_budget)
    show = sys.stderr.isatty() if progress is None else progress
    cuda_ids = [d.index for d in devs if d.type == "cuda"]
    with (
        timing.threads_for(devs, threads),
        torch.random.fork_rng(devices=cuda_ids),
        tqdm(total=len(devs) * len(ladder), disable=not show, unit="size", desc="profiling", leave=False) as bar,
    ):
        entries = _measure(model, devs, sample, target, loss_fn, ladder, repeats, warmup, time_budget / len(devs),
                           find_memory_cap, max_probe, bar)  # fmt: skip
    prof = Profile(entries, model=model_record(model, sample, model_name), source="measured")
    line = emulation_warning(prof) if check_emulation else None
    if line:
        warnings.warn(f"hetsplit.profile: {line}", stacklevel=2)
    return prof


# An emulated device measured further than this from 1/speed times its real device is not
# what it claims to be (a loaded machine without the run-queue clock, a device the profile
# shared with other work): the plans drawn from it would flip or mislead.
_EMULATION_TOLERANCE = 1.3


class EmulationFault(NamedTuple):
    """An emulated device measured off its declared speed (:func:`emulation_faults`)."""

    name: str  # the emulated device, as the profile names it
    base: str  # its real device
    ratio: float  # measured: its time over its real device's
    want: float  # declared: 1/speed
    together: bool  # measured while both ran side by side (a calibration's factors), not alone

    def __str__(self) -> str:
        how = "ran" if self.together else "measured"
        tail = " beside it" if self.together else ""
        return f"{self.name} {how} {self.ratio:.1f}x slower than {self.base}{tail}, not {self.want:g}x"


def emulation_faults(prof: Profile, factors: Mapping[str, float] | None = None) -> list[EmulationFault]:
    """Each emulated device in ``prof`` off ``1/speed`` times its real device's time (its first rank's, on torchrun)."""
    faults = []
    for e in prof.entries:
        info = e.info
        if not info.emulated or info.speed >= 1.0:
            continue
        base = parse_device(label_device(info.name), check=False).base
        real = next((r for r in prof.entries if label_device(r.name) == base), None)
        if real is None:
            continue
        theirs = {m.batch: m.median for m in real.measurements}
        ratios = [m.median / theirs[m.batch] for m in e.measurements if theirs.get(m.batch, 0) > 0]
        if not ratios:
            continue
        ratio, want = statistics.median(ratios), 1.0 / info.speed
        if not _near(ratio, want):
            faults.append(EmulationFault(e.name, base, ratio, want, False))
        elif factors and factors.get(base, 0) > 0 and e.name in factors:
            together = ratio * factors[e.name] / factors[base]
            if not _near(together, want):
                faults.append(EmulationFault(e.name, base, together, want, True))
    return faults


def emulation_warning(prof: Profile, factors: Mapping[str, float] | None = None) -> str | None:
    """One line if an emulated device in ``prof`` was not ``1/speed`` times slower than its real device.

    Compared by the median ratio at the sizes both measured, and with ``factors`` (a
    calibration's, the devices running *together*) side by side too: on a loaded machine the
    scheduler can slow one more than the other (beside two busy processes: 1.6x, which gave
    the demo's ``cpu@0.25`` 11 % of the batch, not 17 %). ``None`` when every one is within 1.3x.
    """
    return describe_faults(emulation_faults(prof, factors))


def describe_faults(faults: Sequence[EmulationFault]) -> str | None:
    """The one warning line of :func:`emulation_warning` for ``faults`` (``None`` for none)."""
    if not faults:
        return None
    why = "" if emulation.measures_load() else " (this system does not report the time a thread waits for a core)"
    if any(not f.together for f in faults):  # the profile itself is off: every plan drawn from it is
        advice = "the plan rests on it — re-profile on a quieter machine or set the shares by hand (weights=)"
    else:  # the profile held; side by side the split follows the speeds measured there, not 1/speed
        advice = (
            "the split follows the speeds measured side by side, not 1/speed — run on a quieter machine "
            "or set the shares by hand (weights=)"
        )
    return f"emulation unreliable here{why}: {'; '.join(map(str, faults))}; {advice}"


def held_to_declared_speed(prof: Profile, faults: Sequence[EmulationFault]) -> Profile:
    """``prof`` with each emulated device that measured faster than its declared speed slowed to it.

    So it never gets more than its declared speed's share; one measured slower keeps its curve.
    """
    scale = {f.name: f.want / f.ratio for f in faults if not f.together and 0 < f.ratio < f.want}
    if not scale:
        return prof
    entries = [
        dataclasses.replace(e, curve=e.curve.scaled(scale[e.name])) if e.name in scale else e for e in prof.entries
    ]
    return dataclasses.replace(prof, entries=entries)


def fault_note(faults: Sequence[EmulationFault], calibrated: bool = False) -> str:
    """What a plan line says of ``faults`` (``""`` for none); ``calibrated``: re-solved from its own steps."""
    held = ", then calibrated in the split" if calibrated else ""
    parts = [f"{f}, planned at {f.want:g}x{held}" if not f.together and f.ratio < f.want else str(f) for f in faults]
    return "emulation unreliable: " + "; ".join(parts) if parts else ""


def _near(ratio: float, want: float) -> bool:
    return want / _EMULATION_TOLERANCE <= ratio <= want * _EMULATION_TOLERANCE


def check_settings(sample: Any, target: Any, repeats: Any, warmup: Any, time_budget: Any) -> None:
    """Check a profile's settings and sample before any device work (a ValueError names the bad value)."""
    kinds = ((repeats, int), (warmup, int), (time_budget, int | float))
    if any(isinstance(v, bool) or not isinstance(v, kind) for v, kind in kinds):
        raise ValueError(f"repeats and warmup must be integers and time_budget a number, got {repeats!r}, "
                         f"{warmup!r}, {time_budget!r}")  # fmt: skip
    if repeats < 1 or warmup < 0 or not (math.isfinite(time_budget) and time_budget > 0):
        raise ValueError(f"need repeats >= 1, warmup >= 0, time_budget > 0; got {repeats}, {warmup}, {time_budget}")
    n = batch_length(sample)
    if n < 1:
        raise ValueError("the sample holds no rows (length 0 along dim 0); pass at least one example input")
    if target is not None and batch_length(target) != n:
        raise ValueError(f"target has {batch_length(target)} rows but sample has {n}; they must match")


def model_record(model: nn.Module, sample: Any, name: str | None = None) -> dict[str, Any]:
    """What a profile records of the model it timed (a sharded parameter counts whole: its global shape)."""
    return {
        "name": name or type(_torch.uncompiled(model)).__name__,
        "fingerprint": fingerprint(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "input_shape": _input_shape(sample),
        "dtype": _dtype(sample),
    }


def _measure(
    model: nn.Module,
    devs: list[Device],
    sample: Any,
    target: Any,
    loss_fn: LossFn | None,
    ladder: list[int],
    repeats: int,
    warmup: int,
    budget: float,
    find_cap: bool,
    max_probe: int,
    bar: tqdm,
) -> list[DeviceProfile]:
    """Time every (device, batch size) point in interleaved passes.

    A first pass climbs the ladder on all devices while each fits its budget; ``repeats - 1``
    more passes time every point once each, so a slow phase of a shared machine is spread over
    all points instead of distorting one.
    """
    runners = [_Runner(model, dev, sample, target, loss_fn) for dev in devs]
    active = list(range(len(devs)))
    for b in ladder:
        bar.set_postfix_str(f"batch {b}")
        climbing = []
        for i in active:
            runner = runners[i]
            if not runner.affordable(b, budget, repeats + warmup):
                continue
            if not runner.try_step(b):  # warm-up and memory check in one
                ok = max(runner.times) if runner.times else 0
                runner.cap = _bisect(runner, ok, b, time.perf_counter() + budget / 4) if ok else 0
                continue
            for _ in range(max(warmup - 1, 0)):
                runner.step(b, throttled=False)
            runner.step(b, record=True)
            climbing.append(i)
        bar.update(len(devs))
        active = climbing
        if not active:
            break
    for _ in range(repeats - 1):
        for b in ladder:
            for runner in runners:
                if b in runner.times:
                    runner.step(b, record=True)
    entries = []
    for dev, runner in zip(devs, runners):
        if not runner.times:
            raise RuntimeError(f"device {dev.name} cannot run even batch {ladder[0]}: out of memory")
        probed = max(runner.times)
        if runner.cap is None and find_cap and (dev.type == "cuda" or dev.max_batch is not None):
            runner.cap, probed = _probe_cap(runner, probed, max_probe, time.perf_counter() + budget)
        entries.append(runner.entry(probed))
    del runners  # their replicas; a GPU's cached blocks go with the next empty_cache
    return entries


def _probe_cap(runner: _Runner, ok: int, max_probe: int, deadline: float) -> tuple[int | None, int]:
    """Double the batch until out of memory, then bisect; returns (cap or None, largest tried).

    ``None`` only when every batch up to ``max_probe`` fit. Out of time first, the largest batch
    that fit is the cap: a plan never hands a device more than it was seen to hold.
    """
    bad = None
    b = ok * 2
    while b <= max_probe:
        if time.perf_counter() >= deadline:
            return ok, ok
        if runner.try_step(b, probing=True):
            ok, b = b, b * 2
        else:
            bad = b
            break
    if bad is None:
        return None, ok
    return _bisect(runner, ok, bad, deadline), bad


def _bisect(runner: _Runner, ok: int, bad: int, deadline: float) -> int:
    """The largest batch that fits, between ``ok`` (fits) and ``bad`` (ran out of memory), to within 1/16."""
    while bad - ok > max(1, ok // 16) and time.perf_counter() < deadline:
        mid = (ok + bad) // 2
        if runner.try_step(mid, probing=True):
            ok = mid
        else:
            bad = mid
    return ok


def _input_shape(sample: Any) -> list[list[int]]:
    leaves, _ = flatten(sample)
    return [list(t.shape[1:]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]


def _dtype(sample: Any) -> str:
    leaves, _ = flatten(sample)
    dtypes = [str(t.dtype).replace("torch.", "") for t in leaves if isinstance(t, torch.Tensor)]
    return ",".join(dict.fromkeys(dtypes))
