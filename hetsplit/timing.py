"""Timing: how every engine measures a device's compute time, apart from waiting, without a synchronisation.

On the CPU (one intra-op thread) a lap reads the thread's compute counter
(:func:`hetsplit.emulation.compute_counter`); on CUDA two events on the current stream;
elsewhere wall time.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import emulation
from .devices import Device
from .tree import flatten

if TYPE_CHECKING:  # a type only: planning sits above timing in the pipeline
    from .planning.plan import Plan


class Lap:
    """An interval of work on a device, read later without forcing a synchronisation (build one with :func:`lap`).

    Off CUDA the compute counter is read at both ends, so it must end in the thread it began in.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._events: tuple[Any, Any] | None = None
        self._seconds: float | None = None
        self.extra = 0.0  # seconds added to the measured interval (e.g. emulated delay after it)
        self._counter = emulation.compute_counter(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)
        self._start = self._counter()

    def stop(self) -> None:
        """Mark the end of the interval (on CUDA: record the end event; no wait); the last call counts."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = self._counter() - self._start

    def ready(self) -> bool:
        """Whether :meth:`seconds` can be read without waiting for the device."""
        return self._seconds is not None or (self._events is not None and bool(self._events[1].query()))

    def seconds(self) -> float:
        """The interval's length in seconds plus :attr:`extra` (waits for the end event if still queued)."""
        if self._seconds is None:
            if self._events is None:
                raise RuntimeError("the lap has not been stopped; use it as `with hetsplit.timing.lap(device) as lap:`")
            start, end = self._events
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1e3
        return self._seconds + self.extra


class PausableLap:
    """A lap that can be paused: the work of one step without the waits inside it (FSDP2's on CUDA).

    The intervals between :meth:`resume` and :meth:`pause` (both idempotent) are summed when read.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._laps: list[Lap] = []
        self._open = False
        self.resume()

    def pause(self) -> None:
        """End the current interval (nothing if paused)."""
        if self._open:
            self._laps[-1].stop()
            self._open = False

    def resume(self) -> None:
        """Start a new interval (nothing if running)."""
        if not self._open:
            self._laps.append(Lap(self.device))
            self._open = True

    stop = pause

    def ready(self) -> bool:
        """Whether :meth:`seconds` can be read without waiting for the device."""
        return not self._open and all(part.ready() for part in self._laps)

    def seconds(self) -> float:
        """The intervals' total in seconds (waits for their end events if still queued)."""
        return sum(part.seconds() for part in self._laps)


@contextlib.contextmanager
def lap(device: Device) -> Iterator[Lap]:
    """Measure the enclosed work on ``device`` without synchronising it: yields a :class:`Lap` to read later."""
    timed = Lap(device)
    try:
        yield timed
    finally:
        timed.stop()


class StepTimer:
    """A training step's compute on one device, without its waits for other ranks.

    On CUDA a lap is two events on the compute stream, which stalls while the rank waits:
    under DDP the lap ends at the step's last parameter gradient (the emulated delay after it
    added back, since it stands for work); under FSDP2 it pauses around the all-gather waits
    (``pause_at_waits``, default on CUDA for a sharded ``model``; untested on a GPU). On the
    CPU a lap counts compute only, so the whole step (or, with no ``model``, the block) is timed.
    """

    def __init__(self, device: Device, model: nn.Module | None = None, *, pause_at_waits: bool | None = None) -> None:
        sharded = _fsdp2_modules(model) if model is not None else []
        if pause_at_waits is None:
            pause_at_waits = bool(sharded) and device.type == "cuda"
        self.device = device
        self._lap: Any = None  # the step's lap while it runs
        self._marked = False
        self._delay_at_mark = 0.0
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._handles: list[Any] = []  # FSDP2's waits: the lap pauses there
        self._gradient_hooks: list[Any] = []  # DDP on CUDA: the lap ends at the last gradient
        if pause_at_waits:
            for m in sharded:
                self._hook(m)
        elif model is not None and not sharded and device.type == "cuda":
            # FSDP2 sets its sharded parameters' gradients itself: these hooks would never fire there.
            self._gradient_hooks = [
                p.register_post_accumulate_grad_hook(self._mark) for p in model.parameters() if p.requires_grad
            ]

    def _hook(self, m: nn.Module) -> None:
        # FSDP2's pre-forward hook (all-gather, wait) was registered with prepend=True at
        # fully_shard: a later prepend runs before it, a plain one after it. Its post-forward
        # hook registers its pre-backward hook (all-gather, wait) on the outputs; gradient
        # hooks of a tensor run in the order they were registered, so one registered before
        # FSDP2's post-forward pauses and one registered after it resumes.
        self._handles += [
            m.register_forward_pre_hook(lambda *_: self._pause(), prepend=True),
            m.register_forward_pre_hook(lambda *_: self._resume()),
            m.register_forward_hook(self._before_post_forward, prepend=True),
            m.register_forward_hook(self._after_post_forward),
        ]

    def _mark(self, _param: torch.Tensor) -> None:
        if self._lap is not None:
            self._lap.stop()
            self._delay_at_mark = self.device.delayed
            self._marked = True

    def _pause(self) -> None:
        if self._lap is not None:
            self._lap.pause()

    def _resume(self) -> None:
        if self._lap is not None:
            self._lap.resume()

    def _before_post_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        if self._lap is None or not torch.is_grad_enabled():
            return
        tensors = [t for t in flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(lambda _grad: self._pause())
        self._pending[id(module)] = tensors

    def _after_post_forward(self, module: nn.Module, _args: Any, _output: Any) -> None:
        for t in self._pending.pop(id(module), []):  # the same tensors FSDP2 hooked
            t.register_hook(lambda _grad: self._resume())

    @contextlib.contextmanager
    def step(self) -> Iterator[Lap | PausableLap]:
        """Time one step's compute; yields its lap (read ``seconds()`` later, without waiting)."""
        current: Lap | PausableLap = PausableLap(self.device) if self._handles else Lap(self.device)
        self._marked, self._lap = False, current
        try:
            yield current
        finally:
            self._lap = None
            self._pending.clear()
            if self._marked and isinstance(current, Lap):  # the work ended at the last gradient: delay after it counts
                current.extra = self.device.delayed - self._delay_at_mark
            else:
                current.stop()

    def remove(self) -> None:
        """Remove the hooks from the model."""
        for handle in self._handles + self._gradient_hooks:
            handle.remove()
        self._handles, self._gradient_hooks = [], []


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` made (none in a torch without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def exposed(walls: Sequence[float], computes: Sequence[float]) -> float:
    """Seconds of one step beyond its slowest rank's compute: the communication no computing hid.

    ``walls`` and ``computes`` are every rank's, each wall from the rank's own start. The rank
    that held the step up waited for nobody: its wall less compute is the smallest. (The
    shortest wall less the longest compute subtracts a head start: DDP steps predicted 6-8 % short.)
    """
    return max(0.0, min(w - c for w, c in zip(walls, computes, strict=True)))


class BusyLog:
    """The laps of every device in each step; finished steps queue until all their laps can be read.

    So a rebalancer reading them (:meth:`readable`) never makes training wait for a GPU.
    """

    def __init__(self) -> None:
        self.current: dict[str, list[Lap]] = {}
        self.last: dict[str, list[Lap]] = {}
        self.unread: deque[tuple[Plan, dict[str, list[Lap]]]] = deque()

    def start(self) -> None:
        """Begin a step."""
        self.current = {}

    def add(self, name: str, lap: Lap) -> None:
        """Count ``lap`` as busy time of device ``name`` in this step."""
        self.current.setdefault(name, []).append(lap)

    def end(self, plan: Plan, *, keep: bool) -> None:
        """End the step that ran ``plan``; ``keep`` it for :meth:`readable`."""
        self.last = self.current
        if keep and self.current:
            self.unread.append((plan, self.current))

    def readable(self) -> Iterator[tuple[Plan, dict[str, float]]]:
        """The kept steps, oldest first, whose laps can all be read now: (plan, seconds per device)."""
        while self.unread and all(lap.ready() for laps in self.unread[0][1].values() for lap in laps):
            plan, busy = self.unread.popleft()
            yield plan, {name: sum(lap.seconds() for lap in laps) for name, laps in busy.items()}

    def last_times(self) -> dict[str, float]:
        """Busy seconds of each device in the last finished step (waits for a GPU to finish it)."""
        return {name: sum(lap.seconds() for lap in laps) for name, laps in self.last.items()}


def cpu_threads(devices: Sequence[Device], requested: int | None = None) -> int:
    """Torch's intra-op threads for timing ``devices``: the one rule of ``profile``, ``bench`` and ``demo``.

    ``requested`` (a whole number >= 1) if given; else 1 when every device is the CPU, real or
    emulated (with several threads a busy machine times a step erratically); else torch's own.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads must be a whole number >= 1 (or None for the default), got {requested!r}")
        return requested
    return 1 if all(d.type == "cpu" for d in devices) else torch.get_num_threads()


@contextlib.contextmanager
def threads_for(devices: Sequence[Device], requested: int | None = None) -> Iterator[int]:
    """Run the enclosed timing with :func:`cpu_threads` threads; torch's setting is restored afterwards."""
    before, threads = torch.get_num_threads(), cpu_threads(devices, requested)
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
