"""Distributed: heterogeneous torchrun ranks — one plan for all, per-rank shares, shard-weighted DDP gradients."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler

from . import __version__
from .costmodel import Curve
from .profiles import Profile
from .devices import Device, DeviceLike, Lap, parse_device
from .rebalance import PlanChange, Rebalancer
from .reduce import shard_weights
from .scatter_gather import batch_length
from .solver import Plan, plan_from_sizes, solve

__all__ = [
    "DistributedError",
    "plan",
    "verify_plan",
    "HeteroDistributedSampler",
    "HeteroBatchSampler",
    "DistributedRebalancer",
    "weight_gradients",
    "scale_loss",
    "rank_device",
    "init_timeout",
]


class DistributedError(RuntimeError):
    """Ranks disagree (versions, plans) or one of them died or hangs."""


def _group_info(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group(...) first "
            "(torchrun sets the environment for it)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _collective(what: str, fn: Callable[[], Any], rank: int) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # gloo and NCCL report timeouts and dead peers as RuntimeError
        raise DistributedError(
            f"rank {rank}: {what} failed: {e}. Another rank died or hangs, or the process group's timeout "
            "(init_process_group(timeout=...)) ran out"
        ) from e


def _all_gather(obj: Any, what: str, group: Any) -> list[Any]:
    rank, world = _group_info(group)
    out: list[Any] = [None] * world
    _collective(what, lambda: dist.all_gather_object(out, obj, group=group), rank)
    return out


def rank_device(devices: str | Sequence[DeviceLike], rank: int | None = None) -> str:
    """This rank's device from a per-rank list: ``"cuda:0,cpu@0.25"`` gives rank 1 ``cpu@0.25``.

    The list is indexed by the global rank, cycling when shorter than the world.
    """
    items = [d.strip() for d in devices.split(",") if d.strip()] if isinstance(devices, str) else [str(d) for d in devices]
    if not items:
        raise ValueError(f"no devices in {devices!r}; give one per rank, e.g. 'cuda:0,cpu'")
    if rank is None:
        rank, _ = _group_info(None)
    return items[rank % len(items)]


def _plan_digest(p: Plan) -> str:
    payload = json.dumps({"devices": p.devices, "sizes": p.sizes, "batch": p.batch_size}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def verify_plan(p: Plan, group: Any = None) -> None:
    """Check that every rank holds the same plan; raise on all ranks if not.

    Raises:
        DistributedError: Naming the ranks whose plan differs from rank 0's.
    """
    digests = _all_gather(_plan_digest(p), "comparing plans", group)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise DistributedError(f"ranks {bad} hold a different plan from rank 0; build the plan with "
                               "hetsplit.distributed.plan(...) on every rank, or load the same plan file everywhere")


def plan(
    model: nn.Module,
    sample: Any,
    batch_size: int,
    *,
    device: DeviceLike | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
    profile: Profile | None = None,
    calibrate: int = 16,
    group: Any = None,
    **profile_kwargs: Any,
) -> Plan:
    """One plan for all ranks: each profiles its own device, rank 0 solves, all receive it.

    Every rank calls this collectively. Each rank profiles ``model`` on its own
    ``device`` (or contributes the given ``profile``); the profiles and hetsplit versions
    are all-gathered; rank 0 solves the global batch and broadcasts the plan. Devices in
    the plan are labelled ``rank{r}:{device}`` in rank order, so ``plan.sizes[rank]`` is
    each rank's local batch.

    The profile times the bare model; a DDP step also pays DDP's own per-step work (its
    forward, gradient bucketing, the all-reduce's CPU time), which weighs most on a slow
    rank. With ``calibrate`` steps, every rank then runs that many real DDP steps of a
    copy of ``model`` on its planned share, its work timed up to its last gradient
    (waiting for other ranks is not work); each rank's curve is corrected to pass
    through its median (work beyond the profile is added as a fixed per-step overhead,
    work short of it scales the curve down) and the plan is solved again. ``model`` is
    not touched.

    Args:
        model: The model (unwrapped, or the module inside DDP).
        sample: Example input for the profiler (see :func:`hetsplit.profile`).
        batch_size: The global batch: samples per step across all ranks.
        device: This rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available,
            else ``cpu``).
        loss_fn, target: As for :func:`hetsplit.profile`.
        profile: This rank's profile, to skip profiling (one device, or the device
            named by ``device``).
        calibrate: DDP steps to calibrate the plan with (after 2 warm-up steps); 0
            skips it (for a job without DDP, or when a share is 0 it is skipped).
        group: The process group (default: the world).
        **profile_kwargs: Passed to :func:`hetsplit.profile` (``time_budget``, ...).

    Returns:
        The same :class:`Plan` on every rank.

    Raises:
        ValueError: On a negative ``calibrate``, before anything else runs.
        DistributedError: If hetsplit versions differ across ranks, a calibration step
            fails on some rank, or a rank dies or hangs past the group's timeout.
    """
    from .profiler import profile as run_profile

    if isinstance(calibrate, bool) or not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"calibrate must be a number of steps >= 0, got {calibrate!r}")
    rank, world = _group_info(group)
    dev = parse_device(device if device is not None else _default_device())
    versions = _all_gather(__version__, "comparing hetsplit versions", group)
    if len(set(versions)) > 1:
        raise DistributedError(f"hetsplit versions differ across ranks: {dict(enumerate(versions))}; "
                               "install the same version on every node")
    if profile is None:
        profile = run_profile(model, sample, [dev], loss_fn, target=target, progress=False, **profile_kwargs)
    entry = profile.entry(dev.name) if len(profile.entries) > 1 else profile.entries[0]
    gathered = _all_gather({"entry": entry.to_dict(), "model": profile.model}, "gathering profiles", group)
    combined = None
    if rank == 0:
        from .profiles import DeviceProfile

        entries = []
        for r, item in enumerate(gathered):
            e = DeviceProfile.from_dict(item["entry"])
            e.info.name = f"rank{r}:{e.info.name}"
            entries.append(e)
        combined = Profile(entries, model=gathered[0]["model"], host="torchrun", source="distributed")
    result = _broadcast_plan(lambda: solve(combined, batch_size), group, rank, world)
    if calibrate and min(result.sizes) > 0:
        work = _calibration_work(model, sample, target, loss_fn, dev, result.sizes[rank], calibrate, group, rank)
        if rank == 0:
            combined = dataclasses.replace(combined, entries=[
                dataclasses.replace(e, curve=_through(e.curve, size, seconds))
                for e, size, seconds in zip(combined.entries, result.sizes, work)])
        result = _broadcast_plan(lambda: solve(combined, batch_size), group, rank, world)
    return result


def _through(curve: Curve, size: int, seconds: float) -> Curve:
    """``curve`` corrected to pass through a measured ``(size, seconds)``.

    Work beyond the prediction is a fixed per-step overhead (what DDP adds to a step);
    work short of it scales the curve down.
    """
    predicted = curve(size)
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(predicted) and predicted > 0):
        return curve
    return curve.shifted(seconds - predicted) if seconds >= predicted else curve.scaled(seconds / predicted)


def _broadcast_plan(make: Callable[[], Plan], group: Any, rank: int, world: int) -> Plan:
    """Rank 0 makes the plan; every rank receives it."""
    holder: list[Any] = [make().to_dict() if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    _collective("broadcasting the plan", lambda: dist.broadcast_object_list(holder, src=src, group=group), rank)
    result = Plan.from_dict(holder[0])
    if len(result.devices) != world:
        raise DistributedError(f"the plan has {len(result.devices)} devices for {world} ranks")
    return result


def _calibration_work(model: nn.Module, sample: Any, target: Any, loss_fn: Callable[..., torch.Tensor] | None,
                      dev: Device, size: int, steps: int, group: Any, rank: int) -> list[float]:
    """Every rank's median seconds of work in a real DDP step on its share (all-gathered)."""
    from .profiler import _move, _rows, train_step

    replica = copy.deepcopy(model).to(dev.torch_device).train()
    index = torch.arange(size)
    inputs = _move(_rows(sample, batch_length(sample), index), dev.torch_device)
    labels = _move(_rows(target, batch_length(target), index), dev.torch_device) if target is not None else None

    try:  # one step alone first: a failing step is reported on every rank, not left hanging in DDP
        train_step(replica, inputs, labels, loss_fn)
        failure = None
    except Exception as e:  # noqa: BLE001 -- reported below, on every rank
        failure = f"{type(e).__name__}: {e}"
    failures = _all_gather(failure, "calibrating the plan", group)
    if any(failures):
        bad = {r: f for r, f in enumerate(failures) if f}
        raise DistributedError(f"a DDP step on the planned shares failed on ranks {bad}; check the model runs "
                               "on these batch sizes, or pass calibrate=0")
    ddp = nn.parallel.DistributedDataParallel(replica, device_ids=[dev.index] if dev.type == "cuda" else None,
                                              process_group=group)
    lap: Lap | None = None
    delay_at_mark = 0.0

    def mark(_param: torch.Tensor) -> None:
        nonlocal delay_at_mark
        if lap is not None:
            lap.stop()
            delay_at_mark = dev.delayed

    handles = [p.register_post_accumulate_grad_hook(mark) for p in replica.parameters() if p.requires_grad]
    laps = []
    try:
        for i in range(2 + steps):
            replica.zero_grad(set_to_none=True)
            lap = Lap(dev)
            train_step(ddp, inputs, labels, loss_fn, dev, cpu_time=True)  # waiting for other ranks is not slowed
            lap.extra = dev.delayed - delay_at_mark  # the emulated delay after the last gradient is work too
            if i >= 2:
                laps.append(lap)
            lap = None
    finally:
        for h in handles:
            h.remove()
    mine = statistics.median(x.seconds() for x in laps)
    return [float(t) for t in _all_gather(mine, "gathering calibration times", group)]


def _default_device() -> str:
    import os

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return "cpu"


class HeteroDistributedSampler(Sampler[int]):
    """Per-rank shares of every global batch, sized by the plan (the uneven ``DistributedSampler``).

    Each epoch's indices (shuffled with ``seed + epoch`` when ``shuffle``) are cut into
    global batches of ``plan.batch_size``; rank ``r`` takes the ``plan.sizes[r]``
    indices at its offset in every global batch. Use it with
    ``DataLoader(dataset, batch_size=plan.sizes[rank], sampler=sampler)``: every rank
    then runs :attr:`steps` steps, so no rank waits for another at the end of an epoch.

    With ``drop_last=True`` a last, incomplete global batch is dropped; with
    ``drop_last=False`` it is completed with indices from the start of the epoch, as
    ``DistributedSampler`` pads, so every sample is seen.

    Args:
        dataset: The dataset (only its length is used).
        plan: The plan every rank holds (see :func:`plan`).
        num_replicas, rank, shuffle, seed, drop_last: As for :class:`HeteroBatchSampler`
            (this sampler is its flat form, with a plan that never changes).

    Raises:
        ValueError: If the plan's device count differs from ``num_replicas`` or ``rank``
            is out of range.
    """

    def __init__(self, dataset: Dataset, plan: Plan, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self._batches = HeteroBatchSampler(dataset, plan, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                           seed=seed, drop_last=drop_last)
        self.dataset, self.plan = dataset, plan
        self.num_replicas, self.rank = self._batches.num_replicas, self._batches.rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.size = plan.sizes[self.rank]
        self.steps = self._batches.steps

    @property
    def epoch(self) -> int:
        """The epoch whose order :meth:`__iter__` gives (see :meth:`set_epoch`)."""
        return self._batches.epoch

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently for ``epoch`` (call it on every rank before each epoch)."""
        self._batches.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for batch in self._batches:
            yield from batch

    def __len__(self) -> int:
        return self.steps * self.size


def _epoch_order(n: int, need: int, shuffle: bool, seed: int) -> list[int]:
    """An epoch's ``need`` indices: shuffled with ``seed`` or in order, padded by wrapping around."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(n))
    while 0 < len(order) < need:  # pad by wrapping around, as DistributedSampler does
        order += order[: need - len(order)]
    return order[:need]


def _world(num_replicas: int | None, rank: int | None, plan: Plan) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        r, w = _group_info(None)
        num_replicas = w if num_replicas is None else num_replicas
        rank = r if rank is None else rank
    if len(plan.sizes) != num_replicas:
        raise ValueError(f"the plan has {len(plan.sizes)} shares for {num_replicas} ranks; "
                         "solve it for this world size")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is out of range for {num_replicas} ranks")
    return num_replicas, rank


def _plan_at(schedule: Sequence[tuple[int, Plan]], step: int) -> Plan:
    """The plan of a ``(first step, plan)`` schedule (oldest first) in force at ``step``."""
    current = schedule[0][1]
    for start, p in schedule:
        if start > step:
            break
        current = p
    return current


class HeteroBatchSampler(Sampler[list[int]]):
    """This rank's share of every global batch, one step at a time, following plan changes.

    The batch-sampler form of :class:`HeteroDistributedSampler`, for online
    rebalancing: each yielded list is one step's indices for this rank, cut from the
    global batch by the plan in force *for that step*. :meth:`set_plan` schedules a new
    plan from a given step on (``DistributedRebalancer`` does this on every rank with
    the same step), so the ranks' shares stay disjoint and cover each global batch
    while the sizes change, even with a ``DataLoader`` that prefetches. Use it as::

        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=sampler.collate)

    (:meth:`collate` also turns a share of 0 samples into an empty batch). Steps are
    counted across epochs (:attr:`yielded`); epochs, shuffling, padding and
    ``drop_last`` work as in :class:`HeteroDistributedSampler`.

    Args:
        dataset: The dataset (its length; :meth:`collate` also reads one item).
        plan: The starting plan, the same on every rank.
        num_replicas: World size (default: the process group's).
        rank: This rank (default: the process group's).
        shuffle: Shuffle each epoch.
        seed: Seed of the shuffle, the same on every rank.
        drop_last: Drop the last incomplete global batch instead of padding it.

    Raises:
        ValueError: If the plan's device count differs from ``num_replicas`` or ``rank``
            is out of range.
    """

    def __init__(self, dataset: Dataset, plan: Plan, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self.num_replicas, self.rank = _world(num_replicas, rank, plan)
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.epoch = 0
        self.yielded = 0  # steps handed out so far, across epochs
        self.schedule: list[tuple[int, Plan]] = [(0, plan)]
        n, b = len(dataset), plan.batch_size  # type: ignore[arg-type]
        self.steps = n // b if drop_last else math.ceil(n / b)

    @property
    def batch_size(self) -> int:
        """The global batch: samples per step across all ranks."""
        return self.schedule[0][1].batch_size

    def plan_at(self, step: int) -> Plan:
        """The plan in force at global step ``step``."""
        return _plan_at(self.schedule, step)

    def set_plan(self, plan: Plan, from_step: int) -> None:
        """Use ``plan`` from global step ``from_step`` on (call it with the same values on every rank).

        Raises:
            ValueError: If the plan changes the global batch or the number of ranks, or
                ``from_step`` is a step already handed out.
        """
        if plan.batch_size != self.batch_size or len(plan.sizes) != self.num_replicas:
            raise ValueError(f"the new plan splits {plan.batch_size} samples over {len(plan.sizes)} ranks; "
                             f"this sampler's global batch is {self.batch_size} over {self.num_replicas} ranks")
        if from_step < self.yielded:
            raise ValueError(f"step {from_step} has already been handed out (next is {self.yielded}); "
                             "schedule plans from a later step")
        self.schedule = [(s, p) for s, p in self.schedule if s < from_step] + [(from_step, plan)]

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently for ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batch_size
        order = _epoch_order(len(self.dataset), self.steps * b, self.shuffle, self.seed + self.epoch)  # type: ignore[arg-type]
        for step in range(self.steps):
            sizes = self.plan_at(self.yielded).sizes
            start = step * b + sum(sizes[: self.rank])
            self.yielded += 1
            yield order[start : start + sizes[self.rank]]

    def __len__(self) -> int:
        return self.steps

    def collate(self, batch: list[Any]) -> Any:
        """``default_collate``, with an empty share collated to empty tensors of the right shape."""
        from torch.utils.data import default_collate

        if batch:
            return default_collate(batch)
        one = default_collate([self.dataset[0]])  # type: ignore[index]
        return torch.utils._pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)


class _WeightState:
    """What the comm hook needs: this step's local batch size, the reduction, and the plan's weight."""

    def __init__(self, group: Any, reduction: str, rank: int) -> None:
        self.group, self.reduction, self.rank = group, reduction, rank
        self.local = 0
        self.buffers: dict[int, torch.Tensor] = {}  # per bucket: the packing buffer, reused every step
        self.weight: float | None = None  # with a plan: this rank's constant weight b_r / B
        self.planned: int | None = None  # with a plan: this rank's samples per step

    def set_plan(self, plan: Plan | None) -> None:
        """Weight the following steps by ``plan`` (``None``: by each step's real sizes)."""
        if plan is None:
            self.weight = self.planned = None
            return
        self.planned = plan.sizes[self.rank]
        self.weight = self.planned / plan.batch_size if self.reduction == "mean" else float(self.planned > 0)


def _weighted_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP compares them with dist.GradBucket, and this module's postponed
    # annotations would be strings. (state: _WeightState, bucket: GradBucket) -> Future[Tensor]
    """The comm hook: each bucket becomes ``sum_r b_r * g_r / B`` on every rank.

    With a plan the weights ``b_r / B`` are constants. Without one, ``[b_r * g_r, b_r]``
    is all-reduced in one collective and divided by the summed count: the count travels
    with the gradients, so no extra round trip is needed and every step (a short last
    one, a rank with 0 samples) is weighted by what really ran. A rank with 0 samples
    sends zeros, whatever its (empty-batch, possibly NaN) gradient holds.
    """
    grads = bucket.buffer()
    if state.weight is not None:
        # Steps follow the plan (checked in the forward pre-hook): the weights are known, so
        # the bucket is scaled in place and summed, as cheaply as DDP's own Python hook.
        if state.weight:
            grads.mul_(state.weight)
        else:
            grads.zero_()  # a rank with no samples (its empty-batch gradient may be NaN)
        return dist.all_reduce(grads, group=state.group, async_op=True).get_future().then(lambda f: f.value()[0])
    b = float(state.local)
    weight = b if state.reduction == "mean" else (1.0 if b > 0 else 0.0)
    packed = state.buffers.get(bucket.index())
    if packed is None or packed.numel() != grads.numel() + 1 or packed.dtype != grads.dtype:
        packed = state.buffers[bucket.index()] = torch.empty(grads.numel() + 1, dtype=grads.dtype, device=grads.device)
    if b > 0:
        torch.mul(grads, weight, out=packed[:-1])
    else:
        packed[:-1].zero_()
    packed[-1] = b
    fut = dist.all_reduce(packed, group=state.group, async_op=True).get_future()

    def finish(f):  # type: ignore[no-untyped-def]
        total = f.value()[0]
        if state.reduction == "sum":
            grads.copy_(total[:-1])
            return grads
        count = total[-1].item()
        if count > 0:
            torch.div(total[:-1], count, out=grads)
        else:
            grads.zero_()
        return grads

    return fut.then(finish)


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient flowing back is multiplied by a constant."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # A factor of 0 (a rank with no samples) gives zeros even where the gradient is NaN.
        return (grad * ctx.factor if ctx.factor else torch.zeros_like(grad)), None


_METHODS = ("hook", "outputs")


def weight_gradients(ddp_model: nn.parallel.DistributedDataParallel, plan: Plan | None = None, *,
                     method: str = "hook", reduction: str = "mean", dim: int = 0, group: Any = None) -> _WeightState:
    """Make DDP average gradients weighted by each rank's shard: ``sum_r b_r * g_r / B``.

    DDP's own average is the plain mean over ranks, biased when shards differ. With a
    per-rank loss that is a mean over the rank's samples, the weighted average equals
    the full-batch gradient; with ``reduction="sum"`` gradients are summed. Every rank
    takes part in every step, also with 0 samples. A forward hook records each step's
    local batch size (the length of the inputs along ``dim``).

    Two ways to weight:

    - ``method="hook"`` (the default) registers a DDP comm hook. With a ``plan``, each
      bucket is scaled in place by the constant ``b_r / B`` and summed: the cost of any
      Python comm hook. Without a plan, steps may have any sizes: each bucket travels
      as ``[b_r * g_r, b_r]`` in one message and is divided by the summed count. Every
      gradient DDP reduces is weighted, whatever path it took.
    - ``method="outputs"`` (needs a ``plan``) registers no comm hook: the gradient
      flowing back into the module's outputs is multiplied by ``world * b_r / B``, and
      DDP's built-in C++ mean does the rest. No Python runs per bucket, the scaling
      touches the outputs rather than every gradient, and any comm hook of the user's
      own that averages (compression, PowerSGD) can still be registered. Exact when
      every per-sample loss term reaches the parameters through the module's outputs,
      as in ``loss_fn(model(x), y)`` (a penalty on the parameters themselves is fine
      too); a loss term built from activations stored elsewhere would not be weighted:
      use the hook then.

    With a ``plan``, every step must follow it (as :class:`HeteroDistributedSampler`
    gives; a step of another size raises on that rank rather than being weighted
    wrongly).

    Args:
        ddp_model: The DistributedDataParallel model (call before the first backward).
        plan: The plan every rank holds (checked to be the same everywhere), or ``None``
            for steps of any size (``method="hook"`` only).
        method: ``"hook"`` or ``"outputs"``, as above.
        reduction: ``"mean"`` or ``"sum"``: how each rank's loss reduces its samples.
        dim: The batch dimension of the inputs.
        group: The process group DDP uses (default: the world).

    Returns:
        The weighting's state; ``state.local`` is the last step's local batch size and
        ``state.set_plan(plan)`` weights the following steps by another plan (what
        :class:`DistributedRebalancer` does).

    Raises:
        ValueError: On an unknown ``reduction`` or ``method``, or ``method="outputs"``
            without a plan.
    """
    shard_weights([1], reduction)  # validates the reduction
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(_METHODS)}")
    if method == "outputs" and plan is None:
        raise ValueError('method="outputs" needs the plan (the weights must be known before the step); '
                         'use method="hook" for steps of any size')
    if plan is not None:
        verify_plan(plan, group)
    rank, world = _group_info(group)
    state = _WeightState(group, reduction, rank)
    state.set_plan(plan)

    def record(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim() > 0 and not kwargs:
            state.local = first.shape[dim]  # the common case, without walking the inputs
        else:
            state.local = batch_length((args, kwargs), dim)
        if state.planned is not None and state.local != state.planned:
            raise DistributedError(
                f"rank {rank}: this step has {state.local} samples but the plan gives this rank {state.planned}; "
                "steps must follow the plan (use HeteroDistributedSampler), or call weight_gradients(ddp) "
                "without a plan to weight steps of any size"
            )

    if method == "hook":
        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if torch.is_grad_enabled():
                record(args, kwargs)

        ddp_model.module.register_forward_pre_hook(before, with_kwargs=True)
        ddp_model.register_comm_hook(state, _weighted_allreduce)
        return state

    def scale(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            return _ScaleGradient.apply(t, world * state.weight)
        return t

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        record(args, kwargs)  # after the forward: one Python call per step; an off-plan step still raises
        if isinstance(output, torch.Tensor):
            return scale(output)
        return torch.utils._pytree.tree_map(scale, output)

    ddp_model.module.register_forward_hook(after, with_kwargs=True)
    return state


class DistributedRebalancer:
    """Online rebalancing for a torchrun job: all ranks' step times pooled, one switch step for all.

    Wrap each training step's work in :meth:`step`. The rank's busy time is measured
    without a device synchronisation (CUDA events on a GPU, a monotonic clock
    elsewhere); with ``model`` given, it ends when the step's last gradient is computed,
    so waiting for other ranks in DDP's all-reduce is not counted as work (without
    ``model``, wrap only the compute). Every ``rebalancer.every`` steps the timings are
    all-gathered and every rank feeds the same :class:`~hetsplit.rebalance.Rebalancer`
    the same data, so all reach the same decision. A new plan starts at the first step
    no rank's sampler has handed out yet: ``sampler`` (a :class:`HeteroBatchSampler`)
    and ``gradients`` (the state returned by :func:`weight_gradients`) follow it from
    that step on, on every rank at once.

    Args:
        plan: The starting plan, the same on every rank (e.g. from :func:`plan`).
        rebalancer: The policy (default: ``Rebalancer()``: every 10 steps, 5 %
            threshold, at most half the batch moved at once).
        sampler: This rank's :class:`HeteroBatchSampler`, to follow plan changes.
        gradients: The state from :func:`weight_gradients` with a plan, to weight each
            step by the plan in force (without a plan the hook weights by real sizes).
        model: The model (or DDP module) whose last gradient marks the end of the work.
        device: This rank's device (default: parsed from the plan's ``rank{r}:DEVICE``
            label, else the CPU).
        group: The process group (default: the world).

    Attributes:
        steps: Steps completed on this rank.
        schedule: ``(first step, plan)`` pairs, oldest first.

    Example:
        >>> rb = hd.DistributedRebalancer(plan, sampler=sampler, gradients=state, model=ddp, device=dev)
        >>> for x, y in loader:
        ...     with rb.step():
        ...         loss = F.cross_entropy(ddp(x), y); opt.zero_grad(); loss.backward()
        ...     opt.step()
    """

    def __init__(self, plan: Plan, rebalancer: Rebalancer | None = None, *, sampler: HeteroBatchSampler | None = None,
                 gradients: _WeightState | None = None, model: nn.Module | None = None,
                 device: DeviceLike | None = None, group: Any = None) -> None:
        self.rank, self.world = _group_info(group)
        if len(plan.sizes) != self.world:
            raise ValueError(f"the plan has {len(plan.sizes)} shares for {self.world} ranks")
        if sampler is not None and sampler.plan_at(sampler.yielded).sizes != plan.sizes:
            raise ValueError(f"the sampler follows sizes {sampler.plan_at(sampler.yielded).sizes}, "
                             f"the plan has {plan.sizes}; build both from the same plan")
        self.rebalancer = rebalancer if rebalancer is not None else Rebalancer()
        self.sampler, self.gradients, self.group = sampler, gradients, group
        self.device = parse_device(device) if device is not None else _device_from_label(plan.devices[self.rank])
        self.schedule: list[tuple[int, Plan]] = [(0, plan)]
        self.steps = 0
        self._mine: dict[int, tuple[int, Lap]] = {}  # step -> (size, lap), until every rank has sent it
        self._lap: Lap | None = None
        self._marked = False
        self._delay_at_mark = 0.0
        if model is not None:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._mark)
        verify_plan(plan, group)

    @property
    def plan(self) -> Plan:
        """The plan in force for the current step (or the next one, between steps)."""
        return self.plan_at(self.steps)

    @property
    def history(self) -> list[PlanChange]:
        """The plan changes so far; each one's ``step`` is the first step that ran the new plan."""
        return self.rebalancer.history

    def plan_at(self, step: int) -> Plan:
        """The plan in force at step ``step``."""
        return _plan_at(self.schedule, step)

    def _mark(self, _param: torch.Tensor) -> None:
        if self._lap is not None:
            self._lap.stop()
            self._delay_at_mark = self.device.delayed
            self._marked = True

    @contextlib.contextmanager
    def step(self) -> Iterator[Plan]:
        """Measure one training step on this rank; yields the plan in force for it.

        Every ``rebalancer.every`` steps, on leaving, the ranks exchange timings
        (one small all-gather) and possibly schedule a new plan.
        """
        current = self.plan
        if self.gradients is not None and self.gradients.weight is not None:
            self.gradients.set_plan(current)
        self._marked = False
        lap = self._lap = Lap(self.device)
        try:
            yield current
        finally:
            self._lap = None
        if self._marked:  # the work ended at the last gradient; emulated delay after it still counts
            lap.extra = self.device.delayed - self._delay_at_mark
        else:
            lap.stop()
        self._mine[self.steps] = (current.sizes[self.rank], lap)
        self.steps += 1
        if self.steps % self.rebalancer.every == 0:
            self._exchange()

    def _exchange(self) -> None:
        ready = {j: (size, lap.seconds()) for j, (size, lap) in self._mine.items() if lap.ready()}
        handed_out = self.sampler.yielded if self.sampler is not None else self.steps
        gathered = _all_gather({"times": ready, "next": max(handed_out, self.steps)}, "exchanging step times",
                               self.group)
        common = sorted(set.intersection(*(set(g["times"]) for g in gathered)))
        names = self.plan.devices
        for j in common:
            sizes = [g["times"][j][0] for g in gathered]
            times = {names[r]: g["times"][j][1] for r, g in enumerate(gathered)}
            self.rebalancer.record(plan_from_sizes(None, names, sizes), times)
            self._mine.pop(j, None)
        start = max(g["next"] for g in gathered)
        current = self.plan_at(start)
        new = self.rebalancer.propose(current, step=start)
        if new is None or new.sizes == current.sizes:
            return
        self.schedule = [(s, p) for s, p in self.schedule if s < start] + [(start, new)]
        if self.sampler is not None:
            self.sampler.set_plan(new, start)


def _device_from_label(label: str) -> Device:
    """``rank1:cuda:0`` → ``cuda:0``; a label without a device gives the CPU."""
    head, _, rest = label.partition(":")
    try:
        return parse_device(rest if head.startswith("rank") and rest else label)
    except ValueError:
        return parse_device("cpu")


def scale_loss(loss: torch.Tensor, local_size: int, global_size: int, *, world_size: int | None = None) -> torch.Tensor:
    """Scale a rank's mean loss so that averaging gradients over ranks weighs shards by size.

    For code that averages gradients itself (an all-reduce divided by the world size,
    or DDP without :func:`weight_gradients`): each rank's loss is multiplied by
    ``world_size * local_size / global_size``, turning the plain mean over ranks into
    ``sum_r b_r * g_r / B``.
    """
    if world_size is None:
        _, world_size = _group_info(None)
    if global_size <= 0:
        raise ValueError(f"global_size must be > 0, got {global_size}")
    return loss * (world_size * local_size / global_size)


def init_timeout(seconds: float) -> _dt.timedelta:
    """A process-group timeout (for ``init_process_group(timeout=...)``), validated."""
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return _dt.timedelta(seconds=seconds)
