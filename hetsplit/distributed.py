"""Distributed: heterogeneous torchrun ranks — one plan for all, per-rank shares, shard-weighted DDP gradients."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler

from . import __version__
from .profiles import Profile
from .devices import DeviceLike, parse_device
from .reduce import shard_weights
from .scatter_gather import batch_length
from .solver import Plan, solve

__all__ = [
    "DistributedError",
    "plan",
    "verify_plan",
    "HeteroDistributedSampler",
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
    group: Any = None,
    **profile_kwargs: Any,
) -> Plan:
    """One plan for all ranks: each profiles its own device, rank 0 solves, all receive it.

    Every rank calls this collectively. Each rank profiles ``model`` on its own
    ``device`` (or contributes the given ``profile``); the profiles and hetsplit versions
    are all-gathered; rank 0 solves the global batch and broadcasts the plan. Devices in
    the plan are labelled ``rank{r}:{device}`` in rank order, so ``plan.sizes[rank]`` is
    each rank's local batch.

    Args:
        model: The model (unwrapped, or the module inside DDP).
        sample: Example input for the profiler (see :func:`hetsplit.profile`).
        batch_size: The global batch: samples per step across all ranks.
        device: This rank's device (default: ``cuda:LOCAL_RANK`` if CUDA is available,
            else ``cpu``).
        loss_fn, target: As for :func:`hetsplit.profile`.
        profile: This rank's profile, to skip profiling (one device, or the device
            named by ``device``).
        group: The process group (default: the world).
        **profile_kwargs: Passed to :func:`hetsplit.profile` (``time_budget``, ...).

    Returns:
        The same :class:`Plan` on every rank.

    Raises:
        DistributedError: If hetsplit versions differ across ranks, or a rank dies or
            hangs past the group's timeout.
    """
    from .profiler import profile as run_profile

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
    holder: list[Any] = [None]
    if rank == 0:
        from .profiles import DeviceProfile

        entries = []
        for r, item in enumerate(gathered):
            e = DeviceProfile.from_dict(item["entry"])
            e.info.name = f"rank{r}:{e.info.name}"
            entries.append(e)
        combined = Profile(entries, model=gathered[0]["model"], host="torchrun", source="distributed")
        holder[0] = solve(combined, batch_size).to_dict()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    _collective("broadcasting the plan", lambda: dist.broadcast_object_list(holder, src=src, group=group), rank)
    result = Plan.from_dict(holder[0])
    if len(result.devices) != world:
        raise DistributedError(f"the plan has {len(result.devices)} devices for {world} ranks")
    return result


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
        if num_replicas is None or rank is None:
            r, w = _group_info(None)
            num_replicas = w if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        if len(plan.sizes) != num_replicas:
            raise ValueError(f"the plan has {len(plan.sizes)} shares for {num_replicas} ranks; "
                             "solve it for this world size")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is out of range for {num_replicas} ranks")
        self.dataset, self.plan = dataset, plan
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.offset = sum(plan.sizes[:rank])
        self.size = plan.sizes[rank]
        n, b = len(dataset), plan.batch_size  # type: ignore[arg-type]
        self.steps = n // b if drop_last else math.ceil(n / b)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently for ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = epoch

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        need = self.steps * self.plan.batch_size
        while len(order) < need:  # pad by wrapping around, as DistributedSampler does
            order += order[: need - len(order)]
        return order[:need]

    def __iter__(self) -> Iterator[int]:
        order, b = self._order(), self.plan.batch_size
        for step in range(self.steps):
            start = step * b + self.offset
            yield from order[start : start + self.size]

    def __len__(self) -> int:
        return self.steps * self.size


class _WeightState:
    """What the comm hook needs: this step's local batch size and the reduction."""

    def __init__(self, group: Any, reduction: str) -> None:
        self.group, self.reduction = group, reduction
        self.local = 0
        self.buffers: dict[int, torch.Tensor] = {}  # per bucket: the packing buffer, reused every step
        self.weight: float | None = None  # with a plan: this rank's constant weight b_r / B


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


def weight_gradients(ddp_model: nn.parallel.DistributedDataParallel, plan: Plan | None = None, *,
                     reduction: str = "mean", dim: int = 0, group: Any = None) -> _WeightState:
    """Make DDP average gradients weighted by each rank's shard: ``sum_r b_r * g_r / B``.

    DDP's own average is the plain mean over ranks, biased when shards differ. This
    registers a DDP comm hook (and a forward pre-hook recording each step's local batch
    size, the length of the inputs along ``dim``). With a per-rank loss that is a mean
    over the rank's samples, the weighted average equals the full-batch gradient; with
    ``reduction="sum"`` gradients are summed. Every rank takes part in every step, also
    with 0 samples.

    With a ``plan``, every step must follow it (as :class:`HeteroDistributedSampler`
    gives; a step of another size raises on that rank rather than being weighted
    wrongly): each bucket is scaled in place by the constant ``b_r / B`` and summed, which
    costs what any Python comm hook costs. Without a plan, steps may have any sizes: each
    bucket travels as ``[b_r * g_r, b_r]`` in one message and is divided by the summed
    count.

    Args:
        ddp_model: The DistributedDataParallel model (call before the first backward).
        plan: The plan every rank holds (checked to be the same everywhere), or ``None``
            for steps of any size.
        reduction: ``"mean"`` or ``"sum"``: how each rank's loss reduces its samples.
        dim: The batch dimension of the inputs.
        group: The process group DDP uses (default: the world).

    Returns:
        The hook's state; ``state.local`` is the last step's local batch size.

    Raises:
        ValueError: On an unknown ``reduction``.
    """
    shard_weights([1], reduction)  # validates the reduction
    if plan is not None:
        verify_plan(plan, group)
    state = _WeightState(group, reduction)
    rank, _ = _group_info(group)
    planned = plan.sizes[rank] if plan is not None else None

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim() > 0 and not kwargs:
            state.local = first.shape[dim]  # the common case, without walking the inputs
        else:
            state.local = batch_length((args, kwargs), dim)
        if planned is not None and torch.is_grad_enabled() and state.local != planned:
            raise DistributedError(
                f"rank {rank}: this step has {state.local} samples but the plan gives this rank {planned}; "
                "steps must follow the plan (use HeteroDistributedSampler), or call weight_gradients(ddp) "
                "without a plan to weight steps of any size"
            )

    ddp_model.module.register_forward_pre_hook(record, with_kwargs=True)
    if plan is not None:
        state.weight = plan.sizes[rank] / plan.batch_size if reduction == "mean" else float(plan.sizes[rank] > 0)
    ddp_model.register_comm_hook(state, _weighted_allreduce)
    return state


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
