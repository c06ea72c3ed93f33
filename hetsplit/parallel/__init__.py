"""Parallel: one process, many devices — scatter, run, combine, reduce.

``sizes`` (a batch's shares) → ``scatter_gather`` (moving shards) → ``replicas`` (the
module per device, its parameters through autograd) → ``apply`` (running them
concurrently) → ``outputs`` (combining what they return, with backward fanned out) →
``grads`` (each replica's gradients, handed to the module through autograd) →
``data_parallel`` (``HeteroDataParallel``, chaining those steps); ``writes`` gives each
shard a version counter of its own and passes writes into the inputs back, ``compiled``
carries a module's ``torch.compile`` over to its replicas. ``reduce`` is the weighted
all-reduce for hand-written loops.

The public names below are torch's ``torch.nn.parallel`` verbs for any devices and uneven
shards (``scatter``, ``replicate``, ``parallel_apply``, ``gather``), the module wrapper and
the pieces of a hand-written loop; ``hetsplit`` re-exports the latter.
"""

from .apply import parallel_apply, run_parallel
from .data_parallel import HeteroDataParallel
from .micro import StepOutOfMemory
from .outputs import count_tokens
from .reduce import reduce_gradients
from .replicas import replicate
from .scatter_gather import gather, scatter
from .sizes import balanced_split

__all__ = [
    "HeteroDataParallel",
    "StepOutOfMemory",
    "balanced_split",
    "count_tokens",
    "gather",
    "parallel_apply",
    "reduce_gradients",
    "replicate",
    "run_parallel",
    "scatter",
]
