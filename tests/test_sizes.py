import platform
import warnings

import pytest
import torch

import hetsplit.quick as quick
from hetsplit import Profile, balanced_split, solve
from hetsplit.parallel.sizes import split_sizes


def test_weights_4_to_1_on_100_rows():
    x = torch.randn(100, 3)
    shards = balanced_split(x, ["cpu", "cpu@0.25"], weights=[4, 1])
    assert [s.shape[0] for s in shards] == [80, 20]
    assert torch.equal(torch.cat(shards), x)


def test_follows_a_profile_or_plan():
    p = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    x = torch.arange(50)
    assert [len(s) for s in balanced_split(x, ["cpu", "cpu@0.25"], profile=p)] == [40, 10]
    plan = solve(p, 50)
    assert [len(s) for s in balanced_split(x, ["cpu", "cpu@0.25"], profile=plan)] == [40, 10]
    with pytest.raises(ValueError, match="the plan is for devices"):
        balanced_split(x, ["cpu@0.25", "cpu"], profile=plan)
    with pytest.raises(ValueError, match="sum to 50, but the batch has 40"):
        balanced_split(x[:40], ["cpu", "cpu@0.25"], profile=plan)


def test_two_arguments_use_the_newest_stored_profile():
    old = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.1)]}, host=platform.node())
    old.created = "2026-01-01T00:00:00+00:00"
    new = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.9)]}, host=platform.node())
    other_host = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.1)]}, host="elsewhere")
    for p in (old, new, other_host):
        p.save()
    assert [len(s) for s in balanced_split(torch.zeros(100), ["cpu", "cpu@0.25"])] == [90, 10]


def test_two_arguments_fall_back_to_calibration_with_one_notice(monkeypatch):
    monkeypatch.setattr(quick, "_QUICK", {})
    monkeypatch.setattr(quick, "_EMULATION", {})
    monkeypatch.setattr(quick, "_NOTICE_SHOWN", False)
    x = torch.randn(200, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = balanced_split(x, "cpu,cpu@0.25")
        second = balanced_split(x, "cpu,cpu@0.25")
    notices = [w for w in caught if "splitting by a quick built-in calibration" in str(w.message)]
    assert len(notices) == 1  # (a busy machine may add one line about noise or emulation: that is its job)
    assert torch.equal(torch.cat(first), x) and [len(s) for s in first] == [len(s) for s in second]
    # In proportion to the speeds, whatever the machine's load: an emulated device is its real one slowed.
    assert [len(s) for s in first] == [160, 40]


def test_bad_input():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="got 3 weights"):
        balanced_split(x, ["cpu", "cpu"], weights=[1, 1, 1])
    with pytest.raises(ValueError, match="empty"):
        balanced_split(torch.zeros(0), ["cpu", "cpu"], weights=[1, 1])
    with pytest.raises(ValueError, match="not both"):
        split_sizes(10, ["cpu"], weights=[1], profile=Profile.from_measurements({"cpu": [(1, 1.0)]}))
    with pytest.raises(ValueError, match="'gpu9'"):
        balanced_split(x, ["cpu", "gpu9"])


def test_split_other_dim():
    x = torch.randn(3, 10)
    shards = balanced_split(x, ["cpu", "cpu"], weights=[1, 4], dim=1)
    assert [s.shape[1] for s in shards] == [2, 8] and torch.equal(torch.cat(shards, dim=1), x)


def test_a_profile_of_another_model_is_refused_naming_both_models():
    import hetsplit
    from hetsplit.profiler import fingerprint

    lenet, mlp = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 5)), torch.nn.Linear(3, 2)
    prof = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    prof.model = {"name": "LeNet", "fingerprint": fingerprint(lenet)}
    with pytest.raises(ValueError) as e:
        hetsplit.HeteroDataParallel(mlp, ["cpu", "cpu@0.25"], profile=prof)
    assert str(e.value) == (
        f"the profile was recorded for another model: LeNet (fingerprint {fingerprint(lenet)}), but this model is "
        f"Linear (fingerprint {fingerprint(mlp)}); profile this model (hetsplit.profile(model, sample, devices)), "
        "or pass plan= or weights="
    )
    dp = hetsplit.HeteroDataParallel(lenet, ["cpu", "cpu@0.25"], profile=prof)  # its own model's profile
    assert dp.sizes_for(50) == [40, 10]
    prof.model = {"name": "timings from elsewhere"}  # no fingerprint recorded: it serves any model
    assert hetsplit.HeteroDataParallel(mlp, ["cpu", "cpu@0.25"], profile=prof).sizes_for(50) == [40, 10]


def test_a_profile_missing_a_device_is_refused_naming_it_before_any_step():
    import hetsplit

    prof = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]}, host="box")
    message = (
        r"the profile has no timings of cpu@0.5 \(it was recorded for cpu, cpu@0.25 on box\); profile these devices "
        r"\(hetsplit.profile\(model, sample, devices\)\), or pass plan= or weights="
    )
    with pytest.raises(ValueError, match=message):
        hetsplit.HeteroDataParallel(torch.nn.Linear(3, 2), ["cpu", "cpu@0.5"], profile=prof)
    with pytest.raises(ValueError, match=message):
        balanced_split(torch.zeros(10), ["cpu", "cpu@0.5"], profile=prof)


def test_a_profile_made_before_torch_compile_serves_the_compiled_model():
    import hetsplit
    from hetsplit.profiler import fingerprint

    lenet, mlp = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 5)), torch.nn.Linear(3, 2)
    prof = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    prof.model = {"name": "LeNet", "fingerprint": fingerprint(lenet)}
    compiled = torch.compile(lenet)  # an OptimizedModule: its parameters are named _orig_mod.*
    assert fingerprint(compiled) == fingerprint(lenet)
    dp = hetsplit.HeteroDataParallel(compiled, ["cpu", "cpu@0.25"], profile=prof)
    assert dp.sizes_for(50) == [40, 10]
    with pytest.raises(ValueError) as e:  # another model, compiled, is still another model
        hetsplit.HeteroDataParallel(torch.compile(mlp), ["cpu", "cpu@0.25"], profile=prof)
    assert str(e.value).startswith(
        f"the profile was recorded for another model: LeNet (fingerprint {fingerprint(lenet)}), but this model is "
        f"Linear (fingerprint {fingerprint(mlp)}); "
    )
