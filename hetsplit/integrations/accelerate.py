"""HeteroAccelerator: accelerate's Accelerator with per-process shares from one hetsplit plan."""

from __future__ import annotations

import atexit
import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import reduce as accelerate_reduce
from torch.utils.data import DataLoader, RandomSampler

import hetsplit.distributed as hd
from hetsplit.devices import Device, device_name, parse_device, rank_label
from hetsplit.distributed.comm_hooks import WeightingState
from hetsplit.distributed.dtypes import verify_dtypes
from hetsplit.distributed.sharded import kind
from hetsplit.planning import Plan
from hetsplit.tree import tree_map

from . import core
from .accelerate_checks import (
    check_arguments,
    check_even_batches,
    shard_on_cpu,
    wants_fsdp2,
)
from .collectives import all_tensors, first_rows, uneven_gather, weighted_reduce
from .core import is_cpu_job, launched_world, throttle_forward
from .loaders import carried_settings, check_loader, rebuilt_loader
from .options import HeteroOptions
from .shares_loader import SharesLoader, load_epochs, save_epochs, shuffle_seed


# accelerate ships no type information: its classes are Any to mypy.
class HeteroAccelerator(accelerate.Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose prepared loaders give each process its share of one hetsplit plan.

    ``prepare(model, optimizer, loader)`` wraps the model as accelerate does (DDP, or FSDP2) and
    weights its gradients by shard, so an optimizer step equals a full-batch step
    (docs/integrations.md, accelerate); the global batch is accelerate's.

    Attributes:
        plan: The plan in force (``None`` until the first loader is prepared without
            ``plan=``; the rebalancer's current one when rebalancing).
        rank_device: This process's hetsplit :class:`~hetsplit.Device` (``None`` without a
            device list: accelerate's ``device`` is then the device).
        rebalancer: The :class:`~hetsplit.distributed.DistributedRebalancer` with
            ``rebalance``, made at the training loader's first batch.

    Args:
        weighting: ``"hook"`` (a DDP comm hook weights every gradient by ``b_r / B``),
            ``"outputs"`` (the gradient into the model's outputs is scaled; no comm hook),
            or ``"none"`` (DDP's plain mean). For a loss averaged over tokens, normalise it
            over the global batch's tokens yourself (``loss_sum / global_tokens * processes``)
            and use ``"none"``, or use :class:`~hetsplit.transformers.HeteroTrainer`.
        loss_fn: ``loss_fn(output, target)`` for profiling a ``(input, target, ...)``
            batch; default: ``output.loss`` for dict batches (Hugging Face models), the
            sum of the outputs otherwise.
        options: ``devices``, ``plan``, ``profile``, ``global_batch_size``, ``rebalance``,
            ``plan_kwargs``, ``quiet``: the arguments every integration shares, as keywords
            or one :class:`~hetsplit.integrations.options.HeteroOptions`. With ``rebalance``
            each batch of the training loader (from its yield to the next) is one step.
        **accelerator_kwargs: Passed to ``accelerate.Accelerator``.

    Raises:
        TypeError, ValueError: As :meth:`~hetsplit.integrations.options.HeteroOptions.check` (the
            same for every integration), and a ``ValueError`` for a device list without one
            device per process, FSDP1, DeepSpeed or Megatron-LM, or FSDP2 over devices of
            two kinds (``cuda:0,cpu``); before any process group is created.

    Example:
        >>> accelerator = HeteroAccelerator()  # was: Accelerator()
        >>> model, opt, loader = accelerator.prepare(model, opt, loader)
    """

    # True in a subclass whose own loss weights each micro-batch by its part of the share
    # (HeteroTrainer's): with weighting="none" a plan with micro-batches is then followed
    # there instead of refused.
    loss_weights_micro_batches: ClassVar[bool] = False
    # The class the user made, named in what it says (HeteroTrainer's accelerator says "HeteroTrainer").
    who: ClassVar[str] = "HeteroAccelerator"
    # What a process whose share is 0 is served (hetsplit.distributed.zero_share.ZERO_SHARES): one real
    # sample weighted 0, so user code never sees an empty batch; HeteroTrainer, which runs
    # such a share on a sample of its own, takes the empty batch.
    zero_share: ClassVar[str] = "sample"

    def __init__(
        self,
        *,
        weighting: str = "hook",
        loss_fn: Any = None,
        options: HeteroOptions | None = None,
        **accelerator_kwargs: Any,
    ) -> None:
        rank, world = launched_world()
        given = HeteroOptions.take(self.who, options, accelerator_kwargs)
        own_loss = self.loss_weights_micro_batches
        names = check_arguments(
            given, weighting, accelerator_kwargs, world, who=self.who, loss_weights_micro_batches=own_loss
        )
        self.rank_device: Device | None = None
        if names is not None:
            self.rank_device = parse_device(names[rank])  # this machine must have it
            if world > 1 and not dist.is_initialized():  # NCCL only when every process is a GPU
                self.rank_device = hd.init(devices=names)
        fsdp2 = wants_fsdp2(accelerator_kwargs) and world > 1
        if fsdp2 and accelerator_kwargs.get("fsdp_plugin") is None:  # from accelerate launch's environment,
            accelerator_kwargs["fsdp_plugin"] = accelerate.utils.FullyShardedDataParallelPlugin()  # as accelerate
        if world > 1:  # prepare and gather alone, without training, join the group too
            hd.drain_at_exit()  # at exit, let gloo's workers finish with the last collective first
        if is_cpu_job(self.rank_device, world):
            # accelerate's MULTI_CPU (gloo, the CPU as device) only comes with cpu=True; an
            # explicit cpu=False (upstream scripts pass cpu=args.cpu) would leave every process
            # alone, each training its own copy.
            accelerator_kwargs["cpu"] = True
        super().__init__(**accelerator_kwargs)
        if fsdp2:  # CPU processes (a device list, no CUDA, or cpu=True): accelerate would drop the plugin
            shard_on_cpu(self.state, accelerator_kwargs["fsdp_plugin"])
        if self.num_processes != world:
            raise ValueError(
                f"{world} processes were launched but accelerate runs {self.num_processes} "
                f"({self.distributed_type}): each would train alone; pass cpu=True on a machine without "
                "CUDA, or launch one process per device with 'hetsplit launch --devices ...'"
            )
        self.options = given
        self._plan = given.plan
        self._profile = given.profile  # not .profile: accelerate's Accelerator.profile() is a method
        self.global_batch_size = given.global_batch_size
        self.weighting = weighting
        self.rebalance = given.rebalance
        self.rebalancer: hd.DistributedRebalancer | None = None
        self.loss_fn = loss_fn
        self.plan_kwargs = given.plan_arguments
        self.model_to_profile: torch.nn.Module | None = None  # what prepare(loader) profiles without a model
        self._planned_loader: DataLoader[Any] | None = None  # the loader whose global batch the plan was made for
        self._planned_shares: SharesLoader | None = None  # that loader, prepared (its sampler is rebalanced)
        self._weightings: list[WeightingState] = []
        self._adopted: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # weighted and throttled
        self._provisional = False  # an FSDP2 plan made before the model was sharded: profiled once it is
        self.device_names = core.labels(names) if names is not None else None
        self._throttle = core.throttler(self.rank_device)
        self.report = core.SplitReport(self.who, self.process_index, given.quiet)
        self._pass_batches = 0  # the training loader's batches handed out in this pass
        # accelerate has no end of training but end_training(), which a script may not call:
        # a run not ended by then says its measured step at exit (the report only: no collective).
        atexit.register(self.report.end)

    @property
    def plan(self) -> Plan | None:
        """The plan in force (``None`` until the first loader is prepared without ``plan=``)."""
        return self.rebalancer.plan if self.rebalancer is not None else self._plan

    @property
    def hetero_plan(self) -> Plan | None:
        """Removed: :attr:`plan` (the attribute error says so)."""
        raise core.renamed(self, "hetero_plan", "plan")

    @property
    def device(self) -> torch.device:
        """This process's device: the hetsplit device given, else accelerate's."""
        if self.rank_device is not None:
            return self.rank_device.torch_device
        device: torch.device = super().device
        return device

    # -- prepare ------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Prepare as accelerate does; loaders get plan shares, models shard-weighted gradients.

        Without a plan, every process profiles the model passed alongside (or :attr:`model_to_profile`,
        or the model prepared last) on its device; with FSDP2, as sharded, the loaders prepared after it.

        Raises:
            ValueError: For a loader over an iterable dataset, without ``batch_size`` (a
                custom batch sampler) or with a sampler other than random or sequential;
                a plan for another number of processes; no model to profile. All before
                any device work.
        """
        loaders = [a for a in args if isinstance(a, DataLoader) and not getattr(a, "_is_accelerate_prepared", False)]
        for loader in loaders:
            check_loader(loader, self.who)
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        if self.is_fsdp2 and models and loaders:
            # accelerate shards the model in this call: model and optimizer first, then the
            # loaders, planned on the model as sharded (no process ever holds it whole).
            if device_placement is not None and len(device_placement) != len(args):
                raise ValueError(
                    f"`device_placement` should be a list with {len(args)} elements (the number of objects passed)."
                )
            out = list(args)

            def prepare_part(indices: list[int]) -> None:
                part = [args[i] for i in indices]
                place = None if device_placement is None else [device_placement[i] for i in indices]
                for i, obj in zip(indices, _results(self.prepare(*part, device_placement=place), part)):
                    out[i] = obj

            prepare_part([i for i, a in enumerate(args) if not isinstance(a, DataLoader)])
            if self._plan is None:
                model = next(out[i] for i, a in enumerate(args) if a is models[0])
                self.set_plan(self._make_plan(model, loaders[0]))
            prepare_part([i for i, a in enumerate(args) if isinstance(a, DataLoader)])
            return tuple(out)
        if loaders and self._plan is None:
            model = models[0] if models else self.model_to_profile
            self.set_plan(self._make_plan(model, loaders[0]))
        result = super().prepare(*args, device_placement=device_placement)
        for obj in _results(result, args):
            if kind(obj) == "fsdp2":  # accelerate's FSDP2 path shards in prepare(), without prepare_model()
                self._adopt(obj)
        return result

    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` (one share per process) for loaders prepared from now on, and weight gradients by it.

        Raises:
            ValueError: If the plan has another number of shares than processes.
        """
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hetsplit Plan, got {type(plan).__name__}: {plan!r}")
        whole = self.weighting == "none" and not self.loss_weights_micro_batches
        core.check_plan(
            self.who, plan, self.num_processes, rebalance=self.rebalance,
            whole_shares=f'{self.who}(weighting="none")' if whole else None,
        )  # fmt: skip
        if self.rebalancer is not None:
            raise ValueError("set_plan while rebalancing: the rebalancer owns the plan; pass rebalance=0 to set plans")
        self._plan = plan
        for state in self._weightings:
            state.set_plan(plan)

    def _global_batch(self, loader: DataLoader[Any]) -> int:
        """Samples per step over all processes: ``global_batch_size`` for the planned loader, else accelerate's."""
        if self.global_batch_size is not None and loader is self._planned_loader:
            return self.global_batch_size
        per_process = loader.batch_size
        assert per_process is not None, "check_loader refused a loader without batch_size"
        return per_process if self.split_batches else self.num_processes * per_process

    def _make_plan(self, model: torch.nn.Module | None, loader: DataLoader[Any]) -> Plan:
        self._planned_loader = loader
        batch = self._global_batch(loader)
        if self.num_processes == 1:
            return core.shares_for(None, batch, _ranks(1))
        given = self._profile is not None or self.plan_kwargs.get("weights") is not None  # nothing to time
        if model is None and self._models:  # prepare(model, optimizer), then the loader: that model
            model = self._models[-1]
        if self.is_fsdp2 and (model is None or kind(model) != "fsdp2"):  # profiled as sharded
            model = next((m for m in self._models if kind(m) == "fsdp2"), model)
        if not given and (model is None or (self.is_fsdp2 and kind(model) != "fsdp2")):
            # The loader comes before the model (prepare(loader), then prepare(model, ...); the
            # Trainer's order under FSDP2, where profiling the model whole would need each device
            # to hold it): even shares until the model is prepared, profiled then (_adopt).
            self._provisional = True
            return core.shares_for(None, batch, _ranks(self.num_processes))
        if model is None:
            raise ValueError(
                "HeteroAccelerator.prepare needs the model to plan the training loader (it is checked for "
                "BatchNorm even with profile= or weights): prepare it first or with the loader, or pass plan="
            )
        if kind(model) != "fsdp2":
            model = self.unwrap_model(model)  # the module inside DDP: profiled (and copied) bare
        device = device_name(self.rank_device if self.rank_device is not None else self.device)
        cuda = [self.device] if self.device.type == "cuda" else []
        with core.forwards_unthrottled():  # a model prepared already (FSDP2): the profile throttles its steps
            return core.profiled_plan(
                self.who, "the model", model, loader, batch, device=device, profile=self._profile,
                plan_kwargs=self.plan_kwargs, cuda=cuda, inputs=lambda b: _profiling_inputs(b, self.loss_fn),
                hint="it calls model(**batch).loss for a dict batch and loss_fn(model(batch[0]), batch[1]) for a "
                "tuple: pass loss_fn=, or plan= (or profile=) to skip profiling",
            )  # fmt: skip

    def _loader_plan(self, loader: DataLoader[Any]) -> Plan:
        """The shares for this loader's global batch: the plan, or its proportions for another batch size."""
        plan = self._plan
        assert plan is not None
        if self._planned_loader is None:  # a given plan: it is for the first loader prepared
            self._planned_loader = loader
        batch = self._global_batch(loader) if loader is not self._planned_loader else plan.batch_size
        return core.shares_for(plan, batch, _ranks(self.num_processes))

    def prepare_data_loader(
        self, data_loader: DataLoader[Any], device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> DataLoader[Any]:
        """This process's share of every global batch (instead of ``BatchSamplerShard``), on its device."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        check_loader(data_loader, self.who)
        if self.num_processes > 1 and not self.even_batches:  # set after the accelerator was made
            check_even_batches(self.weighting)
        if self._plan is None:  # called directly rather than through prepare()
            self.set_plan(self._make_plan(self.model_to_profile, data_loader))
        placement = self.device_placement if device_placement is None else device_placement
        loader = rebuilt_loader(
            data_loader,
            self._loader_plan(data_loader),
            shuffle=isinstance(data_loader.sampler, RandomSampler),
            seed=shuffle_seed(data_loader, self.dataloader_config.data_seed, self.num_processes),
            # accelerate completes a last short global batch by wrapping around (even_batches) only
            # across processes: one process, or even_batches=False, keeps it short, every sample once.
            pad=self.num_processes > 1 and self.even_batches,
            num_replicas=self.num_processes,
            rank=self.process_index,
            zero_share=self.zero_share,
            make=functools.partial(
                SharesLoader, device=self.device if placement else None, _drop_last=data_loader.drop_last,
                _non_blocking=self.non_blocking,
            ),
        )  # fmt: skip
        assert isinstance(loader, SharesLoader)
        loader._is_accelerate_prepared = True
        if data_loader is self._planned_loader:
            self._planned_shares = loader
            if self.steps_in_loader:  # each batch is a step: reported, and timed by the rebalancer
                loader.step_context, loader.pass_ended = self._loader_step, self._loader_pass_ended
        self._dataloaders.append(loader)
        return loader

    # Each batch of the training loader is one step, from its yield to the next; a subclass whose
    # framework fetches several batches first (HeteroTrainer's accumulation window) marks its own.
    steps_in_loader: ClassVar[bool] = True

    def _loader_step(self) -> contextlib.AbstractContextManager[Any]:
        # The report's step is an optimizer step: accelerate's accumulate() synchronises every
        # `gradient_accumulation_steps` batches from a pass's first (and at its end).
        if self._pass_batches % max(int(self.gradient_accumulation_steps), 1) == 0:
            self.report.step(self.plan, self.device_names)
        self.report.batch()
        self._pass_batches += 1
        return self.rebalance_step()

    def _loader_pass_ended(self) -> None:
        # An epoch ended, not the run: evaluation may follow, and is no step's time.
        self.report.pause()
        self._pass_batches = 0

    def end_training(self) -> None:
        """accelerate's end of training, after the measured step beside the predicted one (process 0)."""
        self.report.end(self.plan)
        super().end_training()

    def rebalance_step(self) -> contextlib.AbstractContextManager[Any]:
        """One training step, timed by the rebalancer (made at the first step; nothing without ``rebalance``)."""
        if not self.rebalance or self._planned_shares is None or self._plan is None:
            return contextlib.nullcontext()
        rebalancer = self.rebalancer
        if rebalancer is None:
            rebalancer = self.rebalancer = core.rebalancer(
                self._plan, self.rebalance, sampler=self._planned_shares.shares,
                gradients=self._weightings[0] if self._weightings else None,
                model=self._models[0] if self._models else None, device=self.rank_device,
            )  # fmt: skip
        return rebalancer.step() if rebalancer is not None else contextlib.nullcontext()

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader`` from its ``num_batches``-th batch on (resuming mid-epoch), with the same shares and order."""
        if not isinstance(dataloader, SharesLoader):
            return super().skip_first_batches(dataloader, num_batches)
        return dataloader.resumed(num_batches, **carried_settings(dataloader))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """accelerate's checkpoint, plus each prepared loader's epoch (its shuffle is ``seed + epoch``)."""
        location: str = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if self.is_main_process:
            save_epochs(self._dataloaders, location)
        return location

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """accelerate's resume, plus each prepared loader's epoch, so later epochs draw the orders they would have."""
        super().load_state(input_dir, **kwargs)
        if input_dir is not None:
            load_epochs(self._dataloaders, input_dir)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: Any = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Wrap as accelerate does (DDP), then weight the gradients by shard; emulated devices at their speed.

        accelerate shards an FSDP2 model in :meth:`prepare` instead, where it is weighted the same way.
        """
        if not evaluation_mode and kind(model) == "ddp":  # DDP's first broadcast aborts a rank on a dtype mismatch
            verify_dtypes(model)
        prepared: torch.nn.Module = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        self._adopt(prepared)
        return prepared

    def _adopt(self, model: torch.nn.Module) -> None:
        """Weight a prepared model's gradients by shard and run it at this process's speed (once a model).

        A plan left provisional (:meth:`_make_plan`) is profiled on it, followed from every loader's next batch.
        """
        if model in self._adopted:
            return
        if kind(model) == "fsdp2":
            if self.weighting != "none":  # FSDP2 has no comm hook: weighted at the root's outputs
                self._weightings.append(hd.weight_gradients(model, self._plan))
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.weighting != "none":
            if self.weighting == "outputs" and self._plan is None:
                raise ValueError(
                    'weighting="outputs" needs the plan when the model is prepared: prepare the model together '
                    "with the training loader, or pass plan="
                )
            self._weightings.append(hd.weight_gradients(model, self._plan, method=self.weighting))
        for state in self._weightings:  # a forward off the plan's micro-batches names the call accelerate users make
            state.micro_call = "accelerator.micro_batches(model, batch)"
        throttle_forward(model, self.rank_device)
        self._adopted.add(model)
        if self._provisional and self._planned_loader is not None:  # the model a loader's plan waited for
            self._provisional = False
            self._replan(self._make_plan(model, self._planned_loader))

    def _replan(self, plan: Plan) -> None:
        """Follow ``plan`` from every prepared loader's next batch on (the same on every process)."""
        self.set_plan(plan)
        for loader in self._dataloaders:
            if isinstance(loader, SharesLoader):
                sampler = loader.batch_sampler
                sampler.set_plan(core.shares_for(plan, sampler.batch_size, _ranks(self.num_processes)), sampler.yielded)

    # -- steps and collectives ------------------------------------------------------------

    def micro_batches(self, model: torch.nn.Module, batch: Any, *, dim: int = 0) -> Iterator[Any]:
        """This process's batch cut into the plan's micro-batches, all but the last under ``no_sync()``.

        Each micro-batch's gradient is weighted by its samples, so a mean loss per micro-batch
        still gives the full-batch step; an emulated memory cap (``cpu:max64``) raises
        ``torch.OutOfMemoryError`` above it, as a GPU would.

        Raises:
            ValueError: Without a plan yet, with ``weighting="none"``, or for a batch that
                is not this process's share.

        Example:
            >>> for xm, ym in accelerator.micro_batches(model, (xb, yb)):
            ...     accelerator.backward(F.mse_loss(model(xm), ym))
        """
        plan = self.plan
        if plan is None:
            raise ValueError("no plan yet: prepare the training loader first, or pass plan= to HeteroAccelerator")
        if self.weighting == "none":
            raise ValueError(
                'micro_batches needs hetsplit to weight each micro-batch: use weighting="hook" or "outputs", not "none"'
            )
        if self.num_processes == 1:
            # No DDP wrapper, so no weighting: micro-batches of one process would add their means.
            if any(len(m) > 1 for m in plan.micro_batches):
                raise ValueError(
                    f"micro_batches with one process: the plan runs micro-batches {plan.micro_batches}, which "
                    "nothing weights without several processes; give a plan without micro-batches here, or use "
                    "gradient_accumulation_steps"
                )
            return iter([batch])  # the whole batch, a last short one included (kept short alone)
        return hd.micro_batches(model, batch, plan, rank=self.process_index, dim=dim, device=self.rank_device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` as accelerate does, at this process's emulated speed (waiting is not slowed)."""
        with self._throttle():
            super().backward(loss, **kwargs)

    def gather(self, tensor: Any) -> Any:
        """Every process's tensors concatenated along dim 0, whatever each one's length (uneven shards)."""
        if self.num_processes == 1:
            return tensor
        return uneven_gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every process's rows of the current batch that are data, each sample once, in process order.

        Inside a prepared loader's loop the padding of a last global batch and a zero share's stand-in are left out.
        """
        loader = getattr(self.gradient_state, "active_dataloader", None)
        if not isinstance(loader, SharesLoader) or loader.current_samples is None or self.num_processes == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        rows, real = loader.rows, loader.real_rows()
        mine = first_rows(input_data, rows, real)
        tensors = all_tensors(mine)
        if use_gather_object or not tensors:
            return accelerate.utils.gather_object(mine if isinstance(mine, list) else [mine])
        return self.gather(mine)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce across processes; a ``"mean"`` weights each process by its samples.

        The current batch's samples inside a prepared loader's loop (a batch mean reduces to the global
        batch's), the plan's shares outside one; ``"sum"``, ``"max"`` and ``"none"`` are accelerate's.
        """
        loader = getattr(self.gradient_state, "active_dataloader", None)
        samples = getattr(loader, "current_samples", None)
        if samples is None and self.plan is not None:  # after a loop (an epoch's mean): the plan's shares
            samples = self.plan.sizes[self.process_index]
        if reduction != "mean" or samples is None or self.num_processes == 1:
            return super().reduce(tensor, reduction, scale)
        plain = lambda t, op: accelerate_reduce(t, op, scale)
        return tree_map(lambda t: weighted_reduce(t, samples, "mean", plain) if torch.is_tensor(t) else t, tensor)


def _results(result: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """``prepare``'s return as a tuple, one per argument (accelerate returns a lone object unwrapped)."""
    return tuple(result) if len(args) > 1 else (result,)


def _profiling_inputs(batch: Any, loss_fn: Any) -> tuple[Any, dict[str, Any]]:
    """(sample, {target, loss_fn}) to profile the model on a batch as the training loop will call it."""
    if isinstance(batch, Mapping):  # Hugging Face style: model(**batch).loss
        loss = loss_fn or (lambda out: out["loss"] if isinstance(out, Mapping) else out.loss)
        return dict(batch), {"target": None, "loss_fn": loss}
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and loss_fn is not None:
        return batch[0], {"target": batch[1], "loss_fn": loss_fn}
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0], {"target": None, "loss_fn": None}
    return batch, {"target": None, "loss_fn": None}


def _ranks(n: int) -> list[str]:
    return [rank_label(r) for r in range(n)]
