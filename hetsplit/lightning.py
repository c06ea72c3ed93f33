"""Lightning strategies with each rank's share of every batch from one hetsplit plan: DDP, and FSDP2."""

from hetsplit.integrations.versions import require

require("lightning", "hetsplit.lightning")  # before the framework is imported: one line, not its own error

from hetsplit.integrations.lightning.ddp import HeteroDDPStrategy  # noqa: E402
from hetsplit.integrations.lightning.model_parallel import HeteroModelParallelStrategy  # noqa: E402
from hetsplit.integrations.options import HeteroOptions  # noqa: E402

__all__ = ["HeteroDDPStrategy", "HeteroModelParallelStrategy", "HeteroOptions"]
