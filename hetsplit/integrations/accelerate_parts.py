"""Accelerate parts: the loader, checkpointed epochs and argument checks HeteroAccelerator is built from."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import DataLoaderShard
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from hetsplit.devices import parse_device
from hetsplit.distributed.setup import ENV_DEVICES, rank_devices
from hetsplit.planning import Plan

from . import core
from .collectives import samples_in

# "none": DDP's plain mean, for a loss already normalised over the global batch (what the
# HF Trainer does with num_items_in_batch); the other two weight a per-process mean by shard.
WEIGHTINGS = core.WEIGHTINGS


class SharesLoader(DataLoaderShard):
    """accelerate's ``DataLoaderShard`` over hetsplit's shares, knowing what each yielded batch holds.

    Attributes:
        current_samples: The samples of the current batch the gradient weighting counts
            (0 for the stand-in a share of 0 is served), ``None`` outside a loop.
        origin: The loader this one was cut from by ``skip_first_batches``: its epoch
            counter moves on with this one's, so the next epoch draws the next order.
        step_context: Makes the context each batch is handed out in, from its yield to the
            next (the accelerator's rebalancer times it as one step); ``None``: none.
        pass_ended: Called when a pass over the loader ends (the accelerator's split report).
    """

    current_samples: int | None = None
    origin: SharesLoader | None = None
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    pass_ended: Callable[[], None] | None = None
    _index: int = 0  # the current batch's index from the epoch's first (skipped ones included)
    _rows: int = 0  # its rows

    def __iter__(self) -> Iterator[Any]:
        self._index = self.skip_batches - 1
        for batch in super().__iter__():
            self._index += 1
            self._rows = samples_in(batch) or 0
            self.current_samples = 0 if self.batch_sampler.is_filler(self._index) else self._rows
            with self.step_context() if self.step_context is not None else contextlib.nullcontext():
                yield batch
        self.current_samples = None
        if self.origin is not None:
            self.origin.iteration = max(self.origin.iteration, self.iteration)
        if self.pass_ended is not None:
            self.pass_ended()

    def real_rows(self) -> int:
        """This process's rows of the current batch that are data counted once.

        Not the padding that completes a last global batch, nor the one sample a share of
        0 is served (:meth:`HeteroBatchSampler.real_rows`).
        """
        return min(self._rows, self.batch_sampler.real_rows(self._index))

    def padded(self) -> bool:
        """Whether the current global batch holds padding on some process (the same answer on every one)."""
        return self.batch_sampler.padded(self._index)

    def resumed(self, skip: int, **settings: Any) -> SharesLoader:
        """This loader from its ``skip``-th batch on (resuming mid-epoch): the same shares, order and epoch."""
        loader = SharesLoader(
            self.dataset,
            device=self.device,
            batch_sampler=self.batch_sampler,
            collate_fn=self.collate_fn,
            skip_batches=skip,
            iteration=self.iteration,
            _drop_last=self._drop_last,
            _non_blocking=self._non_blocking,
            **settings,
        )
        loader.origin, loader.step_context, loader.pass_ended = self, self.step_context, self.pass_ended
        loader._is_accelerate_prepared = True
        return loader

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps: the epoch counter (the shuffle of epoch ``e`` is ``seed + e``)."""
        return {"iteration": int(self.iteration)}


def shuffle_seed(loader: DataLoader, data_seed: int | None, processes: int) -> int:
    """The seed every process shuffles with: ``data_seed``, else process 0's (its loader's generator or torch's).

    So ``set_seed`` and a loader's ``generator`` change the order as they would with
    accelerate, and all processes cut the same order.
    """
    if data_seed is not None:
        return int(data_seed)
    generator = getattr(loader, "generator", None) or getattr(loader.sampler, "generator", None)
    seed = [int(generator.initial_seed()) if generator is not None else int(torch.initial_seed())]
    if processes > 1:
        dist.broadcast_object_list(seed, src=0)
    return seed[0] % (1 << 63)


# The file beside accelerate's checkpoint that keeps each prepared loader's epoch.
LOADERS_FILE = "hetsplit_loaders.json"


def save_epochs(loaders: list[Any], location: str) -> None:
    """Write each :class:`SharesLoader`'s epoch counter beside the checkpoint at ``location``."""
    states = [loader.state() for loader in loaders if isinstance(loader, SharesLoader)]
    (Path(location) / LOADERS_FILE).write_text(json.dumps(states))


def load_epochs(loaders: list[Any], location: str) -> None:
    """Give each :class:`SharesLoader` the epoch saved at ``location`` (nothing for a checkpoint without it)."""
    saved = Path(location) / LOADERS_FILE
    if not saved.exists():  # a checkpoint of accelerate's own, or from before hetsplit kept it
        return
    mine = [loader for loader in loaders if isinstance(loader, SharesLoader)]
    for loader, state in zip(mine, json.loads(saved.read_text())):
        loader.iteration = int(state["iteration"])


def wants_fsdp2(accelerator_kwargs: Mapping[str, Any]) -> bool:
    """Whether accelerate will shard with FSDP2: an ``fsdp_plugin`` with ``fsdp_version=2``, or
    ``accelerate launch --use_fsdp --fsdp_version 2`` (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``)."""
    plugin = accelerator_kwargs.get("fsdp_plugin")
    if plugin is not None:
        return getattr(plugin, "fsdp_version", 1) == 2
    return _flag(os.environ.get("ACCELERATE_USE_FSDP")) and os.environ.get("FSDP_VERSION", "1").strip() == "2"


def check_arguments(
    given: Mapping[str, Any],
    accelerator_kwargs: Mapping[str, Any],
    world: int,
    *,
    loss_weights_micro_batches: bool = False,
) -> list[str] | None:
    """Every argument checked before accelerate or a process group starts; the per-process device names.

    Args:
        given: HeteroAccelerator's own arguments by name (``devices``, ``plan``, ``weighting``, ...).
        accelerator_kwargs: Those for ``accelerate.Accelerator``.
        world: The number of processes launched.
        loss_weights_micro_batches: The caller's loss weights each micro-batch itself
            (HeteroTrainer's), so ``weighting="none"`` takes a plan with micro-batches.
    """
    core.check_arguments("HeteroAccelerator", **given)
    plan, weighting, devices = given.get("plan"), given.get("weighting", "hook"), given.get("devices")
    if plan is not None and weighting == "none" and not loss_weights_micro_batches:
        check_whole_shares(plan, 'HeteroAccelerator(weighting="none")')
    if plan is not None and len(plan.sizes) != world:
        raise ValueError(
            f"the plan has {len(plan.sizes)} shares {list(plan.sizes)} but {world} processes run: "
            "give a plan with one share per process"
        )
    # FSDP2 is weighted at the root's outputs (hetsplit.distributed.sharded); DeepSpeed, Megatron-LM
    # and FSDP1 shard in ways whose per-rank gradients hetsplit cannot weight.
    fsdp2 = wants_fsdp2(accelerator_kwargs)
    sharded = [k for k in ("deepspeed_plugin", "megatron_lm_plugin") if accelerator_kwargs.get(k)]
    sharded += ["fsdp_plugin (FSDP1)"] if accelerator_kwargs.get("fsdp_plugin") and not fsdp2 else []
    sharded += [k for k in ("ACCELERATE_USE_DEEPSPEED",) if _flag(os.environ.get(k))]
    sharded += ["ACCELERATE_USE_FSDP (FSDP1)"] if _flag(os.environ.get("ACCELERATE_USE_FSDP")) and not fsdp2 else []
    if sharded:
        # accelerate launch --use_fsdp always sets FSDP_VERSION; ACCELERATE_USE_FSDP alone is what an
        # earlier Accelerator(fsdp_plugin=...) of this process left in its environment.
        left = sharded[0].startswith("ACCELERATE_USE_FSDP") and "FSDP_VERSION" not in os.environ
        why = (
            " (an earlier Accelerator of this process given an fsdp_plugin set ACCELERATE_USE_FSDP=true, and "
            "accelerate would read it as FSDP1: pass fsdp_plugin= again, or remove ACCELERATE_USE_FSDP from "
            "os.environ for DDP)"
            if left
            else ""
        )
        raise ValueError(
            f"HeteroAccelerator splits batches for DDP or FSDP2; {sharded[0]} shards the model instead and is not "
            f"supported{why}: use FullyShardedDataParallelPlugin(fsdp_version=2) (accelerate launch --use_fsdp "
            "--fsdp_version 2), DDP (accelerate launch --multi_gpu), or the plain Accelerator"
        )
    config = accelerator_kwargs.get("dataloader_config")
    if config is not None and getattr(config, "use_stateful_dataloader", False):
        raise ValueError(
            "use_stateful_dataloader=True saves a loader's position in checkpoints, which hetsplit's shares "
            "do not support yet: leave it unset (resume with skip_first_batches, as the Trainer does)"
        )
    if config is not None and not getattr(config, "even_batches", True) and world > 1:
        check_even_batches(weighting)
    if config is not None and getattr(config, "dispatch_batches", None):
        raise ValueError(
            "dispatch_batches=True sends every batch from process 0; HeteroAccelerator gives each process its "
            "own share instead: leave dispatch_batches unset"
        )
    if devices is not None and not isinstance(devices, str):
        devices = ",".join(map(str, devices))
    spec = devices if devices is not None else os.environ.get(ENV_DEVICES)
    if not spec:
        return None
    items = [s for s in spec.split(",") if s.strip()]
    if len(items) > 1 and world == 1:
        raise ValueError(
            f"devices {spec!r} lists {len(items)} devices, one per process, but this job runs 1 process "
            "('accelerate launch --cpu' starts one): start one process per device with "
            f"'accelerate launch --multi_gpu --num_processes {len(items)} ...' (also on a CPU-only machine), "
            f"'hetsplit launch --devices {spec} ...' or torchrun"
        )
    names = rank_devices(spec, world)
    kinds = sorted({parse_device(name, check=False).type for name in names})
    if fsdp2 and len(kinds) > 1:
        raise ValueError(
            f"FSDP2 shards the model over one kind of device, but devices {spec!r} mix {' and '.join(kinds)}: "
            "list devices of one kind (cuda:0,cuda:1 or cpu,cpu@0.25), or train with DDP (no fsdp_plugin)"
        )
    return names


def shard_on_cpu(state: Any, plugin: Any) -> None:
    """Make accelerate's state shard with ``plugin`` (FSDP2) in a multi-process CPU job, as it does on GPUs.

    accelerate sets ``DistributedType.FSDP`` for GPU-like process types only; with
    ``MULTI_CPU`` the plugin is dropped and every process would hold a DDP copy. FSDP2
    itself runs on CPU processes over gloo, and emulated devices (``cpu,cpu@0.25:max8``)
    must run the same path as GPUs: the state is set as accelerate sets it on a GPU
    (the plugin and its mixed precision, the shared distributed type) and from there on
    accelerate's own FSDP2 code prepares, saves and loads.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # FSDP already: the state outlived an earlier accelerator (accelerate keeps it per process).
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP) or state.device.type != "cpu":
        return
    if getattr(state, "fsdp_plugin", None) is None:
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def check_loader(loader: DataLoader) -> None:
    """A loader HeteroAccelerator can re-cut into shares without changing what it means, else one clear error."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"HeteroAccelerator needs a map-style dataset (indexable, with a length), got the iterable "
            f"{type(loader.dataset).__name__}: wrap the data in a map-style Dataset"
        )
    if loader.batch_size is None:
        raise ValueError(
            f"HeteroAccelerator needs a DataLoader with batch_size, got batch_sampler="
            f"{type(loader.batch_sampler).__name__}: pass batch_size= (and shuffle=) instead of a batch sampler"
        )
    if not isinstance(loader.sampler, RandomSampler | SequentialSampler):
        raise ValueError(
            f"HeteroAccelerator replaces the loader's sampler with per-process shares and keeps only its order "
            f"(shuffled or sequential); got {type(loader.sampler).__name__}: use shuffle=True or False instead"
        )


def profiling_inputs(batch: Any, loss_fn: Any) -> tuple[Any, Any, Any]:
    """(sample, target, loss) to profile the model on a batch as the training loop will call it."""
    if isinstance(batch, Mapping):  # Hugging Face style: model(**batch).loss
        return dict(batch), None, loss_fn or (lambda out: out["loss"] if isinstance(out, Mapping) else out.loss)
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and loss_fn is not None:
        return batch[0], batch[1], loss_fn
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0], None, None
    return batch, None, None


def check_even_batches(weighting: str) -> None:
    """Refuse ``even_batches=False`` across processes where the plan weights the gradients (one process: nothing is).

    Raises:
        ValueError: Naming the weighting and what to do instead.
    """
    if weighting != "none":
        raise ValueError(
            f"even_batches=False keeps a last global batch short, which HeteroAccelerator(weighting="
            f"{weighting!r}) cannot weight by the plan: leave even_batches at its default (the last batch "
            "completed by wrapping around, as accelerate does), or weight your own loss with weighting='none'"
        )


def check_whole_shares(plan: Plan, who: str) -> None:
    """Refuse a plan that runs some process's share as several micro-batches where they are not followed.

    Micro-batches are exact only when each one is weighted by its part of the share:
    hetsplit's gradient weighting (:func:`hetsplit.distributed.weight_gradients`) weights
    it by its samples, HeteroTrainer's loss by its items. Without either (a loss the
    user normalises over the global batch, ``weighting="none"``) the share must run as
    one batch.

    Raises:
        ValueError: Naming the process, its micro-batches and what to do instead.
    """
    for rank, parts in enumerate(plan.micro_batches):
        if len(parts) > 1:
            raise ValueError(
                f"{who} runs each process's share as one batch, but the plan splits process {rank}'s share "
                f"{plan.sizes[rank]} into micro-batches {parts}; solve without accumulate (a batch within the "
                "memory caps), use HeteroAccelerator's micro_batches with a weighting (or "
                "hetsplit.distributed.micro_batches in a torchrun loop), or HeteroTrainer, which follows them"
            )
