"""Profile: the measurements and fitted curves of a set of devices for one model, as data."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import statistics
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import store
from ..devices import DeviceInfo, DeviceLike, canonical_name, local_gpus
from ..version import __version__
from . import checks
from .curve import Curve, CurveTable

__all__ = ["Measurement", "DeviceProfile", "Profile", "latest_profile"]


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
        batch = checks.batch_count(data["batch"], "a measurement's batch")
        times = data["times"]
        if not isinstance(times, list) or not times:
            raise ValueError(f"the measurement at batch {batch} has no list of times, got {times!r}")
        return cls(batch, [checks.seconds(t, f"a time at batch {batch}") for t in times])


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
        info = DeviceInfo.from_dict(data["info"])
        try:
            return cls(
                info=info,
                measurements=[Measurement.from_dict(m) for m in data["measurements"]],
                curve=Curve.from_dict(data["curve"]),
                memory_cap=checks.memory_cap(data.get("memory_cap"), "memory_cap"),
                memory_probed_to=checks.memory_cap(data.get("memory_probed_to"), "memory_probed_to"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"device {info.name!r}: {e}") from e


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
        key = canonical_name(device)
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

    @classmethod
    def merge(cls, parts: Sequence[tuple[Profile, str, int]]) -> Profile:
        """One profile of devices taken from several profiles, each used one or more times.

        For what-if planning: ``[(gpu_box, "cuda:0", 8), (old_box, "cpu", 1)]`` is eight
        copies of one machine's GPU and another machine's CPU. Copies are named
        ``NAME#1``, ``NAME#2``, ...; a name found in two profiles is prefixed with its
        profile's host (``hostB/cpu``).

        Raises:
            KeyError: If a profile lacks the device (the message lists what it has).
            ValueError: If a count is below 1.
        """
        picked = []
        for prof, device, copies in parts:
            if copies < 1:
                raise ValueError(f"device {device!r} is used {copies} times; use it at least once")
            picked.append((prof, prof.entry(device), copies))
        names = [e.name for _, e, _ in picked]
        entries = []
        for k, (prof, e, copies) in enumerate(picked):
            base = e.name
            if names.count(base) > 1 and len({id(p) for p, x, _ in picked if x.name == base}) > 1:
                base = (
                    f"{prof.host}/{base}"
                    if [p.host for p, x, _ in picked if x.name == e.name].count(prof.host) == 1
                    else f"{prof.host}#{k}/{base}"
                )
            for i in range(copies):
                name = f"{base}#{i + 1}" if copies > 1 else base
                entries.append(dataclasses.replace(e, info=dataclasses.replace(e.info, name=name)))
        first = parts[0][0] if parts else None
        hosts = sorted({p.host for p, _, _ in parts})
        return cls(entries, model=dict(first.model) if first else {}, host="+".join(hosts), source="merged")

    def matched_to_local(self, gpus: Mapping[str, str] | None = None) -> Profile:
        """This profile with its GPUs renamed to their names on this machine, matched by UUID.

        GPU indices change with ``CUDA_VISIBLE_DEVICES`` and driver ordering; UUIDs do
        not. An entry whose GPU is here under another index gets that index (an emulated
        one keeps its ``@speed``); other entries are unchanged.

        Args:
            gpus: ``{uuid: "cuda:N"}`` (default: this machine's GPUs).
        """
        local = dict(gpus) if gpus is not None else local_gpus()
        entries = []
        for e in self.entries:
            name = local.get(e.info.uuid or "") if e.info.kind == "cuda" else None
            if name is not None:
                if e.info.emulated:
                    name = f"{name}@{e.info.speed:g}"
                if name != e.info.name:
                    e = dataclasses.replace(e, info=dataclasses.replace(e.info, name=name))
            entries.append(e)
        return dataclasses.replace(self, entries=entries)

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
            raise ValueError(
                f"memory_caps names devices without measurements: {unknown}; known: {sorted(measurements)}"
            )
        entries = []
        for label, points in measurements.items():
            pts = []
            for point in points:
                if not isinstance(point, tuple | list) or len(point) != 2:
                    raise ValueError(f"device {label!r}: a measurement must be a (batch, seconds) pair, got {point!r}")
                batch = checks.batch_count(point[0], f"device {label!r}: a measured batch")
                pts.append((batch, checks.seconds(point[1], f"device {label!r}: the time at batch {batch}")))
            cap = checks.memory_cap(caps.get(label), f"device {label!r}: memory cap")
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
        return store.save_profile(self, path, directory=directory)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file written by :meth:`save`.

        Raises:
            hetsplit.store.ProfileFileError: If the file is missing, damaged, or of
                another schema version; the message names the file.
        """
        doc = store.read_json(path, "profile")
        try:
            return cls.from_dict(doc)
        except (KeyError, TypeError, ValueError) as e:
            raise store.ProfileFileError(f"{path}: damaged profile ({type(e).__name__}: {e}); re-create it") from e


def latest_profile(devices: Sequence[DeviceLike], directory: str | Path | None = None) -> Profile | None:
    """The newest profile measured on this machine that covers ``devices``, or ``None``.

    GPUs are matched by UUID, so a profile still serves after ``CUDA_VISIBLE_DEVICES``
    or the device order changes (see :meth:`Profile.matched_to_local`).
    """
    for path in store.find_profiles(devices, directory):
        try:
            return Profile.load(path).matched_to_local()
        except store.ProfileFileError as e:  # damaged inside: skip it, say so, use the next newest
            warnings.warn(f"hetsplit: skipping {e}", stacklevel=2)
    return None


def _versions() -> dict[str, str]:
    return {"hetsplit": __version__, "torch": torch.__version__}
