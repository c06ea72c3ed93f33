"""Apply: run one piece of work per device concurrently, each at its device's (emulated) speed."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..devices import Device, DeviceLike, parse_devices
from ..timing import Lap, lap


class _Worker:
    """One persistent worker thread with a queue of its own, so a job can be placed before it wakes."""

    def __init__(self, pool: _Workers) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Lock]] = queue.SimpleQueue()
        self.cores: frozenset[int] | None = None  # the cores it is kept to; None: the pool's free cores
        self.pool = pool
        self.tid = 0
        started = threading.Event()

        def loop() -> None:
            self.tid = threading.get_native_id()
            # A thread inherits its creator's cores: started from a pinned job (a nested
            # step), it would stay on that one core. It starts free instead.
            if pool.free:
                self.cores = frozenset()
                self.keep_to(None)
            started.set()
            while True:
                job, done = self.jobs.get()
                job()
                del job  # an idle worker must not keep the last step's results (outputs, gradients) alive
                # Idle again before the caller hears of it: its next submission then reuses
                # this worker instead of starting another.
                with pool.lock:
                    pool.idle.append(self)
                done.release()

        threading.Thread(target=loop, name="hetsplit", daemon=True).start()
        started.wait()

    def keep_to(self, cores: frozenset[int] | None) -> None:
        """Let the thread run on ``cores`` only (``None``: the pool's free cores); a no-op when so already."""
        if cores == self.cores or not self.pool.free:
            return
        try:
            os.sched_setaffinity(self.tid, cores if cores is not None else self.pool.free)
            self.cores = cores
        except OSError:  # the cores were taken from the process meanwhile: run where the scheduler likes
            pass


class _Workers:
    """Persistent worker threads for the whole process: one queue put per job, one lock release when done.

    Each submission reserves an idle worker or starts one, so nested calls cannot deadlock; wrappers
    hold no thread, which keeps them picklable.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.cores: dict[tuple[frozenset[int], int, int | None], list[int]] = {}  # see cpu_cores
        # The cores the process may use, as it started (or forked): where unpinned workers run.
        self.free = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()

    def submit(self, job: Callable[[], None], cores: frozenset[int] | None = None) -> threading.Lock:
        """Run ``job`` (which must not raise) in a worker; the returned lock is released when it is done.

        ``cores`` is set before the worker wakes: woken on another core, it would wait there.
        """
        done = threading.Lock()
        done.acquire()
        with self.lock:
            # The one already where the job goes saves a move; else the one idle last.
            at = next((k for k in range(len(self.idle) - 1, -1, -1) if self.idle[k].cores == cores), -1)
            worker = self.idle.pop(at) if self.idle else None
        if worker is None:
            worker = _Worker(self)
        worker.keep_to(cores)
        worker.jobs.put((job, done))
        return done


_WORKERS = _Workers()


def _reset_workers() -> None:
    global _WORKERS
    _WORKERS = _Workers()


os.register_at_fork(after_in_child=_reset_workers)


class _Context:
    """The caller's thread-local grad mode, autocast and saved-tensor hooks, re-entered in a worker thread.

    The hooks were written for one thread: every replica gets them behind one lock.
    """

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
        }
        top, self.hooks_off = _torch.saved_tensors_state()
        user = _torch.user_saved_tensors_hooks(top)
        self.hooks = _one_at_a_time(user) if user is not None else None
        self.own_hooks = user is not None and user is top  # the calling thread's own are the user's

    def enter(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, (enabled, dtype) in self.autocast.items():
            if enabled:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
        if self.hooks_off is not None:
            stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(self.hooks_off))
        elif self.hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))

    def enter_own(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        """In the calling thread: its state is the caller's already; only the hooks go behind the lock."""
        if self.own_hooks and self.hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))


_Hooks = _torch.Hooks


def _one_at_a_time(hooks: _Hooks) -> _Hooks:
    """``hooks`` called under one lock (each pack and unpack whole, never two at once)."""
    pack, unpack = hooks
    lock = threading.RLock()  # a hook whose own work saves a tensor calls pack again, in its thread

    def locked_pack(tensor: torch.Tensor) -> Any:
        with lock:
            return pack(tensor)

    def locked_unpack(packed: Any) -> Any:
        with lock:
            return unpack(packed)

    return locked_pack, locked_unpack


def _current_core_reader() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (the core the calling thread runs on), or ``None`` where there is none."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        import ctypes

        read = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    read.restype, read.argtypes = ctypes.c_int, []
    return read


_CURRENT_CORE = _current_core_reader()


def cpu_cores(devices: Sequence[Device], inline: int | None) -> list[int] | None:
    """The core each job of a step runs on when every job is one-thread CPU work, or ``None`` to leave them be.

    Left alone the scheduler often wakes a worker on its waker's core: on a 2-vCPU VM a balanced
    step ran 10 % slower. Chosen once per process, from the calling thread's core; off with
    ``HETSPLIT_PIN_CPU=0``, with too few cores, or where there is no thread affinity.
    """
    placed = _placement(devices, inline)
    return placed[0] if placed else None


def _placement(devices: Sequence[Device], inline: int | None) -> tuple[list[int], frozenset[int]] | None:
    """:func:`cpu_cores`, and the cores the calling thread may use now (read once a step, restored after)."""
    if _CURRENT_CORE is None or len(devices) < 2 or os.environ.get("HETSPLIT_PIN_CPU") == "0":
        return None
    if any(d.type != "cpu" for d in devices) or torch.get_num_threads() != 1:
        return None
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < len(devices):
        return None
    key = (allowed, len(devices), inline)
    cores = _WORKERS.cores.get(key)
    if cores is None:
        order = sorted(allowed)
        here = _CURRENT_CORE()
        start = order.index(here) if here in allowed else 0
        order = order[start:] + order[:start]  # the calling thread's job on its own core, the others next
        first = inline if inline is not None and inline < len(devices) else 0
        jobs = [first] + [i for i in range(len(devices)) if i != first]
        cores = [0] * len(devices)
        for core, i in zip(order, jobs):
            cores[i] = core
        _WORKERS.cores[key] = cores
    return cores, allowed


def _reraise(e: BaseException, where: str) -> None:
    """Raise the replica's own exception object in the caller, the replica named in its message (or a note)."""
    if len(e.args) == 1 and isinstance(e.args[0], str) and not isinstance(e, KeyError | OSError):
        e.args = (f"{where}: {e.args[0]}",)
    elif hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(where)
    else:  # Python 3.10: the same note by hand (pytest reads it); Python's traceback shows the cause
        e.__notes__ = [*getattr(e, "__notes__", []), where]
        raise e from RuntimeError(where)
    raise e


def as_devices(devices: str | Sequence[DeviceLike]) -> list[Device]:
    """``devices`` parsed, unless they are parsed already (a step's: parsed once, when its wrapper was built)."""
    if not isinstance(devices, str) and all(isinstance(d, Device) for d in devices):
        return list(devices)  # type: ignore[arg-type]
    return parse_devices(devices)


def run_parallel(
    fns: Sequence[Callable[[], Any]],
    devices: Sequence[DeviceLike],
    names: Sequence[str] | None = None,
    laps: list[Lap] | None = None,
    inline: int | None = 0,
) -> list[Any]:
    """Run ``fns[i]()`` for every device concurrently, each at its device's emulated speed.

    An exception in one call is re-raised in the caller, naming the replica and device.

    Args:
        fns: One zero-argument callable per device.
        devices: The devices (``"cpu@0.25"`` or parsed), for throttling and CUDA device selection.
        names: Replica labels for error messages (default: ``0, 1, ...``).
        laps: If given, receives one :class:`~hetsplit.timing.Lap` per call, in order.
        inline: The index of the call to run in the calling thread (``None``: none). A
            backward in the autograd engine's thread for a GPU must name the job on that GPU.

    Example:
        >>> run_parallel([lambda: 1, lambda: 2], parse_devices("cpu,cpu@0.5"))
        [1, 2]
    """
    devices = as_devices(devices)
    if len(devices) != len(fns):
        raise ValueError(f"got {len(fns)} callables and {len(devices)} devices; give one device per callable")
    ctx = _Context()
    spent: list[Lap | None] = [None] * len(fns)
    results: list[tuple[bool, Any]] = [(False, None)] * len(fns)

    def run(i: int, own_thread: bool) -> None:
        try:
            with contextlib.ExitStack() as stack:
                if own_thread:
                    ctx.enter_own(stack, devices[i].torch_device)
                else:
                    ctx.enter(stack, devices[i].torch_device)
                with lap(devices[i]) as timed, devices[i].throttle():
                    out = fns[i]()
                spent[i] = timed
                results[i] = (True, out)
        except BaseException as e:  # re-raised in the caller with the device named
            results[i] = (False, e)

    # The calling thread would only wait: it runs one job itself, the rest go to workers.
    placed = _placement(devices, inline)
    cores = placed[0] if placed else None
    # Workers are placed before they wake (see _Workers.submit), then the calling thread
    # moves to its own core for its job and gets its cores back once the step's work is done.
    latches = [
        _WORKERS.submit(functools.partial(run, i, False), frozenset({cores[i]}) if cores else None)
        for i in range(len(fns))
        if i != inline
    ]
    own_job = inline if inline is not None and inline < len(fns) else None
    before = placed[1] if placed and own_job is not None else None
    try:
        if before is not None and cores is not None and own_job is not None:
            try:
                os.sched_setaffinity(0, {cores[own_job]})
            except OSError:  # the core was taken from the process meanwhile: run where the scheduler likes
                before = None
        if own_job is not None:
            run(own_job, True)
    finally:
        try:
            for done in latches:
                done.acquire()
        finally:  # also when interrupted while waiting: the caller never stays pinned
            if before is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, before)
    values = []
    for i, (ok, value) in enumerate(results):
        if not ok:
            _reraise(value, f"in replica {names[i] if names is not None else i} on device {devices[i].name}")
        values.append(value)
    if laps is not None:
        laps.extend(t for t in spent if t is not None)
    return values


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike] | None = None,
) -> list[Any]:
    """``torch.nn.parallel.parallel_apply`` for any devices, emulated ones included.

    Args:
        modules: One module per device.
        inputs: One input (a tuple of positional arguments, or a single object) per module.
        kwargs_tup: Keyword arguments per module (default: none).
        devices: Each module's device (default: where its first parameter lives, else the CPU).

    Raises:
        ValueError: If the lengths differ.
    """
    n = len(modules)
    kwargs_tup = list(kwargs_tup) if kwargs_tup is not None else [{}] * n
    if devices is None:
        devices = [next((p.device for p in m.parameters()), torch.device("cpu")) for m in modules]
    devs = parse_devices(devices) if n else []
    if not (len(inputs) == len(kwargs_tup) == len(devs) == n):
        raise ValueError(
            f"got {n} modules, {len(inputs)} inputs, {len(kwargs_tup)} kwargs and {len(devs)} devices; "
            "give one of each per replica"
        )
    args = [x if isinstance(x, tuple) else (x,) for x in inputs]
    return run_parallel([functools.partial(modules[i], *args[i], **kwargs_tup[i]) for i in range(n)], devs)
