"""Records: one device's measurements and fitted curve, as data, every number checked when read back."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..devices import DeviceInfo
from ..emulation import check_speed
from . import checks
from .curve import Curve


@dataclasses.dataclass
class Measurement:
    """Repeated timings of one training step at one batch size on one device.

    Attributes:
        batch: The batch size.
        times: Each repeat's seconds (after warm-up).
    """

    batch: int
    times: list[float]

    @property
    def median(self) -> float:
        """The median of the repeats, the figure the curve is fitted to."""
        return float(statistics.median(self.times))

    @property
    def spread(self) -> float | None:
        """Half the interquartile range of the repeats over their median: their relative ± (``None``: one repeat).

        The middle half, not the extremes: one hiccup of a shared machine does not make a whole profile noisy.
        """
        median = self.median
        if len(self.times) < 2 or not (math.isfinite(median) and median > 0):
            return None
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q3 - q1) / 2 / median

    def to_dict(self) -> dict[str, Any]:
        """Return the measurement as a JSON-ready dict (``median`` and ``spread`` are derived, for readers)."""
        return {"batch": self.batch, "times": list(self.times), "median": self.median, "spread": self.spread}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """Build a measurement from :meth:`to_dict` output (a ValueError quotes a bad batch or time)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a measurement must be a mapping with 'batch' and 'times', got {data!r}")
        batch = checks.batch_count(data["batch"], "batch")
        times = data["times"]
        if not isinstance(times, list) or not times:
            raise ValueError(f"the measurement at batch {batch} has no list of times, got {times!r}")
        return cls(batch, [checks.seconds(t, f"times[{i}] at batch {batch}") for i, t in enumerate(times)])


@dataclasses.dataclass(frozen=True)
class Noise:
    """How far one device's measured step times can be trusted, as relative ± figures (derived, never stored).

    Attributes:
        spread: The median over batch sizes of :attr:`Measurement.spread` (``None``: every
            size was timed once, as in a profile built from external timings).
        residual: The largest relative gap between a size's median and the non-decreasing
            curve through the medians: a larger batch measured faster than a smaller one is noise.
    """

    spread: float | None
    residual: float

    @property
    def relative(self) -> float | None:
        """The device's relative ± (the larger of the two), ``None`` when nothing says (one repeat, monotone)."""
        if self.spread is None:
            return self.residual if self.residual > 0 else None
        return max(self.spread, self.residual)

    def to_dict(self) -> dict[str, Any]:
        """Return the noise as a JSON-ready dict."""
        return {"spread": self.spread, "residual": self.residual, "relative": self.relative}


# Peaks are whole bytes: a fitted slope adding less than half a byte over the measured
# batches, or less than this fraction of the largest peak, is the fit's round-off.
_HALF_BYTE = 0.5
_ROUND_OFF = 1e-9


@dataclasses.dataclass
class MemoryModel:
    """Peak memory of a training step against its batch, ``m(b) = base + per_sample * b`` bytes (CUDA).

    Attributes:
        peaks: Measured ``(batch, peak bytes)`` pairs (``torch.cuda.max_memory_allocated``).
        base: Fitted bytes at batch 0 (weights, gradients, workspace), >= 0.
        per_sample: Fitted bytes per sample (activations), >= 0.
    """

    peaks: list[tuple[int, int]]
    base: float
    per_sample: float

    @classmethod
    def fit(cls, peaks: Sequence[tuple[int, int]]) -> MemoryModel:
        """Least-squares line through the peaks (one point: all of it per sample), never negative."""
        pts = sorted((int(b), int(m)) for b, m in peaks)
        if len(pts) == 1 or len({b for b, _ in pts}) == 1:
            return cls(pts, 0.0, pts[-1][1] / max(pts[-1][0], 1))
        per = float(np.polyfit([b for b, _ in pts], [m for _, m in pts], 1)[0])
        # polyfit's round-off is not a slope: flat peaks fit as 7e-15 bytes a sample with one
        # numpy and 0 with another, and a cap of 1 sample follows from the former.
        rise = per * (pts[-1][0] - pts[0][0])  # bytes the slope adds over the measured range
        if per < 0 or abs(rise) <= max(_HALF_BYTE, _ROUND_OFF * max(m for _, m in pts)):
            per = 0.0
        base = max(float(np.mean([m - per * b for b, m in pts])), 0.0)
        return cls(pts, base, per)

    def __call__(self, batch: float) -> float:
        """Predicted peak bytes of a step of ``batch`` samples."""
        return self.base + self.per_sample * batch

    def to_dict(self) -> dict[str, Any]:
        """Return the model as a JSON-ready dict."""
        return {"peaks": [list(p) for p in self.peaks], "base": self.base, "per_sample": self.per_sample}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryModel:
        """Build the model from :meth:`to_dict` output, checking every number (ValueError on a bad one)."""
        peaks = []
        for p in data["peaks"]:
            if not (isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) and p[0] >= 1 and p[1] >= 0):
                raise ValueError(f"memory peaks must be [batch >= 1, bytes >= 0] pairs, got {p!r}")
            peaks.append((p[0], p[1]))
        coef = [data["base"], data["per_sample"]]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e18 for v in coef):
            raise ValueError(f"memory model base and per_sample must be bytes >= 0, got {coef}")
        return cls(peaks, float(coef[0]), float(coef[1]))


@dataclasses.dataclass
class DeviceProfile:
    """One device's measurements and fitted curve.

    Attributes:
        info: What the device is (name, hardware, memory, emulation).
        measurements: Raw timings per batch size.
        curve: The fitted step-time curve.
        memory_cap: Largest batch that fitted in memory (``None``: not probed or never hit).
        memory_probed_to: The largest batch tried while looking for the cap.
        memory: Peak memory against batch size (CUDA devices), ``None`` where not measured.
    """

    info: DeviceInfo
    measurements: list[Measurement]
    curve: Curve
    memory_cap: int | None = None
    memory_probed_to: int | None = None
    memory: MemoryModel | None = None

    @property
    def name(self) -> str:
        """The device's name in the profile (``"cuda:0"``, ``"cpu@0.25"``, ``"v100"``)."""
        return self.info.name

    @property
    def noise(self) -> Noise:
        """How noisy this device's timings are (:class:`Noise`), computed once per entry.

        Raises:
            ValueError: Naming the device, if a measured time is not finite and > 0 or the
                curve predicts no time for a batch: no plan may rest on such a device.
        """
        found = self.__dict__.get("_noise")
        if found is None or found[0] is not self.measurements or found[1] is not self.curve:
            found = self.__dict__["_noise"] = (self.measurements, self.curve, _noise(self))
        return found[2]

    def to_dict(self) -> dict[str, Any]:
        """Return the device profile as a JSON-ready dict (``noise`` is derived, for readers)."""
        return {
            "info": self.info.to_dict(),
            "measurements": [m.to_dict() for m in self.measurements],
            "noise": self.noise.to_dict(),
            "curve": self.curve.to_dict(),
            "memory_cap": self.memory_cap,
            "memory_probed_to": self.memory_probed_to,
            **({"memory": self.memory.to_dict()} if self.memory is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceProfile:
        """Build a device profile from :meth:`to_dict` output, checking every entry (a ValueError names the device)."""
        info = _info(data)
        try:
            measured = data["measurements"]
            if not isinstance(measured, list) or not measured:
                raise ValueError(f"measurements must be a non-empty list, got {measured!r}")
            measurements = []
            for i, m in enumerate(measured):
                try:
                    measurements.append(Measurement.from_dict(m))
                except (KeyError, TypeError) as e:
                    raise ValueError(f"measurements[{i}]: missing or malformed entry ({type(e).__name__}: {e})") from e
                except ValueError as e:
                    raise ValueError(f"measurements[{i}]: {e}") from e
            entry = cls(
                info=info,
                measurements=measurements,
                curve=Curve.from_dict(data["curve"]),
                memory_cap=checks.memory_cap(data.get("memory_cap"), "memory_cap"),
                memory_probed_to=checks.memory_cap(data.get("memory_probed_to"), "memory_probed_to"),
                memory=MemoryModel.from_dict(data["memory"]) if data.get("memory") is not None else None,
            )
        except KeyError as e:
            raise ValueError(f"device {info.name!r}: no {e.args[0]!r} entry") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"device {info.name!r}: {e}") from e
        entry.noise  # noqa: B018 -- a curve that predicts no time is refused on reading, naming the device
        return entry


def _noise(entry: DeviceProfile) -> Noise:
    """The :class:`Noise` of ``entry``'s measurements, refusing times no plan can rest on."""
    name = entry.info.name
    medians: list[tuple[int, float]] = []
    spreads: list[float] = []
    for m in entry.measurements:
        times = m.times
        bad = [t for t in times if not (isinstance(t, int | float) and 0 < t < math.inf)]  # NaN fails too
        if bad or not times:
            raise ValueError(
                f"device {name!r}: measured {bad[0] if bad else None!r} s for a step of batch {m.batch}; a step "
                "takes a finite time > 0 — re-profile this device (or drop it from the devices)"
            )
        if len(times) == 1:  # external timings: one each (10,000 devices of them in a what-if set)
            medians.append((m.batch, float(times[0])))
            continue
        medians.append((m.batch, m.median))
        spread = m.spread  # never None here: two or more times, each finite and > 0
        if spread is not None:
            spreads.append(spread)
    if entry.curve.seconds[0] <= 0:
        raise ValueError(
            f"device {name!r}: its curve predicts {entry.curve.seconds[0]!r} s for a step of batch "
            f"{entry.curve.batch[0]:g}; a step takes a finite time > 0 — re-profile this device"
        )
    ys = [t for _, t in sorted(medians)]
    residual = 0.0
    if any(b < a for a, b in itertools.pairwise(ys)):  # only a measured dip needs the smoothing
        from scipy.optimize import isotonic_regression  # here: scipy costs every process 0.4 s at import

        fitted = isotonic_regression(ys, increasing=True).x  # as Curve.fit smooths the medians
        residual = float(max(abs(y - f) / f for y, f in zip(ys, fitted)))
    return Noise(float(statistics.median(spreads)) if spreads else None, residual)


def _info(data: Any) -> DeviceInfo:
    """The ``info`` entry of a stored device, checked: a name, and a valid emulated speed."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a device entry must be a mapping with 'info', 'measurements' and 'curve', got {data!r}")
    raw = data.get("info")
    if not isinstance(raw, Mapping):
        raise ValueError(f"a device entry has no 'info' mapping (got {raw!r})")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a device's info has no name (got {name!r})")
    info = DeviceInfo.from_dict(raw)
    if not isinstance(info.emulated, bool):
        raise ValueError(f"device {name!r}: info emulated must be true or false, got {info.emulated!r}")
    if info.emulated:
        try:
            check_speed(info.speed, name)
        except (TypeError, ValueError) as e:
            raise ValueError(f"device {name!r}: info speed: {e}") from e
    return info
