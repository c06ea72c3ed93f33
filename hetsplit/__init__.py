"""hetsplit: uneven data parallelism across mixed devices (GPUs of different speeds and the CPU).

The pipeline, one module a step: :mod:`~hetsplit.devices` (what runs) →
:mod:`~hetsplit.profiler` (how fast, into :mod:`~hetsplit.profiles`) →
:mod:`~hetsplit.costmodel` (step-time curves) → :mod:`~hetsplit.solver` (the split) →
:mod:`~hetsplit.scatter_gather` (moving the shards) → :mod:`~hetsplit.apply` and
:mod:`~hetsplit.parallel` (training in one process, gradients via :mod:`~hetsplit.reduce`)
→ :mod:`~hetsplit.distributed` (torchrun). :mod:`~hetsplit.store` keeps profiles on
disk; :mod:`~hetsplit.bench` measures; :mod:`~hetsplit.cli` sits on top.
"""

__version__ = "0.1.0"

from . import models
from .costmodel import Curve
from .profiles import DeviceProfile, Measurement, Profile
from .devices import Device, DeviceInfo, discover, parse_device, parse_devices
from .apply import parallel_apply
from .parallel import HeteroDataParallel
from .profiler import calibrate, profile
from .rebalance import PlanChange, Rebalancer
from .reduce import reduce_gradients
from .scatter_gather import gather, scatter
from .solver import Plan, solve
from .split import balanced_split, split_sizes
from .store import ProfileFileError

__all__ = [
    "__version__",
    "Curve",
    "Device",
    "HeteroDataParallel",
    "DeviceInfo",
    "DeviceProfile",
    "Measurement",
    "Plan",
    "PlanChange",
    "Profile",
    "ProfileFileError",
    "Rebalancer",
    "balanced_split",
    "calibrate",
    "discover",
    "gather",
    "models",
    "parse_device",
    "parallel_apply",
    "parse_devices",
    "profile",
    "reduce_gradients",
    "scatter",
    "solve",
    "split_sizes",
]
