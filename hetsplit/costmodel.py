"""Cost model: per-device step-time curves t(b) fitted to measurements, and the Profile holding them."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import statistics
from itertools import chain
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import isotonic_regression, nnls

from .devices import DeviceInfo, DeviceLike, parse_device

__all__ = ["Curve", "CurveTable", "Measurement", "DeviceProfile", "Profile"]


@dataclasses.dataclass
class Curve:
    """A monotone step-time model ``t(b)`` in seconds for a batch of ``b`` samples.

    The curve is piecewise linear through ``knots`` (measured batch sizes with their
    isotonic-smoothed median times), falls linearly from the first knot to ``intercept``
    (the fixed per-step overhead, which dominates small GPU batches), and continues past
    the last knot with ``slope`` seconds per sample. ``t(0) = 0``: an unused device costs
    nothing. Above ``memory_cap`` the time is infinite.

    Attributes:
        batch: Knot batch sizes, strictly increasing, all >= 1.
        seconds: Knot times, non-decreasing.
        intercept: Fixed overhead in seconds, ``0 <= intercept <= seconds[0]``.
        slope: Marginal seconds per sample beyond the last knot (> 0).
        memory_cap: Largest batch that fits in memory, or ``None`` if unknown/unbounded.
    """

    batch: list[float]
    seconds: list[float]
    intercept: float
    slope: float
    memory_cap: int | None = None

    def __post_init__(self) -> None:
        if not self.batch or len(self.batch) != len(self.seconds):
            raise ValueError(f"a curve needs as many knot times as knot batches, got {self.batch} and {self.seconds}")
        if any(b2 <= b1 for b1, b2 in zip(self.batch, self.batch[1:])) or self.batch[0] < 1:
            raise ValueError(f"curve knots must be increasing batch sizes >= 1, got {self.batch}")
        if any(t2 < t1 for t1, t2 in zip(self.seconds, self.seconds[1:])):
            raise ValueError(f"curve times must be non-decreasing, got {self.seconds}")
        if not (0.0 <= self.intercept <= self.seconds[0]) or not self.slope > 0:
            raise ValueError(f"curve needs 0 <= intercept <= first time and slope > 0, got {self.intercept}, {self.slope}")

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]], memory_cap: int | None = None) -> Curve:
        """Fit a curve to ``(batch size, seconds)`` measurements.

        Times at the same batch size are reduced to their median; medians are made
        non-decreasing by isotonic regression; the fixed overhead and the slope past the
        last measurement come from a non-negative fit of ``t = a + s*b`` (relative errors,
        so small batches count as much as large ones).

        Args:
            points: Measurements; batch sizes >= 1, times > 0.
            memory_cap: Largest batch that fits, if known.

        Returns:
            The fitted curve.

        Raises:
            ValueError: If there is no valid measurement.
        """
        by_batch: dict[int, list[float]] = {}
        for b, t in points:
            if int(b) != b or b < 1:
                raise ValueError(f"measured batch sizes must be positive integers, got {b!r}")
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                raise ValueError(f"measured times must be positive finite seconds, got {t!r} at batch {b}")
            by_batch.setdefault(int(b), []).append(float(t))
        if not by_batch:
            raise ValueError("cannot fit a step-time curve without measurements; give at least one (batch, seconds) pair")
        xs = np.array(sorted(by_batch), dtype=float)
        ys = np.array([statistics.median(by_batch[int(b)]) for b in xs])
        ys = isotonic_regression(ys, increasing=True).x
        if len(xs) == 1:
            # One point says nothing about fixed overhead: assume time proportional to batch.
            return cls([float(xs[0])], [float(ys[0])], 0.0, float(ys[0] / xs[0]), memory_cap)
        a_all, s_all = _affine(xs, ys)
        tail = max(2, len(xs) // 2)
        _, s_tail = _affine(xs[-tail:], ys[-tail:])
        intercept = min(max(a_all, 0.0), float(ys[0]))
        # The slope past the data: the larger of the whole-range and upper-range marginal
        # costs (an unsaturated GPU looks flat; it will not stay flat), never zero.
        slope = max(s_tail, s_all, float(ys[-1] / xs[-1]) * 1e-3)
        return cls([float(x) for x in xs], [float(y) for y in ys], float(intercept), float(slope), memory_cap)

    def __call__(self, b: float) -> float:
        """Predicted seconds for a batch of ``b`` samples."""
        return float(self.evaluate(np.asarray([b], dtype=float))[0])

    def evaluate(self, b: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`__call__` over an array of batch sizes."""
        b = np.asarray(b, dtype=float)
        flat = b.reshape(-1)
        return CurveTable([self]).evaluate(flat, np.zeros(flat.shape, dtype=np.int64)).reshape(b.shape)

    def capacity(self, seconds: float) -> int:
        """The largest integer batch whose predicted time is at most ``seconds``."""
        return int(CurveTable([self]).capacity(float(seconds))[0])

    def scaled(self, factor: float) -> Curve:
        """This curve with every time multiplied by ``factor`` (> 0)."""
        if not factor > 0:
            raise ValueError(f"a curve can only be scaled by a positive factor, got {factor}")
        return dataclasses.replace(self, seconds=[t * factor for t in self.seconds],
                                   intercept=self.intercept * factor, slope=self.slope * factor)

    @property
    def max_measured(self) -> int:
        """The largest batch size the curve was fitted on (beyond it, it extrapolates)."""
        return int(self.batch[-1])

    def to_dict(self) -> dict[str, Any]:
        """Return the curve as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Curve:
        """Build a curve from :meth:`to_dict` output."""
        return cls(
            batch=[float(x) for x in data["batch"]],
            seconds=[float(x) for x in data["seconds"]],
            intercept=float(data["intercept"]),
            slope=float(data["slope"]),
            memory_cap=None if data.get("memory_cap") is None else int(data["memory_cap"]),
        )


class CurveTable:
    """Many curves packed into arrays, evaluated and inverted together (the solver's engine).

    Knot arrays are padded to a common length by repeating each curve's last knot, so
    one vectorised pass serves 10,000 devices.

    Args:
        curves: The curves, one per device (a curve may appear several times).
    """

    def __init__(self, curves: Sequence[Curve]) -> None:
        n = len(curves)
        lengths = {len(c.batch) for c in curves}
        if len(lengths) == 1:  # the common case: no padding, read straight from the lists
            (k,) = lengths
            self.x = np.fromiter(chain.from_iterable(c.batch for c in curves), float, n * k).reshape(n, k)
            self.y = np.fromiter(chain.from_iterable(c.seconds for c in curves), float, n * k).reshape(n, k)
        else:
            width = max(lengths)
            self.x = np.array([c.batch + c.batch[-1:] * (width - len(c.batch)) for c in curves], dtype=float)
            self.y = np.array([c.seconds + c.seconds[-1:] * (width - len(c.seconds)) for c in curves], dtype=float)
        self.intercept = np.fromiter((c.intercept for c in curves), float, n)
        self.slope = np.fromiter((c.slope for c in curves), float, n)
        self.cap = np.fromiter((np.inf if c.memory_cap is None else c.memory_cap for c in curves), float, n)
        self._rows = np.arange(n)

    def evaluate(self, b: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of curve ``rows[j]`` at batch ``b[j]`` (all curves in order by default).

        ``b`` may also be 2-D, one row per curve, to evaluate several batches per curve.
        """
        b = np.asarray(b, dtype=float)
        if b.ndim == 2:
            rows2 = np.repeat(self._rows, b.shape[1])
            return self.evaluate(b.reshape(-1), rows2).reshape(b.shape)
        r = self._rows if rows is None else np.asarray(rows)
        x, y = self.x[r], self.y[r]
        last = x.shape[1] - 1
        k = np.clip((x <= b[:, None]).sum(axis=1) - 1, 0, last)
        k1 = np.minimum(k + 1, last)
        idx = np.arange(len(r))
        xk, yk, xk1, yk1 = x[idx, k], y[idx, k], x[idx, k1], y[idx, k1]
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = yk + (yk1 - yk) * (b - xk) / np.where(xk1 > xk, xk1 - xk, 1.0)
        beyond = yk + self.slope[r] * (b - xk)
        a = self.intercept[r]
        below = a + (y[:, 0] - a) * b / x[:, 0]
        t = np.where(b < x[:, 0], below, np.where(k == last, beyond, inner))
        t = np.where(b <= 0, 0.0, t)
        return np.where(b > self.cap[r], np.inf, t)

    def capacity(self, seconds: float, *, exact: bool = True) -> np.ndarray:
        """For each curve, the largest integer batch with predicted time <= ``seconds``.

        With ``exact=False`` the closed-form inverse is used as is; it may be off by one
        where floating point rounds differently from :meth:`evaluate`.
        """
        x, y = self.x, self.y
        last = x.shape[1] - 1
        k = (y <= seconds).sum(axis=1) - 1  # -1: below the first knot
        kc = np.clip(k, 0, last)
        k1 = np.minimum(kc + 1, last)
        xk, yk, xk1, yk1 = x[self._rows, kc], y[self._rows, kc], x[self._rows, k1], y[self._rows, k1]
        with np.errstate(divide="ignore", invalid="ignore"):
            inner = xk + (seconds - yk) * (xk1 - xk) / (yk1 - yk)
            beyond = xk + (seconds - yk) / self.slope
            x0, y0, a = x[:, 0], y[:, 0], self.intercept
            below = np.where(seconds >= a, x0 * (seconds - a) / np.where(y0 > a, y0 - a, 1.0), 0.0)
        cont = np.where(k < 0, below, np.where(k >= last, beyond, inner))
        cont = np.minimum(np.nan_to_num(cont, nan=0.0, posinf=1e18), np.minimum(self.cap, 1e18))
        c = np.maximum(np.floor(cont), 0.0)
        if not exact:
            return c.astype(np.int64)
        # The closed-form inverse can be off by one in floating point: settle it against
        # evaluate(), which is what the solver's optimality is defined by.
        for _ in range(8):
            up = (self.evaluate(c + 1) <= seconds) & (c + 1 <= self.cap)
            down = (c > 0) & (self.evaluate(c) > seconds)
            if not (up.any() or down.any()):
                break
            c = c + up - down
        return c.astype(np.int64)


def _affine(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """Non-negative least-squares fit of ``y = a + s*x`` in relative error."""
    design = np.stack([1.0 / ys, xs / ys], axis=1)
    (a, s), _ = nnls(design, np.ones_like(ys))
    return float(a), float(s)


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

    def to_dict(self) -> dict[str, Any]:
        """Return the measurement as a JSON-ready dict."""
        return {"batch": self.batch, "times": list(self.times), "median": self.median}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """Build a measurement from :meth:`to_dict` output."""
        return cls(int(data["batch"]), [float(t) for t in data["times"]])


@dataclasses.dataclass
class DeviceProfile:
    """One device's measurements and fitted curve.

    Attributes:
        info: What the device is (name, hardware, memory, emulation).
        measurements: Raw timings per batch size.
        curve: The fitted step-time curve.
        memory_cap: Largest batch that fitted in memory (``None``: not probed or never hit).
        memory_probed_to: The largest batch tried while looking for the cap.
    """

    info: DeviceInfo
    measurements: list[Measurement]
    curve: Curve
    memory_cap: int | None = None
    memory_probed_to: int | None = None

    @property
    def name(self) -> str:
        """The device's name in the profile (``"cuda:0"``, ``"cpu@0.25"``, ``"v100"``)."""
        return self.info.name

    def to_dict(self) -> dict[str, Any]:
        """Return the device profile as a JSON-ready dict."""
        return {
            "info": self.info.to_dict(),
            "measurements": [m.to_dict() for m in self.measurements],
            "curve": self.curve.to_dict(),
            "memory_cap": self.memory_cap,
            "memory_probed_to": self.memory_probed_to,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceProfile:
        """Build a device profile from :meth:`to_dict` output."""
        return cls(
            info=DeviceInfo.from_dict(data["info"]),
            measurements=[Measurement.from_dict(m) for m in data["measurements"]],
            curve=Curve.from_dict(data["curve"]),
            memory_cap=data.get("memory_cap"),
            memory_probed_to=data.get("memory_probed_to"),
        )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclasses.dataclass
class Profile:
    """Step-time curves of a set of devices for one model: the input to :func:`hetsplit.solve`.

    Build one with :func:`hetsplit.profile` (measured here), :meth:`from_measurements`
    (timings taken elsewhere) or :meth:`load` (a stored file).

    Attributes:
        entries: One :class:`DeviceProfile` per device, in order.
        model: What was profiled: ``name``, ``fingerprint``, ``input_shape``, ``dtype``.
        host: The machine's host name.
        created: ISO-8601 time of the measurement.
        versions: ``hetsplit`` and ``torch`` versions that measured it.
        source: ``"measured"``, ``"external"`` or ``"calibration"``.
    """

    entries: list[DeviceProfile]
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    host: str = dataclasses.field(default_factory=platform.node)
    created: str = dataclasses.field(default_factory=_now)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    source: str = "measured"

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if not names:
            raise ValueError("a profile needs at least one device")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"device names in a profile must be unique, got {dupes} more than once")
        if not self.versions:
            self.versions = _versions()

    @property
    def devices(self) -> list[str]:
        """The devices' names, in order."""
        return [e.name for e in self.entries]

    @property
    def emulated(self) -> list[str]:
        """Names of the emulated devices in this profile."""
        return [e.name for e in self.entries if e.info.emulated]

    def entry(self, device: DeviceLike) -> DeviceProfile:
        """Return the :class:`DeviceProfile` of ``device`` (a name, or a device spec).

        Raises:
            KeyError: If the profile has no such device; the message lists those it has.
        """
        index = self.__dict__.get("_index")
        if index is None or len(index) != len(self.entries):
            index = self.__dict__["_index"] = {e.name: e for e in self.entries}
        found = index.get(device) if isinstance(device, str) else None
        if found is not None:
            return found
        key = _key(device)
        if key in index:
            return index[key]
        raise KeyError(f"device {key!r} is not in this profile; it has {self.devices}")

    def table(self, names: Sequence[str], curves: Sequence[Curve] | None = None) -> CurveTable:
        """The curves of ``names`` packed for the solver, cached on this profile.

        ``curves``, if given, are those of ``names`` (saves looking them up again).
        """
        cache = self.__dict__.setdefault("_tables", {})
        key = tuple(names)
        if key not in cache:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = CurveTable(curves if curves is not None else [self.entry(n).curve for n in names])
        return cache[key]

    def curve(self, device: DeviceLike) -> Curve:
        """The step-time curve of ``device``."""
        return self.entry(device).curve

    def step_time(self, device: DeviceLike, batch: int) -> float:
        """Predicted seconds of a training step of ``batch`` samples on ``device``.

        Returns ``0.0`` for a batch of 0 and ``inf`` above the device's memory cap.
        """
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        return self.curve(device)(batch)

    def throughput(self, device: DeviceLike, batch: int) -> float:
        """Predicted samples per second of ``device`` at ``batch``."""
        t = self.step_time(device, batch)
        return batch / t if t > 0 else 0.0

    def memory_caps(self) -> dict[str, int | None]:
        """Each device's memory cap (``None`` where none is known)."""
        return {e.name: e.curve.memory_cap for e in self.entries}

    def subset(self, devices: Sequence[DeviceLike]) -> Profile:
        """A profile of just ``devices`` (each once, in the order given)."""
        return dataclasses.replace(self, entries=[self.entry(d) for d in dict.fromkeys(_key(d) for d in devices)])

    def calibrated(self, observed: Mapping[str, tuple[int, float]]) -> Profile:
        """Correct the curves with step times observed in real training.

        Each device's curve is scaled so that it predicts the observed seconds at the
        observed batch: ``{"cpu@0.25": (41, 0.026)}`` multiplies that curve by
        ``0.026 / t(41)``. Devices not observed (or observed at batch 0) keep their curve.
        The raw measurements are kept; ``source`` records the calibration.
        """
        entries = []
        for e in self.entries:
            batch, seconds = observed.get(e.name, (0, 0.0))
            predicted = e.curve(batch) if batch > 0 else 0.0
            if batch > 0 and seconds > 0 and 0 < predicted < math.inf:
                e = dataclasses.replace(e, curve=e.curve.scaled(seconds / predicted))
            entries.append(e)
        return dataclasses.replace(self, entries=entries, source=f"{self.source}+calibrated")

    @classmethod
    def from_measurements(
        cls,
        measurements: Mapping[str, Iterable[tuple[int, float]]],
        memory_caps: Mapping[str, int] | None = None,
        *,
        model: Mapping[str, Any] | None = None,
        host: str = "external",
    ) -> Profile:
        """Build a profile from timings taken elsewhere, to plan for hardware not at hand.

        Args:
            measurements: ``{label: [(batch, seconds), ...]}``; labels are free-form
                (``"v100"``, ``"node3:cuda:1"``).
            memory_caps: ``{label: largest batch that fits}`` for the devices where known.
            model: Optional description of the model the timings are for.
            host: Where the timings come from.

        Returns:
            A profile whose ``source`` is ``"external"``.

        Raises:
            ValueError: If a cap names an unknown label, or a measurement is invalid.

        Example:
            >>> p = Profile.from_measurements({"v100": [(16, 0.082), (64, 0.221)],
            ...                                "k80": [(16, 0.30), (64, 1.10)]}, memory_caps={"k80": 100})
            >>> p.step_time("k80", 101)
            inf
        """
        caps = dict(memory_caps or {})
        unknown = sorted(set(caps) - set(measurements))
        if unknown:
            raise ValueError(f"memory_caps names devices without measurements: {unknown}; known: {sorted(measurements)}")
        entries = []
        for label, points in measurements.items():
            pts = [(int(b), float(t)) for b, t in points]
            cap = caps.get(label)
            if cap is not None and (int(cap) != cap or cap < 0):
                raise ValueError(f"memory cap of {label!r} must be a non-negative integer, got {cap!r}")
            info = DeviceInfo(name=str(label), kind="external", description=str(label))
            ms = [Measurement(b, [t]) for b, t in pts]
            entries.append(DeviceProfile(info, ms, Curve.fit(pts, cap), memory_cap=cap))
        return cls(entries, model=dict(model or {}), host=host, source="external")

    def to_dict(self) -> dict[str, Any]:
        """Return the profile as a JSON-ready dict (without the schema header)."""
        return {
            "source": self.source,
            "created": self.created,
            "host": self.host,
            "versions": dict(self.versions),
            "model": dict(self.model),
            "emulated": self.emulated,
            "devices": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        """Build a profile from :meth:`to_dict` output."""
        return cls(
            entries=[DeviceProfile.from_dict(d) for d in data["devices"]],
            model=dict(data.get("model", {})),
            host=str(data.get("host", "")),
            created=str(data.get("created", "")),
            versions=dict(data.get("versions", {})),
            source=str(data.get("source", "measured")),
        )

    def save(self, path: str | Path | None = None, *, directory: str | Path | None = None) -> Path:
        """Write the profile as JSON, atomically; return the path written.

        Args:
            path: Target file. Default: a new file in the profile directory
                (see :func:`hetsplit.store.profile_dir`).
            directory: Profile directory to use when ``path`` is not given.
        """
        from . import store

        return store.save_profile(self, path, directory=directory)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file written by :meth:`save`.

        Raises:
            hetsplit.store.ProfileFileError: If the file is missing, damaged, or of
                another schema version; the message names the file.
        """
        from . import store

        return store.load_profile(path)


def _key(device: DeviceLike) -> str:
    if isinstance(device, str):
        try:
            return parse_device(device, check=False).name
        except ValueError:
            return device  # a free-form label from measurements taken elsewhere
    return parse_device(device, check=False).name


def _versions() -> dict[str, str]:
    import torch

    from . import __version__

    return {"hetsplit": __version__, "torch": torch.__version__}
