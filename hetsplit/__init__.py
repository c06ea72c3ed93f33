"""hetsplit: uneven data parallelism across mixed devices (GPUs of different speeds and the CPU).

The public API is ``__all__`` below and those of :mod:`hetsplit.parallel`, :mod:`hetsplit.planning`,
:mod:`hetsplit.distributed`, the integrations (``hetsplit.lightning``, ``hetsplit.accelerate``,
``hetsplit.transformers``) and ``hetsplit.models``; the package map is in docs/how-it-works.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__
from .version import no_attribute as _no_attribute

# The public API, each name with the module it lives in: the one list (``__all__`` is made from it;
# tests/test_layout.py checks the TYPE_CHECKING imports below against it). Names are imported on
# first use (PEP 562), so `import hetsplit` and the CLI's start are instant: torch loads when a name
# that needs it is touched, after the CLI has set up its one-line handling of errors and Ctrl-C.
_PUBLIC = {
    "HeteroDataParallel": ".parallel.data_parallel",
    "StepOutOfMemory": ".parallel.micro",
    "balanced_split": ".parallel.sizes",
    "run_parallel": ".parallel.apply",
    "reduce_gradients": ".parallel.reduce",
    "count_tokens": ".parallel.outputs",
    "profile": ".profiler",
    "solve": ".planning.solver",
    "Profile": ".planning.profile",
    "Plan": ".planning.plan",
    "Rebalancer": ".planning.rebalance",
    "parse_devices": ".devices",
    "emulate": ".devices",
    "Device": ".devices",
}
__all__ = ["__version__", *_PUBLIC]

# Modules reachable as attributes after a plain `import hetsplit`: `hetsplit.distributed` (the
# torchrun API), `hetsplit.parallel` (torch.nn.parallel's verbs), `hetsplit.planning` and
# `hetsplit.models` (the built-in models) for users; the rest are the package's own layers.
_MODULES = {"models": ".apps.models"}
_SUBPACKAGES = ("apps", "devices", "distributed", "emulation", "parallel", "planning", "profiler", "quick",
                "store", "timing", "tree")  # fmt: skip

# Documented names removed before the first release, and what replaces each: their AttributeError says so.
_REMOVED = {
    "parse_device": "hetsplit.parse_devices('cpu@0.25')[0]",
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
    where = _PUBLIC.get(name)
    if where is None:
        raise _no_attribute(__name__, name, _REMOVED)
    module = importlib.import_module(where, __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_MODULES) | set(_SUBPACKAGES))


if TYPE_CHECKING:  # what static tools see: the names of _PUBLIC, imported eagerly
    from .apps import models as models
    from .devices import Device as Device
    from .devices import emulate as emulate
    from .devices import parse_devices as parse_devices
    from .parallel.apply import run_parallel as run_parallel
    from .parallel.data_parallel import HeteroDataParallel as HeteroDataParallel
    from .parallel.micro import StepOutOfMemory as StepOutOfMemory
    from .parallel.outputs import count_tokens as count_tokens
    from .parallel.reduce import reduce_gradients as reduce_gradients
    from .parallel.sizes import balanced_split as balanced_split
    from .planning.plan import Plan as Plan
    from .planning.profile import Profile as Profile
    from .planning.rebalance import Rebalancer as Rebalancer
    from .planning.solver import solve as solve
    from .profiler import profile as profile
