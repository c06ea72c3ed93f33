"""Backward OOM: an out-of-memory error in this rank's backward is noted for the other ranks, as one in forward is.

Why this exists: a rank that runs out of memory in its backward, catches the error and
stops (or ends) leaves its peers in a collective it never joins (DDP's all-reduce, FSDP2's
reduce-scatter); they could only say that it died. A forward's error is seen by a module
hook (``comm_hooks``); nothing of a module or a tensor runs while an error unwinds through
autograd's engine. The one place it passes through Python on its way to the caller is
torch's ``_engine_run_backward``, which ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` all call: it is wrapped, once per process, to write the same
note (``_group.note_out_of_memory``) and raise the error unchanged. A torch without that
function keeps its own (the peers then say only that the rank died).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.autograd
import torch.autograd.graph

from ..emulation import is_out_of_memory
from ._group import _current_step, note_out_of_memory

_MARK = "_hetsplit_notes_out_of_memory"  # on the wrapper: wrapped once, whoever asks again


@functools.cache  # once per process
def note_out_of_memory_in_backward() -> None:
    """From now on, an out-of-memory error raised by a backward in this process is noted for the other ranks."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if not callable(run) or getattr(run, _MARK, False):
        return
    wrapped = _noting(run)
    torch.autograd.graph._engine_run_backward = wrapped
    # torch.autograd imported the name itself (backward() and grad() call it from there).
    if getattr(torch.autograd, "_engine_run_backward", None) is run:
        # (set as an attribute: torch.autograd does not re-export the name, and mypy says so)
        setattr(torch.autograd, "_engine_run_backward", wrapped)  # noqa: B010


def _noting(run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            if is_out_of_memory(error):  # the step the weighting hooks noted at this step's forward
                note_out_of_memory(error, _current_step())
            raise

    setattr(run_backward, _MARK, True)
    return run_backward
