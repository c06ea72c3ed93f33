"""HeteroAccelerator: Hugging Face accelerate with per-device shares from one hetsplit plan."""

from hetsplit.integrations.versions import require

require("accelerate", "hetsplit.accelerate")  # before the framework is imported: one line, not its own error

from hetsplit.integrations.accelerate import HeteroAccelerator  # noqa: E402
from hetsplit.integrations.options import HeteroOptions  # noqa: E402

__all__ = ["HeteroAccelerator", "HeteroOptions"]
