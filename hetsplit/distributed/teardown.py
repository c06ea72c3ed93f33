"""Teardown: at exit, let gloo's worker threads finish with their last collective before the interpreter goes.

Why this exists: a rank whose script ends right after a collective can abort at exit
(SIGABRT, "terminate called without an active exception"). Gloo runs each collective
on a worker thread (``pt_gloo_runloop``) that drops the collective's tensors *after*
the caller has seen it complete; dropping a tensor Python knows takes the GIL, and a
thread that takes the GIL once the interpreter has begun finalizing is ended with
``pthread_exit``, which unwinds through a ``noexcept`` destructor (pytorch/pytorch#190489).
``destroy_process_group`` does not help: it leaves the threads running while anything
(a DDP model, an ``Accelerator``) still holds the group. Measured on the 2-core VM under
load: a two-rank job exiting right after an all-reduce aborted in 22 of 30 runs.

So every rank that uses hetsplit's distributed pieces registers (once) an ``atexit``
handler, which runs while the interpreter is still whole: it releases the GIL in short
sleeps until no gloo worker thread has run or is runnable across one sleep, at most
:data:`_EXIT_WAIT_SECONDS`. Worker threads blocked on a peer (a collective still
pending) count as settled, so a rank that fails never waits on the others.
"""

from __future__ import annotations

import atexit
import functools
import os
import time

# The longest an exiting rank waits for the workers (they need microseconds; a loaded
# machine may not schedule them for tens of milliseconds).
_EXIT_WAIT_SECONDS = 2.0
# Native thread names (Linux ``comm``) of the c10d threads that drop a collective's tensors.
_WORKER_THREAD_NAMES = ("pt_gloo_runloop",)
_SLICE = 0.005  # seconds the GIL is let go per look: long enough for a waiting thread to take it


@functools.cache  # once per process (and names): called from every rank's use of the group
def drain_at_exit(names: tuple[str, ...] = _WORKER_THREAD_NAMES) -> None:
    """Register :func:`wait_for_workers` to run at interpreter exit.

    Args:
        names: Native names of the threads to wait for (gloo's worker by default).
    """
    atexit.register(wait_for_workers, _EXIT_WAIT_SECONDS, names)


def thread_states(names: tuple[str, ...] = _WORKER_THREAD_NAMES) -> dict[int, tuple[str, int]] | None:
    """This process's threads called one of ``names``, with their state and context switches.

    Args:
        names: Native thread names (Linux ``comm``) to look for.

    Returns:
        Thread id -> (state letter, context switches): the kernel's state (``R`` running
        or runnable, ``S`` sleeping, ``D`` in I/O) and the voluntary plus involuntary
        switches, which change whenever the thread ran. ``None`` where ``/proc`` is not
        there (not Linux).
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                if f.read().strip() not in names:
                    continue
            with open(f"/proc/self/task/{tid}/status", encoding="utf-8") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # the thread ended meanwhile
        switches = int(fields.get("voluntary_ctxt_switches", 0)) + int(fields.get("nonvoluntary_ctxt_switches", 0))
        out[int(tid)] = (fields.get("State", "?").split()[0], switches)
    return out


def wait_for_workers(timeout: float = _EXIT_WAIT_SECONDS, names: tuple[str, ...] = _WORKER_THREAD_NAMES) -> bool:
    """Let the GIL go until the worker threads stay still across one short sleep.

    Still means: none is running, runnable or in I/O, and none was scheduled during the
    sleep. A thread waiting for the GIL would take it during the sleep (and so not be
    still), which is why looking at the state alone is not enough.

    Args:
        timeout: Seconds to wait at most.
        names: Native names of the threads to wait for.

    Returns:
        ``True`` if they went still in time (or there are none); ``False`` at the timeout,
        or without ``/proc``, where it sleeps once (best effort).
    """
    before = thread_states(names)
    if before is None:
        time.sleep(_SLICE)
        return False
    if not before:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(_SLICE)
        after = thread_states(names) or {}
        if after == before and all(state not in "RD" for state, _ in after.values()):
            return True
        before = after
    return False
