"""Core: the decisions every integration (Lightning, accelerate, the HF Trainer) shares, made in one place.

Each framework keeps only its own wiring; what a rank's device is called, whether a
multi-process job runs on the CPU, which DataLoader settings a re-cut loader keeps and
how an emulated device is throttled are decided here, so the three cannot drift apart.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch.utils.data import DataLoader

from hetsplit.devices import Device
from hetsplit.distributed.setup import device_name

__all__ = [
    "CARRIED",
    "carried_settings",
    "device_name",
    "is_cpu_job",
    "launched_world",
    "throttle",
]

# DataLoader settings a re-cut loader keeps from the user's (the sampler, batch size and
# drop_last are hetsplit's; collate_fn is passed on its own, as the zero share needs it).
CARRIED = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def launched_world() -> tuple[int, int]:
    """``(rank, world)`` of the job the launcher started (torchrun's ``RANK``/``WORLD_SIZE``; 0, 1 alone).

    Raises:
        ValueError: If ``RANK`` or ``WORLD_SIZE`` is not an integer (naming it).
    """
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        raw = os.environ.get(name, default)
        try:
            values[name] = int(raw)
        except ValueError as e:
            raise ValueError(f"{name} must be an integer, got {raw!r}; start the job with torchrun") from e
    return values["RANK"], values["WORLD_SIZE"]


def is_cpu_job(device: Device | None, world: int) -> bool:
    """Whether this rank of a multi-process job runs on the CPU: its device is one, or, without a
    device list, the machine has no CUDA.

    The frameworks run such a job as one multi-process CPU job only when told (accelerate's
    ``cpu=True``, the Trainer's ``use_cpu=True``); otherwise each process believes it is
    alone and trains its own copy. The integrations tell them.
    """
    if world <= 1:
        return False
    return device.type == "cpu" if device is not None else not torch.cuda.is_available()


def carried_settings(loader: DataLoader) -> dict[str, Any]:
    """The settings of ``loader`` a loader re-cut into hetsplit's shares keeps (:data:`CARRIED`)."""
    carried = {k: getattr(loader, k) for k in CARRIED if hasattr(loader, k)}
    if carried.get("num_workers", 0) > 0:
        carried["prefetch_factor"] = loader.prefetch_factor
    else:  # DataLoader refuses these without workers
        carried.pop("persistent_workers", None)
    return carried


def throttle(device: Device | None) -> contextlib.AbstractContextManager[Any]:
    """Run the block at ``device``'s emulated speed (a real device: no change).

    By process CPU time: waiting for the other ranks in a collective is not work, so it
    is not slowed down as if it were.
    """
    if device is None or not device.emulated:
        return contextlib.nullcontext()
    return device.throttle(cpu_time=True)
