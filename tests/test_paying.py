"""HeteroDataParallel says once, in one line, when its fastest device alone would have been faster (issue 44).

Every test here runs on a clock it controls and on busy times it sets: the wrapper's
own laps are read through ``Lap.seconds``, replaced per device.
"""

import warnings

import pytest
import torch
from torch import nn

import hetsplit
from hetsplit.parallel.paying import PayCheck
from hetsplit.planning.curve import Curve
from hetsplit.planning.plan import Plan
from hetsplit.timing import Lap

DEVICES = ["cpu", "cpu@0.25"]


class _Clock:
    """Steps of ``walls`` seconds, one after another: the check reads it at each step's start and end."""

    def __init__(self, walls):
        self.walls, self.now, self.calls = list(walls), 0.0, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:  # a step's end
            self.now += self.walls.pop(0) if self.walls else 0.02
            return self.now
        self.now += 1.0  # between steps: the optimizer, the data
        return self.now


def _train(monkeypatch, walls, busy, *, steps=8, quiet=False, sizes=(16, 4)):
    """Train a small net on cpu,cpu@0.25 split ``sizes``, each step lasting ``walls[k]``; the warnings said.

    ``busy``: each device's busy seconds a step, half in its forward's lap, half in its backward's.
    """
    monkeypatch.setattr(Lap, "seconds", lambda lap: busy[lap.device.name] / 2)
    net = nn.Linear(4, 2)
    dp = hetsplit.HeteroDataParallel(net, DEVICES, weights=list(sizes), quiet=quiet)
    dp._pay.clock = _Clock(walls)
    x, y = torch.randn(sum(sizes), 4), torch.randn(sum(sizes), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            nn.functional.mse_loss(dp(x), y).backward()
    return [str(w.message) for w in caught if "alone would be faster" in str(w.message)], caught


def test_a_split_slower_than_its_fastest_device_alone_is_said_once(monkeypatch):
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    # cpu: 16 ms on 16 of 20 samples, so 20 ms alone; every split step took 30 ms.
    lines, caught = _train(monkeypatch, [0.030] * 12, {"cpu": 0.016, "cpu@0.25": 0.016}, steps=12)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("hetsplit: HeteroDataParallel: cpu alone would be faster than this split of batch 20")
    assert "a step took 30.0 ms (median of 5, ±0% step to step), cpu alone 20.0 ms" in line
    assert "drop cpu@0.25 from the devices" in line and "weights=" in line
    assert "\n" not in line
    assert {w.filename for w in caught if "alone would be" in str(w.message)} == {__file__}  # the user's line


def test_a_split_that_pays_says_nothing(monkeypatch):
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    lines, _ = _train(monkeypatch, [0.017] * 12, {"cpu": 0.016, "cpu@0.25": 0.016}, steps=12)
    assert lines == []


def test_a_gap_inside_the_step_to_step_noise_says_nothing(monkeypatch):
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    # Median step 24 ms against 20 ms alone (a 17% gap), but the steps swing by ±33%.
    walls = [0.024, 0.012, 0.036, 0.024, 0.016, 0.032, 0.024]
    lines, _ = _train(monkeypatch, walls, {"cpu": 0.016, "cpu@0.25": 0.016}, steps=7)
    assert lines == []


@pytest.mark.parametrize("how", ["env", "keyword"])
def test_the_quiet_flag_silences_the_line(monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("HETSPLIT_QUIET", "1")
    else:
        monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    lines, _ = _train(monkeypatch, [0.030] * 8, {"cpu": 0.016, "cpu@0.25": 0.016}, quiet=how == "keyword")
    assert lines == []


def test_too_few_steps_say_nothing_yet(monkeypatch):
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    # One warm-up and five timed steps decide; the line comes at the step after them.
    lines, _ = _train(monkeypatch, [0.030] * 6, {"cpu": 0.016, "cpu@0.25": 0.016}, steps=6)
    assert lines == []


def test_the_fastest_device_alone_follows_its_curve_from_its_share_to_the_batch():
    # A fixed cost of 10 ms a step: cpu's 16 samples took 26 ms, the whole 20 take 30 ms alone.
    curve = Curve([10.0, 40.0], [0.020, 0.050], 0.010, 0.001)
    slow = curve.scaled(4.0)
    plan = Plan(["cpu", "cpu@0.25"], [16, 4], [0.026, 0.056], 20, curves=[curve, slow])
    check = PayCheck(clock=_Clock([0.035] * 6))
    for k in range(6):
        check.start(k)
        check.end(k, plan, {"cpu": [_Fixed(0.026)], "cpu@0.25": [_Fixed(0.026)]})
    line = check.take()
    assert line is not None and "a step took 35.0 ms" in line and "cpu alone 30.0 ms" in line
    assert check.take() is None  # said once


class _Fixed:
    def __init__(self, seconds):
        self._seconds = seconds

    def ready(self):
        return True

    def seconds(self):
        return self._seconds
