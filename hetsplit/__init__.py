"""hetsplit: uneven data parallelism across mixed devices (GPUs of different speeds and the CPU).

The package reads top to bottom as the pipeline: :mod:`~hetsplit.devices` (what runs;
:mod:`~hetsplit.emulation` slows devices down; :mod:`~hetsplit.timing` measures them)
→ :mod:`~hetsplit.profiler` (how fast; :mod:`~hetsplit.store` keeps it on disk) →
:mod:`~hetsplit.planning` (curves, the exact split, rebalancing) →
:mod:`~hetsplit.parallel` (one process: scatter, replicas, gather, gradients) and
:mod:`~hetsplit.distributed` (torchrun ranks) → :mod:`~hetsplit.apps` (the CLI, bench,
demo, pictures, built-in models). :mod:`~hetsplit.tree` walks nested batches for all.

The public API is ``__all__`` below, that of :mod:`hetsplit.parallel` (torch's
``nn.parallel`` verbs: ``scatter``, ``replicate``, ``parallel_apply``, ``gather``), of
:mod:`hetsplit.planning` (plans and profiles as data) and of :mod:`hetsplit.distributed`,
the integrations' classes (``hetsplit.lightning``, ``hetsplit.accelerate``,
``hetsplit.transformers``) and the built-in models (``hetsplit.models``); the other modules
are the package's own layers.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__
from .version import no_attribute as _no_attribute

# Public names are imported on first use (PEP 562), so `import hetsplit` and the CLI's
# start are instant: torch loads when a name that needs it is touched, after the CLI has
# set up its one-line handling of errors and Ctrl-C.
_WHERE = {
    "Device": ".devices",
    "emulate": ".devices",
    "parse_devices": ".devices",
    "HeteroDataParallel": ".parallel.data_parallel",
    "balanced_split": ".parallel.sizes",
    "StepOutOfMemory": ".parallel.micro",
    "count_tokens": ".parallel.outputs",
    "reduce_gradients": ".parallel.reduce",
    "run_parallel": ".parallel.apply",
    "Plan": ".planning.plan",
    "Profile": ".planning.profile",
    "Rebalancer": ".planning.rebalance",
    "solve": ".planning.solver",
    "profile": ".profiler",
}


# Modules reachable as attributes after a plain `import hetsplit`: `hetsplit.distributed` (the
# torchrun API), `hetsplit.parallel`, `hetsplit.planning` and `hetsplit.models` (the built-in
# models) for users; the rest are the package's own layers, importable but not public.
_MODULES = {"models": ".apps.models"}
_SUBPACKAGES = ("apps", "devices", "distributed", "emulation", "parallel", "planning", "profiler", "quick",
                "store", "timing", "tree")  # fmt: skip


# Names removed before the first release, and what replaces each: their AttributeError says so.
_REMOVED = {
    "parse_device": "hetsplit.parse_devices('cpu@0.25')[0]",
    "split_sizes": "hetsplit.solve(profile, batch_size).sizes, or hetsplit.balanced_split(batch, devices) to cut "
    "the batch itself",
    "discover": "the command 'hetsplit devices', which lists this machine's devices",
    "quick_profile": "hetsplit.profile(model, sample, devices)",
    "solver": "hetsplit.solve(profile, batch_size); its plan_from_sizes is hetsplit.planning.plan_from_sizes",
    # torch keeps its own in torch.nn.parallel, and so does hetsplit in hetsplit.parallel
    "scatter": "hetsplit.parallel.scatter(inputs, devices, sizes)",
    "gather": "hetsplit.parallel.gather(outputs, target)",
    "replicate": "hetsplit.parallel.replicate(network, devices)",
    "parallel_apply": "hetsplit.parallel.parallel_apply(modules, inputs, devices=devices)",
}


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES or name in _MODULES:
        return importlib.import_module(_MODULES.get(name, f".{name}"), __name__)
    where = _WHERE.get(name)
    if where is None:
        raise _no_attribute(__name__, name, _REMOVED)
    module = importlib.import_module(where, __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_MODULES) | set(_SUBPACKAGES))


if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from .apps import models as models
    from .devices import Device, emulate, parse_devices
    from .parallel.apply import run_parallel
    from .parallel.data_parallel import HeteroDataParallel
    from .parallel.micro import StepOutOfMemory
    from .parallel.outputs import count_tokens
    from .parallel.reduce import reduce_gradients
    from .parallel.sizes import balanced_split
    from .planning.plan import Plan
    from .planning.profile import Profile
    from .planning.rebalance import Rebalancer
    from .planning.solver import solve
    from .profiler import profile

# The public API: one process (the module wrapper, the hand-written loop's pieces, the error a
# step that runs out of memory raises), profiling and planning, and naming devices.
__all__ = [
    "__version__",
    "HeteroDataParallel",
    "StepOutOfMemory",
    "balanced_split",
    "run_parallel",
    "reduce_gradients",
    "count_tokens",
    "profile",
    "solve",
    "Profile",
    "Plan",
    "Rebalancer",
    "parse_devices",
    "emulate",
    "Device",
]
