"""Lightning micro-batches: a rank's share run as the plan's micro-batches inside one training step.

All but the last micro-batch run their backward inside the step, their gradients kept from ``zero_grad``
(:class:`GradientsAside`) until Lightning's one backward runs the last and all-reduces the sum.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import Precision
from torch import Tensor, nn

import hetsplit.distributed as hd
from hetsplit.devices import Device
from hetsplit.distributed.sharded import is_sharded, rank_micro
from hetsplit.parallel.reduce import shard_weight
from hetsplit.planning import Plan
from hetsplit.tree import samples_in

from .logs import LOG_SIGNATURE, log_replaced


class MicroBatchRunner(Protocol):
    """What a step run as micro-batches needs of its strategy (:class:`~.strategy.HeteroStrategy` has it)."""

    @property
    def module(self) -> pl.LightningModule: ...

    @property
    def plan(self) -> Plan | None: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def rank_device(self) -> Device | None: ...

    @property
    def precision_plugin(self) -> Precision: ...

    @property
    def aside(self) -> GradientsAside: ...

    def micro_model(self) -> nn.Module: ...

    def run_micro_batch(self, call: Any, *args: Any, **kwargs: Any) -> Any: ...


def run_training_step(
    strategy: MicroBatchRunner, plain: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A hetsplit strategy's training step: the share as one batch (``plain``), or as the plan's micro-batches.

    Raises:
        torch.OutOfMemoryError: If the share, or one of its micro-batches, exceeds the
            rank's emulated memory (``cpu:max4``), as a GPU's would.
    """
    module, plan, rank, device = strategy.module, strategy.plan, strategy.global_rank, strategy.rank_device
    if share_micro_batches(plan, rank, module, sharded=is_sharded(strategy.micro_model())) is None:
        samples = samples_in(args[0] if args else kwargs.get("batch"))
        if device is not None and samples is not None:
            device.check_batch(samples)
        return plain(*args, **kwargs)
    with strategy.precision_plugin.train_step_context():  # as DDPStrategy.training_step (autocast)
        return micro_training_step(strategy, args, kwargs)


def share_micro_batches(
    plan: Plan | None, rank: int, module: pl.LightningModule, *, sharded: bool = False
) -> list[int] | None:
    """This rank's micro-batches when the plan splits its share, else ``None`` (the share runs as one batch).

    Under FSDP2 (``sharded``) every rank runs the plan's largest count. Every rank checks the whole
    plan, so a refusal is raised on every rank before any of them starts the step's collectives.

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
    parts = rank_micro(plan, rank, sharded)
    return list(parts) if len(parts) > 1 else None


def micro_training_step(strategy: MicroBatchRunner, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run this rank's share as ``plan.micro_batches[rank]``; return the share's step output for Lightning.

    Each micro-batch goes through DDP once (so the weighting sees it), all but the last under
    ``no_sync()`` with their backward run here, as Lightning's would be (divided by
    ``accumulate_grad_batches``, through the gradient scaler); ``self.log`` is logged once for the share.

    Raises:
        ValueError: If the batch is not this rank's share, or a micro-batch's step returns no loss.
    """
    synced, module, plan, rank = strategy.micro_model(), strategy.module, strategy.plan, strategy.global_rank
    assert plan is not None, "micro-batches follow a plan"  # share_micro_batches found them in it
    sizes = rank_micro(plan, rank, is_sharded(synced))
    batch = args[0] if args else kwargs["batch"]
    # The index Lightning decides zero_grad by (its epoch loop's), also for a training_step without batch_idx.
    loop = getattr(getattr(module.trainer, "fit_loop", None), "epoch_loop", None)
    index = loop.batch_idx if loop is not None else args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    recorder = LogRecorder(module)
    aside = strategy.aside
    aside.begin(module, index)
    scaler = getattr(strategy.precision_plugin, "scaler", None)  # mixed precision's GradScaler
    # Lightning divides the loss it backpropagates by accumulate_grad_batches; so are these.
    normalize = getattr(module.trainer, "accumulate_grad_batches", 1)
    outs = []
    pieces = hd.micro_batches(synced, batch, plan, rank=rank, device=strategy.rank_device)
    for j, (piece, samples) in enumerate(zip(pieces, sizes)):
        piece_args, piece_kwargs = ((piece, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": piece})
        outs.append(
            strategy.run_micro_batch(partial(_recorded, module, recorder, samples), *piece_args, **piece_kwargs)
        )
        if j < len(sizes) - 1:  # inside no_sync: gradients accumulate locally
            loss = _loss(outs[-1], j, sizes) / normalize
            (scaler.scale(loss) if scaler is not None else loss).backward()
            outs[-1] = _detached(outs[-1])  # its graph is spent
    aside.end()
    result = share_output(outs, sizes)
    recorder.replay()
    return result


def _recorded(module: pl.LightningModule, recorder: LogRecorder, samples: int, *args: Any, **kwargs: Any) -> Any:
    """``module.training_step(*args, **kwargs)`` for one micro-batch of ``samples``, its ``self.log`` recorded."""
    with recorder.recording(samples):
        return module.training_step(*args, **kwargs)


def _loss(out: Any, j: int, sizes: Sequence[int]) -> Tensor:
    """The loss of micro-batch ``j``'s step output (a loss, or a dict with ``"loss"``); else one clear error."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, Tensor):
        raise ValueError(
            f"training_step returned {type(out).__name__} for micro-batch {j + 1} of {len(sizes)} ({sizes[j]} "
            f"samples) of this rank's share, which the plan splits into {list(sizes)}; HeteroDDPStrategy "
            "combines the micro-batches' losses into the step's loss, so each needs one: return a loss tensor "
            "(or a dict with 'loss') from every training_step (skipping a step with None stalls the other ranks "
            "under DDP anyway), or solve the plan without accumulate"
        )
    return loss


class GradientsAside:
    """The gradients of a step's first micro-batches, kept from ``zero_grad`` until Lightning's backward.

    Only at an accumulation window's first batch does Lightning zero between ``training_step`` and its
    backward. The old gradients are dropped at once unless a hook may read them before ``zero_grad``
    (then the micro-batches' wait beside them: one gradient-sized copy).
    """

    def __init__(self) -> None:
        self.held: list[tuple[Tensor, Tensor]] | None = None
        self._old: list[tuple[Tensor, Tensor | None]] | None = None

    def begin(self, module: pl.LightningModule, batch_idx: Any) -> None:
        """Before a micro-batched step's first backward."""
        self.held, self._old = None, None  # a step whose backward Lightning skipped leaves nothing behind
        trainer = module.trainer
        window = getattr(trainer, "accumulate_grad_batches", 1)
        if not isinstance(batch_idx, int) or batch_idx % window != 0:
            return  # no zero_grad before this step's backward: the gradients simply accumulate
        params = [p for p in module.parameters() if p.requires_grad]
        self._old = [(p, p.grad if _read_before_zero_grad(module) else None) for p in params]
        for p in params:
            p.grad = None

    def end(self) -> None:
        """After the step's micro-batches but the last: their gradients aside, the old ones back."""
        if self._old is None:
            return
        self.held = [(p, p.grad) for p, _ in self._old if p.grad is not None]
        for p, old in self._old:
            p.grad = old
        self._old = None

    def restore(self) -> None:
        """Before Lightning's backward: the micro-batches' gradients added to what ``zero_grad`` left."""
        held, self.held = self.held, None
        for p, grad in held or []:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)


def _read_before_zero_grad(module: pl.LightningModule) -> bool:
    """Whether user code may read the gradients between ``training_step`` and ``zero_grad``."""
    overridden = any(
        getattr(type(module), name, None) is not getattr(pl.LightningModule, name)
        for name in ("on_before_zero_grad", "optimizer_zero_grad")
    )
    callbacks = getattr(module.trainer, "callbacks", [])
    return overridden or any(type(c).on_before_zero_grad is not pl.Callback.on_before_zero_grad for c in callbacks)


class _ShareLoss(torch.autograd.Function):
    """Forward: the share's loss ``value``. Backward: the incoming gradient to the given losses, unchanged."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, *losses: Tensor) -> Tensor:
        ctx.count = len(losses)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *([grad] * ctx.count))


def share_output(outs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The share's training-step output from its micro-batches' outputs (each a loss, or a dict with ``"loss"``).

    The loss's value is the sample-weighted mean (what one batch gives); its backward sends the gradient,
    unweighted, to the last micro-batch's loss, the only one not yet backpropagated (the weighting scales
    each micro-batch's gradient already). A dict's other entries go through :func:`combine` with ``rows=True``.

    Raises:
        ValueError: If a micro-batch returned no loss (``None``, or a dict without ``"loss"``).
    """
    losses = [_loss(out, j, sizes) for j, out in enumerate(outs)]
    weights = _weights(sizes)
    total = sum(weights)
    value = sum(loss.detach() * shard_weight(n, total) for loss, n in zip(losses, weights))
    combined = _ShareLoss.apply(value, losses[-1])
    if not isinstance(outs[-1], Mapping):
        return combined
    extra = {}
    for key in outs[-1]:
        if key != "loss":
            present = [(o[key], n) for o, n in zip(outs, sizes) if isinstance(o, Mapping) and key in o]
            extra[key] = combine([v for v, _ in present], [n for _, n in present], rows=True)
    return {"loss": combined, **extra}


def _weights(sizes: Sequence[float]) -> list[float]:
    """What a mean over micro-batches weights each by: its samples; a share of 0's stand-ins (all ``0``) equally."""
    return list(sizes) if sum(sizes) > 0 else [1.0] * len(sizes)


def combine(values: Sequence[Any], weights: Sequence[float], how: str = "mean", *, rows: bool = False) -> Any:
    """One value for the share from its micro-batches' values: their sum, max, min or sample-weighted mean (``how``).

    Dicts are combined per key; with ``rows``, tensors of one row per sample are concatenated; anything
    else (a torchmetrics ``Metric``, a string, tensors of differing shapes) is the last micro-batch's value.
    """
    last = values[-1]
    weights = _weights(weights)
    total = sum(weights)
    if isinstance(last, Mapping):
        out = {}
        for key in last:
            present = [(v[key], w) for v, w in zip(values, weights) if isinstance(v, Mapping) and key in v]
            out[key] = combine([v for v, _ in present], [w for _, w in present], how, rows=rows)
        return out
    if not all(isinstance(v, Tensor | numbers.Number) for v in values):
        return last
    if all(isinstance(v, numbers.Number) for v in values):
        if how == "sum":
            return sum(values)
        if how in ("max", "min"):
            return max(values) if how == "max" else min(values)
        return sum(v * shard_weight(w, total) for v, w in zip(values, weights))
    like = next(v for v in values if isinstance(v, Tensor))
    tensors = [v if isinstance(v, Tensor) else torch.tensor(v, dtype=like.dtype, device=like.device) for v in values]
    if rows and all(t.dim() > 0 and t.shape[0] == w for t, w in zip(tensors, weights)):
        return torch.cat(tensors)
    if any(t.shape != like.shape for t in tensors):
        return last
    stacked = torch.stack(tensors)
    if how == "sum":
        return stacked.sum(0)
    if how in ("max", "min"):
        return stacked.amax(0) if how == "max" else stacked.amin(0)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    share = torch.tensor([shard_weight(w, total) for w in weights], dtype=stacked.dtype, device=stacked.device)
    return (stacked * share.view(-1, *[1] * like.dim())).sum(0)


def _reduction(fx: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a ``reduce_fx`` given to ``self.log`` (name or function)."""
    name = (fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")).lower()
    return {"avg": "mean", "amax": "max", "amin": "min"}.get(name, name)


class LogRecorder:
    """``self.log`` in a micro-batched step: each micro-batch's calls recorded, replayed once for the share.

    Logged per micro-batch, ranks running different numbers of micro-batches would issue different
    numbers of ``sync_dist`` all-reduces, and the value would be one micro-batch's.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, int, dict[str, Any]]]] = {}

    @contextlib.contextmanager
    def recording(self, samples: int) -> Iterator[None]:
        """Inside: ``self.log`` records its calls, for a micro-batch of ``samples`` samples."""
        with log_replaced(self.module, partial(self._record, samples)):
            yield

    def _record(self, samples: int, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = dict(LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs).arguments)
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
