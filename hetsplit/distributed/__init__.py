"""Distributed: heterogeneous torchrun ranks — one plan for all, per-rank shares, shard-weighted DDP gradients.

``setup`` (the launcher's environment, this rank's device, the process group) → ``_group``
(ranks, collectives that fail with one clear error) → ``rank_plan`` (each rank profiles its
device, rank 0 solves, ``calibrate`` runs real steps; ``report`` says the split and its predicted
step) → ``sampler`` (each rank's share of every global batch, from a dataset or from a
global batch in hand; ``same_batch`` checks that batch is the same on every rank; ``zero_share`` what
a rank with a share of 0 runs; ``accumulate`` its micro-batches) → ``comm_hooks`` (gradients
weighted by shard) → ``rebalance`` (online rebalancing across ranks); ``teardown`` waits at exit for gloo's workers;
``restart`` re-plans and resumes on torchrun's elastic restarts.
"""

from ..version import no_attribute
from ._group import DistributedError, guard
from .accumulate import micro_batches
from .comm_hooks import weight_gradients
from .rank_plan import plan
from .rebalance import DistributedRebalancer
from .report import SplitReport
from .restart import Checkpoint
from .sampler import HeteroDistributedSampler, data_loader, local_batch, shared_batch
from .setup import init
from .teardown import drain_at_exit

# The public API of the torchrun path; the modules' other names are the package's own.
__all__ = [
    "init",
    "plan",
    "data_loader",
    "local_batch",
    "shared_batch",
    "HeteroDistributedSampler",
    "weight_gradients",
    "micro_batches",
    "DistributedRebalancer",
    "SplitReport",
    "guard",
    "DistributedError",
    "drain_at_exit",
    "Checkpoint",
]

# Documented names removed before the first release, and what replaces each: their AttributeError says so.
_REMOVED = {
    "rank_device": "dev = hd.init(), which returns this rank's device",
    "scale_loss": "hd.weight_gradients(ddp, plan), which weights each rank's gradients by its share",
    "HeteroBatchSampler": "hd.data_loader(dataset, plan) or hd.HeteroDistributedSampler",
    "init_timeout": "dev = hd.init(timeout=120), which starts the process group with that timeout",
    "failure_message": "hd.guard() around the training loop, which ends a failed rank with one line naming the rank "
    "that failed (its error is hd.DistributedError)",
    "verify_plan": "nothing: hd.weight_gradients and hd.DistributedRebalancer check every rank holds the same plan",
}


def __getattr__(name: str) -> object:
    raise no_attribute(__name__, name, _REMOVED)
