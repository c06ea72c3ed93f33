"""A catalogue of bad inputs (issue 17): each gets one clear error naming the value, before any device work.

Add a row for every new public function or CLI flag. Each row: the issue's item, what is
called, the exception type (or CLI exit status) and a fragment of its one-line message.
Inputs that are legitimate after all (a repeated device, weights as a tensor) are in
LEGIT_ROWS with the behaviour they get. The tests after the tables are the regressions
that need more than one call (files on disk, warnings, timing, processes).
"""

import json
import math
import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hetsplit
from hetsplit import Profile
from hetsplit.apps.cli import main
from hetsplit.devices import Device, parse_device
from hetsplit.files import ProfileFileError
from hetsplit.parallel.sizes import split_sizes
from hetsplit.planning import plan_from_sizes, solve
from hetsplit.planning.checks import MAX_BATCH, MAX_DEVICES
from hetsplit.planning.plan import sizes_from_weights
from hetsplit.quick import quick_profile


def _profile():
    return Profile.from_measurements({"cpu": [(16, 0.01), (64, 0.03)], "cpu@0.25": [(16, 0.04), (64, 0.12)]})


def _stored(tmp_path, mutate):
    path = _profile().save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    mutate(doc["devices"][1])
    path.write_text(json.dumps(doc))
    return path


def _merged(picks):
    prof = _profile()
    return Profile.merge([(prof, device, n) for device, n in picks])


def _run_processes(*args):
    from hetsplit.apps.demo import run_processes

    return run_processes(*args)


def _tiny_profile(devices):
    return hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), devices, batch_sizes=[2], repeats=1, warmup=0)


API_ROWS = [
    # 4: emulated speeds have a lower bound everywhere a speed is given
    ("4 emulated speed too small", lambda: parse_device("cpu@0.0000001"), ValueError, "at least 0.001"),
    ("4 emulated speed zero", lambda: parse_device("cpu@0"), ValueError, "must be in (0, 1]"),
    ("4 set_speed too small", lambda: parse_device("cpu@0.5").set_speed(1e-7), ValueError, "at least 0.001"),
    ("4 set_speed a string", lambda: parse_device("cpu@0.5").set_speed("0.5"), TypeError, "'0.5'"),
    ("4 set_speed a bool", lambda: parse_device("cpu@0.5").set_speed(True), TypeError, "got True"),
    ("4 Device built by hand", lambda: Device("cpu", None, 1e-9, True), ValueError, "at least 0.001"),
    ("27 a speed just above 1, named exactly", lambda: parse_device("cpu@1.0000001"), ValueError,
     "got 1.0000001"),
    ("27 a CPU index other than 0", lambda: parse_device(torch.device("cpu", 1)), ValueError,
     "the CPU has one index, 0"),
    # 7: Profile.merge is bounded and counts copies of one device on
    ("7 merge beyond any what-if", lambda: Profile.merge([(_profile(), "cpu", 10**9)]), ValueError,
     f"between 1 and {MAX_DEVICES:,} devices"),
    ("7 merge a fractional count", lambda: Profile.merge([(_profile(), "cpu", 2.5)]), ValueError, "2.5"),
    # 8: Profile.from_measurements: refused, not truncated; the device named
    ("8 fractional batch", lambda: Profile.from_measurements({"a": [(16.7, 0.1)]}), ValueError, "16.7"),
    ("8 NaN cap", lambda: Profile.from_measurements({"a": [(16, 0.1)]}, memory_caps={"a": math.nan}), ValueError,
     "device 'a': memory cap"),
    ("8 a point that is not a pair", lambda: Profile.from_measurements({"a": [(16,)]}), ValueError,
     "device 'a': a measurement must be a (batch, seconds) pair"),
    ("8 negative time", lambda: Profile.from_measurements({"a": [(16, -1.0)]}), ValueError, "positive, finite"),
    ("8 points not a list", lambda: Profile.from_measurements({"a": 5}), ValueError, "device 'a': give a list"),
    ("8 no points", lambda: Profile.from_measurements({"a": []}), ValueError, "device 'a': no measurements"),
    ("8 a time as a string", lambda: Profile.from_measurements({"a": [(16, "0.1")]}), ValueError, "'0.1'"),
    ("8 not a mapping", lambda: Profile.from_measurements([("a", [(16, 0.1)])]), TypeError, "must be a mapping"),
    ("8 a time of years", lambda: Profile.from_measurements({"a": [(1, 1e300)]}), ValueError, "at most 1e+06"),
    # 10: sizes have a documented bound (2**40)
    ("10 batch beyond any machine", lambda: solve(_profile(), 10**30), ValueError, f"{MAX_BATCH:,}"),
    ("10 split_sizes beyond any machine", lambda: split_sizes(10**30, ["cpu", "cpu@0.5"], weights=[1, 1]),
     ValueError, f"{MAX_BATCH:,}"),
    ("10 profile a batch beyond the probe", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), "cpu",
     batch_sizes=[1_000_000_000]), ValueError, "above max_probe"),
    ("10 profile a fractional batch", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), "cpu",
     batch_sizes=[2.5]), ValueError, "2.5"),
    # 15: the smaller ones
    ("15 scatter sizes with a bool", lambda: hetsplit.parallel.scatter(torch.arange(10), ["cpu", "cpu"], [True, 9]),
     TypeError, "got bool"),
    ("15 scatter a bool dim", lambda: hetsplit.parallel.scatter(torch.zeros(2, 10), ["cpu", "cpu"], [1, 1], dim=True),
     TypeError, "dim must be an integer"),
    ("15 weights as a string", lambda: hetsplit.balanced_split(torch.zeros(10), ["cpu", "cpu@0.5"], weights="41"),
     TypeError, "'41'"),
    ("15 weights as a string, HeteroDataParallel", lambda: hetsplit.HeteroDataParallel(nn.Linear(3, 2),
     ["cpu", "cpu@0.5"], weights="41"), TypeError, "'41'"),
    ("15 a file name as the profile", lambda: hetsplit.balanced_split(torch.zeros(10), ["cpu", "cpu@0.5"],
     profile="profiles/p.json"), TypeError, "Profile.load(path)"),
    ("15 profile an empty sample", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(0, 3), "cpu"), ValueError,
     "no rows"),
    ("15 profile with a NaN budget", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), "cpu",
     time_budget=math.nan), ValueError, "time_budget > 0"),
    ("15 no devices", lambda: hetsplit.parse_devices(""), ValueError, "no devices given in ''"),
    ("15 devices as None", lambda: hetsplit.parse_devices(None), TypeError, "got NoneType"),
    ("15 gather mismatched outputs", lambda: hetsplit.parallel.gather(
     [{"a": torch.zeros(2, 3)}, {"a": torch.zeros(2, 4)}], "cpu"),
     ValueError, "output ['a']: the replicas' tensors of shapes [(2, 3), (2, 4)]"),
    ("2 reduce with NaN sizes", lambda: hetsplit.reduce_gradients([[], []], [math.nan, 2]), ValueError,
     "must be an integer >= 0"),
    # 16: the demo's process engine checks its split and model before starting ranks
    ("16 run_processes sizes per device", lambda: _run_processes(["cpu", "cpu@0.5"], "cnn", [8], 1, 1), ValueError,
     "one whole count >= 0 for each of the devices"),
    ("16 run_processes no sample", lambda: _run_processes(["cpu", "cpu@0.5"], "cnn", [0, 0], 1, 1), ValueError,
     "at least one sample"),
    ("16 run_processes unknown model", lambda: _run_processes(["cpu", "cpu@0.5"], "nosuch", [4, 4], 1, 1),
     ValueError, "unknown model 'nosuch'"),
    # issue 15: emulated memory, micro-batches
    ("m emulate max_batch 0", lambda: hetsplit.emulate("cpu", max_batch=0), ValueError, "from 1 to"),
    ("m emulate max_batch negative", lambda: hetsplit.emulate("cpu", max_batch=-3), ValueError, "got -3"),
    ("m emulate max_batch a float", lambda: hetsplit.emulate("cpu", max_batch=2.5), TypeError, "float: 2.5"),
    ("m emulate max_batch a bool", lambda: hetsplit.emulate("cpu", max_batch=True), TypeError, "bool: True"),
    ("m emulate max_batch a string", lambda: hetsplit.emulate("cpu", max_batch="64"), TypeError, "str: '64'"),
    ("m emulate an emulated device", lambda: hetsplit.emulate("cpu@0.5"), ValueError, "takes a real device"),
    ("m emulate speed 0", lambda: hetsplit.emulate("cpu", speed=0), ValueError, "at least 0.001"),
    ("m device string cap 0", lambda: parse_device("cpu:max0"), ValueError, "got 0"),
    ("m device string cap fractional", lambda: parse_device("cpu@0.5:max1.5"), ValueError,
     "after ':max' must be a whole number"),
    ("m Device cap on a real device", lambda: Device("cpu", max_batch=4), ValueError, "pass emulated=True"),
    ("m accumulate not a bool", lambda: solve(_profile(), 10, accumulate="yes"), TypeError, "got 'yes'"),
    ("m accumulate, no device holds a sample",
     lambda: solve(Profile.from_measurements({"a": [(16, 0.1)]}, memory_caps={"a": 0}), 10, accumulate=True),
     ValueError, "give devices that hold at least one sample"),
    ("m cap-limited without accumulate",
     lambda: solve(Profile.from_measurements({"a": [(16, 0.1)]}, memory_caps={"a": 8}), 10), ValueError,
     "accumulate=True"),
    ("m HDP accumulate not a bool", lambda: hetsplit.HeteroDataParallel(nn.Linear(2, 2), ["cpu", "cpu@0.5"],
     weights=[1, 1], accumulate=1), TypeError, "got 1"),
    ("m micro-batches not summing to the share", lambda: hetsplit.Plan(["a"], [5], [0.0], 5, micro_batches=[[3, 3]]),
     ValueError, "summing to that device's share 5"),
    ("m micro-batch of 0", lambda: hetsplit.Plan(["a"], [5], [0.0], 5, micro_batches=[[5, 0]]), ValueError,
     "whole numbers >= 1"),
    ("m torchrun micro-batches of another share", lambda: list(hetsplit.distributed.micro_batches(
     None, torch.zeros(4), hetsplit.Plan(["a", "b"], [5, 3], [0.0, 0.0], 8), rank=0)), ValueError,
     "the plan gives this rank 5"),
    # 14: HeteroAccelerator checks everything before accelerate or a process group starts
    ("14 accelerator weighting", lambda: _accelerator(weighting="mean"), ValueError, "weighting='mean'"),
    ("14 accelerator plan as a file name", lambda: _accelerator(plan="plan.json"), TypeError, "got str"),
    ("14 accelerator plan for 3 processes", lambda: _accelerator(plan=plan_from_sizes(None, ["a", "b", "c"],
     [1, 1, 1])), ValueError, "3 shares [1, 1, 1] but 1 processes run"),
    ("14 accelerator global batch", lambda: _accelerator(global_batch_size=0), ValueError, "got 0"),
    ("15 accelerator unweighted plan with micro-batches", lambda: _accelerator(weighting="none", plan=hetsplit.Plan(
     ["a"], [5], [0.1], 5, micro_batches=[[3, 2]])), ValueError, "into micro-batches [3, 2]"),
    ("15 accelerator micro-batches before any plan", lambda: _accelerator().micro_batches(None, [1]), ValueError,
     "no plan yet"),
    ("14 accelerator two devices, one process", lambda: _accelerator(devices="cpu,cpu@0.25"), ValueError,
     "this job runs 1 process"),
    ("16 bench calibration steps negative", lambda: _bench(calibrate=-1), ValueError, "got -1"),
    ("16 bench calibration steps not whole", lambda: _bench(calibrate=2.5), ValueError, ">= 0 (0: off), got 2.5"),
    ("16 bench calibration seconds", lambda: _bench(calibrate_seconds=-1.0), ValueError, "seconds >= 0, got -1.0"),
    # 36: a newcomer's first hour: a near-miss device name gets a guess, a removed name its replacement
    ("36 a device without its colon", lambda: parse_device("cuda0"), ValueError, "(did you mean 'cuda:0'?)"),
    ("36 gpu for cuda", lambda: hetsplit.parse_devices("cpu,gpu1"), ValueError, "(did you mean 'cuda:1'?)"),
    ("36 a misspelt type, emulated", lambda: parse_device("cdua-1@0.5"), ValueError,
     "(did you mean 'cuda:1@0.5'?)"),
    ("36 removed hetsplit.parse_device", lambda: hetsplit.parse_device, AttributeError,
     "it was removed: use hetsplit.parse_devices('cpu@0.25')[0]"),
    ("36 removed hetsplit.solver", lambda: hetsplit.solver, AttributeError,
     "it was removed: use hetsplit.solve(profile, batch_size)"),
    ("36 removed hd.rank_device", lambda: hetsplit.distributed.rank_device, AttributeError,
     "it was removed: use dev = hd.init()"),
    # 44: a model on the meta device (shapes, no data) is refused in hetsplit's words, not torch's
    ("44 meta model wrapped", lambda: hetsplit.HeteroDataParallel(_meta(), ["cpu", "cpu@0.5"]), ValueError,
     "HeteroDataParallel: the model's 'weight' and 1 more are on the meta device (shapes without data); "
     "materialise the model first: model.to_empty(device='cpu')"),
    ("44 meta model profiled", lambda: hetsplit.profile(_meta(), torch.zeros(8, 4), ["cpu"], batch_sizes=[2, 4]),
     ValueError, "hetsplit.profile: the model's 'weight' and 1 more are on the meta device"),
    ("44 meta model planned", lambda: hetsplit.distributed.plan(_meta(), torch.zeros(8, 4), 8), ValueError,
     "hd.plan: the model's 'weight' and 1 more are on the meta device"),
    ("44 one meta buffer", lambda: hetsplit.HeteroDataParallel(_meta_buffer(), ["cpu"]), ValueError,
     "the model's 'running_mean' is on the meta device"),
]  # fmt: skip


def _meta():
    with torch.device("meta"):
        return nn.Linear(4, 2)


def _meta_buffer():
    model = nn.BatchNorm1d(4)
    model.running_mean = torch.zeros(4, device="meta")
    return model


def _bench(**kwargs):
    from hetsplit.apps.bench import bench

    return bench("mlp", "cpu,cpu@0.5", **kwargs)


def _accelerator(**kwargs):
    from hetsplit.accelerate import HeteroAccelerator

    return HeteroAccelerator(**kwargs)


@pytest.mark.parametrize("name, call, error, fragment", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_api_bad_inputs(name, call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value) and "\n" not in str(info.value)


LEGIT_ROWS = [
    # 15: one rule for repeated devices: a profile measures each distinct device once, the
    # engines accept repeats (several replicas on one device) and use that curve for each.
    ("15 profile a device twice: measured once", lambda: _tiny_profile(["cpu", "cpu"]).devices, ["cpu"]),
    ("15 split over a repeated device", lambda: split_sizes(10, ["cpu", "cpu"], profile=_profile()), [5, 5]),
    ("15 weights as a tensor", lambda: split_sizes(10, ["cpu", "cpu@0.5"], weights=torch.tensor([4, 1])),
     [8, 2]),
    ("15 weights as an array", lambda: split_sizes(10, ["cpu", "cpu@0.5"], weights=np.array([4.0, 1.0])),
     [8, 2]),
    ("15 weights of any magnitude", lambda: sizes_from_weights(10, [1e308, 1e308]), [5, 5]),
    ("27 'cpu:0' is the CPU, as in torch", lambda: parse_device("cpu:0").name, "cpu"),
    ("27 torch.device('cpu', 0) is the CPU", lambda: parse_device(torch.device("cpu", 0)).name, "cpu"),
    ("7 a device picked twice is numbered on", lambda: _merged([("cpu", 2), ("cpu@0.25", 1), ("cpu", 2)]).devices,
     ["cpu#1", "cpu#2", "cpu@0.25", "cpu#3", "cpu#4"]),
    ("10 the largest batch", lambda: sum(solve(_profile(), MAX_BATCH).sizes), MAX_BATCH),
    ("m accumulate without caps: one micro-batch each", lambda: solve(_profile(), 100, accumulate=True).micro_batches,
     [[85], [15]]),
    ("m a device that holds no sample gets none", lambda: solve(Profile.from_measurements(
     {"a": [(16, 0.1)], "b": [(16, 0.1)]}, memory_caps={"a": 0}), 10, accumulate=True).sizes, [0, 10]),
]  # fmt: skip


@pytest.mark.parametrize("name, call, expected", LEGIT_ROWS, ids=[r[0] for r in LEGIT_ROWS])
def test_legitimate_inputs_get_correct_behaviour(name, call, expected):
    assert call() == expected


FILE_ROWS = [
    # 6 and 9: every measurement, knot and cap of a stored profile is checked on load
    ("negative batch", lambda d: d["measurements"][0].update(batch=-8), "'cpu@0.25'", "-8"),
    ("fractional batch", lambda d: d["measurements"][0].update(batch=16.7), "'cpu@0.25'", "16.7"),
    ("negative time", lambda d: d["measurements"][0].update(times=[-1.0]), "'cpu@0.25'", "-1.0"),
    ("NaN as a string", lambda d: d["measurements"][0].update(times=["NaN"]), "'cpu@0.25'", "'NaN'"),
    ("no times", lambda d: d["measurements"][0].update(times=[]), "'cpu@0.25'", "measurements[0]"),
    ("no measurements", lambda d: d.update(measurements=[]), "'cpu@0.25'", "non-empty list"),
    ("NaN in a curve knot", lambda d: d["curve"]["seconds"].__setitem__(-1, float("nan")), "'cpu@0.25'", "finite"),
    ("NaN in a middle knot", lambda d: d["curve"]["seconds"].__setitem__(0, float("nan")), "'cpu@0.25'",
     "curve seconds[0]"),
    ("a knot as a string", lambda d: d["curve"]["batch"].__setitem__(0, "16"), "'cpu@0.25'", "curve batch[0]"),
    ("a fractional curve cap", lambda d: d["curve"].update(memory_cap=16.7), "'cpu@0.25'", "16.7"),
    ("negative memory cap", lambda d: d.update(memory_cap=-3), "'cpu@0.25'", "memory_cap"),
    ("emulated at speed 0", lambda d: d["info"].update(emulated=True, speed=0), "'cpu@0.25'", "speed"),
    ("no curve", lambda d: d.pop("curve"), "'cpu@0.25'", "no 'curve' entry"),
    ("info not a mapping", lambda d: d.update(info=5), "p.json", "no 'info' mapping"),
]  # fmt: skip


@pytest.mark.parametrize("name, mutate, device, fragment", FILE_ROWS, ids=[r[0] for r in FILE_ROWS])
def test_damaged_profile_files_are_named_with_device_and_entry(tmp_path, name, mutate, device, fragment):
    path = _stored(tmp_path, mutate)
    with pytest.raises(ProfileFileError) as info:
        Profile.load(path)
    message = str(info.value)
    assert str(path) in message and device in message and fragment in message and "\n" not in message


@pytest.mark.parametrize(
    "content", [b"\x89PNG\r\n\x1a\n\xff", ("[" * 100_000).encode(), b'{"a": ' + b"9" * 5000 + b"}"]
)
def test_binary_or_absurdly_nested_files_are_named(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ProfileFileError, match="x.json"):
        Profile.load(path)


def test_an_odd_file_among_stored_profiles_is_skipped_with_a_warning_at_the_callers_line(tmp_path, monkeypatch):
    directory = tmp_path / "profiles"
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(directory))
    good = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    good.host = platform.node()  # stored profiles are looked up for this host
    good.save()
    (directory / "x.json").write_bytes(b"\xff")
    (directory / "deep.json").write_text("[" * 100_000)
    (directory / "huge.json").write_text('{"a": ' + "9" * 5000 + "}")
    newer = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    newer.host, newer.created = platform.node(), "9999-01-01T00:00:00+00:00"  # the newest, but damaged inside
    path = newer.save(directory / "newer.json")
    doc = json.loads(path.read_text())
    doc["devices"][1]["curve"]["seconds"][-1] = "NaN"
    path.write_text(json.dumps(doc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards = hetsplit.balanced_split(torch.zeros(100), ["cpu", "cpu@0.25"])
    assert [len(s) for s in shards] == [80, 20]  # from the good profile
    skipped = " ".join(str(w.message) for w in caught)
    assert all(name in skipped for name in ("x.json", "deep.json", "huge.json", "newer.json"))
    assert {w.filename for w in caught} == {__file__}  # at the caller's line, not inside hetsplit


def test_saved_files_follow_the_umask_and_never_share_a_name(tmp_path):
    old = os.umask(0o022)
    try:
        first, second = _profile().save(directory=tmp_path), _profile().save(directory=tmp_path)
    finally:
        os.umask(old)
    assert first != second and first.exists() and second.exists()  # same host, model, devices and second
    assert first.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])  # no temporaries


def test_an_interrupted_save_leaves_nothing_behind(tmp_path, monkeypatch):
    import hetsplit.store as store

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "link", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _profile().save(directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_quick_profile_derives_an_emulated_device_from_its_real_one():
    prof = quick_profile(["cpu", "cpu@0.25"])
    real, slow = prof.entry("cpu").curve, prof.entry("cpu@0.25").curve
    assert slow.seconds == pytest.approx([4 * t for t in real.seconds]) and prof.entry("cpu@0.25").info.emulated


@pytest.mark.serial  # the calibration times the CPU: run alone, not beside the other pytest worker
def test_the_quick_profile_gives_an_emulated_device_its_share_and_warns_at_the_callers_line(monkeypatch):
    import hetsplit.quick as quick

    monkeypatch.setattr(quick, "_NOTICE_SHOWN", False)
    threads = torch.get_num_threads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sizes = [len(s) for s in hetsplit.balanced_split(torch.zeros(256, 3), ["cpu", "cpu@0.25"])]
    assert sizes[1] > 0 and sum(sizes) == 256, sizes  # was [256, 0]: the slow device silently unused
    assert {w.filename for w in caught} == {__file__}  # a busy machine may add the noisy-timings warning
    assert any("quick built-in calibration" in str(w.message) for w in caught)
    assert torch.get_num_threads() == threads  # the calibration's one thread is given back


def test_what_if_copies_are_solved_fast_and_each_copy_is_worth_the_same(capsys, tmp_path):
    stored = _profile().save(tmp_path / "p.json")
    start = time.perf_counter()
    code = main(["plan", "--use", f"{stored}:cpu*{MAX_DEVICES - 1}", "--use", f"{stored}:cpu@0.25",
                 "--batch-size", "100000"])  # fmt: skip
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert code == 0 and f"without one cpu of external (any of the {MAX_DEVICES - 1} copies)" in out
    assert f"... {MAX_DEVICES - 40:,} more" in out  # the table sums up all but 40 rows
    assert elapsed < 15, elapsed  # a quadratic check took seconds per thousand copies


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CLI_ROWS = [
    # (item, argv, exit status, fragment of the one line on stderr)
    ("4", ["bench", "--rebalance", "--change", "cpu@1=0.0000001@3", "--model", "mlp"], 1, "at least 0.001"),
    ("5", ["profile", "--out", "DIRECTORY", "--devices", "cpu"], 1, "is a directory"),
    ("5", ["profile", "--profile-dir", "/proc/hetsplit/profiles", "--devices", "cpu"], 1,
     "cannot write to /proc/hetsplit/profiles"),
    ("6", ["plan", "BINARY", "--batch-size", "8"], 1, "not a text file"),
    ("m", ["profile", "--devices", "cpu,cpu:max0"], 1, "from 1 to"),
    ("m", ["profile", "--devices", "cpu,cpu@0.5:maxx"], 1, "after ':max' must be a whole number"),
    ("7", ["plan", "--use", "PROFILE:cpu*100000", "--batch-size", "8"], 1, "at most 10,000 devices"),
    ("7", ["plan", "--use", "PROFILE:cpu*6000", "--use", "PROFILE:cpu*6000", "--batch-size", "8"], 1,
     "at most that many"),
    ("10", ["plan", "PROFILE", "--batch-size", str(10**20)], 1, f"{MAX_BATCH:,}"),
    ("10", ["profile", "--batch-sizes", "1000000000", "--devices", "cpu"], 1, "above max_probe=65,536"),
    ("13", ["profile", "--model", "os:getcwd", "--input-shape", "3", "--devices", "cpu"], 1,
     "returned str, not a torch.nn.Module"),
    ("13", ["demo", "--json", "/proc/hetsplit/r.json", "--devices", "cpu,cpu@0.5"], 1, "cannot write to /proc"),
    ("13", ["bench", "--json", "/proc/hetsplit/r.json"], 1, "cannot write to /proc"),
    ("13", ["show", "PROFILE", "--out", "/proc/hetsplit/p.png"], 1, "cannot write to /proc/hetsplit (for p.png)"),
    ("14", ["bench", "--rebalance", "--devices", "cpu,cpu@1", "--change", "cpu@0.5=0.25@3"], 1,
     "not among the devices"),
    ("15", ["profile", "--devices", ""], 1, "no devices given in ''"),
    ("15", ["demo", "--devices", ""], 1, "no devices given in ''"),
    ("15", ["bench", "--devices", ""], 1, "no devices given in ''"),
    ("16", ["bench", "--calibrate", "-1"], 2, "expected a whole number >= 0, got '-1'"),
    ("16", ["bench", "--calibrate-seconds", "-0.5"], 2, "expected a number >= 0, got '-0.5'"),
    ("15", ["plan", "PROFILE", "--devices", "", "--batch-size", "8"], 1, "names no device"),
    ("15", ["demo", "--devices", "cpu"], 1, "two or more devices"),
    ("16", ["demo", "--threads-only", "--devices", "cpu"], 1, "two or more devices"),
    ("15", ["profile", "--budget", "inf", "--devices", "cpu"], 2, "expected a positive number, got 'inf'"),
    ("15", ["plan", "PROFILE", "--batch-size", "8", "--link-gbps", "nan"], 2, "expected a positive number"),
    ("27", ["show", "PROFILE", "--plan", "PLAN", "--batch-size", "50"], 1,
     "--batch-size 50, but the plan"),
    ("27", ["launch", "--devices", "cpu,cpu@0.5"], 2, "give the training script to run"),
    ("27", ["show", "FIFO"], 1, "a named pipe (FIFO), not a hetsplit file"),
    ("36", ["profile", "--devices", "cpu,cuda0"], 1, "cannot parse device 'cuda0' (did you mean 'cuda:0'?)"),
    ("36", ["bench", "--batch-size", "1", "--model", "mlp"], 1,
     "--batch-size 1 cannot be split across 2 devices"),
    ("36", ["demo", "--batch-size", "2", "--devices", "cpu,cpu@0.5,cpu@0.25"], 1,
     "--batch-size 2 cannot be split across 3 devices"),
    ("36", ["plan", "PROFILE", "--use", "PROFILE:cpu*8", "--batch-size", "8"], 1,
     "p.json is given whole (all its devices) and again in --use"),
    ("36", ["show", "VERSION_AS_TEXT"], 1, "damaged file: schema_version '1' is not a whole number"),
    ("36", ["launch", "--devices", "cpu,cpu@0.5", "nosuch.py"], 1, "no such script: nosuch.py"),
]  # fmt: skip


@pytest.mark.parametrize(
    "item, argv, status, fragment", CLI_ROWS, ids=[f"{r[0]} {' '.join(r[1][:2])} {i}" for i, r in enumerate(CLI_ROWS)]
)
def test_cli_bad_inputs_are_one_line_before_any_work(capsys, tmp_path, item, argv, status, fragment):
    stored = _profile().save(tmp_path / "p.json")
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\xff")
    os.mkfifo(tmp_path / "stuck.json")  # read, it would wait for a writer forever
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(solve(Profile.load(stored), 100).to_dict()))
    text_version = tmp_path / "text_version.json"  # "1" where the number 1 belongs: an edited file
    text_version.write_text(stored.read_text().replace('"schema_version": 1', '"schema_version": "1"'))
    names = {"PROFILE": str(stored), "DIRECTORY": str(tmp_path), "BINARY": str(tmp_path / "bin.json"),
             "FIFO": str(tmp_path / "stuck.json"), "PLAN": str(plan), "VERSION_AS_TEXT": str(text_version)}  # fmt: skip
    argv = [names.get(a, a.replace("PROFILE", str(stored))) for a in argv]
    if status == 2:  # argparse's own refusal: usage, then one error line
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and fragment in err.strip().splitlines()[-1], err
        return
    code, out, err = _cli(capsys, *argv)
    assert code == status and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "profiling" not in out and "bench " not in out  # refused before any device work


def test_plan_takes_a_repeated_device_as_copies(capsys, tmp_path):
    stored = _profile().save(tmp_path / "p.json")
    code, out, err = _cli(capsys, "plan", str(stored), "--devices", "cpu,cpu", "--batch-size", "100")
    assert code == 0 and "cpu#1" in out and "cpu#2" in out, err


def test_readme_bench_rebalance_command_works_as_written(capsys, tmp_path):
    """`hetsplit bench --rebalance --change cpu@1=0.25@30` (short here): the devices default to cpu and cpu@1."""
    code, out, err = _cli(capsys, "bench", "--rebalance", "--change", "cpu@1=0.25@4", "--model", "mlp",
                          "--batch-size", "32", "--steps", "8", "--every", "2", "--quiet")  # fmt: skip
    assert code == 0, err
    assert "bench mlp on cpu, cpu@1" in out and "1 CPU thread" in out  # the one thread rule, printed


def test_a_model_module_in_the_current_directory_imports(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodels_here.py").write_text("import torch.nn as nn\ndef factory():\n    return nn.Linear(3, 10)\n")
    monkeypatch.chdir(tmp_path)
    code, _out, err = _cli(capsys, "profile", "--model", "mymodels_here:factory", "--input-shape", "3",
                          "--devices", "cpu", "--batch-sizes", "2,4", "--budget", "2", "--quiet",
                          "--out", str(tmp_path / "p.json"))  # fmt: skip
    assert code == 0, err
    assert Path(tmp_path / "p.json").exists()
    code, out, err = _cli(capsys, "demo", "--model", "mymodels_here:factory", "--input-shape", "3",
                          "--devices", "cpu,cpu@0.5", "--batch-size", "8", "--steps", "1", "--budget", "1",
                          "--quiet", "--threads-only")  # fmt: skip
    assert code == 0 and "hetsplit demo: mymodels_here:factory on cpu, cpu@0.5" in out, err


def test_the_cli_starts_without_torch():
    """So an early Ctrl-C lands in the CLI's handler, not in an import."""
    import subprocess
    import sys

    probe = subprocess.run(
        [sys.executable, "-c", "import sys, hetsplit.apps.cli; print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip() == "False"


def _wait_until_torch_loads(pid, timeout=60.0):
    """Until torch's library is mapped into the process: its own clock, not the machine's speed.

    A fixed delay sent the signal before the CLI was imported when the machine was busy
    (the interpreter's own start then printed the traceback, no code of ours running yet).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps") as f:
                if "libtorch" in f.read():
                    return
        except OSError:  # not Linux, or the process is gone: fall back to a fixed wait
            time.sleep(0.3)
            return
        time.sleep(0.005)
    raise AssertionError(f"torch was not loaded within {timeout} s")


@pytest.mark.serial  # the signal's moment is timed: run alone, not beside the other pytest worker
@pytest.mark.parametrize("delay", [0.0, 1.5], ids=["while_torch_loads", "while_profiling"])
def test_ctrl_c_at_any_moment_is_one_line(tmp_path, delay):
    import signal
    import subprocess
    import sys

    # As from a terminal: a pytest started in the background (`cmd &`) ignores SIGINT, and
    # its children would inherit that.
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetsplit.apps.cli", "profile", "--devices", "cpu", "--quiet",
         "--out", str(tmp_path / "p.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    _wait_until_torch_loads(proc.pid)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "hetsplit: interrupted", err
    assert not (tmp_path / "p.json").exists()
