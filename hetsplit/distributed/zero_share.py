"""Zero share: what a rank the plan gives 0 samples runs each step, and how that stand-in is recognised.

``DataLoader(batch_size=0)`` is refused and many models cannot run 0 rows, yet every rank takes part
in every collective: such a rank runs :data:`STAND_IN` real samples, weighted 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..tree import batch_length, narrow

# How many real samples a zero share runs: two, not one, because BatchNorm cannot train on
# one sample ("Expected more than 1 value per channel": a ResNet's last stage on 28-pixel
# images, any BatchNorm1d), and the plain model never meets one where hetsplit served it
# (one, when the whole global batch is one sample).
STAND_IN = 2

# What a rank whose share is 0 is served: the stand-in (real samples weighted 0), or an empty batch.
ZERO_SHARES = ("sample", "empty")


def check_zero_share(zero_share: str) -> str:
    """``zero_share`` if it is one of :data:`ZERO_SHARES`, else a ``ValueError`` naming them."""
    if zero_share not in ZERO_SHARES:
        raise ValueError(f"zero_share={zero_share!r}: use one of {', '.join(map(repr, ZERO_SHARES))}")
    return zero_share


def stand_in_rows(rows: int) -> int:
    """How many rows the stand-in of a batch of ``rows`` holds (:data:`STAND_IN`, fewer in a smaller batch)."""
    return min(STAND_IN, rows)


def is_stand_in(planned: int | None, rows: int) -> bool:
    """Whether ``rows`` rows run where the plan gives ``planned`` are a zero share's stand-in (or nothing)."""
    return planned == 0 and rows <= STAND_IN


def stand_in_indices(order: Sequence[int], first: int, batch_size: int) -> list[int]:
    """The stand-in's indices in an epoch's ``order``: the first rows of the global batch starting at ``first``."""
    return list(order[first : first + stand_in_rows(batch_size)])


def stand_in_batch(batch: Any, dim: int = 0, *, rows: int | None = None) -> Any:
    """The stand-in cut from a batch in hand: its first rows (views; every tensor with ``dim``, or of ``rows``)."""
    n = batch_length(batch, dim) if rows is None else rows
    return narrow(batch, 0, stand_in_rows(n), dim=dim, rows=rows)


def stand_in_items(dataset: Any) -> list[Any]:
    """The stand-in drawn from a map-style dataset: its first items, for a framework that collates them itself."""
    return [dataset[i] for i in range(stand_in_rows(len(dataset)))]


class HandOff:
    """What the batch handed to the training loop last, on this thread, is: a stand-in, a short batch's share.

    Written by whoever hands a batch to the loop (not the sampler, which a loader's workers run
    ahead) and read by the gradient weighting in the forward.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def hand(self, stand_in: bool, short: list[int] | None = None) -> None:
        """Say whether the batch now handed out is a stand-in; ``short``: every rank's rows of a short global batch."""
        self._local.stand_in = stand_in
        self._local.short = short

    @property
    def stand_in(self) -> bool:
        """Whether the batch in hand is a stand-in."""
        return bool(getattr(self._local, "stand_in", False))

    @property
    def short(self) -> list[int] | None:
        """Every rank's rows of the short global batch in hand, or ``None`` (the plan's sizes)."""
        return getattr(self._local, "short", None)


# The hand-off between the loaders and the weighting (see the module's doc).
IN_HAND = HandOff()
