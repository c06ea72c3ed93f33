"""Apply: run one piece of work per device concurrently, each at its device's (emulated) speed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, parse_devices
from ..timing import Lap, lap

__all__ = ["run_parallel", "parallel_apply"]

# One pool for the process: worker threads persist across steps and wrappers, so a step
# pays a hand-over, not a thread start. Wrappers hold no thread of their own, which keeps
# them picklable and copyable.
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_POOL_SIZE = 64


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_POOL_SIZE, thread_name_prefix="hetsplit")
        return _POOL


class _Context:
    """The caller's grad mode and autocast state, re-entered in a worker thread."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
        }

    def enter(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, (enabled, dtype) in self.autocast.items():
            if enabled:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))


def _reraise(e: BaseException, where: str) -> None:
    message = f"{where}: {type(e).__name__}: {e}"
    try:
        new = type(e)(message)
    except Exception:  # exception types whose constructor takes other arguments
        new = RuntimeError(message)
    raise new from e


def run_parallel(
    fns: Sequence[Callable[[], Any]],
    devices: Sequence[Device],
    names: Sequence[str] | None = None,
    laps: list[Lap] | None = None,
    inline: int | None = None,
) -> list[Any]:
    """Run ``fns[i]()`` for every device concurrently, each at its device's emulated speed.

    Each call runs in a worker thread that carries the caller's grad mode and autocast
    state. An exception in one call is re-raised in the caller, naming the replica and
    device.

    Args:
        fns: One zero-argument callable per device.
        devices: The devices, for throttling and CUDA device selection.
        names: Replica labels for error messages (default: ``0, 1, ...``).
        laps: If given, receives one :class:`~hetsplit.timing.Lap` per call, in order:
            its busy time on the device (emulated slowdown included), measured without
            synchronising a CUDA device.
        inline: The index of a call to run in the calling thread instead (while the
            others run in workers): a backward called from inside the autograd engine's
            thread for a GPU must run there, as that thread is the only one the engine
            runs that GPU's backward on.

    Example:
        >>> run_parallel([lambda: 1, lambda: 2], parse_devices("cpu,cpu@0.5"))
        [1, 2]
    """
    ctx = _Context()
    spent: list[Lap | None] = [None] * len(fns)

    def run(i: int) -> tuple[bool, Any]:
        try:
            with contextlib.ExitStack() as stack:
                ctx.enter(stack, devices[i].torch_device)
                with lap(devices[i]) as timed, devices[i].throttle():
                    out = fns[i]()
                spent[i] = timed
                return True, out
        except BaseException as e:  # re-raised in the caller with the device named
            return False, e

    futures = {i: _pool().submit(run, i) for i in range(len(fns)) if i != inline}
    own = run(inline) if inline is not None else None
    results = [own if i == inline else futures[i].result() for i in range(len(fns))]
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

    Runs ``modules[i](*inputs[i], **kwargs_tup[i])`` concurrently, each at its device's
    emulated speed; a non-tuple input is passed as the only argument, as in torch.

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
    return run_parallel([lambda i=i: modules[i](*args[i], **kwargs_tup[i]) for i in range(n)], devs)
