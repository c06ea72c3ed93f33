"""Apply: run one piece of work per device concurrently, each at its device's (emulated) speed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .devices import Device, Lap

__all__ = ["parallel_apply"]


class _Context:
    """The caller's grad mode and autocast state, re-entered in a worker thread."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
        }

    def enter(self, stack: Any, device: torch.device) -> None:
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


def parallel_apply(
    fns: Sequence[Callable[[], Any]],
    devices: Sequence[Device],
    pool: ThreadPoolExecutor | None = None,
    names: Sequence[str] | None = None,
    laps: list[Lap] | None = None,
) -> list[Any]:
    """Run ``fns[i]()`` for every device concurrently, each at its device's emulated speed.

    Each call runs in a worker thread that carries the caller's grad mode and autocast
    state. An exception in one call is re-raised in the caller, naming the replica and
    device.

    Args:
        fns: One zero-argument callable per device.
        devices: The devices, for throttling and CUDA device selection.
        pool: Threads to use (default: a fresh pool for this call).
        names: Replica labels for error messages (default: ``0, 1, ...``).
        laps: If given, receives one :class:`~hetsplit.devices.Lap` per call, in order:
            its busy time on the device (emulated slowdown included), measured without
            synchronising a CUDA device.
    """
    ctx = _Context()
    spent: list[Lap | None] = [None] * len(fns)

    def run(i: int) -> Any:
        with contextlib.ExitStack() as stack:
            ctx.enter(stack, devices[i].torch_device)
            with devices[i].lap() as lap, devices[i].throttle():
                out = fns[i]()
            spent[i] = lap
            return out

    if len(fns) == 1:
        futures_results = [_capture(run, 0)]
    else:
        own = pool is None
        executor = pool or ThreadPoolExecutor(max_workers=len(fns))
        try:
            futures = [executor.submit(_capture, run, i) for i in range(len(fns))]
            futures_results = [f.result() for f in futures]
        finally:
            if own:
                executor.shutdown()
    results = []
    for i, (ok, value) in enumerate(futures_results):
        if not ok:
            label = names[i] if names is not None else str(i)
            _reraise(value, f"in replica {label} on device {devices[i].name}")
        results.append(value)
    if laps is not None:
        laps.extend(lap for lap in spent if lap is not None)
    return results


def _capture(fn: Callable[[int], Any], i: int) -> tuple[bool, Any]:
    try:
        return True, fn(i)
    except BaseException as e:  # re-raised in the caller with the device named
        return False, e
