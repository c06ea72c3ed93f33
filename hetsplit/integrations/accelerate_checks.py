"""HeteroAccelerator's checks: its arguments and accelerate's, refused before accelerate or a process group starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hetsplit.devices import device_list, parse_device
from hetsplit.distributed.setup import ENV_DEVICES

from .core import check_plan, device_names
from .options import HeteroOptions


def wants_fsdp2(accelerator_kwargs: Mapping[str, Any]) -> bool:
    """Whether accelerate will shard with FSDP2: an ``fsdp_plugin`` with ``fsdp_version=2``, or
    ``accelerate launch --use_fsdp --fsdp_version 2`` (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``)."""
    plugin = accelerator_kwargs.get("fsdp_plugin")
    if plugin is not None:
        return getattr(plugin, "fsdp_version", 1) == 2
    return _flag(os.environ.get("ACCELERATE_USE_FSDP")) and os.environ.get("FSDP_VERSION", "1").strip() == "2"


def check_arguments(
    options: HeteroOptions,
    weighting: str,
    accelerator_kwargs: Mapping[str, Any],
    world: int,
    *,
    who: str = "HeteroAccelerator",
    loss_weights_micro_batches: bool = False,
) -> list[str] | None:
    """Every argument checked before accelerate or a process group starts; the per-process device names.

    With ``loss_weights_micro_batches`` (HeteroTrainer's loss) ``weighting="none"`` takes a plan with micro-batches.
    """
    options.check(who, weighting)
    whole = f'{who}(weighting="none")' if weighting == "none" and not loss_weights_micro_batches else None
    check_plan(who, options.plan, world, whole_shares=whole)
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
    spec = options.device_list if options.device_list is not None else os.environ.get(ENV_DEVICES)
    if not spec:
        return None
    items = device_list(spec)
    if len(items) > 1 and world == 1:
        raise ValueError(
            f"devices {spec!r} lists {len(items)} devices, one per process, but this job runs 1 process "
            "('accelerate launch --cpu' starts one): start one process per device with "
            f"'accelerate launch --multi_gpu --num_processes {len(items)} ...' (also on a CPU-only machine), "
            f"'hetsplit launch --devices {spec} ...' or torchrun"
        )
    names = device_names(spec, world)
    assert names is not None  # spec is set
    kinds = sorted({parse_device(name, check=False).type for name in names})
    if fsdp2 and len(kinds) > 1:
        raise ValueError(
            f"FSDP2 shards the model over one kind of device, but devices {spec!r} mix {' and '.join(kinds)}: "
            "list devices of one kind (cuda:0,cuda:1 or cpu,cpu@0.25), or train with DDP (no fsdp_plugin)"
        )
    return names


def shard_on_cpu(state: Any, plugin: Any) -> None:
    """Make accelerate's state shard with ``plugin`` (FSDP2) in a multi-process CPU job, as it does on GPUs.

    accelerate drops the plugin under ``MULTI_CPU``, though FSDP2 runs over gloo and emulated devices must
    run the GPUs' path; from here on accelerate's own FSDP2 code prepares, saves and loads.
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
