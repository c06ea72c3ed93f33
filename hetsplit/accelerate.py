"""HeteroAccelerator: Hugging Face accelerate with per-device shares from one hetsplit plan."""

from hetsplit.integrations.accelerate import HeteroAccelerator

__all__ = ["HeteroAccelerator"]
