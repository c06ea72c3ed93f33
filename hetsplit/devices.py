"""Devices: parse and validate device strings, discover local hardware, emulate slower devices."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union

import torch

__all__ = [
    "Device",
    "DeviceInfo",
    "Lap",
    "DeviceLike",
    "parse_device",
    "parse_devices",
    "discover",
    "describe",
    "synchronize",
]

DeviceLike = Union[str, torch.device, "Device"]

_SPEC = re.compile(r"^(?P<type>cpu|cuda|mps)(?::(?P<index>\d+))?(?:@(?P<speed>[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?))?$")

# Emulated speeds can be changed while a job runs (issue: devices whose speed changes
# mid-training); they live here, keyed by the device's name, so every copy of a Device
# value sees the change.
_SPEED_OVERRIDES: dict[str, float] = {}
_SLEEP_DEBT: dict[str, float] = {}
_DELAYED: dict[str, float] = {}  # seconds each emulated device has slept in this process


@dataclasses.dataclass(frozen=True)
class Device:
    """A device a shard can run on, possibly emulated at a fraction of its real speed.

    ``Device("cpu", None, 0.25, True)`` is the CPU at a quarter speed: after each
    piece of work it sleeps three times the work's measured duration. Build one with
    :func:`parse_device` rather than by hand.

    Attributes:
        type: ``"cpu"``, ``"cuda"`` or ``"mps"``.
        index: The device index (``None`` for the CPU).
        speed: The emulated speed factor in ``(0, 1]``; ``1.0`` for a real device.
        emulated: Whether the device was asked for with ``@speed`` (even ``@1.0``).
    """

    type: str
    index: int | None = None
    speed: float = 1.0
    emulated: bool = False

    @property
    def base(self) -> str:
        """The real device's name, without the emulation suffix (``"cuda:0"``)."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def name(self) -> str:
        """The canonical spelling, e.g. ``"cpu"``, ``"cuda:1"``, ``"cpu@0.25"``."""
        return f"{self.base}@{self.speed:g}" if self.emulated else self.base

    @property
    def torch_device(self) -> torch.device:
        """The :class:`torch.device` the work actually runs on."""
        return torch.device(self.base)

    @property
    def current_speed(self) -> float:
        """The speed factor in force now (see :meth:`set_speed`)."""
        return _SPEED_OVERRIDES.get(self.name, self.speed) if self.emulated else 1.0

    def set_speed(self, speed: float | None) -> None:
        """Change this emulated device's speed from now on (``None`` restores its own).

        Raises:
            ValueError: If the device is not emulated or the speed is not in (0, 1].
        """
        if speed is None:  # restoring is harmless for any device
            _SPEED_OVERRIDES.pop(self.name, None)
            return
        if not self.emulated:
            raise ValueError(f"device {self.name!r} is real; only emulated devices (e.g. 'cpu@0.5') change speed")
        _check_speed(speed, self.name)
        _SPEED_OVERRIDES[self.name] = float(speed)

    @property
    def delayed(self) -> float:
        """Seconds this emulated device has slept so far in this process (0 for a real one)."""
        return _DELAYED.get(self.name, 0.0)

    def synchronize(self) -> None:
        """Wait for all queued work on the real device to finish."""
        synchronize(self.torch_device)

    @contextlib.contextmanager
    def lap(self) -> Iterator[Lap]:
        """Measure the enclosed work on this device without synchronising it.

        Yields a :class:`Lap` whose :meth:`Lap.seconds` is read later: on a CUDA device
        from two events on the current stream, elsewhere from a monotonic clock.
        """
        lap = Lap(self)
        try:
            yield lap
        finally:
            lap.stop()

    @contextlib.contextmanager
    def throttle(self, *, cpu_time: bool = False) -> Iterator[None]:
        """Run the enclosed work at this device's emulated speed.

        For a real device this does nothing. For an emulated one it waits for the
        device, measures the enclosed work and sleeps ``(1/speed - 1)`` times its
        duration, so the work appears to run at ``speed`` of the real device.

        Args:
            cpu_time: Measure the work as this process's CPU time instead of wall time,
                for an emulated CPU in its own process (one torchrun rank) whose
                enclosed work also waits on other ranks (DDP's backward): waiting is
                not work and must not be slowed down.
        """
        speed = self.current_speed
        if speed >= 1.0:
            yield
            return
        clock = time.process_time if cpu_time and self.type == "cpu" else time.perf_counter
        start = clock()
        yield
        self.synchronize()
        work = clock() - start
        now = time.perf_counter()
        # time.sleep overshoots by tens of microseconds, which would dominate small
        # steps; carry each device's error into its next sleep so the long-run speed is exact.
        wanted = work * (1.0 / speed - 1.0) - _SLEEP_DEBT.get(self.name, 0.0)
        if wanted > 0:
            time.sleep(wanted)
            slept = time.perf_counter() - now
            _SLEEP_DEBT[self.name] = slept - wanted
            _DELAYED[self.name] = _DELAYED.get(self.name, 0.0) + slept
        else:
            _SLEEP_DEBT[self.name] = -wanted

    def __str__(self) -> str:
        return self.name


class Lap:
    """An interval of work on a device, read later without forcing a synchronisation.

    On a CUDA device the interval is a pair of CUDA events recorded on the current
    stream, so measuring adds no synchronisation to the step; reading it waits only for
    the end event, which is normally long done by then (see :meth:`ready`). Elsewhere
    the interval is read from a monotonic clock when it ends. Build one with
    :meth:`Device.lap`.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._events: tuple[Any, Any] | None = None
        self._seconds: float | None = None
        self.extra = 0.0  # seconds added to the measured interval (e.g. emulated delay after it)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)
        self._start = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the interval (on CUDA: record the end event; no wait).

        It may be called again before the lap is read: the last call marks the end.
        """
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start

    def ready(self) -> bool:
        """Whether :meth:`seconds` can be read without waiting for the device."""
        return self._seconds is not None or (self._events is not None and bool(self._events[1].query()))

    def seconds(self) -> float:
        """The interval's length in seconds plus :attr:`extra` (waits for the end event if still queued)."""
        if self._seconds is None:
            if self._events is None:
                raise RuntimeError("the lap has not been stopped; use it as `with device.lap() as lap:`")
            start, end = self._events
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1e3
        return self._seconds + self.extra


@dataclasses.dataclass
class DeviceInfo:
    """What hetsplit knows about one usable device.

    Attributes:
        name: Canonical device name (``"cuda:0"``).
        kind: ``"cpu"``, ``"cuda"`` or ``"mps"``.
        description: Hardware name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        memory_bytes: Total memory of the device (host RAM for the CPU), if known.
        emulated: Whether this is an emulated slower copy of a real device.
        speed: The emulated speed factor (1.0 for real devices).
        uuid: A stable identifier for GPUs (survives ``CUDA_VISIBLE_DEVICES`` changes).
        capability: CUDA compute capability such as ``"9.0"``.
        threads: Intra-op threads torch uses on the CPU.
        driver: The NVIDIA driver version (from ``nvidia-smi``), if known.
        runtime: The CUDA runtime torch was built with, e.g. ``"12.8"``.
        torch: The torch version that saw the device.
    """

    name: str
    kind: str
    description: str
    memory_bytes: int | None = None
    emulated: bool = False
    speed: float = 1.0
    uuid: str | None = None
    capability: str | None = None
    threads: int | None = None
    driver: str | None = None
    runtime: str | None = None
    torch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the info as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        """Build the info from :meth:`to_dict` output (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _check_speed(speed: float, spec: str) -> None:
    if not (0.0 < speed <= 1.0):
        raise ValueError(
            f"emulated speed in {spec!r} must be in (0, 1], got {speed:g}; "
            "write e.g. 'cpu@0.25' for the CPU at a quarter speed"
        )


def parse_device(spec: DeviceLike, *, check: bool = True) -> Device:
    """Parse one device string into a :class:`Device`.

    Accepted forms: ``cpu``, ``cuda``, ``cuda:N``, ``mps``, each optionally followed
    by ``@SPEED`` with ``0 < SPEED <= 1`` for an emulated slower device. A bare
    ``cuda`` means the current CUDA device.

    Args:
        spec: A string, a :class:`torch.device` or a :class:`Device`.
        check: Also check that the device exists on this machine.

    Returns:
        The parsed device.

    Raises:
        TypeError: If ``spec`` is not a string or device.
        ValueError: If the string is malformed or the device is not available.

    Example:
        >>> parse_device("cpu@0.25").speed
        0.25
    """
    if isinstance(spec, Device):
        dev = spec
    elif isinstance(spec, torch.device):
        dev = Device(spec.type, spec.index)
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device type {spec.type!r} in {spec}; use cpu, cuda:N or mps")
    elif isinstance(spec, str):
        text = spec.strip().lower()
        match = _SPEC.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse device {spec!r}; expected cpu, cuda, cuda:N or mps, "
                "optionally with @SPEED for an emulated slower device (e.g. 'cpu@0.25')"
            )
        kind = match["type"]
        index = int(match["index"]) if match["index"] is not None else None
        if kind == "cpu" and index is not None:
            raise ValueError(f"device {spec!r}: the CPU takes no index; write 'cpu'")
        if kind == "cuda" and index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        speed = 1.0
        emulated = match["speed"] is not None
        if emulated:
            speed = float(match["speed"])
            _check_speed(speed, spec)
        dev = Device(kind, index, speed, emulated)
    else:
        raise TypeError(f"a device must be a string or torch.device, got {type(spec).__name__}: {spec!r}")
    if check:
        _check_available(dev, spec)
    return dev


def _check_available(dev: Device, spec: Any) -> None:
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index is None or dev.index >= count:
            seen = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise ValueError(
                f"device {str(spec)!r} is not available: this machine has CUDA devices: {seen}; "
                "run 'hetsplit devices' to list usable devices, or emulate one with e.g. 'cpu@0.5'"
            )
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"device {str(spec)!r} is not available: MPS needs an Apple-silicon Mac; run 'hetsplit devices'")


def parse_devices(specs: str | Iterable[DeviceLike], *, check: bool = True) -> list[Device]:
    """Parse a comma-separated string or a sequence of device specs.

    Args:
        specs: ``"cpu,cpu@0.25"`` or ``["cuda:0", "cpu"]``.
        check: Also check that every device exists on this machine.

    Returns:
        The parsed devices, in order.

    Raises:
        ValueError: If the list is empty or any entry is invalid.
    """
    if isinstance(specs, str):
        items: Sequence[DeviceLike] = [s for s in specs.split(",") if s.strip()]
    elif isinstance(specs, (torch.device, Device)):
        items = [specs]
    else:
        items = list(specs)
    if not items:
        raise ValueError(f"no devices given in {specs!r}; name at least one, e.g. 'cpu' or 'cuda:0,cpu'")
    return [parse_device(s, check=check) for s in items]


def synchronize(device: torch.device | str) -> None:
    """Block until all queued work on ``device`` is done (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


@functools.lru_cache(maxsize=1)
def _nvidia_driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, or ``None`` where it can't be asked."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe(device: DeviceLike) -> DeviceInfo:
    """Describe one device: hardware name, memory, emulation.

    Args:
        device: Any device spec accepted by :func:`parse_device`.

    Returns:
        The device's :class:`DeviceInfo`.
    """
    dev = parse_device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev.index)
        uuid = getattr(props, "uuid", None)
        info = DeviceInfo(
            name=dev.name,
            kind="cuda",
            description=props.name,
            memory_bytes=int(props.total_memory),
            uuid=f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith("GPU-") else (str(uuid) if uuid else None),
            capability=f"{props.major}.{props.minor}",
            driver=_nvidia_driver(),
            runtime=torch.version.cuda,
        )
    elif dev.type == "mps":
        info = DeviceInfo(name=dev.name, kind="mps", description="Apple MPS", memory_bytes=_host_memory())
    else:
        info = DeviceInfo(
            name=dev.name,
            kind="cpu",
            description=_cpu_name(),
            memory_bytes=_host_memory(),
            threads=torch.get_num_threads(),
        )
    info.torch = torch.__version__
    if dev.emulated:
        info.emulated = True
        info.speed = dev.speed
        info.description = f"{info.description} (emulated at {dev.speed:g}x speed)"
    return info


def discover() -> list[DeviceInfo]:
    """List every usable real device on this machine: the CPU, each CUDA GPU, MPS.

    Returns:
        One :class:`DeviceInfo` per device, the CPU last.
    """
    found: list[DeviceInfo] = []
    if torch.cuda.is_available():
        found.extend(describe(f"cuda:{i}") for i in range(torch.cuda.device_count()))
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        found.append(describe("mps"))
    found.append(describe("cpu"))
    return found
