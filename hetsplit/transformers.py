"""HeteroTrainer: the Hugging Face Trainer with each process's share of every batch from one hetsplit plan."""

from hetsplit.integrations.versions import require

require("transformers", "hetsplit.transformers")  # before the framework is imported: one line, not its own error

from hetsplit.integrations.options import HeteroOptions  # noqa: E402
from hetsplit.integrations.transformers import HeteroTrainer  # noqa: E402

__all__ = ["HeteroTrainer", "HeteroOptions"]
