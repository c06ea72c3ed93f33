import json
import math

import pytest

from hetsplit.apps.bench import bench, keep_freed_memory, time_steps

# Every bench here times real steps (shares follow measured speed): run alone, not beside the
# other pytest worker (the rebalancing test missed its slowdown under that load once).
pytestmark = pytest.mark.serial


def test_bench_reports_consistent_figures():
    r = bench("mlp", "cpu,cpu@0.5", batch_size=32, steps=2, warmup=1, profile_budget=2)
    assert set(r.single) == {"cpu", "cpu@0.5"}
    assert r.ideal == pytest.approx(sum(r.single.values()))
    assert r.efficiency == pytest.approx(r.balanced / r.ideal)
    assert r.speedup_vs_even == pytest.approx(r.balanced / r.even)
    assert r.speedup_vs_single == pytest.approx(r.balanced / r.single[r.fastest])
    assert sum(r.plan.sizes) == 32
    assert r.meta["emulated"] == ["cpu@0.5"] and r.meta["data"] == "synthetic"
    assert r.overhead is not None and math.isfinite(r.overhead)
    json.dumps(r.to_dict())  # JSON-ready
    assert "ideal (sum of single devices)" in r.table()


@pytest.mark.parametrize(
    "kwargs, fragment", [({"devices": "cpu"}, "two or more devices"), ({"mode": "scatter"}, "'scatter'")]
)
def test_bench_bad_arguments(kwargs, fragment):
    args = {"model": "mlp", "devices": "cpu,cpu@0.5"} | kwargs
    with pytest.raises(ValueError) as err:
        bench(**args, steps=1)
    assert fragment in str(err.value)


def test_time_steps_runs_every_configuration_round_robin():
    order = []
    t = time_steps({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, [], steps=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())


def test_keep_freed_memory_is_a_flag():
    assert keep_freed_memory() in (True, False)


def test_bench_rebalance_follows_a_slowdown_and_reports_it():
    from hetsplit.apps.bench_rebalance import bench_rebalance

    r = bench_rebalance(
        "mlp", "cpu,cpu@1", batch_size=64, steps=24, every=3, change=("cpu@1", 0.2, 6), settle=12, sweep_steps=2
    )
    assert len(r.step_times) == 24 and len(r.sizes) == 24 and r.sizes[0] == [32, 32]
    assert any(c["step"] > 6 for c in r.changes)
    assert r.sizes[-1][1] < r.sizes[-1][0]  # the slowed device ends with the smaller share
    assert r.optimum > 0 and sum(r.optimum_sizes) == 64 and r.change == {"device": "cpu@1", "speed": 0.2, "step": 6}
    assert 0 <= r.overhead < 1 and r.late_steps == 24 - 6 - 12
    text = r.table()
    assert "plan changes:" in text and "best split found by a sweep" in text and "rebalancer cost" in text
    json.dumps(r.to_dict())


@pytest.mark.parametrize(
    "text, fragment",
    [("cpu=0.5@3", "real device"), ("cpu@1=2@3", "0 < SPEED <= 1"), ("cpu@1:0.5", "DEVICE=SPEED@STEP")],
)
def test_parse_change_rejects_bad_text(text, fragment):
    from hetsplit.apps.bench_rebalance import parse_change

    with pytest.raises(ValueError, match=fragment):
        parse_change(text)
    assert parse_change("cpu@0.5=0.25@30") == ("cpu@0.5", 0.25, 30)


def test_bench_reports_predictions_beside_measurements():
    r = bench("mlp", "cpu,cpu@1", batch_size=32, steps=2, warmup=1, profile_budget=2.0)
    assert set(r.predicted) >= {"even", "balanced", "single:cpu", "single:cpu@1"}
    # The plan is calibrated inside the split first; its prediction adds the step's time
    # outside the devices' work, measured there.
    cal = r.calibration
    assert cal["steps"] == 5 and set(cal["factors"]) == {"cpu", "cpu@1"} and cal["rest"] >= 0
    assert r.ideal_in_split == pytest.approx(sum(r.single[d] / cal["factors"][d] for d in r.single))
    assert r.predicted["balanced"] == pytest.approx(r.plan.step_time + cal["rest"])
    text = r.table()
    assert "predicted (ms)" in text and "left out of its fit" in text and "calibrated in the split" in text
    assert json.loads(json.dumps(r.to_dict()))["holdout"] == r.holdout


@pytest.mark.parametrize("slow", [1.0, 2.0])
def test_calibration_re_solves_from_busy_times_inside_the_split(slow):
    # Both devices profiled alike; inside the split "b" is busy `slow` times its profile.
    import hetsplit
    from hetsplit.apps.bench import calibrate_plan

    prof = hetsplit.Profile.from_measurements({"a": [(10, 0.01), (100, 0.1)], "b": [(10, 0.01), (100, 0.1)]})
    plan = hetsplit.solve(prof, 100)
    assert plan.sizes == [50, 50]
    busy = []

    def step():
        busy.append({"a": 0.05, "b": 0.05 * slow})

    new, info = calibrate_plan(prof, plan, step, busy, [], steps=4, warmup=2)
    assert len(busy) == 4 and info["steps"] == 4  # warm-up steps are not counted
    assert info["factors"] == pytest.approx({"a": 1.0, "b": slow})
    assert info["sizes"] == [50, 50] and info["predicted"] == pytest.approx(0.05)
    assert new.sizes == hetsplit.solve(prof, 100).sizes if slow == 1 else new.sizes == [67, 33]
    assert info["rest"] >= 0


def test_a_calibration_that_split_nothing_still_prints():
    # A plan giving one device everything runs the module's own step: no busy times, no factors.
    from hetsplit.apps.bench_result import BenchResult
    from hetsplit.planning import plan_from_sizes

    r = BenchResult(
        devices=["cpu", "cpu@0.5"], model="mlp", batch_size=8, mode="gather", single={"cpu": 100.0, "cpu@0.5": 50.0},
        even=90.0, balanced=100.0, plan=plan_from_sizes(None, ["cpu", "cpu@0.5"], [8, 0]),
        step_times={"single:cpu": 0.08, "single:cpu@0.5": 0.16, "even": 0.09, "balanced": 0.08}, overhead=None,
        busy={}, meta={}, calibration={"steps": 5, "factors": {}, "rest": 0.001, "sizes": [8, 0], "predicted": 0.08},
    )  # fmt: skip
    assert r.ideal_in_split is None
    text = r.table()
    assert "busy / profile none" in text and "in-split speeds" not in text
