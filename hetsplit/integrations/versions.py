"""Versions: the oldest release of each framework its integration is tested on, refused in one line below it."""

from __future__ import annotations

import importlib.metadata

from hetsplit.version import release

# As pyproject.toml declares them (a test keeps the two equal); each found by the floor pass of
# .ci/run: lightning 2.3 brought ModelParallelStrategy; the Trainer of transformers 5.10.1 counts
# the tokens of a batch as HeteroTrainer's exact weighting expects (5.2-5.9 differ by 2e-3).
MINIMUM = {"lightning": "2.3", "accelerate": "1.15", "transformers": "5.10.1"}


def require(package: str, who: str) -> None:
    """Refuse, before ``who`` imports ``package``, an installed release older than :data:`MINIMUM`'s.

    Raises:
        ImportError: Naming the installed and the needed version, and the command that fixes it.
    """
    need = MINIMUM[package]
    try:
        have = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"{who} needs {package} >= {need}, which is not installed: pip install '{package}>={need}'"
        ) from None
    if release(have) < release(need):
        raise ImportError(
            f"{who} needs {package} >= {need}, but {package} {have} is installed: pip install '{package}>={need}'"
        )
