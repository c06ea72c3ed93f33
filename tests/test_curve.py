import math
import random

import numpy as np
import pytest

from hetsplit.planning.curve import Curve, CurveTable
from hetsplit.planning.profile import Profile


def test_fit_is_monotone_with_fixed_overhead():
    # A GPU-like device: nearly flat at small batches, then linear.
    points = [(1, 0.010), (2, 0.0101), (4, 0.0099), (8, 0.0102), (32, 0.012), (128, 0.03), (256, 0.055)]
    c = Curve.fit(points)
    grid = np.arange(0, 2000)
    t = c.evaluate(grid)
    assert t[0] == 0.0
    assert np.all(np.diff(t[1:]) >= 0)
    assert c(1) == pytest.approx(0.010, rel=0.05)
    assert c.intercept > 0.005  # the fixed per-step cost is captured
    assert c(512) > c(256) > c(128)  # extrapolation keeps rising


def test_fit_smooths_noisy_non_monotone_medians():
    c = Curve.fit([(8, 0.02), (16, 0.015), (32, 0.03)])
    assert c.seconds == sorted(c.seconds)


def test_single_point_assumes_proportional_time():
    c = Curve.fit([(10, 1.0)])
    assert c(20) == pytest.approx(2.0) and c(5) == pytest.approx(0.5)


def test_memory_cap_makes_time_infinite():
    c = Curve.fit([(1, 0.1), (10, 1.0)], memory_cap=12)
    assert math.isfinite(c(12)) and c(13) == math.inf
    assert c.capacity(1e9) == 12


@pytest.mark.parametrize("bad", [[], [(0, 1.0)], [(2, -1.0)], [(2, float("nan"))], [(1.5, 1.0)]])
def test_fit_rejects_bad_measurements(bad):
    with pytest.raises(ValueError):
        Curve.fit(bad)


def test_capacity_inverts_evaluate_exactly():
    rng = random.Random(1)
    for _ in range(50):
        pts = [
            (b, rng.uniform(0.001, 0.01) + b * rng.uniform(1e-4, 1e-2)) for b in sorted(rng.sample(range(1, 300), 4))
        ]
        c = Curve.fit(pts, memory_cap=rng.choice([None, 150]))
        for t in [rng.uniform(0, 3) for _ in range(20)]:
            k = c.capacity(t)
            assert c(k) <= t
            assert c(k + 1) > t


def test_table_evaluates_each_row_with_its_own_curve():
    a, b = Curve.fit([(1, 1.0), (10, 10.0)]), Curve.fit([(1, 2.0), (10, 20.0), (20, 40.0)])
    table = CurveTable([a, b, a])
    out = table.evaluate(np.array([5.0, 5.0, 0.0]))
    assert out.tolist() == pytest.approx([a(5), b(5), 0.0])


def test_from_measurements_and_step_time():
    p = Profile.from_measurements(
        {"v100": [(16, 0.082), (64, 0.221)], "k80": [(16, 0.3), (64, 1.1)]}, memory_caps={"k80": 100}
    )
    assert p.devices == ["v100", "k80"]
    assert p.step_time("v100", 0) == 0.0
    assert p.step_time("v100", 64) == pytest.approx(0.221)
    assert p.step_time("k80", 101) == math.inf
    assert p.source == "external" and p.entry("k80").memory_cap == 100
    assert p.throughput("v100", 64) == pytest.approx(64 / 0.221)


def test_from_measurements_rejects_unknown_cap_and_lookup_names_devices():
    with pytest.raises(ValueError, match=r"\['m60'\]"):
        Profile.from_measurements({"v100": [(1, 1.0)]}, memory_caps={"m60": 3})
    p = Profile.from_measurements({"v100": [(1, 1.0)]})
    with pytest.raises(KeyError, match="it has \\['v100'\\]"):
        p.step_time("a100", 3)


def test_profile_dict_round_trip():
    p = Profile.from_measurements({"a": [(1, 0.1), (8, 0.3)], "b@x": [(4, 0.2)]}, memory_caps={"a": 9})
    q = Profile.from_dict(p.to_dict())
    assert q.to_dict() == p.to_dict()
    assert q.step_time("a", 5) == p.step_time("a", 5)


def test_shifted_adds_a_fixed_overhead_to_every_used_batch():
    c = Curve.fit([(4, 0.02), (16, 0.05), (64, 0.2)], memory_cap=100)
    s = c.shifted(0.003)
    for b in (1, 3, 4, 10, 64, 90):
        assert s(b) == pytest.approx(c(b) + 0.003, rel=1e-12)
    assert s(0) == 0.0 and s(101) == math.inf  # an unused device still costs nothing; the cap stays
    assert s.evaluate(np.array([10.0]))[0] == pytest.approx(s(10), rel=1e-12)
    with pytest.raises(ValueError, match="overhead >= 0 seconds, got -0.1"):
        c.shifted(-0.1)


def test_holdout_error_refits_without_the_middle_point():
    from hetsplit.planning.curve import holdout_error

    line = [(b, 0.001 + 0.0001 * b) for b in (8, 32, 128)]
    batch, predicted, measured = holdout_error(line)
    assert batch == 32 and predicted == pytest.approx(measured, rel=1e-9)  # a straight line predicts itself
    kinked = [(8, 0.01), (32, 0.05), (128, 0.02 + 0.0001 * 128)]
    batch, predicted, measured = holdout_error(kinked)
    assert batch == 32 and measured == 0.05 and predicted < 0.03  # the left-out bump is not in the refit
    assert holdout_error(line[:2]) is None
