"""HeteroAccelerator: Hugging Face accelerate with per-device shares from one hetsplit plan."""

from hetsplit.integrations.accelerate import HeteroAccelerator
from hetsplit.integrations.options import HeteroOptions

__all__ = ["HeteroAccelerator", "HeteroOptions"]
