"""hetsplit: uneven data parallelism across mixed devices (GPUs of different speeds and the CPU).

The package reads top to bottom as the pipeline: :mod:`~hetsplit.devices` (what runs;
:mod:`~hetsplit.emulation` slows devices down; :mod:`~hetsplit.timing` measures them)
→ :mod:`~hetsplit.profiler` (how fast; :mod:`~hetsplit.store` keeps it on disk) →
:mod:`~hetsplit.planning` (curves, the exact split, rebalancing) →
:mod:`~hetsplit.parallel` (one process: scatter, replicas, gather, gradients) and
:mod:`~hetsplit.distributed` (torchrun ranks) → :mod:`~hetsplit.apps` (the CLI, bench,
demo, pictures, built-in models). :mod:`~hetsplit.tree` walks nested batches for all.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# Public names are imported on first use (PEP 562), so `import hetsplit` and the CLI's
# start are instant: torch loads when a name that needs it is touched, after the CLI has
# set up its one-line handling of errors and Ctrl-C.
_WHERE = {
    "models": ".apps.models",
    "solver": ".planning.solver",
    "Device": ".devices",
    "DeviceInfo": ".devices",
    "discover": ".devices",
    "emulate": ".devices",
    "parse_device": ".devices",
    "parse_devices": ".devices",
    "HeteroDataParallel": ".parallel",
    "balanced_split": ".parallel",
    "count_tokens": ".parallel",
    "gather": ".parallel",
    "parallel_apply": ".parallel",
    "reduce_gradients": ".parallel",
    "run_parallel": ".parallel",
    "scatter": ".parallel",
    "split_sizes": ".parallel",
    "Curve": ".planning",
    "DeviceProfile": ".planning",
    "Measurement": ".planning",
    "Plan": ".planning",
    "PlanChange": ".planning",
    "Profile": ".planning",
    "Rebalancer": ".planning",
    "solve": ".planning",
    "profile": ".profiler",
    "quick_profile": ".quick",
    "ProfileFileError": ".store",
}


_SUBPACKAGES = ("apps", "devices", "distributed", "emulation", "parallel", "planning", "profiler", "quick",
                "store", "timing", "tree")  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:  # `hetsplit.planning.even_sizes` after a plain `import hetsplit`
        return importlib.import_module(f".{name}", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'hetsplit' has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if name in ("models", "solver") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_SUBPACKAGES))


if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from .apps import models
    from .devices import Device, DeviceInfo, discover, emulate, parse_device, parse_devices
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
    "emulate",
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
