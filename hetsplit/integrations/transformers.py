"""HeteroTrainer: the Hugging Face Trainer with per-process shares from one hetsplit plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from hetsplit.planning import Plan, Profile

from .accelerate import HeteroAccelerator
from .collectives import samples_in

__all__ = ["HeteroTrainer"]


class HeteroTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose processes each train on their own share of every global batch.

    A one-line change for a Trainer script: ``HeteroTrainer(...)`` instead of
    ``Trainer(...)``. The global batch is kept (processes × ``per_device_train_batch_size``,
    as the Trainer counts it); each process gets the share one hetsplit plan gives its
    device (profiled on every process at the first training loader, or ``plan=``), and
    every step equals a step on the whole global batch:

    - Each process's loss is made its part of the global loss, ``world * S_r / N``
      (``S_r`` its summed per-item loss, ``N`` the items of the global batch: label
      tokens that are not ``-100``, shifted by one for a causal LM, else samples), so
      DDP's plain mean is the global mean. Where the Trainer already normalises by the
      global item count (``num_items_in_batch`` with ``average_tokens_across_devices``,
      the default) its loss is that already and is left alone; a loss normalised by the
      process's own count (that flag off), or the model's own mean over the process's
      items, is rescaled by its share of the items. Padded token losses are thus
      weighted by tokens, and gradient accumulation keeps the Trainer's meaning.
    - Evaluation: the same rule makes the Trainer's equal-weight mean over processes the
      global mean; predictions and labels are gathered with uneven shards, every sample
      once (``gather_for_metrics`` drops the padding of a last incomplete batch).

    Launch one process per device: ``hetsplit launch --devices cpu,cpu@0.25 train.py``,
    torchrun, or ``accelerate launch --multi_gpu --num_processes N``.

    Args:
        *args: As for ``transformers.Trainer``.
        devices: One device per process (default: ``$HETSPLIT_DEVICES``, else the Trainer's).
        plan: A :class:`~hetsplit.Plan` with one share per process.
        profile: This process's :class:`~hetsplit.Profile`, instead of timing the model.
        plan_kwargs: Passed to :func:`hetsplit.distributed.plan` (see :class:`HeteroAccelerator`).
        **trainer_kwargs: As for ``transformers.Trainer``.

    Raises:
        ValueError: If a process would run several GPUs (``nn.DataParallel``), or this
            process's device is not where the Trainer puts the model.

    Example:
        >>> trainer = HeteroTrainer(model=model, args=args, train_dataset=train)  # was: Trainer(...)
        >>> trainer.train()
    """

    def __init__(
        self,
        *args: Any,
        devices: str | None = None,
        plan: Plan | None = None,
        profile: Profile | None = None,
        plan_kwargs: Mapping[str, Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        self._hetero_kwargs = {"devices": devices, "plan": plan, "profile": profile, "plan_kwargs": plan_kwargs}
        super().__init__(*args, **trainer_kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(
                f"this process sees {self.args.n_gpu} GPUs and the Trainer would run nn.DataParallel over them; "
                "HeteroTrainer runs one process per device: start them with 'hetsplit launch --devices ...' or torchrun"
            )
        mine, trainers = self.accelerator.device, torch.device(self.args.device)
        if mine.type != trainers.type:
            raise ValueError(
                f"this process's device is {mine} but the Trainer places the model on {trainers}; "
                f"pass TrainingArguments(use_cpu={mine.type == 'cpu'}) on this process"
            )

    @property
    def hetero_plan(self) -> Plan | None:
        """The plan in force (``None`` until the first training loader is made)."""
        return getattr(self.accelerator, "hetero_plan", None)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # Kept to build the HeteroAccelerator with exactly the Trainer's own settings.
        self._accelerator_args = super()._build_accelerator_args(**kwargs)
        return self._accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator set-up, with a :class:`HeteroAccelerator` in place of ``Accelerator``."""
        super().create_accelerator_and_postprocess()
        # "none": the loss itself is made each process's part of the global loss (compute_loss),
        # which is exact for padded token losses too, where weighting by samples is not.
        self.accelerator = HeteroAccelerator(weighting="none", **self._hetero_kwargs, **self._accelerator_args)
        self.gather_function = self.accelerator.gather_for_metrics

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, cut into this process's shares (the model is profiled first if needed)."""
        self.accelerator.model_to_profile = self.model
        return super().get_train_dataloader()

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The Trainer's loss, as this process's part of the global batch's loss (``world * S_r / N``)."""
        if samples_in(inputs) == 0:
            return self._empty_share_loss(model, inputs, return_outputs, num_items_in_batch)
        items = _items(inputs, getattr(self, "_loss_shifts_labels", False))
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        world = self.accelerator.num_processes
        counted = num_items_in_batch is not None and (self.model_accepts_loss_kwargs or self.compute_loss_func)
        if world == 1 or (counted and self.args.average_tokens_across_devices):
            return result  # already sum / global items × world: the Trainer counted every process's items
        if counted:  # sum / this process's items over the accumulation window
            items = (
                float(num_items_in_batch.sum()) if torch.is_tensor(num_items_in_batch) else float(num_items_in_batch)
            )
        loss, outputs = result if return_outputs else (result, None)
        total = torch.tensor([float(items)], dtype=torch.float64, device=loss.device)
        dist.all_reduce(total)  # the global batch's items (in this step or window)
        loss = _part(loss, world * items / total.item() if total.item() else 0.0)
        return (loss, outputs) if return_outputs else loss

    def _empty_share_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool, num_items: torch.Tensor | int | None
    ) -> Any:
        """A share of 0 samples: one real sample through the model, weighted 0, and outputs of 0 rows.

        Many models cannot run a batch of 0 rows (attention reshapes fail), yet DDP needs
        every process in every backward: the process runs one sample of the data set
        and adds exactly 0 to the gradients and the loss.
        """
        dataset = self.train_dataset if model.training or self.eval_dataset is None else self.eval_dataset
        if isinstance(dataset, Mapping):  # several named evaluation sets: any sample will do
            dataset = next(iter(dataset.values()))
        filler = self._prepare_inputs(self.data_collator([dataset[0]]))
        kept = {k: v for k, v in filler.items() if k in inputs}
        result = super().compute_loss(model, kept, return_outputs=return_outputs, num_items_in_batch=num_items)
        loss, outputs = result if return_outputs else (result, None)
        loss = _part(loss, 0.0)
        if not return_outputs:
            return loss
        return loss, type(outputs)({k: v[:0] if torch.is_tensor(v) and v.dim() else v for k, v in outputs.items()})


def _items(inputs: Mapping[str, Any], shifted: bool) -> int:
    """Items a mean loss averages over in ``inputs``: label tokens that count (not -100), else samples."""
    labels = inputs.get("shift_labels", inputs.get("labels")) if isinstance(inputs, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        if shifted and "shift_labels" not in inputs and labels.dim() > 1:
            labels = labels[..., 1:]
        return int(labels.ne(-100).sum())
    return samples_in(inputs) or 0


def _part(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """``loss * factor``; a process without items adds an exact 0 (its own mean over nothing is NaN)."""
    if factor:
        return loss * factor
    return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
