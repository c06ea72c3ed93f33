"""Distributed: heterogeneous torchrun ranks — one plan for all, per-rank shares, shard-weighted DDP gradients.

``_group`` (ranks, collectives that fail with one clear error) → ``rank_plan`` (each rank
profiles its device, rank 0 solves, DDP steps calibrate) → ``sampler`` (each rank's
share of every global batch; ``accumulate`` its micro-batches) → ``comm_hooks`` (gradients weighted by shard) →
``rebalance`` (online rebalancing across ranks); ``teardown`` waits at exit for gloo's workers.
"""

from ._group import DistributedError, failure_message, guard, init_timeout, is_failure, verify_plan
from .accumulate import micro_batches
from .comm_hooks import WeightingState, scale_loss, weight_gradients
from .rank_plan import plan, rank_device
from .rebalance import DistributedRebalancer
from .sampler import HeteroBatchSampler, HeteroDistributedSampler, data_loader
from .setup import ENV_DEVICES, init
from .teardown import drain_at_exit

__all__ = [
    "ENV_DEVICES",
    "DistributedError",
    "DistributedRebalancer",
    "HeteroBatchSampler",
    "HeteroDistributedSampler",
    "WeightingState",
    "data_loader",
    "drain_at_exit",
    "failure_message",
    "guard",
    "init",
    "init_timeout",
    "is_failure",
    "micro_batches",
    "plan",
    "rank_device",
    "scale_loss",
    "verify_plan",
    "weight_gradients",
]
