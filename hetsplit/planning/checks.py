"""Checks: the numbers hetsplit reads from users and files — batch sizes, seconds, memory caps — validated once."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# No real batch comes near 2**40 samples; past it the solver's arithmetic (float64 sums
# of sample counts) would lose integers, and a typo would run for hours.
MAX_BATCH = 1 << 40
# A training step of over a million seconds (11 days) is a unit mistake, not a timing; the
# bound also keeps every predicted time (a slope times MAX_BATCH samples) finite.
MAX_SECONDS = 1e6
# The solver plans 10,000 devices in ~40 ms; a what-if set far beyond that is a typo.
MAX_DEVICES = 10_000


def batch_count(value: Any, what: str, *, minimum: int = 1) -> int:
    """``value`` as a batch size: an integer from ``minimum`` to :data:`MAX_BATCH` (no bool, no 16.7).

    Raises:
        ValueError: Naming ``what`` and the value (as do the checks below).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{what} must be a whole number of samples, got {type(value).__name__}: {value!r}")
    if isinstance(value, float | np.floating) and not (math.isfinite(value) and float(value).is_integer()):
        raise ValueError(f"{what} must be a whole number of samples, got {value!r}")
    count = int(value)
    if count < minimum or count > MAX_BATCH:
        raise ValueError(f"{what} must be between {minimum} and {MAX_BATCH:,} samples, got {value!r}")
    return count


def batch_size(value: Any, what: str) -> int:
    """``value`` as the batch a plan splits: an integer (no bool, no 16.0) from 1 to :data:`MAX_BATCH`.

    Raises:
        TypeError: On a value that is not an integer.
        ValueError: On an empty batch, or one beyond any machine.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}; an empty batch has nothing to split")
    return batch_count(value, what)


def seconds(value: Any, what: str) -> float:
    """``value`` as a measured time: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{what} must be a number of seconds, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"{what} must be positive, finite seconds (at most {MAX_SECONDS:g}), got {value!r}")
    return float(value)


def memory_cap(value: Any, what: str) -> int | None:
    """``value`` as a memory cap: ``None`` (unknown) or a whole number of samples >= 0."""
    if value is None:
        return None
    return batch_count(value, what, minimum=0)


def device_count(value: Any, what: str) -> int:
    """``value`` as a number of devices (copies): an integer from 1 to :data:`MAX_DEVICES`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{what} must be a whole number of devices, got {type(value).__name__}: {value!r}")
    if not 1 <= value <= MAX_DEVICES:
        raise ValueError(f"{what} must be between 1 and {MAX_DEVICES:,} devices, got {value:,}")
    return int(value)


def materialised(model: Any, where: str) -> None:
    """Refuse a model with parameters or buffers on the ``meta`` device (shapes, no data), before any work.

    ``where`` names who refuses it (``"hd.plan"``); the ValueError names the first such tensor.
    """
    named = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, t in named if t.is_meta]
    if on_meta:
        more = f" and {len(on_meta) - 1} more are" if len(on_meta) > 1 else " is"
        raise ValueError(
            f"{where}: the model's {on_meta[0]!r}{more} on the meta device (shapes without data); materialise "
            "the model first: model.to_empty(device='cpu') (or the device to train on), then initialise its weights "
            "(reset_parameters() or load_state_dict)"
        )
