"""HeteroTrainer: the Hugging Face Trainer with per-process shares from one hetsplit plan."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from hetsplit.devices import Device, parse_device
from hetsplit.distributed.accumulate import all_reduce_once as _all_reduce_once
from hetsplit.distributed.accumulate import micro_sizes_for as _micro_sizes
from hetsplit.distributed.accumulate import row_pieces as _pieces
from hetsplit.distributed.sharded import kind, micro_for_rows
from hetsplit.distributed.zero_share import stand_in_items
from hetsplit.parallel.reduce import shard_weight
from hetsplit.planning import Plan
from hetsplit.tree import flatten, narrow, samples_in

from . import core
from .accelerate import HeteroAccelerator
from .core import is_cpu_job, launched_world
from .loss_items import items_in, piece_items, zero_gradients
from .options import HeteroOptions


class _TrainerPrivates(transformers.Trainer):
    """HeteroTrainer's overrides of ``transformers.Trainer``'s private methods, all here: its version risk.

    Also read, not overridden, with a fallback where a release lacks them: ``_get_num_items_in_batch``,
    ``_prepare_inputs``, ``_loss_shifts_labels``, ``loss_is_scaled_for_ga``, ``_tr_loss`` and
    ``TrainingArguments._setup_devices``.
    """

    accelerator: Any
    _accelerator_args: dict[str, Any]

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # Kept to build the HeteroAccelerator with exactly the Trainer's own settings.
        self._accelerator_args = super()._build_accelerator_args(**kwargs)
        return self._accelerator_args

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's end of training, with the loss it has not logged yet averaged over the processes.

        Only the processes' mean is the global batch's loss, but the Trainer adds what is left since
        the last log as this process's own to ``train_loss`` (0 on a process whose share is 0).
        """
        rest = getattr(self, "_tr_loss", None)
        if torch.is_tensor(rest) and self.accelerator.num_processes > 1:
            total = rest.detach().clone()
            dist.all_reduce(total)
            self._tr_loss = total / self.accelerator.num_processes
        # transformers leaves _finalize_training unannotated.
        return super()._finalize_training(*args, **kwargs)  # type: ignore[no-untyped-call]

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """The Trainer's save; a gathered ``state_dict``'s tied weights are one tensor again, saved once.

        ``save_pretrained`` finds tied weights by shared storage, and FSDP2's gathered state dict
        holds a copy per name (GPT-2's ``lm_head.weight`` would be saved twice).
        """
        if state_dict is not None and self.model is not None:
            state_dict = _tied_as_one(self.accelerator.unwrap_model(self.model), state_dict)
        super()._save(output_dir, state_dict=state_dict)


class HeteroTrainer(_TrainerPrivates):
    """``transformers.Trainer`` whose processes each train on their own share of every global batch.

    The global batch (processes × ``per_device_train_batch_size``) is cut by one plan and each
    process's loss becomes its part of the global loss over items (label tokens, else samples),
    ``world * S_r / N``, so every step equals the plain model's step on the whole global batch
    (docs/integrations.md, Trainer). Launch one process per device: ``hetsplit launch --devices
    cpu,cpu@0.25 train.py``, torchrun, or ``accelerate launch --multi_gpu --num_processes N``.

    Args:
        *args: As for ``transformers.Trainer``.
        options: ``devices``, ``plan``, ``profile``, ``global_batch_size``, ``rebalance``,
            ``plan_kwargs``, ``quiet``: the arguments every integration shares, as keywords
            or one :class:`~hetsplit.integrations.options.HeteroOptions`. No ``weighting``: the
            loss weights by items itself, exact for token losses where weighting by samples is not.
        **trainer_kwargs: As for ``transformers.Trainer``.

    Raises:
        TypeError, ValueError: As :meth:`~hetsplit.integrations.options.HeteroOptions.check` (the
            same for every integration), before the Trainer starts.
        ValueError: With the Trainer's FSDP1 or DeepSpeed (the message names FSDP2, which
            runs), if a process would run several GPUs (``nn.DataParallel``), or this
            process's device is not where the Trainer puts the model.

    Example:
        >>> trainer = HeteroTrainer(model=model, args=args, train_dataset=train)  # was: Trainer(...)
        >>> trainer.train()
    """

    def __init__(self, *args: Any, options: HeteroOptions | None = None, **trainer_kwargs: Any) -> None:
        given = HeteroOptions.take("HeteroTrainer", options, trainer_kwargs)
        given.check("HeteroTrainer", weighting="none")
        given = dataclasses.replace(given, devices=given.device_list)  # one string, as every process reads it
        training_args = trainer_kwargs.get("args", args[1] if len(args) > 1 else None)
        _check_sampling(training_args)
        _run_on_cpu(training_args, given.device_list)
        self.options = given
        self._window_items: float | None = None  # items of the global batch over this accumulation window
        self._piece_items: dict[int, tuple[Any, list[int], list[float]]] = {}  # id: batch, sizes, their items
        # Per evaluation batch, this process's (summed loss, items, samples): reduced once at the end.
        self._eval_rows: list[torch.Tensor] | None = None
        self._filler: Any = None  # the loader an empty share borrows two real samples from
        self._null_step = False  # this step's loss is exact zeros through the outputs (FSDP2, no items)
        self._batches = 0  # global batches (training_step calls) of the optimizer step running
        super().__init__(*args, **trainer_kwargs)
        self.add_callback(_StepTimes(self))
        if self.args.n_gpu > 1:
            raise ValueError(
                f"this process sees {self.args.n_gpu} GPUs and the Trainer would run nn.DataParallel over them; "
                "HeteroTrainer runs one process per device: start them with 'hetsplit launch --devices ...' or torchrun"
            )
        mine, trainers = self.accelerator.device, torch.device(self.args.device)
        if mine.type != trainers.type or (mine.type == "cuda" and mine.index != trainers.index):
            raise ValueError(
                f"this process's device is {mine} but the Trainer places the model on {trainers}; list the devices "
                f"so that process r gets cuda:LOCAL_RANK, or pass TrainingArguments(use_cpu={mine.type == 'cpu'})"
            )
        self.accelerator.model_to_profile = self.model  # also when evaluation comes first

    @property
    def plan(self) -> Plan | None:
        """The plan in force (``None`` until the first loader is made; the rebalancer's when rebalancing)."""
        return getattr(self.accelerator, "plan", None)

    @property
    def hetero_plan(self) -> Plan | None:
        """Removed: :attr:`plan` (the attribute error says so)."""
        raise core.renamed(self, "hetero_plan", "plan")

    @property
    def rank_device(self) -> Device | None:
        """This process's hetsplit device (``None`` without a device list)."""
        return getattr(self.accelerator, "rank_device", None)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator set-up, with a :class:`HeteroAccelerator` in place of ``Accelerator``."""
        version = (self.args.fsdp_plugin_args or {}).get("fsdp_version", 1)
        sharding = [f"fsdp={self.args.fsdp!r} (FSDP{version})"] if self.args.fsdp and version != 2 else []
        sharding += [f"deepspeed={self.args.deepspeed!r}"] if self.args.deepspeed else []
        if sharding:  # before the Trainer builds its accelerator: one line, on every process
            raise ValueError(_refused_sharding(", ".join(sharding)))
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled:  # from the environment: accelerate launch --use_deepspeed
            raise ValueError(_refused_sharding("accelerate launch's --use_deepspeed"))
        # "none": each process's loss is made its part of the global loss (compute_loss), exact
        # for token losses too, where weighting gradients by samples is not; under FSDP2 too,
        # whose reduce-scatter averages the processes' gradients as DDP's all-reduce does.
        self.accelerator = _TrainerAccelerator(weighting="none", options=self.options, **self._accelerator_args)
        # Read again: on CPU processes the Trainer's own accelerator dropped the FSDP2 plugin
        # (accelerate shards on GPUs only), which HeteroAccelerator keeps (its emulated twin).
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None
        self.accelerator.model_to_profile = getattr(self, "model", None)
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )

    def _shifts(self, model: nn.Module) -> bool:
        """Whether the model's loss predicts label i+1 at position i (a causal LM), so position 0 never counts."""
        inner = self.accelerator.unwrap_model(model)
        config = getattr(inner, "config", None)
        return getattr(inner, "loss_function", None) is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", 0)

    def _counted_items(self, model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor | int:
        """The items the plain Trainer divides ``inputs``' summed loss by in evaluation, else the model's own.

        GPT-2's ``loss_type`` is None, so the Trainer counts its labels unshifted (16 for a block of 16,
        where its loss averages 15). The rule is copied, not called: the Trainer's count all-gathers.
        """
        counts = "labels" in inputs and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        # transformers before _loss_shifts_labels counted every label unshifted.
        shifted = getattr(self, "_loss_shifts_labels", False) if counts else self._shifts(model)
        return items_in(inputs, shifted)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, cut into this process's shares (the model is profiled first if needed)."""
        self._filler = loader = super().get_train_dataloader()
        return loader

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's training; afterwards a step of its own counts its items again (see :meth:`training_step`)."""
        try:
            result = super().train(*args, **kwargs)
        finally:
            self._window_items, self._piece_items = None, {}  # the last window's count is not a later step's
        self.accelerator.report.end(self.plan)  # the measured step beside the predicted one (process 0)
        return result

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        """The Trainer's next accumulation window, and the items of the global batch over it (one all-reduce)."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        # once per window, before any micro-batch
        self._window_items = self._count_items(batches, device, num_items)
        return batches, num_items

    def _count_items(self, batches: list[Any], device: torch.device, counted: Any) -> float:
        """The items of the global batch over ``batches`` (this process's), counted on every process.

        ``counted`` is the Trainer's own count; each micro-batch's items are kept for :meth:`training_step`.
        """
        shifted = self._shifts(self._trained_model())
        layout = [(batch, self._micro(samples_in(batch) or 0)) for batch in batches]
        counts = [piece_items(batch, sizes, shifted, device) for batch, sizes in layout]  # on the device
        local = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.float64, device=device)
        total = self._global_items(counted, local.sum())
        values = torch.cat([total, local]).tolist()  # one synchronisation per window, as the Trainer's own count
        self._piece_items, at = {}, 1
        for batch, sizes in layout:
            self._piece_items[id(batch)] = (batch, sizes, values[at : at + len(sizes)])
            at += len(sizes)
        return float(values[0])

    def _global_items(self, counted: Any, local: torch.Tensor) -> torch.Tensor:
        """What the global batch's summed loss is divided by: the Trainer's count ``counted``, else ``local``'s sum.

        Returns one float64 count on ``local``'s device, summed over the processes (GPT-2: see :meth:`_counted_items`).
        """
        trainers = torch.is_tensor(counted)
        total = (counted if trainers else local).to(local.device, torch.float64).reshape(1)
        if trainers and self.args.average_tokens_across_devices and self.args.world_size > 1:
            return total  # the Trainer's count is the sum over the processes already (accelerator.gather)
        if self.accelerator.num_processes > 1:
            dist.all_reduce(total)
        return total

    def _pieces(self, inputs: Any) -> tuple[list[int], list[float]]:
        """This batch's micro-batch sizes and the items of each (counted with its window's, else here)."""
        sizes = self._micro(samples_in(inputs) or 0)
        batch, known, counts = self._piece_items.get(id(inputs), (None, None, None))
        if batch is inputs and known == sizes and counts is not None:
            return sizes, counts
        shifted = self._shifts(self._trained_model())
        counted: list[float] = piece_items(inputs, sizes, shifted, self.args.device).tolist()
        return sizes, counted

    def _trained_model(self) -> nn.Module:
        """The model the Trainer trains (``self.model``, set by the Trainer's constructor)."""
        model = self.model
        if model is None:
            raise RuntimeError("HeteroTrainer has no model: pass model= (or model_init=) to the Trainer")
        return model

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's step on this process's batch, run as the plan's micro-batches for this process.

        All but the last micro-batch run under ``no_sync``; a piece without items is not run, and a
        batch without any runs its last piece with every gradient held at an exact 0 (DDP needs a
        backward on every process).

        Returns the detached loss: the sum of the micro-batches' losses.

        Raises:
            torch.OutOfMemoryError: If a micro-batch (or an unsplit share) exceeds this
                process's emulated memory (``cpu:max4``), as a GPU would run out.
        """
        self._batches += 1  # the split report times the Trainer's steps (_StepTimes)
        with self.accelerator.rebalance_step():  # one step of the rebalancer (nothing without rebalance)
            return self._step(model, inputs, num_items_in_batch)

    def _step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        outside = self._window_items is None  # a step outside the Trainer's loop: its items, counted once here
        if outside:  # on every process whatever its micro-batches, so the all-reduces pair up
            counted = self._get_num_items_in_batch([inputs], self.args.device)
            self._window_items = self._count_items([inputs], self.args.device, counted)
        try:
            sizes, counts = self._pieces(inputs)
            sharded = kind(model) == "fsdp2"
            device = self.rank_device
            if device is not None and any(sizes):
                device.check_batch(max(sizes))  # before any forward
            pieces = _pieces(inputs, sizes)
            if sharded:  # FSDP2's forwards are collective: every piece runs, as many on every process
                return self._run_sharded(model, pieces, counts, num_items_in_batch)
            run = [piece for piece, n in zip(pieces, counts) if n > 0]
            if not run:  # no items: DDP still needs this process's backward, which must add exact zeros
                with zero_gradients(model):
                    alone: torch.Tensor = super().training_step(model, pieces[-1], num_items_in_batch)
                return alone
            losses: list[torch.Tensor] = []
            for piece in _all_reduce_once(model, run):  # a piece without items adds nothing: not run
                losses.append(super().training_step(model, piece, num_items_in_batch))
            return _summed(losses)
        finally:
            if outside:
                self._window_items, self._piece_items = None, {}

    def _run_sharded(
        self, model: nn.Module, pieces: list[Any], counts: list[float], num_items_in_batch: Any
    ) -> torch.Tensor:
        """Each piece's forward and backward, each reduce-scattering its gradient (FSDP2).

        A piece without items adds exact zeros through its outputs (:func:`_zero_through`).
        """
        losses: list[torch.Tensor] = []
        for piece, n in zip(pieces, counts):
            self._null_step = n == 0
            try:
                losses.append(super().training_step(model, piece, num_items_in_batch))
            finally:
                self._null_step = False
        return _summed(losses)

    def _micro(self, rows: int) -> list[int]:
        """This process's micro-batch sizes for a batch of ``rows`` rows; under FSDP2 as many as every process runs."""
        rank = self.accelerator.process_index
        if self.plan is not None and kind(self._trained_model()) == "fsdp2":
            return micro_for_rows(self.plan, rank, rows)
        return _micro_sizes(self.plan, rank, rows)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """This process's part of the global batch's loss, ``world * S_r / N`` (see the class)."""
        shifted = self._shifts(model)
        empty = samples_in(inputs) == 0
        # The model's own mean over this process's items; num_items_in_batch is left out on
        # purpose, as models that honour it and models that ignore it then mean the same.
        # A copy: the Trainer pops "labels" from what it is given (label smoothing).
        null = self._null_step and model.training
        result = super().compute_loss(
            model, self._filler_inputs(inputs) if empty else dict(inputs), return_outputs=return_outputs or null
        )
        loss: torch.Tensor
        outputs: Any
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        if null:  # exact zeros through the outputs: the loss over no items may be NaN, and so its backward
            loss = _zero_through(outputs, loss)
            outputs = outputs if return_outputs else None
        elif model.training and not empty:
            items = items_in(inputs, shifted)  # a tensor on the labels' device: the factor needs no synchronisation
            total = self._window_items
            if total is None:  # a step outside the Trainer's loop: count this step's items on every process
                counted = self._get_num_items_in_batch([inputs], self.args.device)
                total = self._global_items(counted, torch.as_tensor(items, device=loss.device)).item()
            # Each item's shard weight, 1 / N, times the processes DDP averages over: S_r items weigh world * S_r / N.
            factor = self.accelerator.num_processes * shard_weight(1, total)
            scaled = getattr(self, "loss_is_scaled_for_ga", None)
            if scaled is None:  # the Trainer's own rule for when it divides by the accumulation steps
                scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
                scaled = scaled or self.compute_loss_func is not None
            if not scaled:  # the Trainer divides by the accumulation steps itself then
                factor *= self.current_gradient_accumulation_steps
            scale = items.to(torch.float64) * factor if torch.is_tensor(items) else torch.tensor(items * factor)
            scale = scale.to(loss.device, loss.dtype)
            # A batch without items adds an exact 0 (the model's mean over none is NaN); its
            # gradients, NaN too (0 * 1/0), training_step makes exact zeros.
            loss = torch.where(scale > 0, loss * scale, 0.0) if factor else _part(loss, 0.0)
        elif not model.training and self._eval_rows:
            # Under FSDP2 a forward is collective: where some process's rows pad a last global
            # batch and it runs a second forward over its real rows, every process runs one.
            together = kind(model) == "fsdp2" and self._padded_batch()
            if not empty:
                real = self._real_rows(inputs)
                whole = real == samples_in(inputs)
                mean = loss if whole and not together else self._real_mean(model, inputs, real, together)
                rows = inputs if whole else _rows(inputs, real)
                real_items = items_in(rows, shifted)  # what the model's own mean averages over
                counted = self._counted_items(model, rows)  # what the plain Trainer divides the batch's sum by
                self._eval_rows[-1] += _eval_row(mean, real_items, counted, real, self.args.device)
            elif together:
                self._real_mean(model, self._filler_inputs(inputs), 0, together)
        if empty:
            loss = _part(loss, 0.0)
            outputs = _rows(outputs, 0) if outputs is not None else None
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop; ``<prefix>_loss`` becomes the plain one-process Trainer's (see the class)."""
        self._eval_rows = []
        try:
            output = super().evaluation_loop(*args, **kwargs)
        finally:
            rows, self._eval_rows = self._eval_rows, None
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        # A row of zeros (no samples) after them: never an empty collective.
        zero = torch.zeros(3, dtype=torch.float64, device=self.args.device)
        total = torch.stack([*rows, zero])
        if self.accelerator.num_processes > 1:  # every process runs every global batch: rows pair up
            dist.all_reduce(total)
        metrics = output.metrics
        if metrics is not None and f"{prefix}_loss" in metrics:
            loss = _mean_over_batches(total, self.args.logging_nan_inf_filter)
            if loss is not None:
                metrics[f"{prefix}_loss"] = loss
        return output

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step on this process's share of one evaluation batch, which opens its row of the loss."""
        if self._eval_rows is not None:
            self._eval_rows.append(torch.zeros(3, dtype=torch.float64, device=self.args.device))
        return super().prediction_step(model, inputs, *args, **kwargs)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's evaluation loader, cut in the plan's proportions."""
        loader = super().get_eval_dataloader(eval_dataset)
        if self._filler is None:
            self._filler = loader
        return loader

    def _filler_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Real samples (two: BatchNorm cannot train on one), shaped as the loader's batches, for a share of 0."""
        loader = self._filler
        if loader is None:
            raise RuntimeError("HeteroTrainer: a share of 0 samples before any loader was made; pass a data set")
        items = stand_in_items(loader.dataset)
        some = self._prepare_inputs(loader.collate_fn(items))
        return {k: v for k, v in some.items() if k in inputs}

    def _real_rows(self, inputs: dict[str, Any]) -> int:
        """This process's rows of the current evaluation batch that are not padding of a last incomplete batch."""
        loader = getattr(self.accelerator.gradient_state, "active_dataloader", None)
        real = getattr(loader, "real_rows", None)
        return real() if callable(real) else samples_in(inputs) or 0

    def _padded_batch(self) -> bool:
        """Whether some process's rows of the current evaluation batch pad a last global batch."""
        loader = getattr(self.accelerator.gradient_state, "active_dataloader", None)
        padded = getattr(loader, "padded", None)
        return bool(padded()) if callable(padded) else False

    def _real_mean(self, model: nn.Module, inputs: dict[str, Any], real: int, together: bool = False) -> torch.Tensor:
        """The model's mean loss over the first ``real`` rows; with ``together`` (FSDP2) it runs even when 0."""
        if real == 0 and not together:
            return torch.zeros(())
        with torch.no_grad():
            mean = super().compute_loss(model, _rows(inputs, real) if real else inputs)
        assert isinstance(mean, torch.Tensor), "compute_loss without return_outputs returns the loss"
        return mean if real else torch.zeros(())


def _refused_sharding(what: str) -> str:
    return (
        f"HeteroTrainer runs DDP or FSDP2, not {what}; remove it, or shard with FSDP2: "
        "TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...}) (the default version), or accelerate "
        "launch --use_fsdp --fsdp_version 2"
    )


def _eval_row(
    mean: torch.Tensor, real_items: torch.Tensor | int, counted: torch.Tensor | int, samples: int, device: torch.device
) -> torch.Tensor:
    """One process's part of an evaluation batch: (summed loss, items as the Trainer counts, samples), float64.

    Tensors throughout: no synchronisation per batch; a NaN ``mean`` over no items adds 0.
    """
    items = torch.as_tensor(real_items, dtype=torch.float64, device=device)
    summed = torch.where(items > 0, mean.detach().to(device, torch.float64) * items, 0.0)
    counts = torch.as_tensor(counted, dtype=torch.float64, device=device)
    return torch.stack([summed, counts, items.new_tensor(samples)])


def _mean_over_batches(rows: torch.Tensor, drop_not_finite: bool) -> float | None:
    """The plain Trainer's ``eval_loss`` from each global batch's (summed loss, items, samples).

    A mean over the batches weighted by samples, as its loop repeats each batch's loss per sample; a
    not-finite batch is left out under ``logging_nan_inf_filter``. ``None`` without any sample.
    """
    rows = rows[rows[:, 2] > 0].cpu()
    if not len(rows):
        return None
    losses, samples = rows[:, 0] / rows[:, 1], rows[:, 2]
    finite = torch.isfinite(losses)
    if drop_not_finite and finite.any():
        losses, samples = losses[finite], samples[finite]
    return float((losses * samples).sum() / samples.sum())


def _rows(tree: Any, n: int) -> Any:
    """The first ``n`` rows of every tensor with a batch dimension in ``tree`` (a dict, a model output)."""
    return narrow(tree, 0, n)


def _check_sampling(args: Any) -> None:
    """Refuse a length-grouped training order before any work (hetsplit cuts each global batch by the plan)."""
    strategy = getattr(args, "train_sampling_strategy", None)
    grouped = [f"train_sampling_strategy={strategy!r}"] if strategy in ("group_by_length", "batch_rebalance") else []
    grouped += ["group_by_length=True"] if getattr(args, "group_by_length", False) is True else []
    if grouped:
        raise ValueError(
            f"HeteroTrainer cannot keep TrainingArguments({grouped[0]}): that sampler orders the samples by length "
            "for per-process batches of one size, while hetsplit cuts every global batch into the plan's uneven "
            "shares in a random or sequential order; leave it out (the default, 'random') or pass "
            "train_sampling_strategy='sequential'"
        )


def _launched_cpu_job(devices: str | None) -> bool:
    """Whether this process belongs to a launched multi-process job on the CPU (:func:`core.is_cpu_job`)."""
    try:
        rank, world = launched_world()
    except ValueError:
        return False  # reported, naming the variable, where the accelerator is made
    try:
        names = core.device_names(devices, world)
        device = parse_device(names[rank], check=False) if names is not None else None
    except ValueError:
        device = None  # a bad list is reported, naming it, where the accelerator is made
    return is_cpu_job(device, world)


def _run_on_cpu(args: Any, devices: str | None) -> None:
    """Make a multi-process job on the CPU one job: ``TrainingArguments(use_cpu=True)``, as it must be.

    Without it the Trainer's accelerate state on a machine without CUDA is a single process, so
    every process would train its own copy; the arguments' cached device set-up is redone.
    """
    if args is None or getattr(args, "use_cpu", True) or not _launched_cpu_job(devices):
        return
    args.use_cpu = True
    vars(args).pop("_setup_devices", None)
    _ = args.device  # set up again: accelerate's shared state is reset and made a multi-CPU job


class _StepTimes(transformers.TrainerCallback):
    """The split report's steps: each optimizer step timed from the Trainer's ``on_step_begin`` to its ``on_step_end``.

    Not start to start, which would hold the evaluation, saving and logging run between steps.
    """

    def __init__(self, trainer: HeteroTrainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        trainer._batches = 0
        # The first step says the split (process 0): the plan is made by then (the first loader or batch).
        trainer.accelerator.report.step(trainer.plan, trainer.accelerator.device_names)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.accelerator.report.step_end(self.trainer._batches)


class _TrainerAccelerator(HeteroAccelerator):
    """The HeteroAccelerator of a HeteroTrainer, whose loss weights each micro-batch itself (``training_step``)."""

    loss_weights_micro_batches = True
    who = "HeteroTrainer"
    zero_share = "empty"  # compute_loss runs a share of 0 on two real samples of its own, weighted 0
    steps_in_loader = False  # the Trainer fetches a whole accumulation window first: training_step is a step


def _zero_through(outputs: Any, loss: torch.Tensor) -> torch.Tensor:
    """A loss of exact 0 whose backward reaches every module the outputs came from, with exact-zero gradients.

    For FSDP2, whose gradients bypass :func:`zero_gradients`' parameter hooks: the loss over no items
    can be NaN, but the logits are finite and ``0 * logits.sum()`` backpropagates zeros.
    """
    leaves = [t for t in flatten(outputs)[0] if torch.is_tensor(t) and t.requires_grad and t is not loss]
    if not leaves:
        return _part(loss, 0.0)
    return _summed([t.sum() for t in leaves]) * 0.0


def _tied_as_one(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every name of one parameter of ``model`` (tied weights) holding one tensor, the first's."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = dict(state_dict)
    for group in names.values():
        present = [name for name in group if name in tied]
        for name in present[1:]:
            tied[name] = tied[present[0]]
    return tied


def _summed(losses: list[torch.Tensor]) -> torch.Tensor:
    """The sum of one or more losses (the first one itself when alone, as the Trainer's own step returns it)."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def _part(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """``loss * factor``; a process without items adds an exact 0 (its own mean over nothing is NaN)."""
    if factor:
        return loss * factor
    return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0


# Upstream scripts (run_clm.py) log "distributed training: ..." from their TrainingArguments before
# the Trainer exists (and fixes them, _run_on_cpu); accelerate's own switch, set on the import that
# is the script's one-line change, makes them right from the start (a value of the user's is kept).
if _launched_cpu_job(None):
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
