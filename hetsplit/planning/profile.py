"""Profile: the measurements and fitted curves of a set of devices for one model, as data."""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import hashlib
import math
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import _torch, files, store
from ..devices import DeviceInfo, DeviceLike, canonical_name, describe, local_gpus
from ..version import __version__
from . import checks
from .curve import Curve, CurveTable
from .records import DeviceProfile, Measurement


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's class and parameter/buffer names, shapes and dtypes (not values).

    What a profile records of the model it timed, so a profile of another model is refused. A
    compiled module has the fingerprint of the module it compiled (the same step).

    Returns:
        16 hex digits.
    """
    model = _torch.uncompiled(model)
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        # A lazy module's parameter has no shape before its first forward.
        shape = "lazy" if torch.nn.parameter.is_lazy(t) else tuple(t.shape)
        h.update(f"{name}:{shape}:{t.dtype};".encode())
    return h.hexdigest()[:16]


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

    @property
    def stand_in(self) -> str:
        """The model whose steps the curves time when it is not the one being split, else ``""``.

        ``"calibration-mlp"`` for the quick built-in calibration, whose curves give each
        device's throughput, not the user's model's seconds; once corrected by measured steps
        (``"calibration+calibrated"``, ``"+rebalanced"``) it times the model trained: ``""``.
        """
        if not self.source.startswith("calibration") or "+" in self.source:
            return ""
        return str(self.model.get("name") or "calibration")

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if not names:
            raise ValueError("a profile needs at least one device")
        counts = collections.Counter(names)  # linear: profiles of 10,000 copies
        dupes = sorted(n for n, count in counts.items() if count > 1)
        if dupes:
            shown = ", ".join(repr(n) for n in dupes[:5]) + (f" and {len(dupes) - 5:,} more" if len(dupes) > 5 else "")
            raise ValueError(f"device names in a profile must be unique, got {shown} more than once")
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
        index: dict[str, DeviceProfile] | None = self.__dict__.get("_index")
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
        """The curves of ``names`` (given as ``curves``, or looked up) packed for the solver, cached on this profile."""
        cache: dict[tuple[str, ...], CurveTable] = self.__dict__.setdefault("_tables", {})
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
        """Predicted seconds of a training step of ``batch`` samples on ``device`` (0 at 0, ``inf`` above its cap)."""
        if not batch >= 0:  # NaN too
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
        """One profile of devices taken from several profiles, each used one or more times (what-if planning).

        ``[(gpu_box, "cuda:0", 8), (old_box, "cpu", 1)]`` is eight copies of one machine's GPU
        and another's CPU. Copies are named ``NAME#1``, ``NAME#2``, ...; a name found in two
        profiles is prefixed with its host (``hostB/cpu``).

        Raises:
            KeyError: If a profile lacks the device (the message lists what it has).
            ValueError: If a count is not a whole number from 1 to
                :data:`~hetsplit.planning.checks.MAX_DEVICES`, or the devices add up to more.
        """
        picked = []
        for prof, device, copies in parts:
            copies = checks.device_count(copies, f"the copies of device {device!r}")
            picked.append((prof, prof.entry(device), copies))
        total = sum(copies for _, _, copies in picked)
        if total > checks.MAX_DEVICES:
            raise ValueError(
                f"the merged profile would hold {total:,} devices; plan for at most {checks.MAX_DEVICES:,}"
            )
        # One key per (profile, device): its copies are numbered on across parts.
        counts: dict[tuple[int, str], int] = {}
        for prof, e, copies in picked:
            counts[id(prof), e.name] = counts.get((id(prof), e.name), 0) + copies
        profiles_of: dict[str, set[int]] = {}
        for prof, e, _ in picked:
            profiles_of.setdefault(e.name, set()).add(id(prof))
        entries, numbered = [], dict.fromkeys(counts, 0)
        for k, (prof, e, copies) in enumerate(picked):
            base = e.name
            if len(profiles_of[base]) > 1:
                same_host = {id(p) for p, x, _ in picked if x.name == base and p.host == prof.host}
                base = f"{prof.host}/{base}" if len(same_host) == 1 else f"{prof.host}#{k}/{base}"
            key = (id(prof), e.name)
            for _ in range(copies):
                numbered[key] += 1
                name = f"{base}#{numbered[key]}" if counts[key] > 1 else base
                entries.append(dataclasses.replace(e, info=dataclasses.replace(e.info, name=name)))
        first = parts[0][0] if parts else None
        hosts = sorted({p.host for p, _, _ in parts})
        return cls(entries, model=dict(first.model) if first else {}, host="+".join(hosts), source="merged")

    def matched_to_local(self, gpus: Mapping[str, str] | None = None) -> Profile:
        """This profile with its GPUs renamed to their names on this machine, matched by UUID.

        GPU indices change with ``CUDA_VISIBLE_DEVICES`` and driver ordering; UUIDs do not. An
        emulated GPU keeps its ``@speed``.

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
        """Correct the curves with step times observed in real training: ``{device: (batch, seconds)}``.

        Each observed curve is scaled to predict the observed seconds at the observed batch
        (``{"cpu@0.25": (41, 0.026)}`` multiplies it by ``0.026 / t(41)``); the others are kept.
        """
        entries = []
        for e in self.entries:
            batch, seconds = observed.get(e.name, (0, 0.0))
            if batch > 0 and not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(
                    f"device {e.name!r}: observed {seconds!r} s at batch {batch}; need finite seconds >= 0"
                )
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
            TypeError: If ``measurements`` or ``memory_caps`` is not a mapping.
            ValueError: If a cap names an unknown label, or a label, measurement or cap
                is invalid; the message names the device and the bad entry.

        Example:
            >>> p = Profile.from_measurements({"v100": [(16, 0.082), (64, 0.221)],
            ...                                "k80": [(16, 0.30), (64, 1.10)]}, memory_caps={"k80": 100})
            >>> p.step_time("k80", 101)
            inf
        """
        for arg, value in (("measurements", measurements), ("memory_caps", memory_caps)):
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"{arg} must be a mapping {{label: ...}}, got {type(value).__name__}: {value!r}")
        caps = dict(memory_caps or {})
        unknown = sorted(set(caps) - set(measurements))
        if unknown:
            raise ValueError(
                f"memory_caps names devices without measurements: {unknown}; known: {sorted(measurements)}"
            )
        entries = []
        for label, points in measurements.items():
            if not isinstance(label, str) or not label:
                raise ValueError(f"device labels must be non-empty strings, got {label!r}")
            if isinstance(points, str | bytes) or not isinstance(points, Iterable):
                raise ValueError(f"device {label!r}: give a list of (batch, seconds) pairs, got {points!r}")
            pts = []
            for point in points:
                if not isinstance(point, tuple | list) or len(point) != 2:
                    raise ValueError(f"device {label!r}: a measurement must be a (batch, seconds) pair, got {point!r}")
                batch = checks.batch_count(point[0], f"device {label!r}: a measured batch")
                pts.append((batch, checks.seconds(point[1], f"device {label!r}: the time at batch {batch}")))
            if not pts:
                raise ValueError(f"device {label!r}: no measurements; give at least one (batch, seconds) pair")
            cap = checks.memory_cap(caps.get(label), f"device {label!r}: memory cap")
            info = DeviceInfo(name=str(label), kind="external", description=str(label))
            times: dict[int, list[float]] = {}
            for b, t in pts:  # a batch timed several times is one measurement with repeats: its spread is known
                times.setdefault(b, []).append(t)
            ms = [Measurement(b, ts) for b, ts in sorted(times.items())]
            entry = DeviceProfile(info, ms, Curve.fit(pts, cap), memory_cap=cap)
            entry.noise  # noqa: B018 -- worked out once here, not in the first solve of 10,000 devices
            entries.append(entry)
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
        """Build a profile from :meth:`to_dict` output, checking every device's entries.

        Raises:
            ValueError: Naming the device and the bad entry (see :meth:`DeviceProfile.from_dict`).
        """
        devices = data["devices"]
        if not isinstance(devices, list) or not devices:
            raise ValueError(f"'devices' must be a non-empty list of device entries, got {devices!r}"[:300])
        for key in ("model", "versions"):
            if not isinstance(data.get(key, {}), Mapping):
                raise ValueError(f"{key!r} must be a mapping, got {data[key]!r}"[:300])
        return cls(
            entries=[DeviceProfile.from_dict(d) for d in devices],
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
        doc = files.read_json(path, "profile")
        advice = "re-create it with 'hetsplit profile'"
        try:
            return cls.from_dict(doc)
        except KeyError as e:
            raise files.ProfileFileError(f"{path}: damaged profile: no {e.args[0]!r} entry; {advice}") from e
        except (TypeError, ValueError, AttributeError) as e:
            raise files.ProfileFileError(f"{path}: damaged profile: {e}; {advice}") from e


def latest_profile(
    devices: Sequence[DeviceLike], directory: str | Path | None = None, *, model: str | None = None
) -> Profile | None:
    """The newest profile measured on this machine that covers ``devices``, or ``None``.

    GPUs are matched by UUID (:meth:`Profile.matched_to_local`). Damaged files are skipped
    with a warning; one from another torch or hardware description is used, with one warning.

    Args:
        devices: The devices the profile must cover.
        directory: Where to look (see :func:`hetsplit.store.profile_dir`).
        model: A model's fingerprint (:func:`hetsplit.profiler.fingerprint`): only a
            profile of that model applies. Default: a profile of any model.

    Raises:
        TypeError: If ``model`` is not a fingerprint string.
    """
    if model is not None and not isinstance(model, str):
        raise TypeError(
            f"model must be a fingerprint string (hetsplit.profiler.fingerprint(model)), got {type(model).__name__}"
        )
    for item in store._stored_profiles(devices, directory, fingerprint=model):
        key = (str(item.path), item.stamp)
        prof = _LOADED.get(key)
        if prof is None:
            try:
                prof = Profile.from_dict(item.doc)
            except KeyError as e:  # damaged inside: skip it, say so, use the next newest
                store._skip_damaged(item, f"{item.path}: damaged profile: no {e.args[0]!r} entry")
                continue
            except (TypeError, ValueError, AttributeError) as e:
                store._skip_damaged(item, f"{item.path}: damaged profile: {e}")
                continue
            if len(_LOADED) >= 64:
                _LOADED.clear()
            _LOADED[key] = prof
        local = prof.matched_to_local()
        changed = _changed_since(local, devices)
        if changed and (key, changed) not in _STALE_SHOWN:
            _STALE_SHOWN.add((key, changed))
            store.warn_at_caller(
                f"hetsplit: using the stored profile {item.path}, measured {changed}; its split may be off — "
                "re-profile ('hetsplit profile') to refresh it"
            )
        return local
    return None


_LOADED: dict[tuple[str, tuple[int, ...]], Profile] = {}
_STALE_SHOWN: set[tuple[tuple[str, tuple[int, ...]], str]] = set()  # each file's each change, warned about once


def _changed_since(prof: Profile, devices: Sequence[DeviceLike]) -> str:
    """What differs between when ``prof`` was measured and now ('' if nothing): torch, the devices' hardware."""
    notes = []
    then = prof.versions.get("torch")
    if then and then != torch.__version__:
        notes.append(f"under torch {then} (now {torch.__version__})")
    for name in dict.fromkeys(canonical_name(d) for d in devices):
        recorded = prof.entry(name).info
        if recorded.kind not in ("cpu", "cuda", "mps"):
            continue
        try:
            now = describe(name).description
        except (RuntimeError, ValueError):  # a device that cannot be described now: nothing to compare
            continue
        if recorded.description != now:
            notes.append(f"on other hardware ({name} was {recorded.description!r}, now {now!r})")
    return " and ".join(notes)


def _versions() -> dict[str, str]:
    return {"hetsplit": __version__, "torch": torch.__version__}
