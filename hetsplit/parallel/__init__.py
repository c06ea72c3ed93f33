"""Parallel: one process, many devices — scatter, run, combine, reduce (the modules: docs/how-it-works.md).

The public names are torch's ``torch.nn.parallel`` verbs for any devices and uneven shards.
"""

from .apply import parallel_apply
from .replicas import replicate
from .scatter_gather import gather, scatter

__all__ = ["gather", "parallel_apply", "replicate", "scatter"]
