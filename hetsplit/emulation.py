"""Emulation: slowed devices (``cpu@0.25``), so mixed hardware can be shown and tested on one machine.

The real work runs on the real device, then sleeps; the state (speed changes, sleep debt,
time slept) is keyed by the device's name, so every copy of a device value sees it.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

# Below this an emulated step takes over 1000 times its real duration: a typo, not a device.
MIN_SPEED = 1e-3
# An emulated memory above this is a typo: no forward that large could run.
_MAX_EMULATED_BATCH = 1 << 40

_SPEED_OVERRIDES: dict[str, float] = {}
_SLEEP_DEBT: dict[str, float] = {}
_DELAYED: dict[str, float] = {}  # seconds each emulated device has slept in this process


class _Emulated(Protocol):
    # Read-only members: hetsplit's Device is a frozen dataclass, and emulation never writes them.
    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def speed(self) -> float: ...
    @property
    def emulated(self) -> bool: ...
    @property
    def max_batch(self) -> int | None: ...

    def synchronize(self) -> None: ...


def check_speed(speed: float, spec: str) -> None:
    """Raise unless ``speed`` is a usable emulated speed factor (TypeError: not a number; ValueError: out of range)."""
    if isinstance(speed, bool) or not isinstance(speed, int | float):
        raise TypeError(f"emulated speed for {spec!r} must be a number in [{MIN_SPEED:g}, 1], got {speed!r}")
    if not (math.isfinite(speed) and MIN_SPEED <= speed <= 1.0):
        raise ValueError(
            f"emulated speed in {spec!r} must be in (0, 1] and at least {MIN_SPEED:g}, got {speed!r}; "
            "write e.g. 'cpu@0.25' for the CPU at a quarter speed"
        )


def check_max_batch(max_batch: object, spec: str) -> None:
    """Raise unless ``max_batch`` is ``None`` or a whole number of samples from 1 to :data:`_MAX_EMULATED_BATCH`."""
    if max_batch is None:
        return
    if isinstance(max_batch, bool) or not isinstance(max_batch, int):
        raise TypeError(
            f"emulated max_batch for {spec!r} must be a whole number of samples >= 1, "
            f"got {type(max_batch).__name__}: {max_batch!r}"
        )
    if not 1 <= max_batch <= _MAX_EMULATED_BATCH:
        raise ValueError(
            f"emulated max_batch for {spec!r} must be from 1 to {_MAX_EMULATED_BATCH:,} samples, got {max_batch}; "
            "a device that holds no sample cannot train"
        )


def check_batch(device: _Emulated, batch: int) -> None:
    """Raise ``torch.OutOfMemoryError`` for a forward of more samples than ``device``'s emulated memory holds."""
    cap = device.max_batch if device.emulated else None
    if cap is not None and batch > cap:
        import torch  # here, not at the top: the CLI imports this module before torch

        raise torch.OutOfMemoryError(
            f"out of memory (emulated) on {device.name}: a forward on {batch} samples, "
            f"but its emulated memory holds {cap}"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error: torch's (CUDA, emulated) or a RuntimeError that says so."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error)
    )


class _Placed(Protocol):
    @property
    def type(self) -> str: ...
    @property
    def torch_device(self) -> torch.device: ...


def release_after_oom(devices: Iterable[_Placed]) -> None:
    """Free what a step that ran out of memory left: its graph (collected garbage) and cached GPU memory.

    Only after a failure (a full collection costs tens of milliseconds, more than a small
    model's whole profile), outside the ``except`` block, once the error's frames are gone.
    """
    import gc

    import torch

    gc.collect()
    for d in {d.torch_device for d in devices if d.type == "cuda"}:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()


def current_speed(device: _Emulated) -> float:
    """The speed factor in force now for ``device`` (1.0 for a real device)."""
    if not device.emulated:
        return 1.0
    # Asked at every throttled step: the name is spelled out only when some speed was changed.
    return _SPEED_OVERRIDES.get(device.name, device.speed) if _SPEED_OVERRIDES else device.speed


def set_speed(device: _Emulated, speed: float | None) -> None:
    """Change an emulated device's speed from now on (``None`` restores its own).

    Raises:
        TypeError: If the speed is not a number.
        ValueError: If the device is real or the speed is out of range.
    """
    if speed is None:  # restoring is harmless for any device
        _SPEED_OVERRIDES.pop(device.name, None)
        return
    if not device.emulated:
        raise ValueError(f"device {device.name!r} is real; only emulated devices (e.g. 'cpu@0.5') change speed")
    check_speed(speed, device.name)
    _SPEED_OVERRIDES[device.name] = float(speed)


def delayed(device: _Emulated) -> float:
    """Seconds ``device`` has slept for emulation so far in this process (0 for a real one)."""
    return _DELAYED.get(device.name, 0.0)


_SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: ns on a CPU, ns runnable but waiting for one, slices
_HAS_SCHEDSTAT: bool | None = None
_EXTRA = threading.local()  # per thread: emulated compute added by throttles (seconds beyond the real work)
_STAT = threading.local()  # per thread: its schedstat file, open (see _runnable_time)


def _runnable_time() -> float:
    """This thread's seconds on a core plus its seconds waiting in the run queue for one.

    A loaded machine slows the real work by exactly the run-queue wait, so an emulated device
    that counts it stays ``1/speed`` times slower; blocked time (a lock, a collective) is not
    counted. The CPU clock is exact (schedstat's own figure moves only at scheduler ticks); the
    wait is schedstat's second field. Without Linux's schedstat: the CPU time alone.
    """
    global _HAS_SCHEDSTAT
    if _HAS_SCHEDSTAT is not False:
        try:
            # Every lap reads this twice per replica per step: the file is opened once per
            # thread (/proc/thread-self names the thread that opens it) and read in place,
            # 2 us a read against 15 us for an open, read and close. The descriptor lives
            # in the thread's local state and is closed with it.
            stat = getattr(_STAT, "file", None)
            if stat is None:
                stat = _STAT.file = _Descriptor(_SCHEDSTAT)
            waiting = int(os.pread(stat.fd, 128, 0).split()[1])
            _HAS_SCHEDSTAT = True
            return time.thread_time() + waiting * 1e-9
        except (OSError, ValueError, IndexError):
            _HAS_SCHEDSTAT = False
    return time.thread_time()


class _Descriptor:
    """A file opened for reading at its descriptor, closed when the holder goes (a thread's end, the exit)."""

    __slots__ = ("fd",)

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError):  # AttributeError: the open itself failed
            pass


def _wall_time() -> float:
    return time.perf_counter()


def measures_load() -> bool:
    """Whether the work clock counts the time a thread waits for a core (Linux schedstat); outputs say if not."""
    _runnable_time()
    return bool(_HAS_SCHEDSTAT)


def work_clock(device: _Emulated) -> Callable[[], float]:
    """The clock a device's work is measured by: :func:`_runnable_time` on a one-thread CPU, else wall time."""
    if device.type == "cpu":
        import torch  # emulation is imported before torch is needed; this is called per piece of work

        if torch.get_num_threads() == 1:
            return _runnable_time
    return _wall_time


def compute_counter(device: _Emulated) -> Callable[[], float]:
    """A counter of this thread's compute seconds on ``device``, plus the compute its throttles slept for."""
    clock = work_clock(device)
    if clock is _wall_time:
        return clock
    return lambda: clock() + getattr(_EXTRA, "seconds", 0.0)


@contextlib.contextmanager
def throttle(device: _Emulated) -> Iterator[None]:
    """Run the enclosed work at ``device``'s emulated speed (nothing for a real device).

    Sleeps until the piece has taken ``work / speed`` in all, the work measured by
    :func:`work_clock`: its own waits (a collective, the interpreter lock) overlap the
    slow-down, as a slow GPU computes while its peers wait.
    """
    speed = current_speed(device)
    if speed >= 1.0:
        yield
        return
    clock = work_clock(device)
    began, start = _wall_time(), clock()
    yield
    device.synchronize()
    work = clock() - start
    now = _wall_time()
    if clock is _wall_time:
        need = work * (1.0 / speed - 1.0)
    else:
        need = max(0.0, work / speed - (now - began))
        _EXTRA.seconds = getattr(_EXTRA, "seconds", 0.0) + work * (1.0 / speed - 1.0)
    # time.sleep overshoots by tens of microseconds, which would dominate small steps;
    # carry each device's error into its next sleep so the long-run speed is exact.
    wanted = need - _SLEEP_DEBT.get(device.name, 0.0)
    if wanted > 0:
        _sleep(wanted)
        slept = _wall_time() - now
        _SLEEP_DEBT[device.name] = slept - wanted
        _DELAYED[device.name] = _DELAYED.get(device.name, 0.0) + slept
    else:
        _SLEEP_DEBT[device.name] = -wanted


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def copy_to(data: Any, device: torch.device, *, requires_grad: bool = False) -> Any:
    """A copy of ``data`` (a tensor or a nest of them) on ``device``, never sharing storage with it.

    ``cpu`` and ``cpu@0.25`` are one memory: ``p.to(device)`` would return ``p`` itself and
    both replicas would apply every update to the same parameters. ``requires_grad`` makes
    each floating-point copy a leaf that records gradients.
    """

    import torch  # here, not at the top: the CLI may import this module before torch

    from .tree import tree_map

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        out = x.detach().to(device, copy=True)
        return out.requires_grad_(requires_grad and out.is_floating_point())

    return tree_map(one, data)
