"""Parallel: one process, many devices — scatter, run, combine, reduce.

``sizes`` (a batch's shares) → ``inputs`` (each replica's shard) → ``replicas`` (the
module per device) → ``apply`` (running them concurrently) → ``outputs`` (combining what
they return) → ``grads`` (their gradients, handed to the module through autograd), chained
by ``data_parallel`` (``HeteroDataParallel``); ``micro`` and ``local`` run a device's
share as micro-batches, ``paying`` says when the split does not pay. ``scatter_gather``
and ``reduce`` are the verbs of a hand-written loop.

The public names are torch's ``torch.nn.parallel`` verbs for any devices and uneven
shards, the module wrapper and the pieces of a hand-written loop.
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
