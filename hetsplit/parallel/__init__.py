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
shards; the module wrapper and the pieces of a hand-written loop are ``hetsplit``'s own
(``hetsplit.HeteroDataParallel``, ``hetsplit.run_parallel``, ...).
"""

from .apply import parallel_apply
from .replicas import replicate
from .scatter_gather import gather, scatter

__all__ = ["gather", "parallel_apply", "replicate", "scatter"]
