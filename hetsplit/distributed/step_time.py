"""Step time: a rank's own compute in a DDP or FSDP2 step, apart from waiting for the others, and the communication.

Why. Inside a DDP step a rank waits in the gradients' all-reduce; inside an FSDP2 step in
every layer's all-gather and reduce-scatter, until the other ranks get there. Timed by
the wall, every rank's step lasts as long as the slowest rank's, and a plan or a
rebalancer fed those times sees the ranks as equally busy. So the shares are solved on
each rank's compute, and the communication is modelled apart, as seconds every step
pays whatever its split, added to the predicted step: before training, the step's
collectives timed once at their real sizes (:func:`communication`); while training,
what a step took beyond its slowest rank's compute (:func:`exposed`).

Compute. On the CPU a lap (:func:`hetsplit.timing.lap`) reads the thread's compute
counter, which does not move while the thread is blocked in a collective. On CUDA a lap
is two events on the compute stream, which under FSDP2 stalls at each layer's all-gather
until the other ranks have joined it: :class:`StepTimer` pauses the lap there, around
FSDP2's own waits (its forward pre-hook, its pre-backward gradient hook). That CUDA path
is untested (written without a GPU); it still counts the end of the backward, where
FSDP2 waits for its last reduce-scatter. DDP on CUDA: :class:`hetsplit.timing.WorkTimer`
(the lap ends at the last gradient, before DDP waits for its all-reduce).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..devices import Device
from ..timing import Lap, PausableLap, WorkTimer
from ..tree import flatten
from . import sharded as _sharded
from ._group import all_gather, collective


class StepTimer:
    """Times a rank's compute in each training step of ``model``, without its waits for other ranks.

    Args:
        device: This rank's device.
        model: The model (DDP, FSDP2, or a module holding FSDP2 modules); ``None``: time
            the enclosed block as it is.
        pause_at_waits: Pause the lap around FSDP2's waits for its all-gathers (default:
            on CUDA, for a sharded model; on the CPU the compute counter leaves the waits
            out already).
    """

    def __init__(self, device: Device, model: nn.Module | None = None, *, pause_at_waits: bool | None = None) -> None:
        sharded = model is not None and _sharded.holds_sharded(model)
        if pause_at_waits is None:
            pause_at_waits = sharded and device.type == "cuda"
        self.device = device
        self._lap: PausableLap | None = None
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._handles: list[Any] = []
        # DDP on CUDA: the lap ends at the last gradient (WorkTimer's hooks); FSDP2 sets its
        # sharded parameters' gradients itself, so those hooks would never fire.
        self._ddp = WorkTimer(device, None if sharded else model)
        if pause_at_waits and model is not None:
            fsdp = _sharded.fsdp2_module()
            for m in model.modules():
                if fsdp is not None and isinstance(m, fsdp):
                    self._hook(m)

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
        if not self._handles:
            with self._ddp.step() as lap:
                yield lap
            return
        current = self._lap = PausableLap(self.device)
        try:
            yield current
        finally:
            self._lap = None
            self._pending.clear()
            current.stop()

    def remove(self) -> None:
        """Remove the hooks from the model."""
        self._ddp.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def exposed(walls: Sequence[float], computes: Sequence[float]) -> float:
    """Seconds of one step beyond its slowest rank's compute: the communication no computing hid.

    ``walls`` and ``computes``: every rank's wall time and compute for the same step, each
    wall from the rank's own start. The step ends at one moment on every rank (its last
    collective), so a rank's wall less its compute is its waits plus what no compute hid;
    the rank that held the step up waited for nobody, and its difference is the smallest.
    Not the shortest wall less the longest compute: when the busiest rank started first,
    that subtracts its head start and predicted DDP steps 6-8 % short (bench_predict).
    """
    return max(0.0, min(w - c for w, c in zip(walls, computes, strict=True)))


def communication(model: nn.Module, device: torch.device, group: Any = None, *, repeats: int = 3) -> float:
    """Seconds of the collectives of one training step of ``model``, timed once at their real sizes.

    DDP: an all-reduce of the trainable parameters' bytes, in DDP's 25 MB buckets (DDP
    overlaps them with the backward, so this bounds what they add). FSDP2: for each
    ``fully_shard`` module, the all-gather of its parameters in the forward, again in the
    backward (resharded after the forward: every module but the root), and the
    reduce-scatter of its gradients; counted as not overlapped, as on gloo (on CUDA FSDP2
    prefetches the all-gathers behind compute: an upper bound). Each distinct collective
    is timed ``repeats`` times after a barrier (the median), the smallest over the ranks
    (the last to arrive waited least). Collective: every rank calls it, with its device
    (the process group's tensors live there).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world <= 1:
        return 0.0
    ops: collections.Counter[tuple[str, int, torch.dtype]] = collections.Counter()  # (kind, numel, dtype): a step's
    fsdp = _sharded.fsdp2_module()
    if fsdp is not None and _sharded.holds_sharded(model):
        modules = [m for m in model.modules() if isinstance(m, fsdp)]
        for m in modules:
            owned = _own_parameters(m, fsdp)
            for dtype in dict.fromkeys(p.dtype for p in owned):
                shard = -(-sum(p.numel() for p in owned if p.dtype == dtype) // world)  # of the unsharded size
                ops["all_gather", shard, dtype] += 1 if m is modules[0] else 2
                ops["reduce_scatter", shard, dtype] += 1
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        for dtype in dict.fromkeys(p.dtype for p in params):
            numel = sum(p.numel() for p in params if p.dtype == dtype)
            bucket = _BUCKET // torch.empty((), dtype=dtype).element_size()
            full, rest = divmod(numel, bucket)
            ops["all_reduce", bucket, dtype] += full
            ops["all_reduce", rest, dtype] += 1 if rest else 0
    what, total = "timing the step's collectives", 0.0
    for (kind, numel, dtype), count in sorted(ops.items(), key=str):  # the same order on every rank
        if not count:
            continue
        piece = torch.zeros(numel, dtype=dtype, device=device)
        whole = torch.zeros(numel * world, dtype=dtype, device=device) if kind != "all_reduce" else piece
        runs = []
        for i in range(repeats + 1):  # the first run sets the collective up: not timed
            collective(what, lambda: dist.barrier(group=group), rank, group)
            start = time.perf_counter()
            collective(what, functools.partial(_run, kind, piece, whole, group), rank, group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                runs.append(time.perf_counter() - start)
        total += count * statistics.median(runs)
    return float(min(all_gather(total, what, group)))


_BUCKET = 25 * 2**20  # DDP's default bucket: its all-reduces are of this size


def _own_parameters(module: nn.Module, fsdp: type) -> list[torch.Tensor]:
    """The parameters ``module``'s own ``fully_shard`` manages: its own, less those of nested ones."""
    nested = {id(p) for m in module.modules() if m is not module and isinstance(m, fsdp) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def _run(kind: str, shard: torch.Tensor, full: torch.Tensor, group: Any) -> None:
    if kind == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, shard, group=group)
    elif kind == "reduce_scatter":  # the _single names where torch has them: the others are deprecated
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(shard, full, group=group)
    else:
        dist.all_reduce(shard, group=group)
