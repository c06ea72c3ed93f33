"""Setup: one process per device — this rank's device, and a process group whose backend fits the mix."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..devices import Device, DeviceLike, device_list, device_name, parse_device
from ._group import group_info, init_timeout
from .teardown import drain_at_exit

# `hetsplit launch` puts the job's device list here, one device per global rank.
ENV_DEVICES = "HETSPLIT_DEVICES"


class LaunchEnv(NamedTuple):
    """This process's place in the job, as the launcher (torchrun, ``hetsplit launch``) set it."""

    rank: int
    world: int
    local_rank: int


def launch_env(*, required: bool = False) -> LaunchEnv:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from torchrun's environment: the one reader of them.

    Without ``required`` a process started alone is rank 0 of 1; a value that is not an integer,
    or a missing one with ``required``, is a ``ValueError``.
    """
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if required and missing:
        raise ValueError(
            f"RANK and WORLD_SIZE are not set (missing: {', '.join(missing)}); start the script with "
            "'hetsplit launch' or torchrun"
        )
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        raw = os.environ.get(name, default)
        try:
            values[name] = int(raw)
        except ValueError as e:
            raise ValueError(f"{name} must be an integer, got {raw!r}; start the job with torchrun") from e
    return LaunchEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


def rank_devices(devices: str | Sequence[DeviceLike], world: int) -> list[str]:
    """The per-rank device list (``"cuda:0,cuda:1,cpu"`` or a list), one canonical name per rank: the one rule.

    Raises:
        ValueError: If the list is empty, malformed, or its length is not ``world``.
    """
    items = device_list(devices) if isinstance(devices, str) else list(devices)
    names = [parse_device(device_name(s), check=False).name for s in items]
    if not names:
        raise ValueError(f"no devices in {devices!r}; list one device per process, e.g. 'cuda:0,cuda:1,cpu'")
    if len(names) != world:
        raise ValueError(
            f"{len(names)} device{'' if len(names) == 1 else 's'} {names} for {world} processes; "
            "list exactly one device per process "
            "(repeat a device to run several processes on it, e.g. 'cpu,cpu@0.25')"
        )
    return names


def rank_device(devices: str | Sequence[DeviceLike], rank: int | None = None, *, world: int | None = None) -> str:
    """This rank's device of :func:`rank_devices` (``"cuda:0,cpu@0.25"`` gives rank 1 ``cpu@0.25``).

    ``rank`` and ``world`` default to the process group's, else torchrun's: it works before any rendezvous.

    Raises:
        ValueError: As :func:`rank_devices`, or if the rank or world size cannot be found.
    """
    if rank is None or world is None:
        if dist.is_available() and dist.is_initialized():
            here, size = group_info(None)
        else:
            try:
                here, size, _ = launch_env(required=True)
            except ValueError as e:
                raise ValueError(f"no process group: {e}, or pass rank= and world=") from e
        rank = here if rank is None else rank
        world = size if world is None else world
    names = rank_devices(devices, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is out of range for {world} ranks")
    return names[rank]


def choose_backend(devices: list[str]) -> str:
    """``"nccl"`` when every rank is a distinct CUDA GPU (and NCCL is built in), else ``"gloo"``.

    NCCL moves only CUDA tensors, and refuses two ranks on one GPU ("invalid usage" on an H200).
    """
    parsed = [parse_device(d, check=False) for d in devices]
    all_gpu = all(d.type == "cuda" for d in parsed)
    named = [d.index for d in parsed if d.type == "cuda" and d.index is not None]  # bare "cuda": one per rank
    shared = len(set(named)) < len(named)
    return "nccl" if all_gpu and not shared and dist.is_available() and dist.is_nccl_available() else "gloo"


def init(
    timeout: float | None = None, *, devices: str | Sequence[DeviceLike] | None = None, backend: str | None = None
) -> Device:
    """Join the job started by ``hetsplit launch`` (or torchrun) on this rank's own device.

    Starts the default process group; run each step's work under ``device.throttle()``.

    Args:
        timeout: Seconds before a collective waiting for a dead or hung rank fails (default: torch's).
        devices: The per-rank device list, overriding ``$HETSPLIT_DEVICES`` (``hetsplit launch`` sets it);
            or this node's, one per local rank (``--nnodes MIN:MAX``; the backend then goes by them).
        backend: Force a backend (``"gloo"``, ``"nccl"``) instead of choosing by the mix.

    Returns:
        This rank's :class:`~hetsplit.Device`.

    Raises:
        ValueError: Without a device list or torchrun's environment, with a list whose
            length is not the world size, or a device this machine lacks; before the
            process group is created.
    """
    spec = devices if devices is not None else os.environ.get(ENV_DEVICES)
    if not spec:
        raise ValueError(
            f"no device list: start the job with 'hetsplit launch --devices ...', or pass devices= "
            f"(or set ${ENV_DEVICES}) to list one device per rank"
        )
    rank, world, local_rank = launch_env(required=True)
    # Under torchrun's --nnodes MIN:MAX the world is whichever nodes are present: each node lists its own devices.
    count = len(device_list(spec) if isinstance(spec, str) else spec)
    node = count == int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world
    names = rank_devices(spec, count if node else world)
    device = parse_device(names[local_rank if node else rank])  # this machine must have it
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
    backend = backend or choose_backend(names)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=init_timeout(timeout) if timeout is not None else None)
    drain_at_exit()  # at exit, let gloo's workers finish with the last collective first (see teardown)
    return device
