"""Records: one device's measurements and fitted curve, as data, every number checked when read back."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from ..devices import DeviceInfo
from ..emulation import check_speed
from . import checks
from .curve import Curve

__all__ = ["Measurement", "DeviceProfile"]


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
        """Build a measurement from :meth:`to_dict` output.

        Raises:
            ValueError: If the batch is not a positive whole number or a time is not
                positive, finite seconds (a string such as ``"NaN"`` included), quoting it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a measurement must be a mapping with 'batch' and 'times', got {data!r}")
        batch = checks.batch_count(data["batch"], "batch")
        times = data["times"]
        if not isinstance(times, list) or not times:
            raise ValueError(f"the measurement at batch {batch} has no list of times, got {times!r}")
        return cls(batch, [checks.seconds(t, f"times[{i}] at batch {batch}") for i, t in enumerate(times)])


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
        """Build a device profile from :meth:`to_dict` output, checking every entry.

        Raises:
            ValueError: Naming the device and the bad entry (a measurement, a curve knot,
                a memory cap, the device's description).
        """
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
            return cls(
                info=info,
                measurements=measurements,
                curve=Curve.from_dict(data["curve"]),
                memory_cap=checks.memory_cap(data.get("memory_cap"), "memory_cap"),
                memory_probed_to=checks.memory_cap(data.get("memory_probed_to"), "memory_probed_to"),
            )
        except KeyError as e:
            raise ValueError(f"device {info.name!r}: no {e.args[0]!r} entry") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"device {info.name!r}: {e}") from e


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
