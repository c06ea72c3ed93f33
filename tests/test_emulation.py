"""Emulated devices: slowed as the real device is slowed, on a quiet or a loaded machine; waits never slowed.

Each rule is checked on a machine the test controls (:class:`FakeMachine` stands in for the
thread's clocks and ``time.sleep``), so the assertions hold on a busy CI machine; one test
reads the real clocks with bounds that do not depend on the load.
"""

import threading
import time

import pytest
import torch

from hetsplit import emulation, timing
from hetsplit.devices import parse_device


class FakeMachine:
    """The clocks of one thread: wall time, and the time it ran or waited for a core (its work)."""

    def __init__(self, monkeypatch):
        self.wall = self.runnable = 0.0
        self.slept: list[float] = []
        monkeypatch.setattr(emulation, "_wall_time", lambda: self.wall)
        monkeypatch.setattr(emulation, "_runnable_time", lambda: self.runnable)
        monkeypatch.setattr(emulation, "_sleep", self._sleep)
        monkeypatch.setattr(emulation, "_SLEEP_DEBT", {})
        monkeypatch.setattr(emulation, "_DELAYED", {})
        monkeypatch.setattr(emulation, "_EXTRA", threading.local())
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the work runs in the calling thread

    def work(self, cpu, *, queued=0.0, blocked=0.0):
        """``cpu`` seconds on a core, ``queued`` waiting for one (a loaded machine), ``blocked`` on a lock."""
        self.runnable += cpu + queued
        self.wall += cpu + queued + blocked

    def _sleep(self, seconds):
        self.slept.append(seconds)
        self.wall += seconds

    def piece(self, device, **work):
        """The wall time of one throttled piece of ``work`` on ``device``."""
        began = self.wall
        with device.throttle():
            self.work(**work)
        return self.wall - began


@pytest.fixture
def machine(monkeypatch):
    return FakeMachine(monkeypatch)


@pytest.mark.parametrize("queued", [0.0, 0.01, 0.03], ids=["quiet", "load-2x", "load-4x"])
def test_an_emulated_cpu_stays_four_times_slower_at_any_load(machine, queued):
    """Two busy processes on two cores: the real work waits for a core as long again, or longer.

    The CPU-time rule this replaces measured 10 ms of work and slept until 40 ms had passed:
    at a 4x load the real piece already took 40 ms and the emulated one was no slower.
    """
    real = machine.piece(parse_device("cpu"), cpu=0.01, queued=queued)
    emulated = machine.piece(parse_device("cpu@0.25"), cpu=0.01, queued=queued)
    assert emulated == pytest.approx(4 * real)


def test_a_wait_inside_a_piece_is_never_slowed(machine):
    """A collective (or the interpreter lock) inside the piece: the piece takes work / speed, the wait overlaps it."""
    slow = parse_device("cpu@0.25")
    assert machine.piece(slow, cpu=0.01, blocked=0.02) == pytest.approx(0.04)  # 10 ms of work is 40 ms
    assert machine.piece(slow, cpu=0.01, blocked=0.05) == pytest.approx(0.06)  # a longer wait: nothing added
    assert machine.slept == pytest.approx([0.01])


def test_sleep_overshoot_is_carried_into_the_next_piece(machine, monkeypatch):
    slow = parse_device("cpu@0.5")
    monkeypatch.setattr(emulation, "_sleep", lambda s: machine._sleep(s + 0.002))  # each sleep 2 ms too long
    total = sum(machine.piece(slow, cpu=0.01) for _ in range(10))
    assert total == pytest.approx(0.2, abs=0.0021)  # the long-run speed is exact; only the last overshoot stays


def test_a_lap_counts_compute_and_the_emulated_slow_down_not_the_waits(machine):
    real, slow = parse_device("cpu"), parse_device("cpu@0.25")
    with timing.lap(real) as lap:
        machine.work(0.01, queued=0.01, blocked=0.5)
    assert lap.seconds() == pytest.approx(0.02)  # the wait for a core slows the work; the lock wait is not work
    with timing.lap(slow) as lap, slow.throttle():
        machine.work(0.01, blocked=0.5)
    assert lap.seconds() == pytest.approx(0.04)  # as the quarter-speed device would have computed


def test_several_intra_op_threads_fall_back_to_wall_time(machine, monkeypatch):
    """The work runs on other threads then: the piece sleeps (1/speed - 1) times its wall time."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert emulation.work_clock(parse_device("cpu@0.25")) is emulation._wall_time
    assert machine.piece(parse_device("cpu@0.25"), cpu=0.01, queued=0.01) == pytest.approx(0.08)


def test_the_runnable_clock_counts_work_not_sleep():
    """The real clock: a busy loop's wall time is work (running or queued), a sleep is not."""
    start = emulation._runnable_time()
    time.sleep(0.05)
    assert emulation._runnable_time() - start < 0.02
    start, began = emulation._runnable_time(), time.perf_counter()
    while time.perf_counter() - began < 0.05:
        pass
    busy = emulation._runnable_time() - start
    if emulation.measures_load():
        # Each moment of a busy loop the thread is on a core or queued for one, whatever the load.
        assert busy >= 0.045
    else:  # no schedstat (not Linux): the thread's CPU time alone, which a loaded machine shrinks
        assert 0 < busy <= 0.06


def test_without_schedstat_the_clock_is_the_threads_cpu_time(monkeypatch):
    monkeypatch.setattr(emulation, "_SCHEDSTAT", "/nonexistent/schedstat")
    monkeypatch.setattr(emulation, "_HAS_SCHEDSTAT", None)
    monkeypatch.setattr(emulation, "_STAT", threading.local())  # no file this thread opened before
    monkeypatch.setattr(time, "thread_time", lambda: 12.5)
    assert emulation._runnable_time() == 12.5 and not emulation.measures_load()


def test_real_device_is_never_throttled(machine):
    assert machine.piece(parse_device("cpu"), cpu=0.01, queued=0.03) == pytest.approx(0.04)
    assert machine.slept == []
