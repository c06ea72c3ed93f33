import dataclasses
import json
import math
from pathlib import Path

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
    from hetsplit.apps.bench import bench_rebalance

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
    from hetsplit.apps.bench import parse_change

    with pytest.raises(ValueError, match=fragment):
        parse_change(text)
    assert parse_change("cpu@0.5=0.25@30") == ("cpu@0.5", 0.25, 30)


def test_bench_reports_predictions_beside_measurements(monkeypatch):
    # The profile is the test's (two equal devices, three sizes), so the plan calibrated starts split
    # whatever the machine's load: a measured one, beside busy processes, once gave cpu nothing
    # ([0, 64]), and a device with no share reports no busy times, so no factor.
    import hetsplit
    from hetsplit.apps import bench as bench_module

    points = [(8, 0.004), (32, 0.012), (64, 0.022)]
    prof = hetsplit.Profile.from_measurements({"cpu": points, "cpu@1": points})
    monkeypatch.setattr(bench_module, "run_profile", lambda *a, **k: prof)
    r = bench("lenet", "cpu,cpu@1", batch_size=64, steps=2, warmup=1, profile_budget=2.0, calibrate_seconds=0.3)
    assert r.calibration["sizes"] == [32, 32]
    assert set(r.predicted) >= {"even", "balanced", "single:cpu", "single:cpu@1"}
    # The plan is calibrated inside the split first, 5 steps at a time until 0.3 s of them;
    # its prediction is taken from those steps, the even split's adds their time outside
    # the devices' work.
    cal = r.calibration
    assert cal["steps"] >= 5 and cal["steps"] % 5 == 0 and set(cal["factors"]) == {"cpu", "cpu@1"}
    assert r.ideal_in_split == pytest.approx(sum(r.single[d] / cal["factors"][d] for d in r.single))
    assert r.predicted["balanced"] == cal["step"]
    assert r.predicted["even"] == pytest.approx(r.plan.even_time + cal["rest"])
    text = r.table()
    assert "predicted (ms)" in text and "left out of its fit" in text and "calibrated in the split" in text
    assert json.loads(json.dumps(r.to_dict()))["holdout"] == r.holdout


def _calibrate(busy_steps, *, steps=None, seconds=0.0, pause=0.0):
    """Calibrate a [50, 50] plan of two equally profiled devices on steps that report ``busy_steps``."""
    import time

    import hetsplit
    from hetsplit.apps.bench import calibrate_plan

    prof = hetsplit.Profile.from_measurements({"a": [(10, 0.01), (100, 0.1)], "b": [(10, 0.01), (100, 0.1)]})
    plan = hetsplit.solve(prof, 100)
    assert plan.sizes == [50, 50]
    busy, todo = [], iter(busy_steps)

    def step():
        time.sleep(pause)
        busy.append(next(todo))

    steps = steps or len(busy_steps) - 2
    new, info = calibrate_plan(prof, plan, step, busy, [], steps=steps, warmup=2, seconds=seconds)
    return prof, new, info, busy


@pytest.mark.parametrize("slow", [1.0, 2.0])
def test_calibration_re_solves_from_busy_times_inside_the_split(slow):
    # Both devices profiled alike; inside the split "b" is busy `slow` times its profile.
    import hetsplit

    prof, new, info, busy = _calibrate([{"a": 0.05, "b": 0.05 * slow}] * 6)
    assert len(busy) == 4 and info["steps"] == 4  # warm-up steps are not counted
    assert info["factors"] == pytest.approx({"a": 1.0, "b": slow}) and info["uncertainty"] == 0
    assert info["sizes"] == [50, 50] and info["predicted"] == pytest.approx(0.05)
    assert new.sizes == hetsplit.solve(prof, 100).sizes if slow == 1 else new.sizes == [67, 33]
    # The prediction scales each step's busy times to the new shares: a 0.05 * 67/50, b 0.1 * 33/50.
    assert info["step"] == pytest.approx(0.05 if slow == 1 else 0.067, abs=1e-3)


def test_calibration_does_not_move_the_plan_inside_the_noise():
    # "b" looks 6 % slower by its median, but its steps spread from 0.03 to 0.07 s: a move
    # of a few samples would gain less than the estimate's own uncertainty.
    import hetsplit

    noisy = [0.03, 0.07, 0.053, 0.04, 0.065, 0.054, 0.06, 0.035]
    prof, new, info, _ = _calibrate([{"a": 0.05, "b": b} for b in [0.05, 0.05, *noisy]])
    assert info["factors"]["b"] == pytest.approx(1.06, abs=0.01) and info["uncertainty"] > 0.05
    slower_b = [dataclasses.replace(e, curve=e.curve.scaled(info["factors"][e.name])) for e in prof.entries]
    naive = hetsplit.solve(hetsplit.Profile(slower_b), 100).sizes
    assert naive != [50, 50]  # re-solving from the medians alone would move ...
    assert new.sizes == [50, 50]  # ... the calibration keeps the plan


def test_calibration_predicts_the_slowest_device_of_each_step():
    # The two devices take turns being slow: each one's median is 0.055 s, every step 0.06 s.
    a, b = [0.05, 0.06] * 3, [0.06, 0.05] * 3
    _, new, info, _ = _calibrate([{"a": x, "b": y} for x, y in zip(a, b)])
    assert new.sizes == [50, 50] and max(new.times) == pytest.approx(0.055, rel=0.01)
    assert info["step"] == pytest.approx(0.06)


def test_calibration_adds_each_step_s_time_outside_the_devices_work():
    # Each step takes at least 10 ms of wall time while its devices report 2-3 ms busy:
    # the rest (loss, gather, optimizer) is measured and added to the prediction.
    a, b = [0.002, 0.003] * 4, [0.003, 0.002] * 4
    _, _, info, _ = _calibrate([{"a": x, "b": y} for x, y in zip(a, b)], pause=0.01)
    assert info["rest"] >= 0.007 - 1e-4
    assert info["step"] == pytest.approx(0.003 + info["rest"])


def test_calibration_runs_until_its_seconds_are_spent():
    _, _, info, busy = _calibrate([{"a": 0.05, "b": 0.05}] * 200, steps=4, seconds=0.03, pause=0.002)
    assert info["steps"] % 4 == 0 and 8 <= info["steps"] == len(busy) < 30


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


def test_calibration_keeps_a_micro_batched_plan_micro_batched():
    # "b" holds at most 10 samples: the plan runs its share in micro-batches. Calibrating
    # on steps as profiled must give back a plan still cut under the cap, not one batch.
    import hetsplit
    from hetsplit.apps.bench import calibrate_plan

    curve = [(2, 0.002), (10, 0.01), (100, 0.1)]
    prof = hetsplit.Profile.from_measurements({"a": curve, "b": curve[:2]}, memory_caps={"b": 10})
    plan = hetsplit.solve(prof, 100, accumulate=True)
    assert max(plan.micro_batches[1]) <= 10 < plan.sizes[1]
    busy = []

    def step():
        busy.append({name: t for name, t in zip(plan.devices, plan.times)})

    new, _ = calibrate_plan(prof, plan, step, busy, [], steps=4, warmup=1)
    assert new.micro_batches == plan.micro_batches


@pytest.mark.parametrize("batchnorm", [False, True])
def test_calibration_never_hands_a_batchnorm_model_a_share_of_one_sample(batchnorm):
    # "b" is 16x slower inside the split: re-solved it would get 1 of 32 samples, which a
    # BatchNorm layer cannot train on (bench_predict: ResNet-18, [15, 1, ...] in replica 1).
    import hetsplit
    from hetsplit.apps.bench import calibrate_plan

    prof = hetsplit.Profile.from_measurements({"a": [(1, 0.001), (32, 0.032)], "b": [(1, 0.001), (32, 0.032)]})
    plan = hetsplit.solve(prof, 32)
    busy = []

    def step():
        busy.append({"a": 0.016, "b": 0.016 * 16})

    new, _ = calibrate_plan(prof, plan, step, busy, [], steps=4, warmup=1, minimum=2 if batchnorm else 1)
    assert (1 in new.sizes) is not batchnorm and sum(new.sizes) == 32, new.sizes


def test_a_calibrated_plan_on_another_set_of_devices_is_predicted_from_its_own_steps(monkeypatch):
    # Inside the split "b" is 200x slower than profiled: calibrated, the plan drops it ([100, 0]),
    # and the step becomes the module's own on "a" alone, with no core shared with "b"'s thread
    # (busy 0.075 s for 50 samples split, 0.1 s for 100 alone). Scaled from the split steps the
    # prediction would be 0.15 + rest (bench_predict saw +22 % and +52 %); a second round of
    # calibration steps on the new plan predicts the 0.1 s it takes. The clock is the test's.
    import types

    import hetsplit
    from hetsplit.apps import bench as bench_module

    now = [0.0]
    monkeypatch.setattr(bench_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    prof = hetsplit.Profile.from_measurements({"a": [(10, 0.01), (100, 0.1)], "b": [(10, 0.01), (100, 0.1)]})
    plan = hetsplit.solve(prof, 100)
    running, busy, set_to = [plan], [], []

    def step():
        sizes = running[-1].sizes
        seen = {"a": 0.075, "b": 0.075 * 200} if sizes[1] else {}  # alone: the module's step logs no busy time
        busy.append(seen)
        now[0] += max(seen.values()) + 0.01 if seen else 0.1

    def set_plan(p):
        set_to.append(p.sizes)
        running.append(p)

    new, info = bench_module.calibrate_plan(prof, plan, step, busy, [], steps=4, warmup=1, set_plan=set_plan)
    assert new.sizes == [100, 0] and set_to == [[100, 0]] and info["rounds"] == 2 and info["steps"] == 8
    assert info["step"] == pytest.approx(0.1)
    running.append(plan)
    _, alone = bench_module.calibrate_plan(prof, plan, step, busy, [], steps=4, warmup=1)  # no second round
    assert alone["rounds"] == 1 and alone["step"] > 0.14


def test_bench_never_hands_a_batchnorm_model_a_share_of_one_sample(monkeypatch):
    # The profile solves 17 samples as [16, 1]; a BatchNorm model cannot train on one sample, so the
    # balanced split moves it (bench_predict's ResNet-18 on three devices failed in replica 1 without).
    import torch.nn as nn

    import hetsplit
    from hetsplit.apps import bench as bench_module
    from hetsplit.apps.bench import bench
    from hetsplit.apps.models import ModelSpec

    prof = hetsplit.Profile.from_measurements(
        {"cpu": [(1, 0.001), (17, 0.016)], "cpu@0.25": [(1, 0.0156), (17, 0.265)]}
    )
    assert hetsplit.solve(prof, 17).sizes == [16, 1]
    monkeypatch.setattr(bench_module, "run_profile", lambda *a, **k: prof)
    spec = ModelSpec("bn-mlp", lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), (8,), 3)
    r = bench(spec, "cpu,cpu@0.25", batch_size=17, steps=1, warmup=0, calibrate=0)
    assert 1 not in r.plan.sizes and sum(r.plan.sizes) == 17, r.plan.sizes


@pytest.mark.parametrize("skew", [1.6, 1.1])
def test_an_emulated_device_slowed_more_beside_its_real_one_is_said_in_one_line(monkeypatch, skew):
    # Profiled one at a time, cpu@0.25 was 4x slower than cpu; inside the split the scheduler slowed
    # its work `skew` times as much as the real one's (1.6: as beside two busy processes): the plan
    # then gives it too little, and the demo says why instead of printing the share as if it held.
    import dataclasses

    import hetsplit
    from hetsplit.apps import bench as bench_module
    from hetsplit.apps.demo import verdict

    prof = hetsplit.Profile.from_measurements({"cpu": [(8, 0.01), (32, 0.04)], "cpu@0.25": [(8, 0.04), (32, 0.16)]})
    prof.entries[1].info = dataclasses.replace(prof.entries[1].info, emulated=True, speed=0.25)
    monkeypatch.setattr(bench_module, "run_profile", lambda *a, **k: prof)
    calibrate = bench_module.calibrate_plan

    def skewed(*args, **kwargs):  # the factors as measured beside busy processes
        plan, info = calibrate(*args, **kwargs)
        return plan, {**info, "factors": {"cpu": 1.0, "cpu@0.25": skew}}

    monkeypatch.setattr(bench_module, "calibrate_plan", skewed)
    r = bench("mlp", "cpu,cpu@0.25", batch_size=32, steps=1, warmup=0, calibrate=2)
    line = r.meta["emulation_warning"]
    if skew > 1.3:
        assert line.startswith("emulation unreliable here") and "cpu@0.25 ran 6.4x slower than cpu beside it" in line
        assert line in verdict(r)
    else:  # 4.4x: within 1.3 of its speed
        assert line is None


def test_the_demo_s_split_line_gives_each_share_its_time_and_says_an_emulation_measured_off(monkeypatch):
    # cpu@0.25 profiled only 2x slower than cpu: planned at its declared 4x, and the split line says so;
    # a profile noisier than 25 % leaves the predicted step out of the verdict.
    import hetsplit
    from hetsplit.apps import bench as bench_module
    from hetsplit.apps.demo import verdict
    from hetsplit.profiler import emulation_faults, held_to_declared_speed

    prof = hetsplit.Profile.from_measurements({"cpu": [(8, 0.01), (32, 0.04)], "cpu@0.25": [(8, 0.02), (32, 0.08)]})
    prof.entries[1].info = dataclasses.replace(prof.entries[1].info, emulated=True, speed=0.25)
    monkeypatch.setattr(bench_module, "run_profile", lambda *a, **k: prof)
    r = bench("mlp", "cpu,cpu@0.25", batch_size=32, steps=1, warmup=0, calibrate=0)
    declared = hetsplit.solve(held_to_declared_speed(prof, emulation_faults(prof)), 32)
    assert r.plan.sizes == declared.sizes != hetsplit.solve(prof, 32).sizes
    a, b = declared.sizes
    ta, tb = (f"{t * 1e3:.1f} ms" for t in declared.times)
    lines = verdict(r).splitlines()
    assert lines[0] == (
        f"balanced split of 32: cpu {a} ({a / 32:.0%}, {ta}), cpu@0.25 {b} ({b / 32:.0%}, {tb}); "
        "emulation unreliable: cpu@0.25 measured 2.0x slower than cpu, not 4x, planned at 4x"
    ), lines[0]
    assert any(line.startswith("the plan (from each device timed alone) predicted a balanced step") for line in lines)
    # Every configuration's steps' own ± is measured, and the error is said beside it.
    assert set(r.meta["step_noise"]) == set(r.step_times)
    r.meta["step_noise"] = {"balanced": 0.04, "single:cpu": 0.02}
    said = next(line for line in verdict(r).splitlines() if "predicted a balanced step" in line)
    error = r.predicted["balanced"] / r.step_times["balanced"] - 1
    assert f"(error {error:+.0%}, noise ±4%)" in said, said
    noisy = dataclasses.replace(r, plan=dataclasses.replace(r.plan, noise=0.4))
    said = [line for line in verdict(noisy).splitlines() if "balanced step" in line]
    assert said == [
        f"the plan's (from each device timed alone) balanced step: unreliable here (noise ±40%); measured "
        f"{r.step_times['balanced'] * 1e3:.1f} ms"
    ], said


def test_the_demo_s_ranks_find_an_installed_hetsplit_without_site_packages_on_their_path(monkeypatch):
    # A wheel's demo put site-packages on its ranks' PYTHONPATH, and torchrun's ranks then had no
    # gloo ("Unknown c10d backend type GLOO", torch 2.15): its process engine failed.
    import os
    import site

    from hetsplit.apps import demo

    installed = site.getsitepackages()[0]
    checkout = str(Path(demo.__file__).resolve().parents[2])
    assert demo._is_site_packages(installed) and not demo._is_site_packages(checkout)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(demo, "__file__", os.path.join(installed, "hetsplit", "apps", "demo.py"))
    assert "PYTHONPATH" not in demo._rank_env(["cpu", "cpu@0.25"], 1)
    monkeypatch.setattr(demo, "__file__", os.path.join(checkout, "hetsplit", "apps", "demo.py"))
    assert demo._rank_env(["cpu", "cpu@0.25"], 1)["PYTHONPATH"].split(os.pathsep) == [checkout]
