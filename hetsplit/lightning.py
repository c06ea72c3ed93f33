"""Lightning strategies with each rank's share of every batch from one hetsplit plan: DDP, and FSDP2."""

from hetsplit.integrations.lightning.ddp import HeteroDDPStrategy
from hetsplit.integrations.lightning.model_parallel import HeteroModelParallelStrategy
from hetsplit.integrations.options import HeteroOptions

__all__ = ["HeteroDDPStrategy", "HeteroModelParallelStrategy", "HeteroOptions"]
