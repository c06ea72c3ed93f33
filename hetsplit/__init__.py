"""hetsplit: uneven data parallelism across mixed devices (GPUs of different speeds and the CPU).

The package reads top to bottom as the pipeline: :mod:`~hetsplit.devices` (what runs;
:mod:`~hetsplit.emulation` slows devices down; :mod:`~hetsplit.timing` measures them)
→ :mod:`~hetsplit.profiler` (how fast; :mod:`~hetsplit.store` keeps it on disk) →
:mod:`~hetsplit.planning` (curves, the exact split, rebalancing) →
:mod:`~hetsplit.parallel` (one process: scatter, replicas, gather, gradients) and
:mod:`~hetsplit.distributed` (torchrun ranks) → :mod:`~hetsplit.apps` (the CLI, bench,
demo, pictures, built-in models). :mod:`~hetsplit.tree` walks nested batches for all.
"""

from .version import __version__  # isort: skip  (first: the modules below read it)

from .apps import models
from .devices import Device, DeviceInfo, discover, parse_device, parse_devices
from .parallel import (
    HeteroDataParallel,
    balanced_split,
    count_tokens,
    gather,
    parallel_apply,
    reduce_gradients,
    run_parallel,
    scatter,
    split_sizes,
)
from .planning import Curve, DeviceProfile, Measurement, Plan, PlanChange, Profile, Rebalancer, solve, solver
from .profiler import profile
from .quick import quick_profile
from .store import ProfileFileError

__all__ = [
    "__version__",
    "Curve",
    "Device",
    "DeviceInfo",
    "DeviceProfile",
    "HeteroDataParallel",
    "Measurement",
    "Plan",
    "PlanChange",
    "Profile",
    "ProfileFileError",
    "Rebalancer",
    "balanced_split",
    "count_tokens",
    "discover",
    "gather",
    "models",
    "parallel_apply",
    "parse_device",
    "parse_devices",
    "profile",
    "quick_profile",
    "reduce_gradients",
    "run_parallel",
    "scatter",
    "solve",
    "solver",
    "split_sizes",
]
