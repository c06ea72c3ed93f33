"""HeteroAccelerator: accelerate's Accelerator with per-process shares from one hetsplit plan."""

from __future__ import annotations

import os
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

import hetsplit.distributed as hd
from hetsplit.devices import parse_device

__all__ = ["HeteroAccelerator"]


class HeteroAccelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` whose prepared loaders follow one hetsplit plan.

    ``prepare(model, optimizer, train_loader)`` replaces accelerate's even sharding with
    this process's share of every global batch, wraps the model as accelerate does (DDP)
    and weights its gradients by shard, so a step equals a full-batch step.

    Args:
        devices: Per-process device list (``"cpu,cpu@0.25"``); default ``$HETSPLIT_DEVICES``.
        plan: A plan for all processes; else one is profiled at ``prepare``.
        profile: This process's profile, used instead of timing the model.
        global_batch_size: Samples per step over all processes (default processes × loader batch size).
        weighting: ``"hook"`` or ``"outputs"``, as for :func:`hetsplit.distributed.weight_gradients`.
        loss_fn: Loss used when profiling (``loss_fn(output, target)``); default: the model's own.
        **accelerator_kwargs: Passed to ``accelerate.Accelerator``.
    """

    def __init__(
        self,
        *,
        devices: str | None = None,
        plan: Any = None,
        profile: Any = None,
        global_batch_size: int | None = None,
        weighting: str = "hook",
        loss_fn: Any = None,
        **accelerator_kwargs: Any,
    ) -> None:
        if weighting not in ("hook", "outputs"):
            raise ValueError(f"weighting={weighting!r}: use 'hook' or 'outputs'")
        spec = devices or os.environ.get(hd.ENV_DEVICES)
        self.hetero_device = None
        if spec and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            self.hetero_device = hd.init(devices=spec)
        elif spec:
            rank = int(os.environ.get("RANK", "0"))
            names = [d.strip() for d in spec.split(",")]
            self.hetero_device = parse_device(names[rank % len(names)])
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
            accelerator_kwargs.setdefault("cpu", True)  # accelerate's MULTI_CPU (gloo) needs cpu=True
        super().__init__(**accelerator_kwargs)
        self.hetero_plan = plan
        self.hetero_profile = profile
        self.global_batch_size = global_batch_size
        self.weighting = weighting
        self.loss_fn = loss_fn
        self._hetero_model = None
        self._pending_loaders: list[DataLoader] = []

    def _throttle(self) -> Any:
        dev = self.hetero_device
        if dev is not None and hasattr(dev, "throttle"):
            return dev.throttle(cpu_time=True)
        import contextlib

        return contextlib.nullcontext()

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Prepare objects as accelerate does; loaders get plan shares, models shard-weighted gradients."""
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        loaders = [a for a in args if isinstance(a, DataLoader)]
        for loader in loaders:
            self._check_loader(loader)
        if loaders and self.hetero_plan is None:
            self.hetero_plan = self._make_plan(models[0] if models else None, loaders[0])
        if self.hetero_plan is not None:
            n = len(self.hetero_plan.sizes)
            if n != self.num_processes:
                raise ValueError(
                    f"plan has {n} shares {list(self.hetero_plan.sizes)} but {self.num_processes} processes run: "
                    "give a plan with one share per process"
                )
        return super().prepare(*args, device_placement=device_placement)

    def _check_loader(self, loader: DataLoader) -> None:
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError(
                f"HeteroAccelerator needs a map-style dataset, got iterable {type(loader.dataset).__name__}: "
                "wrap the data in a map-style Dataset"
            )
        if loader.batch_size is None:
            raise ValueError(
                f"HeteroAccelerator needs a DataLoader with batch_size, got batch_sampler="
                f"{type(loader.batch_sampler).__name__}: pass batch_size= (and shuffle=) instead of a batch sampler"
            )

    def _make_plan(self, model: Any, loader: DataLoader) -> Any:
        batch = self.global_batch_size or self.num_processes * loader.batch_size
        if self.num_processes == 1:
            from hetsplit.planning import plan_from_sizes

            return plan_from_sizes(None, ["rank0"], [batch])
        if model is None:
            raise ValueError("HeteroAccelerator.prepare needs the model with the loader to profile: pass plan=")
        first = next(iter(loader))
        sample, target = (first[0], first[1]) if isinstance(first, (list, tuple)) else (first, None)
        if isinstance(first, dict):
            sample = dict(first)
        device = str(self.hetero_device.name) if getattr(self.hetero_device, "name", None) else str(self.device)
        kwargs: dict[str, Any] = {"profile": self.hetero_profile, "time_budget": 10}
        if self.loss_fn is not None:
            kwargs.update(loss_fn=self.loss_fn, target=target)
        else:
            kwargs.update(loss_fn=lambda out: out.loss if hasattr(out, "loss") else out.float().mean())
        return hd.plan(model, sample, batch, device=device, **kwargs)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: Any = None, slice_fn_for_dispatch=None):
        """This process's share of every global batch (no ``BatchSamplerShard``), moved to the device."""
        self._check_loader(data_loader)
        shuffle = isinstance(data_loader.sampler, torch.utils.data.RandomSampler)
        kwargs = {
            "num_workers": data_loader.num_workers,
            "collate_fn": data_loader.collate_fn,
            "pin_memory": data_loader.pin_memory,
        }
        loader = hd.data_loader(
            data_loader.dataset,
            self.hetero_plan,
            shuffle=shuffle,
            drop_last=data_loader.drop_last,
            num_replicas=self.num_processes,
            rank=self.process_index,
            **kwargs,
        )
        loader = accelerate.data_loader.DataLoaderShard(
            loader.dataset,
            device=self.device if device_placement is not False else None,
            batch_sampler=loader.batch_sampler,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
        )
        self._dataloaders.append(loader)
        return loader

    def prepare_model(self, model: torch.nn.Module, device_placement: Any = None, evaluation_mode: bool = False):
        """Wrap as accelerate does (DDP), then weight the gradients by shard."""
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.hetero_plan is not None:
            hd.weight_gradients(model, self.hetero_plan, method=self.weighting)
        self._hetero_model = model
        return model

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` as accelerate does, at this process's (emulated) speed."""
        with self._throttle():
            super().backward(loss, **kwargs)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every process's samples once, in rank order, with uneven shards (sizes gathered, padded, trimmed)."""
        if self.num_processes == 1:
            return input_data
        return _uneven_gather(input_data)

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors of any first-dimension length from every process."""
        if self.num_processes == 1:
            return tensor
        return _uneven_gather(tensor)


def _uneven_gather(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _uneven_gather(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_uneven_gather(v) for v in data)
    if not isinstance(data, torch.Tensor):
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, data)
        return out
    t = data if data.dim() else data.reshape(1)
    n = torch.tensor([t.shape[0]], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    counts = [int(s) for s in sizes]
    pad = max(counts)
    padded = torch.zeros((pad, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:c] for p, c in zip(parts, counts)])
