"""Group: the process group's rank and size, collectives that fail with one clear error."""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import torch.distributed as dist

from .. import _torch
from ..emulation import is_out_of_memory
from ..planning.plan import Plan
from .teardown import drain_at_exit


class DistributedError(RuntimeError):
    """Ranks disagree (versions, plans) or one of them died or hangs.

    Attributes:
        step: The training step that failed (counted from 0), when known.
        ranks: The ranks that died or hang, when known (a two-rank job: the other one).
        timeout: The process group's timeout in seconds, when known.
    """

    def __init__(
        self, message: str, *, step: int | None = None, ranks: list[int] | None = None, timeout: float | None = None
    ) -> None:
        super().__init__(message)
        self.step, self.ranks, self.timeout = step, ranks, timeout


DistributedError.__module__ = "hetsplit.distributed"  # where users import it from (tracebacks name it so)


def group_info(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group(...) first "
            "(torchrun sets the environment for it)"
        )
    drain_at_exit()  # this rank uses the group: at exit, let gloo's workers finish first (see teardown)
    _one_line_for_uncaught_failures()
    return dist.get_rank(group), dist.get_world_size(group)


def _place(group: Any = None) -> tuple[int | None, int | None]:
    """This rank and the world size, ``(None, None)`` outside a process group (unlike :func:`group_info`, no error)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return None, None


# -- a rank that failed first tells the others why -----------------------------------------------
# A rank that runs out of memory, catches the error and carries on (or ends) leaves its peers
# in a collective it never joins: they see only gloo's "Connection closed by peer" or a timeout.
# So the failing rank writes one line under this key in the process group's store (the
# rendezvous store every rank already holds), and a peer's failure line quotes it.
_NOTE_KEY = "hetsplit/failed/{rank}"
_NOTE_WAIT = 1.0  # seconds a failing rank waits for the store when it reads the others' notes


def _store() -> Any:
    """The default process group's store, or ``None`` (no group, or a torch without one)."""
    return _torch.default_store()


def note_failure(line: str) -> None:
    """Tell the other ranks, through the store, why this rank stopped taking part (best effort)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(_NOTE_KEY.format(rank=dist.get_rank()), line)
    except Exception:
        pass


def failure_notes(rank: int | None, world: int | None) -> dict[int, str]:
    """The other ranks' notes of why they stopped (:func:`note_failure`), by rank."""
    store = _store()
    if store is None or not world or not _store_outlives_peers(rank):
        return {}
    notes = {}
    try:  # a store whose host is stopped would keep a failing rank waiting for the store's timeout
        before = store.timeout
        store.set_timeout(_dt.timedelta(seconds=_NOTE_WAIT))
    except Exception:
        return {}
    try:
        for r in range(world):
            key = _NOTE_KEY.format(rank=r)
            if r != rank and store.check([key]):
                notes[r] = store.get(key).decode(errors="replace")
    except Exception:
        pass  # the store's host is gone: no notes
    finally:
        store.set_timeout(before)
    return notes


def _store_outlives_peers(rank: int | None) -> bool:
    """Whether reading the store cannot meet a dead host: torchrun's agent holds it, or this rank (rank 0) does."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or rank == 0


def ran_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is this rank's own out-of-memory error, not a peer's failure that quotes one.

    A survivor's collective fails quoting the failed rank's note ("rank 1 ran out of memory ..."):
    that survivor must not note an OOM of its own nor be told to take a smaller share.
    """
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return is_out_of_memory(error) and not isinstance(error, DistributedError) and not is_failure(error)


def note_out_of_memory(error: BaseException, step: int | None = None) -> None:
    """This rank ran out of memory in a step (``error``): the line the other ranks' failures will quote."""
    where = f" at step {step}" if step is not None else ""
    first = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    note_failure(f"ran out of memory{where} ({first})")


# A backward's OOM leaves peers in a collective it never joins (DDP's all-reduce, FSDP2's
# reduce-scatter); a forward's is seen by a module hook (comm_hooks), a backward's only where
# torch lets hetsplit see errors leaving autograd's engine (_torch.on_backward_error).
@functools.cache  # once per process
def note_out_of_memory_in_backward() -> bool:
    """From now on, note a backward's out-of-memory error for the other ranks; whether this torch allows it."""
    return _torch.on_backward_error(_note_if_out_of_memory)


def _note_if_out_of_memory(error: BaseException) -> None:
    if ran_out_of_memory(error):  # the step the weighting hooks noted at this step's forward
        note_out_of_memory(error, _current_step())


@functools.cache  # once per process
def _one_line_for_uncaught_failures() -> None:
    """An uncaught dead-or-hung-peer error ends the rank with :class:`guard`'s one line instead of gloo's traceback."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        rank, world = _place()
        if not is_failure(error) or rank is None:
            previous(kind, error, tb)
            return
        line = as_error(error, rank=rank, world=world, step=_current_step(), timeout=group_timeout())
        print(f"hetsplit: {line}", file=sys.stderr, flush=True)

    sys.excepthook = hook


# The training step this process is in, as last noted by a guard, the weighting hooks or
# the rebalancer (one number per process: a failure message names it).
_progress: dict[str, int | None] = {"step": None}


def note_step(step: int) -> None:
    """Record the training step (from 0) this rank is running; failures name it."""
    _progress["step"] = step


def _current_step() -> int | None:
    """The step last recorded by :func:`note_step`, or ``None`` before training."""
    return _progress["step"]


def group_timeout(group: Any = None) -> float | None:
    """The process group's timeout in seconds (``init_process_group(timeout=...)``), or ``None`` if unknown."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    for device in ("cpu", "cuda"):
        timeout = _torch.backend_timeout(pg, device)
        if timeout is not None:
            return timeout.total_seconds()
    return None


# What gloo, NCCL and the TCP store say when a peer died or hangs (torch raises them as
# RuntimeError, or DistBackendError / DistNetworkError / DistStoreError in newer versions).
_DEAD = re.compile(
    r"connection (?:reset|closed|refused)|broken pipe|end of file|\beof\b|socket closed|"
    r"remote process exited|peer .*(?:closed|down)",
    re.IGNORECASE,
)
_HUNG = re.compile(r"timed out|timeout|deadline exceeded|watchdog", re.IGNORECASE)
_COMM = re.compile(r"gloo|nccl|c10d|processgroup|pair\.cc|tcpstore|socket", re.IGNORECASE)
_WRAPPED = re.compile(r"DistributedError: ([^\n]*)")  # our own message, raised inside a comm hook's future
_GLOO_NOISE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*|\s*This is typically caused by.*$|\s*GLHF.*$")


def _dist_error_types() -> tuple[type[BaseException], ...]:
    names = ("DistBackendError", "DistNetworkError", "DistStoreError")
    return tuple(t for n in names if isinstance(t := getattr(dist, n, None), type))


def is_failure(error: BaseException) -> bool:
    """Whether ``error`` is a communication failure (a dead or hung peer), not a bug in this rank's own step."""
    if isinstance(error, DistributedError):
        return False  # already one clear message
    if isinstance(error, _dist_error_types()):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return bool(_WRAPPED.search(text)) or (bool(_COMM.search(text)) and bool(_DEAD.search(text) or _HUNG.search(text)))


def as_error(
    error: BaseException,
    *,
    rank: int | None,
    world: int | None,
    step: int | None = None,
    what: str = "training step",
    timeout: float | None = None,
) -> DistributedError:
    """``error`` (a dead or hung peer) as one line naming this rank, the step, the failed rank and the timeout."""
    others = [r for r in range(world) if r != rank] if world else []
    ranks = others if len(others) == 1 else None
    notes = failure_notes(rank, world)
    wrapped = _WRAPPED.search(str(error))
    if wrapped:  # the comm hook already wrote the line; torch wrapped it in its future's error
        line = wrapped.group(1).strip()
        found = re.search(r", step (\d+):", line)
        return DistributedError(line, step=int(found.group(1)) if found else step, ranks=ranks, timeout=timeout)
    text = " ".join(str(error).split("\n\nAt:")[0].split())
    reason = _GLOO_NOISE.sub("", text).strip().rstrip(".")[:200] or type(error).__name__
    who = f"rank {others[0]}" if ranks else "another rank"
    limit = f"{timeout:g} s" if timeout is not None else "process group's"
    hung = not notes and not _DEAD.search(text) and bool(_HUNG.search(text))
    if notes:  # a rank said why it stopped taking part: that, not what its silence looked like here
        said = "; ".join(f"rank {r} {note}" for r, note in sorted(notes.items()))
        ranks = sorted(notes)
        how = f"{said} and stopped taking part in the collectives ({reason})"
    elif hung:
        how = (
            f"{who} did not answer within the {limit} timeout: it hangs, is stopped, or is slower than "
            f"the timeout allows ({reason})"
        )
    elif _DEAD.search(text):
        how = f"{who} died or lost its connection ({reason})"
    else:
        how = f"{type(error).__name__}: {reason}"
    where = f"rank {rank}" if rank is not None else "this rank"
    if step is not None:
        where += f", step {step}"
    tail = ""
    if not hung:
        tail = f"; process-group timeout {timeout:g} s" if timeout is not None else ""
        tail += "; that rank's own output says why" if _DEAD.search(text) and not notes else ""
    return DistributedError(f"{where}: {what} failed: {how}{tail}", step=step, ranks=ranks, timeout=timeout)


class guard:  # lower case: used like a function, `with hd.guard(step=i):`
    """Turn a dead or hung peer inside the block into one :class:`DistributedError` line.

    The line names this rank, ``what``, the step (``step``, else the last one the weighting hooks
    noted), the rank that failed when known, and the timeout; other exceptions pass through.
    An out-of-memory error is noted for the other ranks and raised as one line too.

    Example:
        >>> for step, (x, y) in enumerate(loader):
        ...     with hd.guard(step=step):
        ...         opt.zero_grad(); F.cross_entropy(ddp(x), y).backward(); opt.step()
    """

    __slots__ = ("group", "step", "what")

    def __init__(self, step: int | None = None, *, what: str = "training step", group: Any = None) -> None:
        self.step, self.what, self.group = step, what, group

    def __enter__(self) -> guard:
        if self.step is not None:
            note_step(self.step)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if error is not None and ran_out_of_memory(error):
            step = self.step if self.step is not None else _current_step()
            note_out_of_memory(error, step)
            raise _oom_error(error, step, self.group) from error
        if error is None or not is_failure(error):
            return False
        rank, world = _place(self.group)
        step = self.step if self.step is not None else _current_step()
        raise as_error(
            error, rank=rank, world=world, step=step, what=self.what, timeout=group_timeout(self.group)
        ) from error


def _oom_error(error: BaseException, step: int | None, group: Any) -> DistributedError:
    """Out of memory on this rank: one line; the other ranks stop at their next collective, naming this rank."""
    rank = _place(group)[0]
    where = ", ".join(
        x for x in (f"rank {rank}" if rank is not None else "", f"step {step}" if step is not None else "") if x
    )
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else type(error).__name__  # one line, without torch's stack
    return DistributedError(
        f"{where or 'this rank'}: out of memory ({first}); every rank stops: give this rank a smaller share or "
        "micro-batches (a profile with its memory cap and hd.plan(..., accumulate=True), then hd.micro_batches) "
        "or use a smaller batch",
        step=step,
        ranks=[rank] if rank is not None else None,
    )


def collective(what: str, fn: Callable[[], Any], rank: int, group: Any = None, *, step: int | None = None) -> Any:
    """``fn()``, a collective; its failure (any ``RuntimeError``: a dead or hung peer) becomes one clear line."""
    try:
        return fn()
    except RuntimeError as e:  # gloo and NCCL report timeouts and dead peers as RuntimeError
        if isinstance(e, DistributedError):
            raise
        world = dist.get_world_size(group) if dist.is_initialized() else None
        raise as_error(e, rank=rank, world=world, step=step, what=what, timeout=group_timeout(group)) from e


def all_gather(obj: Any, what: str, group: Any, *, step: int | None = None) -> list[Any]:
    rank, world = group_info(group)
    out: list[Any] = [None] * world
    collective(what, lambda: dist.all_gather_object(out, obj, group=group), rank, group, step=step)
    return out


def _plan_digest(p: Plan) -> str:
    payload = json.dumps({"devices": p.devices, "sizes": p.sizes, "batch": p.batch_size}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def verify_plan(p: Plan, group: Any = None) -> None:
    """Check that every rank holds the same plan; a :class:`DistributedError` on all ranks naming those that differ."""

    digests = all_gather(_plan_digest(p), "comparing plans", group)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise DistributedError(
            f"ranks {bad} hold a different plan from rank 0; build the plan with "
            "hetsplit.distributed.plan(...) on every rank, or load the same plan file everywhere"
        )


def init_timeout(seconds: float) -> _dt.timedelta:
    """A process-group timeout (for ``init_process_group(timeout=...)``), validated."""
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return _dt.timedelta(seconds=seconds)
