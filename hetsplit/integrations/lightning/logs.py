"""``self.log`` replaced for the length of a step: a zero share's stand-in step, a micro-batch's."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl

# How self.log binds its arguments: what a replacement reads its options by.
LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_NOT_SET = object()


@contextlib.contextmanager
def stand_in_logging(module: pl.LightningModule, rows: int) -> Iterator[None]:
    """``self.log`` in a zero share's stand-in step: nothing in what is synced, the rank's own mean elsewhere.

    Unsynced values mean over the ``rows`` stand-in samples, so a rank without real samples never logs
    NaN (0 of 0) into what the user monitors (``EarlyStopping(monitor=...)`` on every rank).
    """
    plain = module.log

    def log(*args: Any, **kwargs: Any) -> None:
        options = dict(LOG_SIGNATURE.bind(module, *args, **kwargs).arguments)
        options.pop("self", None)
        if options.get("sync_dist", False):
            options["batch_size"] = 0
        elif options.get("batch_size") is None:
            options["batch_size"] = rows
        plain(**options)

    with log_replaced(module, log):
        yield


@contextlib.contextmanager
def log_replaced(module: pl.LightningModule, log: Callable[..., None]) -> Iterator[None]:
    """``module.log`` is ``log`` inside (an instance attribute over the class's method; removed after)."""
    # setattr, as mypy rightly refuses to assign a method.
    own = vars(module).get("log", _NOT_SET)
    setattr(module, "log", log)  # noqa: B010
    try:
        yield
    finally:
        if own is _NOT_SET:
            delattr(module, "log")
        else:
            setattr(module, "log", own)  # noqa: B010
