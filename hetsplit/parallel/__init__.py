"""Parallel: one process, many devices — scatter, run, combine, reduce.

``sizes`` (a batch's shares) → ``scatter_gather`` (moving shards) → ``replicas`` (a
copy of the module per device) → ``apply`` (running them concurrently) → ``outputs``
(combining what they return, with backward fanned out) → ``reduce`` (gradients into
the module) → ``data_parallel`` (``HeteroDataParallel``, chaining those steps).
"""

from .apply import parallel_apply, run_parallel
from .data_parallel import HeteroDataParallel
from .outputs import count_tokens
from .reduce import accumulate_gradients, reduce_gradients, shard_weights
from .scatter_gather import gather, scatter
from .sizes import balanced_split, default_profile, split_sizes

__all__ = [
    "HeteroDataParallel",
    "accumulate_gradients",
    "balanced_split",
    "count_tokens",
    "default_profile",
    "gather",
    "parallel_apply",
    "reduce_gradients",
    "run_parallel",
    "scatter",
    "shard_weights",
    "split_sizes",
]
