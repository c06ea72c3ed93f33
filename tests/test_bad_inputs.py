"""A catalogue of bad inputs (issue 17): each gets one clear error naming the value, before any device work.

Add a row for every new public function or CLI flag. Each row: what is called, the
exception type (or CLI exit status) and a fragment of its one-line message.
"""

import json
import math
import platform
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hetsplit
from hetsplit import Profile, ProfileFileError
from hetsplit.apps.cli import main
from hetsplit.planning import solve
from hetsplit.planning.checks import MAX_BATCH


def _profile():
    return Profile.from_measurements({"cpu": [(16, 0.01), (64, 0.03)], "cpu@0.25": [(16, 0.04), (64, 0.12)]})


def _stored(tmp_path, mutate):
    path = _profile().save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    mutate(doc["devices"][1])
    path.write_text(json.dumps(doc))
    return path


API_ROWS = [
    ("emulated speed too small", lambda: hetsplit.parse_device("cpu@0.0000001"), ValueError, "at least 0.001"),
    ("emulated speed zero", lambda: hetsplit.parse_device("cpu@0"), ValueError, "must be in (0, 1]"),
    ("batch beyond any machine", lambda: solve(_profile(), 10**30), ValueError, f"{MAX_BATCH:,}"),
    ("fractional batch", lambda: Profile.from_measurements({"a": [(16.7, 0.1)]}), ValueError, "16.7"),
    ("NaN cap", lambda: Profile.from_measurements({"a": [(16, 0.1)]}, memory_caps={"a": math.nan}), ValueError,
     "device 'a': memory cap"),
    ("a point that is not a pair", lambda: Profile.from_measurements({"a": [(16,)]}), ValueError,
     "device 'a': a measurement must be a (batch, seconds) pair"),
    ("negative time", lambda: Profile.from_measurements({"a": [(16, -1.0)]}), ValueError, "positive, finite"),
    ("scatter sizes with a bool", lambda: hetsplit.scatter(torch.arange(10), ["cpu", "cpu"], [True, 9]), TypeError,
     "got bool"),
    ("weights as a string", lambda: hetsplit.balanced_split(torch.zeros(10), ["cpu", "cpu@0.5"], weights="41"),
     TypeError, "'41'"),
    ("profile an empty sample", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(0, 3), "cpu"), ValueError,
     "no rows"),
    ("profile with a NaN budget", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), "cpu",
     time_budget=math.nan), ValueError, "time_budget > 0"),
    ("profile a batch beyond the probe", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), "cpu",
     batch_sizes=[1_000_000_000]), ValueError, "above max_probe"),
    ("profile a device twice", lambda: hetsplit.profile(nn.Linear(3, 2), torch.zeros(4, 3), ["cpu", "cpu"]),
     ValueError, "repeat a device"),
    ("reduce with NaN sizes", lambda: hetsplit.reduce_gradients([[], []], [math.nan, 2]), ValueError,
     "must be an integer >= 0"),
]  # fmt: skip


@pytest.mark.parametrize("name, call, error, fragment", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_api_bad_inputs(name, call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value) and "\n" not in str(info.value)


FILE_ROWS = [
    ("negative batch", lambda d: d["measurements"][0].update(batch=-8), "'cpu@0.25'", "-8"),
    ("negative time", lambda d: d["measurements"][0].update(times=[-1.0]), "'cpu@0.25'", "-1.0"),
    ("NaN as a string", lambda d: d["measurements"][0].update(times=["NaN"]), "'cpu@0.25'", "'NaN'"),
    ("NaN in a curve knot", lambda d: d["curve"]["seconds"].__setitem__(-1, float("nan")), "'cpu@0.25'", "finite"),
    ("negative memory cap", lambda d: d.update(memory_cap=-3), "'cpu@0.25'", "memory_cap"),
]


@pytest.mark.parametrize("name, mutate, device, fragment", FILE_ROWS, ids=[r[0] for r in FILE_ROWS])
def test_damaged_profile_files_are_named_with_device_and_entry(tmp_path, name, mutate, device, fragment):
    path = _stored(tmp_path, mutate)
    with pytest.raises(ProfileFileError) as info:
        Profile.load(path)
    message = str(info.value)
    assert str(path) in message and device in message and fragment in message


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\xff", ("[" * 100_000).encode()])
def test_binary_or_absurdly_nested_files_are_named(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ProfileFileError, match="x.json"):
        Profile.load(path)


def test_an_odd_file_among_stored_profiles_is_skipped_with_a_warning(tmp_path, monkeypatch):
    directory = tmp_path / "profiles"
    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(directory))
    good = Profile.from_measurements({"cpu": [(100, 0.1)], "cpu@0.25": [(100, 0.4)]})
    good.host = platform.node()  # stored profiles are looked up for this host
    good.save()
    (directory / "x.json").write_bytes(b"\xff")
    (directory / "deep.json").write_text("[" * 100_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards = hetsplit.balanced_split(torch.zeros(100), ["cpu", "cpu@0.25"])
    assert [len(s) for s in shards] == [80, 20]  # from the good profile
    skipped = " ".join(str(w.message) for w in caught)
    assert "x.json" in skipped and "deep.json" in skipped


def test_saved_files_follow_the_umask_and_never_share_a_name(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        first, second = _profile().save(directory=tmp_path), _profile().save(directory=tmp_path)
    finally:
        os.umask(old)
    assert first != second and first.exists() and second.exists()  # same host, model, devices and second
    assert first.stat().st_mode & 0o777 == 0o644


def test_the_quick_profile_derives_an_emulated_device_from_its_real_one():
    prof = hetsplit.quick_profile(["cpu", "cpu@0.25"])
    real, slow = prof.entry("cpu").curve, prof.entry("cpu@0.25").curve
    assert slow.seconds == pytest.approx([4 * t for t in real.seconds]) and prof.entry("cpu@0.25").info.emulated


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CLI_ROWS = [
    (["profile", "--devices", ""], "no devices given in ''"),
    (
        ["profile", "--model", "os:getcwd", "--input-shape", "3", "--devices", "cpu"],
        "returned str, not a torch.nn.Module",
    ),
    (["plan", "--use", "PROFILE:cpu*100000", "--batch-size", "8"], "at most 10,000 devices"),
    (["plan", "PROFILE", "--batch-size", str(10**20)], f"{MAX_BATCH:,}"),
    (["demo", "--json", "/proc/hetsplit/r.json", "--devices", "cpu,cpu@0.5"], "cannot write to /proc"),
    (["bench", "--json", "/proc/hetsplit/r.json"], "cannot write to /proc"),
    (["profile", "--out", "DIRECTORY", "--devices", "cpu"], "is a directory"),
    (["bench", "--rebalance", "--devices", "cpu,cpu@1", "--change", "cpu@0.5=0.25@3"], "not among the devices"),
]


@pytest.mark.parametrize("argv, fragment", CLI_ROWS, ids=[" ".join(r[0][:2]) + f" {i}" for i, r in enumerate(CLI_ROWS)])
def test_cli_bad_inputs_are_one_line_before_any_work(capsys, tmp_path, argv, fragment):
    stored = _profile().save(tmp_path / "p.json")
    argv = [str(stored) if a == "PROFILE" else a.replace("PROFILE", str(stored)) for a in argv]
    argv = [str(tmp_path) if a == "DIRECTORY" else a for a in argv]
    code, out, err = _cli(capsys, *argv)
    assert code == 1 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "profiling" not in out and "bench " not in out  # refused before any device work


def test_a_model_module_in_the_current_directory_imports(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodels_here.py").write_text("import torch.nn as nn\ndef factory():\n    return nn.Linear(3, 10)\n")
    monkeypatch.chdir(tmp_path)
    code, _out, err = _cli(capsys, "profile", "--model", "mymodels_here:factory", "--input-shape", "3",
                          "--devices", "cpu", "--batch-sizes", "2,4", "--budget", "2", "--quiet",
                          "--out", str(tmp_path / "p.json"))  # fmt: skip
    assert code == 0, err
    assert Path(tmp_path / "p.json").exists()


def test_ctrl_c_at_any_moment_is_one_line(tmp_path):
    """The CLI starts without torch, so an early Ctrl-C lands in its handler, not in an import."""
    import signal
    import subprocess
    import sys
    import time

    probe = subprocess.run(
        [sys.executable, "-c", "import sys, hetsplit.apps.cli; print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip() == "False"
    for delay in (0.3, 1.5):  # while torch loads, and once profiling runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetsplit.apps.cli", "profile", "--devices", "cpu", "--quiet",
             "--out", str(tmp_path / "p.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err.strip() == "hetsplit: interrupted", err
        assert not (tmp_path / "p.json").exists()
