"""HeteroTrainer: the Hugging Face Trainer with each process's share of every batch from one hetsplit plan."""

from hetsplit.integrations.options import HeteroOptions
from hetsplit.integrations.transformers import HeteroTrainer

__all__ = ["HeteroTrainer", "HeteroOptions"]
