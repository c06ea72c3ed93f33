"""Lightning parts: the modules, callback, loader settings and reductions HeteroDDPStrategy is built from."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from hetsplit.devices import parse_device
from hetsplit.distributed.rank_plan import rank_device
from hetsplit.distributed.sharded import holds_sharded
from hetsplit.planning import Plan, Rebalancer

from . import core
from .core import carried_settings


class StepModule(nn.Module):
    """What DDP wraps: the LightningModule, called exactly once per step (or per micro-batch).

    hetsplit's gradient weighting hooks this module's forward. A ``self(x)`` inside
    ``training_step`` calls the LightningModule again, never this module, so the hooks
    see each step once (``weighting="outputs"`` scales the step's loss, not also its logits).
    State-dict keys of the LightningModule are unchanged (Lightning saves that module).
    A micro-batched step calls DDP once per micro-batch, each running ``call`` instead
    (see :meth:`calling`), so the hooks see each micro-batch once.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.call: Callable[..., Any] | None = None
        ignore = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
        if ignore:  # DDP reads these names from the module it wraps
            self._ddp_params_and_buffers_to_ignore = [f"module.{name}" for name in ignore]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule (Lightning's forward redirection makes that its ``*_step``), or ``call``."""
        if self.call is not None:
            return self.call(*args, **kwargs)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def calling(self, call: Callable[..., Any]) -> Iterator[None]:
        """Run ``call(*args, **kwargs)`` as this module's forward inside the block (one micro-batch's step)."""
        self.call = call
        try:
            yield
        finally:
            self.call = None


class _Shared:
    """A context factory that ``copy.deepcopy`` (the profiler copies the model) shares, never copies."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.factory = factory

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class LossModule(nn.Module):
    """A copy of a LightningModule whose forward is its ``training_step``: the loss the profiler times.

    The copy has no trainer, so ``self.log`` in ``training_step`` would warn on every
    call; those warnings are silenced. The step runs in ``context`` (the precision
    plugin's training context: autocast for mixed precision).

    Args:
        module: The detached copy of the LightningModule.
        context: A callable returning the context manager to run the step in.
    """

    def __init__(self, module: pl.LightningModule, context: Callable[[], Any] = contextlib.nullcontext) -> None:
        super().__init__()
        self.module = module
        self.context = _Shared(context)

    @classmethod
    def detached(cls, module: pl.LightningModule, context: Callable[[], Any] = contextlib.nullcontext) -> LossModule:
        """A :class:`LossModule` over a copy of ``module`` made without its trainer (``module`` keeps it).

        Returns:
            The loss module (the original module is untouched).
        """
        trainer = module.trainer
        module.trainer = None  # the copy must not drag the trainer along, nor log through it
        try:
            replica = copy.deepcopy(module)
        finally:
            module.trainer = trainer
        return cls(replica, context)

    def forward(self, batch: Any) -> torch.Tensor:
        """The loss of ``training_step(batch, 0)`` (its ``"loss"`` entry when it returns a dict).

        Called as Lightning calls it: ``batch_idx`` only where the hook's signature takes
        one (``training_step(self, batch)`` is allowed; Lightning's own FSDP2 example has it).
        """
        step = self.module.training_step
        args = (batch, 0) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*`self\.log\(\)`.*")
            with self.context.factory():
                out = step(*args)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'; "
                "HeteroDDPStrategy profiles the loss training_step returns: pass plan= or profile= instead"
            )
        return loss


class HeteroCallback(pl.Callback):
    """Installed by HeteroDDPStrategy: each epoch's shuffle for the shares, and the rebalancer around each batch.

    Lightning calls ``set_epoch`` on a loader's ``sampler`` and ``batch_sampler.sampler``
    only, not on a batch sampler itself, so the strategy's batch sampler gets its epoch
    here. With ``rebalance=K`` every training batch (forward, backward, optimizer step)
    runs inside :meth:`hetsplit.distributed.DistributedRebalancer.step`.

    Args:
        strategy: The strategy (a ``HeteroDDPStrategy``) whose sampler and rebalancer to drive.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._steps = contextlib.ExitStack()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Say the measured step beside the predicted one (rank 0)."""
        self.strategy.training_ended()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Shuffle the shares of this epoch (the same order on every rank); count its samples afresh."""
        self.strategy.count_samples()
        if self.strategy.train_sampler is not None:
            self.strategy.train_sampler.set_epoch(trainer.current_epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Tell the strategy which batch runs; open the rebalancer's step."""
        self.strategy.batch_started(idx)
        if self.strategy.rebalancer is not None:
            self._steps.enter_context(self.strategy.rebalancer.step())

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Tell the strategy which batch of which loader runs (a step may take no ``batch_idx``)."""
        self.strategy.batch_started(batch_idx, dataloader_idx)

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """As :meth:`on_validation_batch_start`."""
        self.strategy.batch_started(batch_idx, dataloader_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """Close the step: its time is recorded; every K steps the ranks exchange times."""
        self._steps.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Drop an open step without exchanging (a failed rank must not wait for the others)."""
        self._steps.pop_all()


def check_arguments(given: Mapping[str, Any], ddp_kwargs: Mapping[str, Any]) -> None:
    """Check HeteroDDPStrategy's arguments ``given`` by name (see its docstring), before anything runs.

    Raises:
        TypeError, ValueError: As :func:`hetsplit.integrations.core.check_arguments`, and a
            ``ValueError`` for ``ddp_comm_hook`` with ``weighting="hook"``.
    """
    core.check_arguments("HeteroDDPStrategy", weightings=("hook", "outputs"), **given)
    if given.get("weighting", "hook") == "hook" and ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ValueError(
            "weighting='hook' registers hetsplit's DDP comm hook and DDP takes one: "
            "use weighting='outputs' to keep your ddp_comm_hook"
        )


def check_micro_plan(
    plan: Plan | None, module: nn.Module, rebalance: int | Rebalancer, *, who: str = "HeteroDDPStrategy"
) -> None:
    """Refuse what a plan with micro-batches cannot run with; every rank checks the same plan before any step.

    Args:
        plan: The plan the training loader follows.
        module: The LightningModule (after Lightning's ``sync_batchnorm`` conversion).
        rebalance: The strategy's ``rebalance`` argument.
        who: The strategy's class (named in the message).

    Raises:
        ValueError: If the plan splits some rank's share and ``rebalance`` is set
            (:func:`~hetsplit.integrations.core.check_rebalance`), or ranks run different
            numbers of micro-batches and ``module`` holds a ``torch.nn.SyncBatchNorm`` (its
            collectives would not match across ranks).
    """
    core.check_rebalance(who, plan, rebalance)
    if plan is None or all(len(parts) <= 1 for parts in plan.micro_batches):
        return
    r = next(r for r, parts in enumerate(plan.micro_batches) if len(parts) > 1)
    split = f"the plan splits rank {r}'s share {plan.sizes[r]} into micro-batches {plan.micro_batches[r]}"
    counts = [max(1, len(parts)) for parts in plan.micro_batches]  # a share that runs whole is one forward
    sync = next((name or "the model" for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
    if sync is not None and len(set(counts)) > 1:
        raise ValueError(
            f"the model has a SyncBatchNorm ({sync}, e.g. from Trainer(sync_batchnorm=True)) and {split}, while "
            f"the ranks run {counts} micro-batches: SyncBatchNorm's collectives run in every micro-batch's forward, "
            "so ranks with different counts would wait on each other forever. Use a plan "
            "without micro-batches (solve without accumulate), one giving every rank the same number of "
            "micro-batches, or plain BatchNorm (Trainer(sync_batchnorm=False))"
        )


def rank_devices(
    spec: str, world: int, accelerator: str, here: Sequence[int], *, who: str = "HeteroDDPStrategy"
) -> list[str]:
    """The per-rank device list ``spec``, checked against the world, the accelerator and this node.

    Every rank runs the same checks on the same values, so each raises the same error.

    Args:
        spec: One device per rank (``"cpu,cpu@0.25"``).
        world: The number of processes.
        accelerator: The device type Lightning's accelerator runs every rank on.
        here: The ranks of this node, whose devices must exist here.
        who: The strategy's class (named in the messages).

    Returns:
        The canonical device names, one per rank.

    Raises:
        ValueError: On a list of another length, a device of another type than the
            accelerator's (a CPU with ``accelerator="gpu"``), or one this node lacks.
    """
    try:
        names = [rank_device(spec, r, world=world) for r in range(world)]
    except ValueError as e:
        raise ValueError(f"{who}(devices={spec!r}) with {world} processes (Trainer devices × num_nodes): {e}") from None
    wrong = [f"rank {r}: {n}" for r, n in enumerate(names) if parse_device(n, check=False).type != accelerator]
    if wrong:
        kind = {"cuda": "'gpu'", "cpu": "'cpu'"}.get(accelerator, repr(accelerator))
        raise ValueError(
            f"Trainer(accelerator={kind}) runs every rank on {accelerator}, but {who}(devices={spec!r}) "
            f"lists {', '.join(wrong)}. Lightning runs all ranks on one accelerator: list only {accelerator} devices "
            "(emulated ranks such as 'cpu,cpu@0.25' with accelerator='cpu'), or start a CPU rank among GPUs "
            "with 'hetsplit launch' and hetsplit.distributed"
        )
    for r in here:
        if r < world:
            try:
                parse_device(names[r])
            except ValueError as e:
                raise ValueError(f"{who}: rank {r}'s device {names[r]!r}: {e}") from None
    return names


def loader_settings(loader: Any, stage: str, *, strict: bool) -> tuple[bool, int, dict[str, Any]] | None:
    """How to rebuild ``loader`` on hetsplit's shares: ``(shuffle, seed, DataLoader keyword arguments)``.

    The sampler Lightning may have put in (``DistributedSampler``) or the user's
    ``RandomSampler``/``SequentialSampler`` only says whether to shuffle; everything
    else (``collate_fn``, workers, pinning, ...) is kept.

    Args:
        loader: The loader Lightning hands the strategy.
        stage: ``"training"``, ``"validation"``, ... (for the message).
        strict: Raise when the loader cannot be sharded by index; else return ``None``.

    Returns:
        The settings, or ``None`` when the loader cannot be rebuilt and ``strict`` is false.

    Raises:
        ValueError: With ``strict``, for anything but a ``DataLoader`` over a map-style
            dataset with ``batch_size`` and a random, sequential or plain distributed sampler.
    """
    problem = None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    shuffle = False
    if not isinstance(loader, DataLoader):
        problem = f"it is a {type(loader).__name__}, not a torch DataLoader; return a DataLoader"
    elif isinstance(loader.dataset, IterableDataset):
        problem = (
            f"its dataset {type(loader.dataset).__name__} is iterable; shares are cut by index, "
            "so use a map-style Dataset (with __getitem__ and __len__)"
        )
    elif loader.batch_size is None:
        problem = (
            "it has no batch_size (its batches come from a batch_sampler, or batch_size=None); the per-rank "
            "batch comes from the plan: pass batch_size= (and shuffle=) instead of a batch sampler"
        )
    elif isinstance(loader.sampler, RandomSampler):
        shuffle = True
    elif type(loader.sampler) is DistributedSampler:  # what Lightning puts in with use_distributed_sampler=True
        shuffle, seed = bool(loader.sampler.shuffle), int(loader.sampler.seed)
    elif not isinstance(loader.sampler, SequentialSampler):
        problem = (
            f"its sampler {type(loader.sampler).__name__} cannot be kept (hetsplit cuts every global batch by index "
            "and only shuffles or not): use shuffle=True/False, or weight the dataset itself"
        )
    if problem is not None:
        if strict:
            raise ValueError(f"HeteroDDPStrategy cannot shard the {stage} loader: {problem}")
        return None
    kwargs: dict[str, Any] = {"collate_fn": loader.collate_fn, **carried_settings(loader)}
    return shuffle, seed, kwargs


def profiled_plan(strategy: Any, loader: Any, batch_size: int) -> Plan:
    """Profile a detached copy of the LightningModule on this rank's device; rank 0 solves for all.

    Args:
        strategy: The ``HeteroDDPStrategy`` or ``HeteroModelParallelStrategy`` (its module, device,
            profile and ``plan_kwargs``). A module sharded with ``fully_shard`` is profiled
            in place, the ranks in turns, as :func:`hetsplit.distributed.plan` does.
        loader: The user's training loader (one batch of it is the profiling sample).
        batch_size: The global batch to plan.

    Raises:
        RuntimeError: If ``training_step`` cannot be profiled (naming the device and the cause).
    """
    cuda = [strategy.root_device] if strategy.root_device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # drawing the sample shuffles: the run must not see it
        sample = next(iter(loader))  # as the loader gives it (on the CPU): the profiler moves rows itself
    module, context = strategy.lightning_module, strategy.precision_plugin.train_step_context
    if not holds_sharded(module):
        model = LossModule.detached(module, context)
        return _profiled(strategy, model, sample, batch_size, cuda)
    # torch refuses to copy an FSDP2 module: hetsplit.distributed.plan times the sharded module
    # itself, the ranks in turns, and leaves it as it was. Detached from the trainer meanwhile,
    # so the profile's self.log goes nowhere (and syncs nothing).
    trainer = module.trainer
    module.trainer = None
    try:
        return _profiled(strategy, LossModule(module, context), sample, batch_size, cuda)
    finally:
        module.trainer = trainer


def _profiled(strategy: Any, model: nn.Module, sample: Any, batch_size: int, cuda: list[torch.device]) -> Plan:
    return core.profiled_plan(
        strategy._who, "training_step", model, (sample,), batch_size, device=strategy.rank_device,
        profile=strategy.profile, plan_kwargs=strategy.plan_kwargs, cuda=cuda,
        hint="fix the step, or pass plan= (or profile=) to skip profiling",
    )  # fmt: skip
