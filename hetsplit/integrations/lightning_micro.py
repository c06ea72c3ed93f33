"""Lightning micro-batches: a rank's share run as the plan's micro-batches inside one training step, one backward.

A plan solved with ``accumulate=True`` may split a rank's share (``plan.micro_batches[rank]``,
e.g. ``[64, 64, 63]`` on a device with little memory). Lightning's automatic optimization
calls the strategy's ``training_step`` once with the whole share, then ``zero_grad``, then
one backward on the loss it returned, so gradients computed inside the step would be
wiped. HeteroDDPStrategy therefore runs each micro-batch's ``training_step`` under
activation checkpointing (only its inputs and its loss are kept) and returns one loss
for the share; Lightning's backward recomputes one micro-batch at a time, so the rank
holds about one micro-batch's activations, and the optimizer, precision plugin and
backward hooks run once per step as usual.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hetsplit.distributed as hd
from hetsplit.devices import Device
from hetsplit.planning import Plan

from .collectives import samples_in
from .lightning_buffers import BufferKeeper, Reenterable, Snapshot

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_NOT_SET = object()


def run_training_step(strategy: Any, plain: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """HeteroDDPStrategy's training step: the share as one batch, or as the plan's micro-batches.

    Args:
        strategy: The ``HeteroDDPStrategy`` (its plan, rank, model, device and precision plugin).
        plain: ``DDPStrategy.training_step`` (the share as one batch, through Lightning's forward redirection).
        args: The arguments Lightning gave ``training_step`` (the share's batch first).
        kwargs: Its keyword arguments.

    Returns:
        The step output for Lightning's automatic (or manual) optimization.

    Raises:
        torch.OutOfMemoryError: If the share, or one of its micro-batches, exceeds the
            rank's emulated memory (``cpu:max4``), as a GPU's would.
        ValueError: As :func:`share_micro_batches` and :func:`micro_training_step`.
    """
    module, plan, rank, device = strategy.lightning_module, strategy.plan, strategy.global_rank, strategy.rank_device
    if share_micro_batches(plan, rank, module) is None:
        samples = samples_in(args[0] if args else kwargs.get("batch"))
        if device is not None and samples is not None:
            device.check_batch(samples)
        return plain(*args, **kwargs)
    with strategy.precision_plugin.train_step_context():  # as DDPStrategy.training_step (autocast)
        return micro_training_step(strategy.model, module, plan, rank, args, kwargs, device=device)


def share_micro_batches(plan: Plan | None, rank: int, module: pl.LightningModule) -> list[int] | None:
    """This rank's micro-batches when the plan splits its share, else ``None`` (the share runs as one batch).

    Every rank checks the whole plan, so a refusal is raised on every rank at once,
    before any of them starts the step's collectives.

    Args:
        plan: The plan in force, or ``None`` before there is one.
        rank: This rank.
        module: The LightningModule (its optimization mode is checked).

    Returns:
        ``plan.micro_batches[rank]`` when it holds several micro-batches, else ``None``.

    Raises:
        ValueError: If the plan splits some rank's share and ``module`` uses manual optimization.
    """
    if plan is None:
        return None
    split = [(r, parts) for r, parts in enumerate(plan.micro_batches) if len(parts) > 1]
    if split and not module.automatic_optimization:
        r, parts = split[0]
        raise ValueError(
            f"the plan splits rank {r}'s share {plan.sizes[r]} into micro-batches {parts}, which HeteroDDPStrategy "
            "runs inside training_step before Lightning's one backward; with manual optimization "
            "(automatic_optimization=False) training_step runs its own backward, so the micro-batches cannot be "
            "followed: use automatic optimization, or solve the plan without accumulate (shares within the memory caps)"
        )
    parts = plan.micro_batches[rank]
    return list(parts) if len(parts) > 1 else None


def micro_training_step(
    ddp: nn.Module,
    module: pl.LightningModule,
    plan: Plan,
    rank: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: Device | None = None,
) -> Any:
    """Run this rank's share as ``plan.micro_batches[rank]``; return the share's step output for Lightning.

    The batch is cut by :func:`hetsplit.distributed.micro_batches` (which also makes an
    emulated memory such as ``cpu:max64`` raise ``torch.OutOfMemoryError`` for a
    micro-batch it cannot hold). Each micro-batch goes through DDP, all but the last
    under ``no_sync()`` (DDP then prepares one gradient all-reduce, for the step's one
    backward), so the strategy's gradient weighting sees each micro-batch and scales its
    gradient by its share of the rank's samples. Inside, ``training_step`` runs under
    non-reentrant activation checkpointing that restores the random state of its forward
    when it is recomputed (dropout masks are the forward's; on a GPU that GPU's
    generator too) and the buffers of its forward. ``self.log`` is recorded and logged
    once for the share after the last micro-batch (:class:`LogRecorder`).

    Args:
        ddp: The DDP model; its module is the strategy's ``StepModule``.
        module: The LightningModule.
        plan: The plan in force.
        rank: This rank.
        args: The arguments Lightning gave ``training_step`` (the share's batch first).
        kwargs: Its keyword arguments.
        device: This rank's hetsplit device (an emulated memory cap is enforced).

    Returns:
        The step output, as :func:`share_output` builds it.

    Raises:
        ValueError: If the batch is not this rank's share, or a micro-batch's step returns no loss.
        torch.OutOfMemoryError: If a micro-batch exceeds the device's emulated memory.
    """
    sizes = plan.micro_batches[rank]
    batch = args[0] if args else kwargs["batch"]
    recorder = LogRecorder(module)
    # Non-reentrant checkpointing saves the random state of the devices its tensor arguments
    # are on (and always the CPU's): this empty tensor makes that the module's device, even
    # for a batch it cannot see into.
    anchor = torch.empty(0, device=module.device)
    outs = []
    for piece, samples in zip(hd.micro_batches(ddp, batch, plan, rank=rank, device=device), sizes):
        piece_args, piece_kwargs = ((piece, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": piece})
        with ddp.module.calling(partial(_checkpointed, module, recorder, samples, anchor)):
            outs.append(ddp(*piece_args, **piece_kwargs))
    result = share_output(outs, sizes)
    recorder.replay()
    return result


def _checkpointed(
    module: pl.LightningModule, recorder: LogRecorder, samples: int, anchor: Tensor, *args: Any, **kwargs: Any
) -> Any:
    """``module.training_step(*args, **kwargs)`` for one micro-batch, under activation checkpointing."""

    def step(_anchor: Tensor, *a: Any, **k: Any) -> Any:
        return module.training_step(*a, **k)

    contexts = partial(recorder.contexts, samples)
    return checkpoint(step, anchor, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)


class _ShareLoss(torch.autograd.Function):
    """Forward: the share's loss ``value``. Backward: the incoming gradient to every micro-batch's loss, unchanged."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, *losses: Tensor) -> Tensor:  # type: ignore[override]
        ctx.count = len(losses)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *([grad] * ctx.count))


def share_output(outs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The share's training-step output from its micro-batches' outputs (each a loss, or a dict with ``"loss"``).

    The loss's value is the sample-weighted mean of the micro-batches' losses: the mean
    loss over the share, what one batch gives, so Lightning logs and the strategy's
    shard weighting see the share as before. Its backward sends the gradient to each
    micro-batch's loss unweighted: the strategy's gradient weighting already scales each
    micro-batch's gradient by its share of the rank's samples. The other entries of a
    dict are combined by :func:`combine` with ``rows=True`` (per-sample tensors are
    concatenated in order, scalars averaged by samples).

    Args:
        outs: Each micro-batch's ``training_step`` output, in order.
        sizes: Each micro-batch's samples.

    Returns:
        The loss tensor, or a dict with ``"loss"`` and the combined other entries.

    Raises:
        ValueError: If a micro-batch returned no loss (``None``, or a dict without ``"loss"``).
    """
    losses = []
    for j, out in enumerate(outs):
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise ValueError(
                f"training_step returned {type(out).__name__} for micro-batch {j + 1} of {len(outs)} ({sizes[j]} "
                f"samples) of this rank's share, which the plan splits into {list(sizes)}; HeteroDDPStrategy "
                "combines the micro-batches' losses into the step's loss, so each needs one: return a loss tensor "
                "(or a dict with 'loss') from every training_step (skipping a step with None stalls the other ranks "
                "under DDP anyway), or solve the plan without accumulate"
            )
        losses.append(loss)
    total = sum(sizes)
    value = sum(loss.detach() * (n / total) for loss, n in zip(losses, sizes))
    combined = _ShareLoss.apply(value, *losses)
    if not isinstance(outs[-1], Mapping):
        return combined
    extra = {}
    for key in outs[-1]:
        if key != "loss":
            present = [(o[key], n) for o, n in zip(outs, sizes) if isinstance(o, Mapping) and key in o]
            extra[key] = combine([v for v, _ in present], [n for _, n in present], rows=True)
    return {"loss": combined, **extra}


def combine(values: Sequence[Any], weights: Sequence[float], how: str = "mean", *, rows: bool = False) -> Any:
    """One value for the share from the values its micro-batches produced.

    Args:
        values: One value per micro-batch that produced it, in order.
        weights: Each one's samples (what a mean is weighted by).
        how: ``"sum"``, ``"max"``, ``"min"``; anything else is a sample-weighted mean.
        rows: Concatenate tensors holding one row per sample (``values[j]`` has
            ``weights[j]`` rows), as one batch's per-sample output would be.

    Returns:
        Numbers and tensors: their sum, max, min or sample-weighted mean (numbers stay
        numbers); dicts: combined per key; anything else (a torchmetrics ``Metric``, a
        string, tensors of differing shapes): the last micro-batch's value.
    """
    last = values[-1]
    if isinstance(last, Mapping):
        out = {}
        for key in last:
            present = [(v[key], w) for v, w in zip(values, weights) if isinstance(v, Mapping) and key in v]
            out[key] = combine([v for v, _ in present], [w for _, w in present], how, rows=rows)
        return out
    if not all(isinstance(v, Tensor | numbers.Number) for v in values):
        return last
    if all(isinstance(v, numbers.Number) for v in values):
        if how in ("sum", "max", "min"):
            return {"sum": sum, "max": max, "min": min}[how](values)
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)
    like = next(v for v in values if isinstance(v, Tensor))
    tensors = [v if isinstance(v, Tensor) else torch.tensor(v, dtype=like.dtype, device=like.device) for v in values]
    if rows and all(t.dim() > 0 and t.shape[0] == w for t, w in zip(tensors, weights)):
        return torch.cat(tensors)
    if any(t.shape != like.shape for t in tensors):
        return last
    stacked = torch.stack(tensors)
    if how in ("sum", "max", "min"):
        return {"sum": stacked.sum, "max": stacked.amax, "min": stacked.amin}[how](0)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    share = torch.tensor([w / sum(weights) for w in weights], dtype=stacked.dtype, device=stacked.device)
    return (stacked * share.view(-1, *[1] * like.dim())).sum(0)


def _reduction(fx: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a ``reduce_fx`` given to ``self.log`` (name or function)."""
    name = (fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")).lower()
    return {"avg": "mean", "amax": "max", "amin": "min"}.get(name, name)


class LogRecorder:
    """``self.log`` and buffers in a micro-batched step: each micro-batch recorded in its forward, replayed once.

    Lightning's ``self.log`` acts at once: an ``on_step`` value with ``sync_dist=True``
    is an all-reduce per call, and the step's value is the last one logged. Logged per
    micro-batch, ranks running different numbers of micro-batches would issue different
    numbers of collectives, and the value would be one micro-batch's. So inside each
    micro-batch's forward ``self.log`` (and ``self.log_dict``, which calls it) only
    records; :meth:`replay` then logs every name once, its values combined by
    :func:`combine` according to ``reduce_fx`` (a mean by samples, or by the
    ``batch_size=`` given, which is then summed): the share's value, as one batch would
    log it. When a micro-batch is recomputed in backward (after every micro-batch's
    forward), ``self.log`` does nothing, and the buffers its forward changed read as that
    forward found them, then are put back as the forwards left them, so they are updated
    no second time (BatchNorm's running statistics, a spectral norm's vectors, a moving
    average rebound with ``self.mean = ...``): see :mod:`.lightning_buffers`, which also
    says what the copies cost (one copy of each buffer the forward changes, per
    micro-batch, until backward). Other side effects of ``training_step`` (a torchmetrics
    metric updated in it, a counter) may happen again, up to the last operation backward
    needs: non-reentrant checkpointing stops the recomputation there, so a metric updated
    after the loss is counted once.

    Args:
        module: The LightningModule whose ``log`` and buffers are handled.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, int, dict[str, Any]]]] = {}

    def contexts(self, samples: int) -> tuple[contextlib.AbstractContextManager[None], ...]:
        """The forward and recomputation contexts of one micro-batch of ``samples`` samples (a ``context_fn``).

        The recomputation context may be entered several times (a second backward through
        a retained graph, ``torch.autograd.grad`` inside ``training_step``).
        """
        buffers = BufferKeeper.of(self.module).snapshot()
        return self.recording(samples, buffers), Reenterable(partial(self.recomputing, buffers))

    @contextlib.contextmanager
    def recording(self, samples: int, buffers: Snapshot | None = None) -> Iterator[None]:
        """Inside: ``self.log`` records its calls, for a micro-batch of ``samples`` samples.

        Args:
            samples: The micro-batch's samples (what its logged values are weighted by).
            buffers: Entered around the forward: keeps the buffers it changes as it found them.
        """
        with (
            buffers if buffers is not None else contextlib.nullcontext(),
            _log_replaced(self.module, partial(self._record, samples)),
        ):
            yield

    @contextlib.contextmanager
    def recomputing(self, buffers: Snapshot | None = None) -> Iterator[None]:
        """Inside (a micro-batch recomputed in backward): ``self.log`` does nothing; buffers as its forward found them.

        Args:
            buffers: The micro-batch's :class:`~.lightning_buffers.Snapshot` (from its forward's
                :meth:`recording`); the buffers are put back as they were after.
        """
        with (
            buffers.restored() if buffers is not None else contextlib.nullcontext(),
            _log_replaced(self.module, _ignore),
        ):
            yield

    def _record(self, samples: int, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = dict(_LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs).arguments)
        for key in ("self", "name", "value"):
            options.pop(key, None)
        if not options.get("enable_graph", False):
            value = _detached(value)
        self.calls.setdefault(name, []).append((value, samples, options))

    def replay(self) -> None:
        """Log each recorded name once, with its micro-batches' values combined (the options of its first call)."""
        calls, self.calls = self.calls, {}
        for name, recorded in calls.items():
            options = dict(recorded[0][2])
            given = [o.get("batch_size") for _, _, o in recorded]
            weights = [n if b is None else b for (_, n, _), b in zip(recorded, given)]
            if any(b is not None for b in given):
                options["batch_size"] = sum(weights)
            how = _reduction(options.get("reduce_fx", "mean"))
            self.module.log(name, combine([v for v, _, _ in recorded], weights, how), **options)


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while a micro-batch is recomputed: its forward's calls were recorded already."""


@contextlib.contextmanager
def _log_replaced(module: nn.Module, log: Callable[..., None]) -> Iterator[None]:
    """``module.log`` is ``log`` inside (an instance attribute over the class's method; removed after)."""
    own = vars(module).get("log", _NOT_SET)
    module.log = log
    try:
        yield
    finally:
        if own is _NOT_SET:
            del module.log
        else:
            module.log = own
