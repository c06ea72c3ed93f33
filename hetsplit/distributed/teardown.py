"""Teardown: at exit, let gloo's worker threads finish with their last collective before the interpreter goes.

A gloo worker taking the GIL during finalisation aborts the rank (pytorch/pytorch#190489): a
two-rank job exiting right after an all-reduce aborted in 22 of 30 runs on the 2-core VM. A
worker blocked on a peer counts as settled, so a failed rank never waits on the others.
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
    """Register :func:`wait_for_workers` to run at interpreter exit (``names``: the threads' native names)."""
    atexit.register(wait_for_workers, _EXIT_WAIT_SECONDS, names)


def thread_states(names: tuple[str, ...] = _WORKER_THREAD_NAMES) -> dict[int, tuple[str, int]] | None:
    """This process's threads called one of ``names``: thread id -> (state letter, context switches); None off Linux."""
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
    """Let the GIL go until the threads ``names`` stay still across one short sleep (at most ``timeout`` seconds).

    Still: not running, runnable or in I/O, and not scheduled during the sleep (a thread waiting for
    the GIL takes it then). ``False`` at the timeout, or without ``/proc`` (after one sleep).
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
