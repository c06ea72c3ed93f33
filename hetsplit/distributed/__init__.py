"""Distributed: heterogeneous torchrun ranks — one plan for all, per-rank shares, shard-weighted DDP gradients.

``_group`` (ranks, collectives that fail with one clear error) → ``rank_plan`` (each rank
profiles its device, rank 0 solves, DDP steps calibrate) → ``sampler`` (each rank's
share of every global batch; ``accumulate`` its micro-batches) → ``comm_hooks`` (gradients weighted by shard) →
``rebalance`` (online rebalancing across ranks); ``teardown`` waits at exit for gloo's workers.
"""

from ._group import DistributedError, guard
from .accumulate import micro_batches
from .comm_hooks import weight_gradients
from .rank_plan import plan
from .rebalance import DistributedRebalancer
from .sampler import HeteroDistributedSampler, data_loader
from .setup import init
from .teardown import drain_at_exit

# The public API of the torchrun path; the modules' other names are the package's own.
__all__ = [
    "init",
    "plan",
    "data_loader",
    "HeteroDistributedSampler",
    "weight_gradients",
    "micro_batches",
    "DistributedRebalancer",
    "guard",
    "DistributedError",
    "drain_at_exit",
]
