"""Restart: torchrun's elastic restarts — the plan re-solved from stored curves, the run resumed where it stopped."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..devices import Device, DeviceInfo
from ..files import read_json, write_json
from ..hardware import cpu_name
from ..planning.curve import Curve
from ..planning.plan import Plan
from ..planning.profile import Profile
from ..planning.records import DeviceProfile, Measurement
from ._group import _place, all_gather, group_info
from .rank_plan import plan as solve_plan
from .sampler import HeteroDistributedSampler

_CURVES = "curves.json"


def _key(device: Device) -> str:
    """A device's curve's name: the device and its hardware (``cuda:0`` is another GPU on another node)."""
    return f"{device.name} {torch.cuda.get_device_name(device.index) if device.type == 'cuda' else cpu_name()}"


class Checkpoint:
    """A run's checkpoints in one folder, for ``torchrun --nnodes MIN:MAX --max-restarts N``.

    Each restart is a new world: :meth:`plan` solves it from the devices' curves stored
    here by an earlier start (no profiling, no calibration: 0.1-0.3 s on 1-3 CPU ranks,
    where profiling took 5-20 s), :meth:`load` restores model, optimizer and the sampler's
    global-batch position, and :meth:`save` writes them with DCP. The global batch is the
    plan's, whatever the world. docs/elastic.md ("torchrun restarts").

    Args:
        directory: The folder, shared by every node (DCP writes each rank's shards there).
        keep: Checkpoints kept (older ones are deleted after a save).
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        self.directory, self.keep = Path(directory), keep
        self.stored = False  # whether the last plan() came from stored curves

    @property
    def latest(self) -> Path | None:
        """The newest complete checkpoint (a ``step-N`` folder: only renamed there once whole), or ``None``."""
        done = sorted(self.directory.glob("step-*"), key=lambda p: int(p.name[5:]))
        return done[-1] if done else None

    def plan(self, model: torch.nn.Module, sample: Any, batch_size: int, *, device: Device, **kwargs: Any) -> Plan:
        """:func:`~.rank_plan.plan` for this world: from stored curves when every rank's device has one.

        Otherwise (a first start, or a device never seen) every rank profiles as ``hd.plan``
        does with ``kwargs``; the new plan's curves are stored for the next restart.

        Raises:
            As :func:`~.rank_plan.plan`.
        """
        group = kwargs.get("group")
        path = self.directory / _CURVES
        stored = read_json(path, "curves")["curves"] if path.exists() else {}
        keys = all_gather(_key(device), "looking up the stored curves", group)  # every rank's, in rank order
        self.stored = all(k in stored for k in keys)
        if self.stored:
            curve = Curve.from_dict(stored[_key(device)])
            knots = [Measurement(int(b), [t]) for b, t in zip(curve.batch, curve.seconds)]
            info = DeviceInfo(name=device.name, kind=device.type, description="stored curve")
            entry = DeviceProfile(info, knots, curve, memory_cap=curve.memory_cap)
            kwargs = {**kwargs, "profile": Profile([entry], source="stored"), "calibrate": 0}
        result = solve_plan(model, sample, batch_size, device=device, **kwargs)
        if group_info(group)[0] == 0 and result.curves:
            stored.update({k: c.to_dict() for k, c in zip(keys, result.curves)})
            write_json(path, "curves", {"curves": stored})
        return result

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, group: Any = None) -> Path:
        """Write model, optimizer and ``step`` (global batches done) as ``step-N`` (collective).

        Every rank writes its shards into a hidden folder; rank 0 renames it once all are
        done, so a node that dies mid-save leaves the previous checkpoint the newest whole one.

        Returns:
            The checkpoint's folder.
        """
        msd, osd = get_state_dict(model, optimizer)
        final = self.directory / f"step-{step}"
        tmp = self.directory / f".step-{step}.tmp"
        rank = _place(group)[0] or 0  # one process without a group: rank 0
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died before
        if dist.is_initialized():
            dist.barrier(group)  # no rank writes into the folder before that one is gone
        dcp_save({"model": msd, "optim": osd, "step": step}, checkpoint_id=tmp, process_group=group)
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(self.directory.glob("step-*"), key=lambda p: int(p.name[5:]))[: -self.keep]:
                shutil.rmtree(old.rename(old.with_name(f".{old.name}.old")), ignore_errors=True)
        if dist.is_initialized():
            dist.barrier(group)  # no rank starts the next save before this one is named
        return final

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: HeteroDistributedSampler | None = None,
        *,
        group: Any = None,
    ) -> int:
        """Restore the newest checkpoint, whatever world wrote it, and put ``sampler`` at its global batch.

        Returns:
            The step to train next (global batches done), 0 when there is no checkpoint.
        """
        latest = self.latest
        if latest is None:
            return 0
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
        dcp_load(state, checkpoint_id=latest, process_group=group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if sampler is not None:
            sampler.resume(step)
        return step
