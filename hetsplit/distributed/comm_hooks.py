"""Comm hooks: DDP gradients weighted by each rank's shard, ``sum_r b_r * g_r / B``."""

from __future__ import annotations

import contextlib
import math
import sys
import typing
import warnings
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.reduce import shard_weight, shard_weights
from ..planning.plan import Plan
from ..tree import batch_length, flatten, tree_map
from . import sharded as _sharded
from ._group import (
    DistributedError,
    as_error,
    group_info,
    group_timeout,
    note_out_of_memory,
    note_out_of_memory_in_backward,
    note_step,
    ran_out_of_memory,
    verify_plan,
)
from .report import SplitReport
from .zero_share import IN_HAND, HandOff, is_stand_in

_WEIGHTED = "_hetsplit_weighting"  # on the weighted model: its WeightingState


class WeightingState:
    """What the comm hook needs: this step's local batch size, the reduction, and the plan's weight.

    ``steps`` counts optimizer steps: forwards under ``no_sync()`` and the plan's micro-batches are
    one step; ``step`` is the one running (from 0), named by a failure in its all-reduce.
    """

    def __init__(
        self,
        group: Any,
        reduction: str,
        rank: int,
        world: int | None = None,
        *,
        sharded: bool = False,
        in_hand: HandOff = IN_HAND,
    ) -> None:
        self.group, self.reduction, self.rank, self.world = group, reduction, rank, world
        # Where the loaders say whether the batch in hand is a zero share's stand-in (read without a plan).
        self.in_hand = in_hand
        self.sharded = sharded  # an FSDP2 model: every rank runs the same number of micro-batches
        self.local = 0
        self.steps = 0
        self.step: int | None = None
        self.open = False  # a step has started whose gradients are not synchronised yet
        self.method = "hook"  # how weight_gradients weights: "hook" or "outputs"
        self.buffers: dict[int, torch.Tensor] = {}  # per bucket: the packing buffer, reused every step
        self.weight: float | None = None  # with a plan: this rank's constant weight b_r / B
        # With a plan: the running step's weight, b_r / B, or b'_r / B' for an epoch's short last global batch.
        self.now: float | None = None
        self.planned: int | None = None  # with a plan: this rank's samples per step
        self.micro: list[int] | None = None  # with a plan: this rank's micro-batches, when several
        self.pos = 0  # the next micro-batch
        self.part = 1.0  # the running micro-batch's share of the rank's gradient
        self.handles: list[Any] = []  # the forward hooks on the model (an integration removes them at teardown)
        self.sum_checks = _SUM_CHECKS if reduction == "mean" else 0  # steps whose outputs' gradient is looked at
        # How the user runs a plan's micro-batches, named when a forward does not follow them
        # (an integration names its own call).
        self.micro_call = "hd.micro_batches(model, batch, plan)"
        self.plan: Plan | None = None  # the plan in force (set_plan)
        self.report: SplitReport | None = None  # times each step of a plan hd.plan said (SplitReport.following)

    def set_plan(self, plan: Plan | None) -> None:
        """Weight the following steps by ``plan`` (``None``: by each step's real sizes)."""
        self.micro, self.pos, self.part = None, 0, 1.0
        self.plan = plan
        if self.report is None:
            self.report = SplitReport.following(plan)
        if plan is None:
            self.weight = self.planned = self.now = None
            return
        self.planned = plan.sizes[self.rank]
        micro = _sharded.rank_micro(plan, self.rank, self.sharded)
        self.micro = micro if len(micro) > 1 else None
        self.weight = self.now = shard_weight(self.planned, plan.batch_size, self.reduction)

    def follow(self, local: int) -> None:
        """Check a step of ``local`` samples against the plan (or a short last global batch) and set :attr:`now`.

        Raises:
            DistributedError: If the step has neither the plan's size nor the short batch's.
        """
        assert self.planned is not None and self.plan is not None
        short = self.in_hand.short
        if short is not None and len(short) == len(self.plan.sizes):
            mine = short[self.rank]
            if local == mine or is_stand_in(mine, local):
                self.now = shard_weight(mine, sum(short), self.reduction)
                return
        # A share of 0 is served two real samples (the sampler's zero_share="sample"), which the
        # plan's weight, 0, leaves out of the gradient.
        elif local == self.planned or is_stand_in(self.planned, local):
            self.now = self.weight
            return
        expected = f"the plan gives this rank {self.planned}"
        if short is not None:
            expected = f"this rank's share of the short global batch {short} is {short[self.rank]}"
        raise DistributedError(
            f"rank {self.rank}: this step has {local} samples but {expected}; "
            "steps must follow the plan (use hd.data_loader), or call weight_gradients(ddp) "
            "without a plan to weight steps of any size"
        )

    def started(self, syncs: bool = True, batch: bool = True) -> None:
        """A training forward began (``syncs``: its backward ends the step; ``batch``: it starts a global batch)."""
        if not self.open:
            self.step = self.steps
            self.steps += 1
            note_step(self.step)
            if self.report is not None:
                self.report.step(self.plan)
        if batch and self.report is not None:
            self.report.batch()
        self.open = not syncs

    def failed(self, error: BaseException) -> DistributedError:
        """The all-reduce of this step failed (a dead or hung peer): one line naming the step."""
        return as_error(
            error,
            rank=self.rank,
            world=self.world,
            step=self.step,
            what="gradient all-reduce",
            timeout=group_timeout(self.group),
        )


def _weighted_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP compares them with dist.GradBucket, and this module's postponed
    # annotations would be strings. (state: WeightingState, bucket: GradBucket) -> Future[Tensor]
    """The comm hook: each bucket becomes ``sum_r b_r * g_r / B``; without a plan as ``[b_r * g_r, b_r]``."""
    grads = bucket.buffer()
    if state.now is not None:
        # Steps follow the plan (checked in the forward pre-hook): the weights are known, so
        # the bucket is scaled in place and summed, as cheaply as DDP's own Python hook.
        if state.now:
            grads.mul_(state.now)
        else:
            grads.zero_()  # a rank with no samples (its empty-batch gradient may be NaN)
        return dist.all_reduce(grads, group=state.group, async_op=True).get_future().then(partial(_first, state))
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
        total = _first(state, f)
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


def _first(state: WeightingState, fut: torch.futures.Future[Any]) -> torch.Tensor:
    """The all-reduced tensor; a dead or hung peer raises one line naming the step (torch quotes it, guard reads it)."""
    try:
        reduced: torch.Tensor = fut.value()[0]
    except RuntimeError as e:
        raise state.failed(e) from e
    return reduced


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient flowing back is multiplied by a constant."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # A factor of 0 (a rank with no samples) gives zeros even where the gradient is NaN.
        return (grad * ctx.factor if ctx.factor else torch.zeros_like(grad)), None


_METHODS = ("hook", "outputs")


def weight_gradients(
    ddp_model: nn.Module,
    plan: Plan | None = None,
    *,
    method: str | None = None,
    reduction: str = "mean",
    dim: int = 0,
    group: Any = None,
) -> WeightingState:
    """Make DDP average gradients weighted by each rank's shard: ``sum_r b_r * g_r / B``.

    DDP's plain mean is biased when shards differ. ``method="hook"`` registers a comm hook;
    ``"outputs"`` scales the gradient into the outputs by ``world * b_r / B`` (FSDP2's only way:
    ``set_gradient_divide_factor`` is one factor for all ranks). docs/torchrun.md.

    Args:
        ddp_model: The DDP model, or the FSDP2 root module (call before the first backward).
        plan: The plan every rank holds, or ``None`` for steps of any size (not ``"outputs"`` for DDP).
        method: ``"hook"`` or ``"outputs"`` (default: ``"hook"`` for DDP, ``"outputs"`` for FSDP2).
        reduction: ``"mean"`` or ``"sum"``: how each rank's loss reduces its samples (a summed loss
            under ``"mean"`` is warned about once).
        dim: The batch dimension of the inputs.
        group: The process group DDP uses (default: the world).

    Returns:
        The weighting's state; its ``set_plan(plan)`` weights the following steps by another plan.

    Raises:
        ValueError: On an unknown ``reduction`` or ``method``, ``method="outputs"``
            without a plan for DDP, or ``method="hook"`` for FSDP2.
        DistributedError: On every rank, for an FSDP1 or hybrid-sharded model, or one
            sharded differently on different ranks.
    """
    shard_weights([1], reduction)  # validates the reduction
    sharded = _sharded.is_sharded(ddp_model)
    if method is None:
        method = "outputs" if sharded else "hook"
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(_METHODS)}")
    if sharded and method == "hook":
        raise ValueError(
            'method="hook" weights DDP\'s comm hook; an FSDP2 model has none: leave method out '
            "(FSDP2 is weighted at the outputs, with or without a plan)"
        )
    if sharded:
        _sharded.check_sharded(ddp_model, group)  # every rank, before any step
    if method == "outputs" and plan is None and not sharded:
        raise ValueError(
            'method="outputs" needs the plan (the weights must be known before the step); '
            'use method="hook" for steps of any size'
        )
    # A model weighted twice (hd.plan(ddp, ...) weights it too) would scale its gradients twice.
    earlier = ddp_model.__dict__.get(_WEIGHTED)
    if earlier is not None:
        if earlier.plan is plan and earlier.method == method and earlier.reduction == reduction:
            return typing.cast(WeightingState, earlier)
        raise ValueError(
            "this model's gradients are weighted already (by hd.plan(ddp, ...) or an earlier weight_gradients) "
            f"with method={earlier.method!r} and another plan or reduction; weight it once, and change its plan "
            "with the state's set_plan(plan)"
        )
    if plan is not None:
        verify_plan(plan, group)
    rank, world = group_info(group)
    state = WeightingState(group, reduction, rank, world, sharded=sharded)
    state.set_plan(plan)
    state.method = method
    ddp_model.__dict__[_WEIGHTED] = state  # not an nn.Module attribute: no state_dict, no deep copy rule
    # The hooks travel with copy.deepcopy(ddp.module) (an EMA model, an evaluation copy);
    # they act only on the module they were registered on, so a copy runs unweighted.
    # FSDP2 has no inner module: its hooks go on the root (which torch refuses to copy).
    inner = ddp_model if sharded else ddp_model.module
    if not isinstance(inner, nn.Module):
        raise ValueError(
            f"weight_gradients takes a DistributedDataParallel model or an FSDP2 root module; "
            f"got {type(ddp_model).__name__}, whose .module is a {type(inner).__name__}"
        )
    owner = weakref.ref(inner)

    def training(module: nn.Module) -> bool:  # a training forward of the weighted module, not paused
        return torch.is_grad_enabled() and module is owner() and id(module) not in _PAUSED

    def record(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim() > 0 and not kwargs:
            state.local = first.shape[dim]  # the common case, without walking the inputs
        else:
            state.local = batch_length((args, kwargs), dim)
        if state.planned is None and state.in_hand.stand_in:
            state.local = 0  # data_loader's stand-in for a share of 0: real samples that count for nothing
        # DDP's no_sync() and nanoGPT's `ddp.require_backward_grad_sync = False` leave this
        # forward's gradients unsynchronised: the step goes on (an FSDP2 root has no such flag).
        syncs = getattr(ddp_model, "require_backward_grad_sync", True) is not False
        if state.micro is not None:
            _micro_step(state, rank, syncs)
            return
        state.started(syncs)
        if state.planned is not None:
            state.follow(state.local)

    if method == "hook":
        _note_out_of_memory_in_forward(inner, state, counted_before=True)

        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if training(module):
                record(args, kwargs)

        def part(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            # Micro-batches: each one's gradient counts by its share of the rank's samples.
            if not training(module):
                return None
            _watch_for_a_sum(state, output)
            return None if state.micro is None else _scaled(output, state.part)

        state.handles.append(inner.register_forward_pre_hook(before, with_kwargs=True))
        state.handles.append(inner.register_forward_hook(part, with_kwargs=True))
        # DDP's method (an FSDP2 model was refused above): named on DDP's class for the type checker.
        typing.cast(nn.parallel.DistributedDataParallel, ddp_model).register_comm_hook(state, _weighted_allreduce)
        return state

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not training(module):
            return None
        record(args, kwargs)  # after the forward: one Python call per step; an off-plan step still raises
        if state.now is None:  # FSDP2 without a plan: B from this step's counts
            total = _sharded.exchanged_total(state.local, module, group, rank)
            weight = shard_weight(state.local, total, reduction)
            return _watch_for_a_sum(state, _scaled(output, world * weight))
        return _watch_for_a_sum(state, _scaled(output, world * state.now * state.part))

    state.handles.append(inner.register_forward_hook(after, with_kwargs=True))
    _note_out_of_memory_in_forward(inner, state, counted_before=False)
    return state


def _note_out_of_memory_in_forward(inner: nn.Module, state: WeightingState, *, counted_before: bool) -> None:
    """An out-of-memory error in this rank's forward is noted for the other ranks (see ``_group.note_failure``).

    ``counted_before``: the step was counted before the forward (DDP's pre-hook), not after (FSDP2).
    """

    def noted(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        error = sys.exc_info()[1]  # the hook runs inside torch's `except` when the forward raised
        if output is None and error is not None and ran_out_of_memory(error):
            note_out_of_memory(error, state.step if counted_before else state.steps)

    state.handles.append(inner.register_forward_hook(noted, always_call=True))
    note_out_of_memory_in_backward()  # and one in its backward (_group)


# The first training steps whose outputs' gradient is looked at for a summed loss (a
# constant gradient is one comparison of the outputs' gradient; after that, nothing).
_SUM_CHECKS = 3


def _watch_for_a_sum(state: WeightingState, output: Any) -> Any:
    """In the first steps under ``reduction="mean"``, warn once if the loss is a sum over the batch.

    ``model(x).sum()`` puts a gradient of exactly 1 in every output element (``out.mean(1).sum()``:
    ``1/k``), a mean over the samples ``1/b`` or less; other losses are not judged.
    """
    if state.sum_checks <= 0 or state.planned == 0 or state.local < 2:
        return output
    state.sum_checks -= 1
    rows = state.local
    for leaf in flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point() and leaf.dim():
            leaf.register_hook(partial(_judge_gradient, state, rows))
    return output


def _judge_gradient(state: WeightingState, rows: int, grad: torch.Tensor) -> None:
    flat = grad.detach().reshape(-1)
    if state.sum_checks < 0 or flat.numel() < rows or not bool((flat == flat[0]).all()):
        return
    value, per_sample = float(flat[0]), flat.numel() / rows
    if value == 1.0 or (per_sample != rows and math.isclose(value, 1 / per_sample, rel_tol=1e-6)):
        state.sum_checks = -1  # once
        warnings.warn(
            f"hd.weight_gradients(..., reduction='mean'): the loss's gradient into the model's outputs is "
            f"{value:g} in every element ({rows} samples), as of a loss summed over the batch "
            "(model(x).sum()); the mean weighting b_r / B then differs from the one-process gradient. "
            "Pass reduction='sum' for a summed loss, or average it over the rank's samples",
            UserWarning,
            stacklevel=2,
        )


# Modules whose weighting hooks do nothing for now (by id: a module may be unhashable).
_PAUSED: set[int] = set()


@contextlib.contextmanager
def paused(model: nn.Module) -> Iterator[None]:
    """The weighting hooks on ``model`` and inside it do nothing meanwhile: a profile's steps are not training steps."""

    ids = {id(m) for m in model.modules()} - _PAUSED
    _PAUSED.update(ids)
    try:
        yield
    finally:
        _PAUSED.difference_update(ids)


def _scaled(output: Any, factor: float) -> Any:
    """``output`` whose floating tensors scale the gradient flowing back through them by ``factor``."""

    def scale(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            return _ScaleGradient.apply(t, factor)
        return t

    return scale(output) if isinstance(output, torch.Tensor) else tree_map(scale, output)


def _micro_step(state: WeightingState, rank: int, syncs: bool = True) -> None:
    """A forward of one of this rank's micro-batches: checked against the plan, its share noted."""
    micro = state.micro
    assert micro is not None
    # A 0 is a sharded model's filler: two real samples weighted 0 (see sharded._even_micro).
    filler = is_stand_in(micro[state.pos], state.local)
    if state.local != micro[state.pos] and not filler:
        short = state.in_hand.short
        why = (
            f"; an epoch's short last global batch {short} is not cut into micro-batches: "
            "build the loader with drop_last=True (or pad=True)"
            if short is not None
            else f"; run them with {state.micro_call}"
        )
        raise DistributedError(
            f"rank {rank}: this forward has {state.local} samples but the micro-batches for this rank are "
            f"{micro} (next: {micro[state.pos]}){why}"
        )
    # A step is all of the rank's micro-batches (an FSDP2 model synchronises each: the last ends it).
    state.started(syncs and state.pos == len(micro) - 1, batch=state.pos == 0)
    if filler:
        state.part = 0.0
    else:  # the micro-batch's weight in the rank's gradient, as a shard's in the step's
        state.part = shard_weight(state.local, sum(micro), state.reduction)
    state.pos = (state.pos + 1) % len(micro)
