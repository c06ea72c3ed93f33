"""Devices: parse and validate device strings, canonical names, discover local hardware."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from . import (
    _torch,  # noqa: F401  # first: it refuses, in one line, a torch older than hetsplit supports
    emulation,
    hardware,
)

DeviceLike = Union[str, torch.device, "Device"]

_SPEC = re.compile(
    r"^(?P<type>cpu|cuda|mps)(?::(?P<index>\d+))?(?:@(?P<speed>[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?))?(?::max(?P<cap>[^,\s]*))?$"
)


@dataclasses.dataclass(frozen=True)
class Device:
    """A device a shard can run on, possibly emulated at a fraction of its real speed.

    ``Device("cpu", None, 0.25, True)`` is the CPU at a quarter speed; ``max_batch=64`` also
    emulates a small memory. Usually made by :func:`parse_devices` (``"cpu@0.25:max64"``) or
    :func:`emulate`.

    Attributes:
        type: ``"cpu"``, ``"cuda"`` or ``"mps"``.
        index: The device index (``None`` for the CPU).
        speed: The emulated speed factor in ``(0, 1]``; ``1.0`` for a real device.
        emulated: Whether the device was asked for with ``@speed`` (even ``@1.0``) or ``:maxN``.
        max_batch: The emulated memory: the most samples one forward may take (``None``: no limit).
    """

    type: str
    index: int | None = None
    speed: float = 1.0
    emulated: bool = False
    max_batch: int | None = None

    def __post_init__(self) -> None:
        # Built by hand too (the docstring's example): the same rules as parse_device.
        if self.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device type {self.type!r}; use cpu, cuda or mps")
        index = self.index
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
            raise ValueError(f"device index must be None or an integer >= 0, got {self.index!r}")
        if self.type == "cpu" and index not in (None, 0):
            raise ValueError(f"device 'cpu:{index}': the CPU has one index, 0; write 'cpu'")
        object.__setattr__(self, "index", None if self.type == "cpu" else index)  # cpu:0 is the CPU, as in torch
        if not isinstance(self.emulated, bool):
            raise TypeError(f"Device.emulated must be True or False, got {self.emulated!r}")
        if self.emulated:
            emulation.check_speed(self.speed, f"{self.base}@{self.speed}")
        elif self.speed != 1.0 or self.max_batch is not None:
            raise ValueError(
                f"a real device runs at speed 1.0 with its own memory, got speed {self.speed!r}, "
                f"max_batch {self.max_batch!r}; pass emulated=True to emulate a slower or smaller device"
            )
        emulation.check_max_batch(self.max_batch, self.base)

    @property
    def base(self) -> str:
        """The real device's name, without the emulation suffix (``"cuda:0"``)."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def name(self) -> str:
        """The canonical spelling: ``"cpu"``, ``"cuda:1"``, ``"cpu@0.25"``, ``"cpu@0.25:max64"``, ``"cpu:max64"``."""
        if not self.emulated:
            return self.base
        speed = "" if self.speed == 1.0 and self.max_batch is not None else f"@{self.speed:g}"
        return f"{self.base}{speed}" + ("" if self.max_batch is None else f":max{self.max_batch}")

    @property
    def torch_device(self) -> torch.device:
        """The :class:`torch.device` the work actually runs on."""
        return torch.device(self.base)

    @property
    def current_speed(self) -> float:
        """The speed factor in force now (see :meth:`set_speed`)."""
        return emulation.current_speed(self)

    def set_speed(self, speed: float | None) -> None:
        """Change this emulated device's speed from now on (``None`` restores its own).

        Raises:
            ValueError: If the device is not emulated or the speed is out of range.
        """
        emulation.set_speed(self, speed)

    @property
    def delayed(self) -> float:
        """Seconds this emulated device has slept so far in this process (0 for a real one)."""
        return emulation.delayed(self)

    def synchronize(self) -> None:
        """Wait for all queued work on the real device to finish."""
        synchronize(self.torch_device)

    def throttle(self, *, cpu_time: bool | None = None) -> contextlib.AbstractContextManager[None]:
        """Run the enclosed work at this device's emulated speed (see :func:`hetsplit.emulation.throttle`).

        Args:
            cpu_time: Deprecated, ignored: the work is always timed as compute, which is
                what ``cpu_time=True`` asked for. Removed in hetsplit 0.2.
        """
        if cpu_time is not None:
            warnings.warn(
                f"Device.throttle(cpu_time={cpu_time!r}) is deprecated and ignored: throttle() always times the "
                "work as compute (what cpu_time=True did); write dev.throttle(). cpu_time= goes in hetsplit 0.2",
                DeprecationWarning,
                stacklevel=2,
            )
        return emulation.throttle(self)

    def copy(self, data: Any, *, requires_grad: bool = False) -> Any:
        """``data`` copied onto this device, never sharing its storage (see :func:`hetsplit.emulation.copy_to`)."""
        return emulation.copy_to(data, self.torch_device, requires_grad=requires_grad)

    def check_batch(self, batch: int) -> None:
        """Raise ``torch.OutOfMemoryError`` if this device's emulated memory cannot take ``batch`` samples."""
        emulation.check_batch(self, batch)

    def __str__(self) -> str:
        return self.name


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
        max_batch: The emulated memory in samples (``None``: the device's own).
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
    max_batch: int | None = None
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
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceInfo:
        """Build the info from :meth:`to_dict` output (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_device(spec: DeviceLike, *, check: bool = True) -> Device:
    """Parse one device string (or ``torch.device``, or :class:`Device`) into a :class:`Device`.

    ``cpu``, ``cuda`` (the current CUDA device), ``cuda:N`` or ``mps``, then optionally
    ``@SPEED`` (an emulated slower device) and ``:maxN`` (an emulated memory of ``N`` samples a
    forward). ``check`` also checks that the device exists on this machine.
    """
    if isinstance(spec, Device):
        dev = spec
    elif isinstance(spec, torch.device):
        if spec.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"unsupported device type {spec.type!r} in {spec}; use cpu, cuda:N or mps")
        dev = Device(spec.type, spec.index)
    elif isinstance(spec, str):
        text = spec.strip().lower()
        match = _SPEC.match(text)
        if match is None:
            guess = _did_you_mean(text)
            raise ValueError(
                f"cannot parse device {spec!r}{guess}; expected cpu, cuda, cuda:N or mps, optionally with @SPEED "
                "for an emulated slower device (e.g. 'cpu@0.25') and :maxN for an emulated memory of N samples"
            )
        kind = match["type"]
        index = int(match["index"]) if match["index"] is not None else None
        if kind == "cuda" and index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        speed = 1.0
        emulated = match["speed"] is not None or match["cap"] is not None
        if match["speed"] is not None:
            speed = float(match["speed"])
            emulation.check_speed(speed, spec)
        cap = None
        if match["cap"] is not None:
            if not match["cap"].isdigit():
                raise ValueError(f"device {spec!r}: the emulated memory after ':max' must be a whole number of samples "
                                 f"(e.g. 'cpu@0.25:max64'), got {match['cap']!r}")  # fmt: skip
            cap = int(match["cap"])
        dev = Device(kind, index, speed, emulated, cap)
    else:
        raise TypeError(f"a device must be a string or torch.device, got {type(spec).__name__}: {spec!r}")
    if check:
        _check_available(dev, spec)
    return dev


# The names people write for a device type that torch spells otherwise.
_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "metal": "mps"}


def _did_you_mean(text: str) -> str:
    """``" (did you mean 'cuda:0'?)"`` for a near miss such as ``cuda0``, ``gpu:1`` or ``cdua``; else ``""``."""
    found = re.fullmatch(r"([a-z]+)[:_\-#.]*(\d*)(.*)", text.replace(" ", ""))
    if found is None:
        return ""
    word, index, rest = found.groups()
    kind = _ALIASES.get(word) or next(
        iter(difflib.get_close_matches(word, ["cpu", "cuda", "mps"], n=1, cutoff=0.7)), None
    )
    if kind is None:
        return ""
    guess = kind + (f":{index}" if index else "") + rest
    return f" (did you mean {guess!r}?)" if guess != text and _SPEC.match(guess) else ""


def emulate(base: DeviceLike, *, speed: float = 1.0, max_batch: int | None = None) -> Device:
    """An emulated device: ``base`` slowed to ``speed`` and, with ``max_batch``, a small memory (``cpu@0.25:max64``).

    Args:
        base: The real device, e.g. ``"cpu"`` or ``"cuda:0"``.
        speed: Speed factor in ``[MIN_SPEED, 1]``.
        max_batch: Most samples one forward may take (a whole number >= 1), or ``None``.

    Returns:
        The emulated :class:`Device`, labelled emulated everywhere.

    Raises:
        TypeError, ValueError: If ``base`` is emulated or unknown, or a value is bad.

    Example:
        >>> emulate("cpu", speed=0.25, max_batch=64).name
        'cpu@0.25:max64'
    """
    real = parse_device(base)
    if real.emulated:
        raise ValueError(f"emulate() takes a real device, got {real.name!r}; write e.g. emulate('cpu', speed=0.25)")
    emulation.check_speed(speed, f"emulate({real.name!r})")
    emulation.check_max_batch(max_batch, real.name)
    return Device(real.type, real.index, float(speed), True, max_batch)


def _check_available(dev: Device, spec: Any) -> None:
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index is None or dev.index >= count:
            seen = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise ValueError(
                f"device {str(spec)!r} is not available: this machine has CUDA devices: {seen}; "
                "run 'hetsplit devices' to list usable devices, or emulate one with e.g. 'cpu@0.5'"
            )
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(
            f"device {str(spec)!r} is not available: MPS needs an Apple-silicon Mac; run 'hetsplit devices'"
        )


def device_list(spec: str) -> list[str]:
    """The entries of a comma-separated device list, stripped, empty ones dropped, not parsed: the one split."""
    return [s.strip() for s in spec.split(",") if s.strip()]


# The frameworks name the CPU with an index (accelerate's multi-CPU device is "cpu:0",
# torch.device("cpu", 0) prints so); hetsplit's CPU takes none (Device makes cpu:0 the
# CPU). A framework's index is dropped, whatever follows it (@speed, :maxN).
_CPU_INDEX = re.compile(r"^cpu:\d+(?=$|[@:])")


def device_name(device: Any) -> str:
    """hetsplit's name for a device as a framework writes it: ``cpu:0`` is ``cpu`` (``cpu:0@0.25``: ``cpu@0.25``)."""
    if isinstance(device, Device):
        return device.name
    return _CPU_INDEX.sub("cpu", str(device).strip())


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
        items: Sequence[DeviceLike] = device_list(specs)
    elif isinstance(specs, (torch.device, Device)):
        items = [specs]
    elif isinstance(specs, Iterable) and not isinstance(specs, bytes):
        items = list(specs)
    else:
        raise TypeError(
            f"devices must be a string such as 'cuda:0,cpu' or a list of devices, got {type(specs).__name__}: {specs!r}"
        )
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


def describe(device: DeviceLike) -> DeviceInfo:
    """Describe one device (any spec :func:`parse_device` takes): hardware name, memory, emulation."""
    dev = parse_device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev.index)
        uuid = getattr(props, "uuid", None)
        info = DeviceInfo(
            name=dev.name,
            kind="cuda",
            description=props.name,
            memory_bytes=int(props.total_memory),
            uuid=None if not uuid else str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}",
            capability=f"{props.major}.{props.minor}",
            driver=hardware.nvidia_driver(),
            runtime=torch.version.cuda,
        )
    elif dev.type == "mps":
        info = DeviceInfo(name=dev.name, kind="mps", description="Apple MPS", memory_bytes=hardware.host_memory())
    else:
        info = DeviceInfo(
            name=dev.name,
            kind="cpu",
            description=hardware.cpu_name(),
            memory_bytes=hardware.host_memory(),
            threads=torch.get_num_threads(),
        )
    info.torch = torch.__version__
    if dev.emulated:
        info.emulated, info.speed, info.max_batch = True, dev.speed, dev.max_batch
        memory = "" if dev.max_batch is None else f", memory of {dev.max_batch} samples"
        info.description = f"{info.description} (emulated at {dev.speed:g}x speed{memory})"
    return info


def discover() -> list[DeviceInfo]:
    """Every usable real device on this machine: each CUDA GPU, MPS, the CPU last."""
    found: list[DeviceInfo] = []
    if torch.cuda.is_available():
        found.extend(describe(f"cuda:{i}") for i in range(torch.cuda.device_count()))
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        found.append(describe("mps"))
    found.append(describe("cpu"))
    return found


def canonical_name(device: DeviceLike) -> str:
    """A device's canonical name (``"cuda:0"``, ``"cpu@0.25"``); a label (``"v100"``, ``"rank1:cuda:0"``) as it is."""
    if isinstance(device, str):
        try:
            return parse_device(device, check=False).name
        except ValueError:
            return device
    return parse_device(device, check=False).name


def rank_label(rank: int, device: object = "") -> str:
    """A torchrun rank's name in a plan: ``rank1:cpu@0.25`` (``rank1`` for a share set by hand, with no device)."""
    return f"rank{rank}:{device}" if device else f"rank{rank}"


def label_device(name: str) -> str:
    """The device a rank's name stands for (``cpu@0.25`` of ``rank1:cpu@0.25``); any other name as it is."""
    head, _, rest = name.partition(":")
    return rest if head.startswith("rank") and head[4:].isdigit() and rest else name


def local_gpus() -> dict[str, str]:
    """``{uuid: "cuda:N"}`` for the GPUs visible to this process (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    found = {}
    for i in range(torch.cuda.device_count()):
        info = describe(f"cuda:{i}")
        if info.uuid:
            found[info.uuid] = info.name
    return found
