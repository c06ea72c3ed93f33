"""HeteroDDPStrategy: a Lightning DDP strategy with each rank's share of every batch from one hetsplit plan."""

from hetsplit.integrations.lightning import HeteroDDPStrategy

__all__ = ["HeteroDDPStrategy"]
