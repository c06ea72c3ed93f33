"""The quick calibration and the default profile: what splits a batch when nothing else says how."""

import platform
import warnings

import pytest
import torch
from torch import nn

import hetsplit
import hetsplit.quick as quick
from hetsplit import Profile
from hetsplit.devices import describe
from hetsplit.planning.curve import Curve
from hetsplit.planning.profile import DeviceProfile, Measurement
from hetsplit.profiler import fingerprint


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(quick, "_QUICK", {})
    monkeypatch.setattr(quick, "_NOISY", {})
    monkeypatch.setattr(quick, "_EMULATION", {})
    monkeypatch.setattr(quick, "_NOTICE_SHOWN", False)
    monkeypatch.setattr(quick, "_REASONS_SHOWN", set())


def _fake_profiler(monkeypatch, rounds, *, emulated_slowdown=None):
    """quick.profile replaced by a clock the test controls: timings given per call, {batch: [seconds of each repeat]}.

    The calibration's calls (real devices) are counted in the list returned; the check of an
    emulated device beside its real one gets the real device's timings at batch 64, the
    emulated one's ``emulated_slowdown`` times them (default: ``1/speed``, emulation that holds).
    """
    calls = []

    def fake(model, sample, devices, **kwargs):
        devs = hetsplit.parse_devices(devices)
        times = rounds[min(len(calls), len(rounds) - 1)]
        if not any(d.emulated for d in devs):
            calls.append(kwargs)
        entries = []
        for d in devs:
            slow = (emulated_slowdown or 1 / d.speed) if d.emulated else 1.0
            ms = [
                Measurement(b, [t * slow for t in ts]) for b, ts in sorted(times.items()) if b in kwargs["batch_sizes"]
            ]
            entries.append(DeviceProfile(describe(d), ms, Curve.fit([(m.batch, m.median) for m in ms], None)))
        return Profile(entries, source="measured")

    monkeypatch.setattr(quick, "profile", fake)
    return calls


STEADY = {64: [0.010, 0.011, 0.012], 256: [0.040, 0.041, 0.05], 1024: [0.16, 0.165, 0.2]}
NOISY = {64: [0.010, 0.030, 0.031], 256: [0.040, 0.041, 0.05], 1024: [0.16, 0.165, 0.2]}
# a busy machine: each try's fastest step at batch 64 is another, so no two agree
BUSY = [{**NOISY, 64: [0.010 * (k + 1), 0.05, 0.06]} for k in range(3)]


def _quick(devices, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = quick.quick_profile(devices, **kw)
    return prof, [str(w.message) for w in caught]


def test_noisy_timings_are_measured_again_until_they_agree(monkeypatch):
    calls = _fake_profiler(monkeypatch, [STEADY])
    prof, messages = _quick(["cpu", "cpu@0.25"])
    assert len(calls) == 1 and prof.source == "calibration"  # steady: measured once
    monkeypatch.setattr(quick, "_QUICK", {})
    calls = _fake_profiler(monkeypatch, [NOISY, STEADY])
    prof, messages = _quick(["cpu", "cpu@0.25"])
    assert len(calls) == 2 and prof.source == "calibration"  # the second round's repeats confirm the fastest
    assert not any("noisy" in m for m in messages)


def test_timings_that_stay_noisy_say_the_split_is_uncertain(monkeypatch):
    calls = _fake_profiler(monkeypatch, BUSY)
    prof, messages = _quick(["cpu", "cpu@0.25"])
    assert len(calls) == quick._ROUNDS and prof.source == "calibration (noisy)"
    noisy = [m for m in messages if "noisy" in m]
    assert len(noisy) == 1 and "cpu: at batch 64 the two fastest of 9 steps differ by 100%" in noisy[0]
    assert "this split is uncertain" in noisy[0]
    again, messages = _quick(["cpu", "cpu@0.25"])  # cached: not measured or warned about again
    assert len(calls) == quick._ROUNDS and again.source == "calibration (noisy)" and messages == []


def _stored(model, **devices):
    prof = Profile.from_measurements(devices, host=platform.node())
    prof.model = {"name": type(model).__name__, "fingerprint": fingerprint(model)}
    return prof.save()


def test_a_stored_profile_decides_only_its_own_models_split(monkeypatch):
    _fake_profiler(monkeypatch, [STEADY])
    lenet, mlp = nn.Sequential(nn.Conv2d(1, 6, 5)), nn.Linear(3, 2)
    path = _stored(lenet, cpu=[(100, 0.1)], **{"cpu@0.25": [(100, 0.9)]})
    assert quick.default_profile(["cpu", "cpu@0.25"], lenet).source == "external"  # its own profile
    _quick(["cpu", "cpu@0.25"])  # the generic notice, once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = quick.default_profile(["cpu", "cpu@0.25"], mlp)
    assert prof.source == "calibration"  # LeNet's curves were used for the MLP
    assert len(caught) == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert f"the stored profile {path} covers these devices but measured another model (Sequential)" in message
    assert quick.default_profile(["cpu", "cpu@0.25"]).source == "external"  # no model named: any profile
    assert quick.default_profile("cpu,cpu@0.25", fingerprint(lenet)).source == "external"


def test_a_wrapper_with_no_split_argument_uses_only_its_own_model_s_stored_profile(monkeypatch):
    """HeteroDataParallel passes its module: a stored LeNet profile never splits an MLP's batches."""

    _fake_profiler(monkeypatch, [STEADY])
    lenet, mlp = nn.Sequential(nn.Conv2d(1, 6, 5)), nn.Linear(3, 2)
    _stored(lenet, cpu=[(100, 0.1)], **{"cpu@0.25": [(100, 0.9)]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = hetsplit.HeteroDataParallel(mlp, ["cpu", "cpu@0.25"])
        dp(torch.randn(8, 3))
    assert dp._plans.profile.source == "calibration"
    dp = hetsplit.HeteroDataParallel(lenet, ["cpu", "cpu@0.25"])
    dp(torch.randn(8, 1, 8, 8))
    assert dp._plans.profile.source == "external"  # its own model's stored profile


def test_the_calibration_notice_from_a_wrapper_points_at_the_user_s_line(monkeypatch):
    import hetsplit

    _fake_profiler(monkeypatch, [STEADY])
    dp = hetsplit.HeteroDataParallel(nn.Linear(3, 2), ["cpu", "cpu@0.25"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp(torch.randn(8, 3))  # through nn.Module.__call__, not a line of torch's
    assert caught and all(w.filename == __file__ for w in caught), [w.filename for w in caught]


# What the calibration MLP measured on the 2-vCPU VM, quiet: half a millisecond of fixed cost
# per step, 0.019 ms a sample. Solving with that cost gave a newcomer's small CNN [50, 0] on
# cpu,cpu@0.25 (its own profile: [45, 5]); the cost is the calibration model's, not theirs.
MLP_LIKE = {64: [0.0017] * 5, 256: [0.0050] * 5, 1024: [0.0205] * 5}


def test_the_quick_split_follows_each_device_s_speed_not_the_calibration_model_s_fixed_cost(monkeypatch):
    _fake_profiler(monkeypatch, [MLP_LIKE])
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = hetsplit.HeteroDataParallel(cnn, ["cpu", "cpu@0.25"])
        sizes = {b: dp.sizes_for(b) for b in (8, 50, 128)}
    assert sizes == {8: [7, 1], 50: [40, 10], 128: [103, 25]}  # by speed; the faster device always the most
    assert dp._plans.profile.curve("cpu").intercept == 0.0


def test_emulation_that_does_not_hold_on_a_busy_machine_is_said_in_one_line(monkeypatch):
    _fake_profiler(monkeypatch, [STEADY], emulated_slowdown=1.4)  # a loaded machine: 1.4x, not 4x
    prof, messages = _quick(["cpu", "cpu@0.25"])
    said = [m for m in messages if "emulation unreliable" in m]
    assert len(said) == 1 and "cpu@0.25 measured 1.4x slower than cpu, not 4x" in said[0], messages
    assert prof.source == "calibration (emulation unreliable)"
    assert solve_sizes(prof, 50) == [40, 10]  # the split still follows the speeds; the line says it may not balance
    again, messages = _quick(["cpu", "cpu@0.25"])  # checked once per process
    assert not any("emulation" in m for m in messages) and again.source == prof.source


def test_emulation_that_holds_adds_no_line(monkeypatch):
    _fake_profiler(monkeypatch, [STEADY])
    prof, messages = _quick(["cpu", "cpu@0.25"])
    assert prof.source == "calibration" and not any("emulation" in m for m in messages), messages


def solve_sizes(prof, batch):
    return hetsplit.solve(prof, batch).sizes


def test_a_wrapper_split_by_the_calibration_predicts_no_step_of_the_user_s_model(monkeypatch, capsys):
    """Issue 44: dp.plan.step_time was the calibration MLP's ~1 ms beside a model's step of ~130 ms."""
    import json
    import math

    from hetsplit.distributed import SplitReport
    from hetsplit.planning.plan import Plan

    _fake_profiler(monkeypatch, [STEADY])
    dp = hetsplit.HeteroDataParallel(nn.Linear(3, 2), ["cpu", "cpu@0.25"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp(torch.randn(40, 3)).sum().backward()
    plan = dp.plan
    assert plan.sizes == [32, 8]  # the shares still follow each device's throughput
    assert plan.stand_in == "calibration-mlp" and math.isnan(plan.step_time), plan
    assert math.isnan(plan.speedup_vs_even) and plan.noise_notes() == []
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["step_time"] is None and data["stand_in"] == "calibration-mlp"
    assert Plan.from_dict(data).stand_in == "calibration-mlp"
    SplitReport("train.py", 0).announce(plan)
    out = capsys.readouterr().out
    assert "no predicted step (split by a quick calibration of each device, which times calibration-mlp" in out


def test_a_profiled_plan_still_predicts_its_step_and_old_plan_files_load():
    from hetsplit.planning.plan import Plan
    from hetsplit.planning.solver import solve

    prof = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    plan = solve(prof, 100)
    assert plan.stand_in == "" and plan.step_time == pytest.approx(0.08)
    old = plan.to_dict()
    del old["stand_in"]  # a file written before the field
    assert Plan.from_dict(old).step_time == pytest.approx(0.08)
    # A calibration corrected by the model's own measured steps times that model.
    for source, stand_in in [("calibration", "calibration-mlp"), ("calibration+rebalanced", "")]:
        assert Profile(prof.entries, model={"name": "calibration-mlp"}, source=source).stand_in == stand_in
