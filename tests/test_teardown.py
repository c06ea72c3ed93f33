"""The exit handler: a rank waits for gloo's worker threads to go still before the interpreter finalizes.

The worker threads here are Python threads given the gloo worker's native name, so the
handler sees them exactly as it sees gloo's; the real race is measured by
benchmarks/bench_exit.py (two-rank gloo jobs exiting right after an all-reduce).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hetsplit.distributed import teardown

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
NAME = "hs_test_worker"


def _name_this_thread(name: str) -> None:
    ctypes.CDLL(None).prctl(15, name.encode())  # PR_SET_NAME: the native name /proc shows


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_it_waits_until_a_working_thread_blocks():
    done, release = threading.Event(), threading.Event()

    def worker():
        _name_this_thread(NAME)
        _spin(0.2)
        done.set()
        release.wait()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(0.02)  # it is spinning now
    try:
        assert teardown.wait_for_workers(timeout=5.0, names=(NAME,))
        assert done.is_set()  # it returned only after the thread stopped working
    finally:
        release.set()
        t.join()


def test_a_sleeping_thread_that_keeps_waking_is_not_still():
    # The gloo case: a worker that needs the GIL sleeps (state S) while it waits for it,
    # so its state alone would say "idle"; only its being scheduled tells it is not.
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def worker():
        _name_this_thread(NAME)
        go.wait()
        for _ in range(150):
            time.sleep(0.001)  # asleep nearly all the time, yet working
        done.set()
        release.wait()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(0.02)
    try:
        go.set()
        assert teardown.wait_for_workers(timeout=5.0, names=(NAME,))
        assert done.is_set()
    finally:
        release.set()
        t.join()


class _Clock:
    """teardown's clock, the test's: each of its sleeps advances it by the seconds asked (and sleeps them)."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.now += seconds
        self.sleeps += 1


def test_it_gives_up_at_the_timeout(monkeypatch):
    # On the test's clock (a busy machine stretches the real one; the wait is counted in its own sleeps).
    clock = _Clock()
    monkeypatch.setattr(teardown, "time", clock)
    stop = threading.Event()

    def worker():
        _name_this_thread(NAME)
        while not stop.is_set():
            _spin(0.01)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(0.02)
    try:
        assert not teardown.wait_for_workers(timeout=0.2, names=(NAME,))
        assert 0.2 <= clock.now < 0.2 + 2 * teardown._SLICE, clock.now  # the whole timeout, then one look more
    finally:
        stop.set()
        t.join()


def test_without_worker_threads_it_returns_at_once(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(teardown, "time", clock)
    assert teardown.wait_for_workers(names=("no_such_thread",))
    assert clock.sleeps == 0 and clock.now == 0.0  # not one sleep


def test_the_states_name_each_worker_thread():
    release = threading.Event()

    def worker():
        _name_this_thread(NAME)
        release.wait()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(0.05)
    try:
        states = teardown.thread_states((NAME,))
        assert len(states) == 1 and next(iter(states.values()))[0] == "S"
    finally:
        release.set()
        t.join()


def test_at_exit_the_process_waits_for_a_working_worker(tmp_path):
    # A daemon thread is killed when the interpreter ends: its file exists only if the
    # exit handler (registered twice, run once) waited for it to finish working.
    marker = tmp_path / "finished"
    code = textwrap.dedent(f"""
        import ctypes, threading, time
        from hetsplit.distributed import teardown
        def worker():
            ctypes.CDLL(None).prctl(15, b"{NAME}")
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                pass
            open({str(marker)!r}, "w").close()
            threading.Event().wait()
        threading.Thread(target=worker, daemon=True).start()
        time.sleep(0.02)
        teardown.drain_at_exit(({NAME!r},))
        teardown.drain_at_exit(({NAME!r},))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert marker.exists()
