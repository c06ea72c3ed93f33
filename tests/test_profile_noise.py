"""A profile knows its noise: the spread of its repeats, its fit's residual, and when a plan's gain is inside them."""

import json
import math

import pytest

from hetsplit import Profile, solve
from hetsplit.apps.cli import main
from hetsplit.devices import DeviceInfo
from hetsplit.files import ProfileFileError
from hetsplit.planning import Plan
from hetsplit.planning.curve import Curve
from hetsplit.planning.records import DeviceProfile, Measurement
from hetsplit.planning.solver import plan_from_sizes


def _repeated(spread):
    """A fast device and one 20x slower, each size timed three times: the median and ±``spread`` of it."""
    return Profile.from_measurements(
        {
            name: [(b, per * b * k) for b in (8, 32, 128) for k in (1 - spread, 1, 1 + spread)]
            for name, per in (("a", 0.001), ("b", 0.02))
        }
    )


def test_a_measurement_s_spread_is_half_its_interquartile_range_over_its_median():
    assert Measurement(8, [0.5, 0.2, 0.3, 0.1, 0.4]).spread == pytest.approx(0.1 / 0.3)  # quartiles 0.2 and 0.4
    assert Measurement(8, [0.1, 0.1, 0.1, 0.1, 9.0]).spread == 0.0  # one hiccup is not the machine's noise
    assert Measurement(8, [0.1]).spread is None


def test_a_device_s_noise_is_its_repeats_spread_and_its_fit_s_residual():
    noisy = _repeated(0.2).entry("a").noise
    assert noisy.spread == pytest.approx(0.1) and noisy.residual == 0.0 and noisy.relative == pytest.approx(0.1)
    # A larger batch measured faster than a smaller one: the curve smooths it, the noise keeps it.
    dip = Profile.from_measurements({"d": [(8, 0.020), (32, 0.015), (64, 0.030)]}).entry("d").noise
    assert dip.spread is None and dip.residual == pytest.approx(0.0025 / 0.0175) and dip.relative == dip.residual
    once = Profile.from_measurements({"e": [(8, 0.01), (32, 0.03)]}).entry("e").noise
    assert once.relative is None  # timed once each, in order: nothing says how noisy


def test_the_noise_is_written_for_readers_and_a_file_without_it_still_loads(tmp_path):
    prof = _repeated(0.2)
    path = prof.save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    assert doc["devices"][0]["noise"]["relative"] == pytest.approx(0.1)
    assert doc["devices"][0]["measurements"][0]["spread"] == pytest.approx(0.1)
    for device in doc["devices"]:  # as written before profiles knew their noise
        del device["noise"]
        for m in device["measurements"]:
            del m["spread"]
    path.write_text(json.dumps(doc))
    old = Profile.load(path)
    assert old.entry("a").noise == prof.entry("a").noise and old.to_dict() == prof.to_dict()


def test_a_plan_says_when_its_gain_is_inside_the_noise():
    plan = solve(_repeated(0.2), 100)
    assert plan.sizes == [96, 4] and plan.noise == pytest.approx(0.1)
    # 96 ms against a alone's 100 ms: a gain of 4 % measured with a ±10 % spread may not be there.
    assert plan.noise_notes() == ["the predicted gain over a alone (4%) is inside the measurement noise (±10%)"]
    assert solve(_repeated(0.02), 100).noise_notes() == []  # quiet timings: the 4 % is real
    # Compared with other step times (e.g. a gradient exchange added): the gain over the even split too.
    assert plan.noise_notes(even=0.1) == [
        "the predicted gain over the even split (4%) is inside the measurement noise (±10%)",
        "the predicted gain over a alone (4%) is inside the measurement noise (±10%)",
    ]
    # A calibrated step slower than the alternative is said as such, never "inside the noise".
    assert plan.noise_notes(step=0.12) == ["predicted 17% slower than a alone, beyond the measurement noise (±10%)"]
    alone = plan_from_sizes(_repeated(0.2), ["a", "b"], [100, 0])
    assert alone.noise_notes() == []  # a alone compared with itself says nothing
    assert plan_from_sizes(None, ["a", "b"], [96, 4]).noise_notes() == []  # sizes by hand: no noise known


def test_a_plan_s_noise_round_trips_and_an_older_plan_file_loads():
    plan = solve(_repeated(0.2), 100)
    data = plan.to_dict()
    assert data["noise"] == pytest.approx(0.1) and Plan.from_dict(data).noise == pytest.approx(0.1)
    del data["noise"]
    older = Plan.from_dict(data)
    assert math.isnan(older.noise) and older.noise_notes() == []
    assert plan_from_sizes(None, ["a", "b"], [1, 1]).to_dict()["noise"] is None  # JSON has no NaN


def test_hetsplit_plan_prints_when_the_gain_is_inside_the_noise(capsys, tmp_path):
    path = _repeated(0.2).save(tmp_path / "noisy.json")
    assert main(["plan", str(path), "--batch-size", "100"]) == 0
    assert "the predicted gain over a alone (4%) is inside the measurement noise (±10%)" in capsys.readouterr().out
    path = _repeated(0.02).save(tmp_path / "quiet.json")
    assert main(["plan", str(path), "--batch-size", "100"]) == 0
    assert "inside the measurement noise" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_a_plan_with_a_device_measured_at_zero_or_non_finite_time_is_refused_naming_it(bad):
    good = Profile.from_measurements({"a": [(8, 0.01), (32, 0.03)]}).entry("a")
    broken = DeviceProfile(
        DeviceInfo(name="b", kind="external", description="b"),
        [Measurement(8, [bad]), Measurement(32, [0.1])],
        Curve.fit([(8, 0.02), (32, 0.1)]),
    )
    prof = Profile([good, broken])
    for make in (lambda: solve(prof, 10), lambda: plan_from_sizes(prof, ["a", "b"], [5, 5])):
        with pytest.raises(ValueError, match=rf"device 'b': measured {bad!r} s for a step of batch 8; .*re-profile"):
            make()


def test_a_stored_curve_that_predicts_no_time_is_refused_naming_the_device(tmp_path):
    path = Profile.from_measurements({"a": [(8, 0.01)], "b": [(8, 0.02), (32, 0.05)]}).save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    doc["devices"][1]["curve"].update(seconds=[0.0, 0.0], intercept=0.0)  # b: no time at all up to batch 32
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileFileError, match=r"device 'b': its curve predicts 0.0 s for a step of batch 8"):
        Profile.load(path)
