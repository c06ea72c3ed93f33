import argparse
import json

import pytest

from hetsplit import Profile
from hetsplit.apps.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_devices_table_and_json(capsys):
    code, out, _ = _run(capsys, "devices")
    assert code == 0 and "cpu" in out and "memory" in out
    code, out, _ = _run(capsys, "devices", "--json")
    assert code == 0 and any(d["kind"] == "cpu" for d in json.loads(out))


def test_profile_then_plan(capsys, tmp_path):
    out_file = tmp_path / "p.json"
    code, out, _ = _run(
        capsys,
        "profile",
        "--devices",
        "cpu,cpu@0.5",
        "--model",
        "mlp",
        "--batch-sizes",
        "4,16",
        "--repeats",
        "2",
        "--budget",
        "5",
        "--out",
        str(out_file),
        "--quiet",
        "--batch-size",
        "64",
    )
    assert code == 0, out
    assert "cpu@0.5 (emulated)" in out and "emulated devices: cpu@0.5" in out and "synthetic" in out
    assert "; 1 CPU thread\n" in out  # CPU-only sets with an emulated CPU profile on one thread each
    assert "share of 64" in out and str(out_file) in out
    prof = Profile.load(out_file)
    assert prof.devices == ["cpu", "cpu@0.5"] and prof.model["name"] == "mlp"
    code, out, _ = _run(capsys, "plan", str(out_file), "--batch-size", "40")
    assert code == 0 and "predicted compute per step" in out and "even split" in out and "emulated" in out
    code, out, _ = _run(capsys, "plan", str(out_file), "--batch-size", "40", "--json")
    plan = json.loads(out)
    assert sum(plan["sizes"]) == 40 and plan["devices"] == ["cpu", "cpu@0.5"]


def test_profile_defaults_add_an_emulated_cpu_on_a_one_device_machine(capsys, tmp_path, monkeypatch):
    import hetsplit.apps.commands as commands
    from hetsplit.devices import DeviceInfo

    monkeypatch.setenv("HETSPLIT_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr("hetsplit.devices.discover", lambda: [DeviceInfo("cpu", "cpu", "test cpu")])
    assert commands.default_devices() == ["cpu", "cpu@0.25"]
    code, out, _ = _run(capsys, "profile", "--batch-sizes", "2,8", "--repeats", "1", "--budget", "3", "--quiet")
    assert code == 0 and "cpu@0.25 (emulated)" in out
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "missing.json", "--batch-size", "4"], "missing.json: no such file"),
        (["profile", "--devices", "cuda:9"], "'cuda:9' is not available"),
        (["profile", "--devices", "cpu", "--model", "nosuch"], "unknown model 'nosuch'"),
        (["profile", "--devices", "cpu", "--model", "os.path:join"], "needs --input-shape"),
    ],
)
def test_errors_are_one_line_and_nonzero(capsys, argv, fragment):
    code, _out, err = _run(capsys, *argv)
    assert code == 1 and fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_of_damaged_profile_and_unknown_device(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = _run(capsys, "plan", str(bad), "--batch-size", "4")
    assert code == 1 and "bad.json: damaged file" in err
    good = Profile.from_measurements({"a": [(1, 0.1)]}).save(tmp_path / "g.json")
    code, _, err = _run(capsys, "plan", str(good), "--batch-size", "4", "--devices", "b")
    assert code == 1 and "'b' is not in this profile" in err


def test_argument_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "x.json", "--batch-size", "0"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_bench_command_and_json(capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, _ = _run(
        capsys,
        "bench",
        "--devices",
        "cpu,cpu@0.5",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--steps",
        "2",
        "--budget",
        "2",
        "--json",
        str(out_file),
        "--quiet",
    )
    assert code == 0 and "even split" in out and "efficiency vs ideal" in out and "emulated devices: cpu@0.5" in out
    doc = json.loads(out_file.read_text())
    assert doc["kind"] == "bench" and sum(doc["result"]["plan"]["sizes"]) == 32


def test_bench_needs_two_devices(capsys):
    code, _, err = _run(capsys, "bench", "--devices", "cpu", "--model", "mlp", "--steps", "1")
    assert code == 1 and "two or more devices" in err


def test_bench_rebalance_command(capsys, tmp_path):
    out_file = tmp_path / "reb.json"
    code, out, _ = _run(
        capsys,
        "bench",
        "--rebalance",
        "--devices",
        "cpu,cpu@1",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--steps",
        "12",
        "--every",
        "3",
        "--change",
        "cpu@1=0.25@4",
        "--json",
        str(out_file),
        "--quiet",
    )
    assert code == 0 and "online rebalancing from the even split" in out and "rebalancer cost" in out
    doc = json.loads(out_file.read_text())
    assert doc["kind"] == "bench-rebalance" and len(doc["result"]["step_times"]) == 12
    code, _, err = _run(capsys, "bench", "--change", "cpu@1=0.25@4", "--devices", "cpu,cpu@1")
    assert code == 1 and "--change needs --rebalance" in err
    code, _, err = _run(
        capsys, "bench", "--rebalance", "--change", "cpu@0.5=0.25@4", "--devices", "cpu,cpu@1", "--model", "mlp"
    )
    assert code == 1 and "not among the devices" in err


def test_demo_runs_end_to_end_and_writes_results_for_show(capsys, tmp_path):
    out_file = tmp_path / "demo.json"
    code, out, _ = _run(
        capsys,
        "demo",
        "--devices",
        "cpu,cpu@0.5",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--steps",
        "2",
        "--budget",
        "1",
        "--quiet",
        "--json",
        str(out_file),
    )
    assert code == 0, out
    assert "emulated: cpu@0.5" in out and "synthetic data" in out
    assert "balanced split of 32" in out and "of the ideal" in out and "sits idle" in out
    assert "processes (hetsplit launch, 2 gloo ranks, DDP)" in out and "on this machine" in out
    # The process engine's own work, each rank's the same steps without the all-reduce:
    # the verdict says how much of its step lies beyond it, when the all-reduce fits there.
    proc = json.loads(out_file.read_text())["result"]["processes"]
    assert len(proc["work"]) == 2 and all(0 < w < 60 for w in proc["work"])
    beyond = proc["step"] - max(proc["work"])
    assert ("beyond the slowest rank's own work, of which" in out) == (beyond >= proc["allreduce"])
    assert "ms on an all-reduce of" in out
    code, out, _ = _run(capsys, "show", str(out_file), "--out", str(tmp_path / "timeline.png"))
    assert code == 0 and (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_devices_add_an_emulated_cpu_on_a_one_device_machine(monkeypatch):
    import hetsplit.apps.demo as demo
    from hetsplit.devices import DeviceInfo

    monkeypatch.setattr(demo, "discover", lambda: [DeviceInfo(name="cpu", kind="cpu", description="CPU")])
    assert demo.demo_devices() == ["cpu", "cpu@0.25"]


def _two_machines(tmp_path):
    model = {"name": "resnet18", "parameter_bytes": 44_700_000, "fingerprint": "f"}
    a = Profile.from_measurements(
        {"cuda:0": [(16, 0.004), (256, 0.012)], "cpu": [(16, 0.05), (256, 0.8)]}, host="gpubox", model=model
    ).save(tmp_path / "a.json")
    b = Profile.from_measurements({"cpu": [(16, 0.1), (256, 1.6)]}, host="oldbox", model=model).save(
        tmp_path / "b.json"
    )
    return a, b


def test_plan_what_if_across_profiles_with_copies_and_a_link(capsys, tmp_path):
    a, b = _two_machines(tmp_path)
    code, out, _ = _run(
        capsys, "plan", "--use", f"{a}:cuda:0*4", "--use", f"{b}:cpu", "--batch-size", "1024", "--link-gbps", "10"
    )
    assert code == 0, out
    assert "what-if split of a batch of 1024" in out and "cuda:0#4" in out
    assert "predicted gradient all-reduce" in out and "not measurements" in out
    assert "without cpu of oldbox" in out and "without cuda:0*4 of gpubox" in out
    code, out, _ = _run(capsys, "plan", str(a), str(b), "--batch-size", "64", "--json")
    plan = json.loads(out)
    assert plan["devices"] == ["cuda:0", "gpubox/cpu", "oldbox/cpu"] and sum(plan["sizes"]) == 64


def test_show_draws_a_profile_with_a_plan_file(capsys, tmp_path):
    a, _ = _two_machines(tmp_path)
    code, out, _ = _run(capsys, "plan", str(a), "--batch-size", "100", "--json")
    (tmp_path / "plan.json").write_text(out)
    code, out, _ = _run(capsys, "show", str(a), "--plan", str(tmp_path / "plan.json"))
    assert code == 0 and "picture written to" in out and a.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["demo", "--devices", "cpu,cuda:7"], "'cuda:7' is not available"),
        (["demo", "--devices", "cpu,cpu@2"], "must be in (0, 1]"),
        (["demo", "--devices", "cpu,cpu@0.5", "--model", "nosuch"], "unknown model 'nosuch'"),
        (["profile", "--devices", "gpu0"], "gpu0"),
        (["plan", "--batch-size", "4"], "give a profile file"),
        (["plan", "--use", "a.json", "--batch-size", "4"], "bad --use 'a.json'"),
        (["plan", "--use", "nosuch.json:cpu*2", "--batch-size", "4"], "nosuch.json: no such file"),
        (["bench", "--devices", "cpu,cuda:3", "--model", "mlp"], "'cuda:3' is not available"),
        (["bench", "--rebalance", "--devices", "cpu,cpu@1", "--change", "cpu@1=x@3"], "bad speed change"),
        (["show", "nosuch.json"], "nosuch.json: no such file"),
    ],
)
def test_every_command_reports_bad_input_in_one_line(capsys, argv, fragment):
    code, _out, err = _run(capsys, *argv)
    assert code == 1 and fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_damaged_and_wrong_files_are_one_line_errors(capsys, tmp_path):
    a, _ = _two_machines(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "hetsplit", "kind": "profile", "schema_version": 1, "devices": [{}]}')
    for argv, fragment in [
        (["show", str(bad)], "damaged profile"),
        (["plan", f"{a}", str(bad), "--batch-size", "8"], "damaged profile"),
        (["plan", "--use", f"{a}:cuda:5", "--batch-size", "8"], "'cuda:5' is not in this profile"),
        (["show", str(a), "--plan", str(tmp_path / "none.json")], "none.json: no such file"),
        (["show", str(a), "--plan", str(bad)], "not a plan"),
        (["plan", str(a), str(a), "--devices", "cpu", "--batch-size", "8"], "--devices picks devices of one profile"),
    ]:
        code, _, err = _run(capsys, *argv)
        assert code == 1 and fragment in err and len(err.strip().splitlines()) == 1, (argv, err)
    tmp_bench = tmp_path / "bench.json"
    from hetsplit import store

    store.write_json(tmp_bench, "bench", {"result": {"devices": ["cpu"]}})
    code, _, err = _run(capsys, "show", str(tmp_bench))
    assert code == 1 and "damaged bench results" in err


def test_devices_rejects_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["devices", "--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_the_demo_ranks_import_the_standard_library_not_a_file_of_the_current_directory(tmp_path, monkeypatch):
    import subprocess
    import sys

    from hetsplit.apps.demo import _rank_env

    (tmp_path / "statistics.py").write_text("raise SystemExit('imported the statistics.py of the current directory')\n")
    (tmp_path / "mymodel_here.py").write_text("import torch.nn as nn\ndef factory():\n    return nn.Linear(3, 2)\n")
    (tmp_path / "bin").mkdir()
    probe = tmp_path / "bin" / "rank.py"  # run by path, as torchrun runs the demo's ranks
    probe.write_text(
        "import statistics\nfrom hetsplit.apps.models import load_model\n"
        "print(statistics.__file__, load_model('mymodel_here:factory', (3,)).name)\n"
    )
    monkeypatch.chdir(tmp_path)
    env = _rank_env(["cpu", "cpu@0.5"], 1)
    proc = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stdlib, model = proc.stdout.split()
    assert not stdlib.startswith(str(tmp_path)) and model == "mymodel_here:factory"  # a model module here still loads


def test_bench_and_demo_train_a_model_of_any_number_of_classes(capsys, tmp_path, monkeypatch):
    (tmp_path / "three_classes.py").write_text(
        "import torch.nn as nn\ndef factory():\n    return nn.Linear(4, 3)\n"
        "def sequence():\n    return nn.Conv1d(4, 3, 1)\n"
    )
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "bench", "--model", "three_classes:factory", "--input-shape", "4", "--devices",
                          "cpu,cpu@0.5", "--batch-size", "8", "--steps", "1", "--budget", "1", "--calibrate", "0",
                          "--quiet")  # fmt: skip
    assert code == 0 and "balanced" in out, err  # was IndexError: Target 6 is out of bounds (10 classes assumed)
    code, out, err = _run(capsys, "bench", "--model", "three_classes:sequence", "--input-shape", "4,5", "--devices",
                          "cpu,cpu@0.5", "--steps", "1", "--quiet")  # fmt: skip
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (
        "its output is a tensor of shape (2, 3, 5); give a classifier, or time any model with 'hetsplit profile'" in err
    )


def test_a_profile_of_a_built_in_model_is_named_after_it():
    import torch

    import hetsplit

    prof = hetsplit.profile(hetsplit.models.lenet(), torch.zeros(2, 1, 28, 28), "cpu", batch_sizes=[2], repeats=1)
    assert prof.model["name"] == "LeNet"  # was Sequential


def test_budget_is_one_option_everywhere_and_the_removed_spelling_names_it(capsys):
    from hetsplit.apps.cli import build_parser

    parser = build_parser()
    for command in ("demo", "profile", "bench"):
        assert parser.parse_args([command, "--budget", "3"]).budget == 3.0
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--profile-budget", "4"])
    assert "--profile-budget was removed: use --budget SECONDS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    help_text = capsys.readouterr().out
    assert "--budget" in help_text and "--profile-budget" not in help_text


def test_an_even_split_that_does_not_fit_is_explained_not_inf(capsys, tmp_path):
    prof = Profile.from_measurements(
        {"a": [(16, 0.01), (64, 0.03)], "b": [(16, 0.04), (64, 0.12)]}, memory_caps={"a": 60, "b": 20}
    )
    path = prof.save(tmp_path / "capped.json")
    code, out, err = _run(capsys, "plan", str(path), "--batch-size", "70")
    assert code == 0, err
    assert "even split: does not fit in memory (b holds at most 20 samples, its even share is 35" in out
    assert "one device alone: none holds the whole batch (batch 70; a at most 60, b at most 20)" in out
    assert "inf" not in out


def test_a_full_disk_after_profiling_names_the_file_and_keeps_the_results_shown(capsys, tmp_path, monkeypatch):
    import errno
    import os

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out_file = tmp_path / "p.json"
    code, out, err = _run(capsys, "profile", "--devices", "cpu,cpu@0.5", "--model", "mlp", "--batch-sizes", "2,4",
                          "--budget", "1", "--quiet", "--out", str(out_file))  # fmt: skip
    assert code == 1 and f"cannot write {out_file}: No space left on device" in err  # was "[Errno 28] ..." alone
    assert "share of 256" in out and not out_file.exists() and list(tmp_path.iterdir()) == []


def test_every_subcommand_says_what_it_does_and_its_defaults():
    from hetsplit.apps.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert sub.description, f"'hetsplit {name} --help' has no description"
        for action in sub._actions:
            if action.help in (None, argparse.SUPPRESS) or action.default in (None, False, [], argparse.SUPPRESS):
                continue
            assert "default" in action.help, f"hetsplit {name} {action.option_strings}: help does not say the default"


def test_bench_runs_on_a_repeated_device(capsys):
    # cpu,cpu: two replicas on one device, each planned with that device's curve (was: "the plan is
    # for devices ['cpu'], but this wrapper runs on ['cpu', 'cpu']" after profiling).
    code, out, err = _run(capsys, "bench", "--devices", "cpu,cpu", "--model", "mlp", "--batch-size", "8",
                          "--steps", "1", "--budget", "1", "--calibrate", "0", "--quiet")  # fmt: skip
    assert code == 0, err
    assert [line.split("  ")[0] for line in out.splitlines() if line.startswith("cpu alone")] == ["cpu alone"]
    assert "balanced split [" in out
    assert "listed cpu 2 times: copies of a device share it, so it counts once in the ideal" in out


def test_plan_notes_a_profile_measured_here_under_another_torch(capsys, tmp_path):
    import platform

    import torch

    prof = Profile.from_measurements({"cpu": [(16, 0.01), (64, 0.03)]}, host=platform.node())
    prof.source, prof.versions = "measured", {"hetsplit": "0.1", "torch": "1.0.0"}
    path = prof.save(tmp_path / "old.json")
    code, out, _ = _run(capsys, "plan", str(path), "--batch-size", "8")
    assert (
        code == 0
        and (
            f"note: {path} was measured on this machine under torch 1.0.0, which is now torch {torch.__version__}; "
            "its times may be off — re-profile ('hetsplit profile') to refresh it"
        )
        in out
    )
    prof.host = "otherbox"  # another machine's profile records that machine's torch: nothing to say
    code, out, _ = _run(capsys, "plan", str(prof.save(tmp_path / "other.json")), "--batch-size", "8")
    assert code == 0 and "note:" not in out


def test_profile_of_a_model_taking_token_ids(capsys, tmp_path, monkeypatch):
    (tmp_path / "tokens.py").write_text(
        "import torch.nn as nn\n"
        "def factory():\n    return nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(24, 3))\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["profile", "--model", "tokens:factory", "--input-shape", "6", "--devices", "cpu,cpu@0.5", "--batch-sizes",
            "2,4", "--repeats", "1", "--budget", "2", "--quiet", "--out", str(tmp_path / "p.json")]  # fmt: skip
    code, out, err = _run(capsys, *argv)  # was: the first step failed in torch's words about the embedding
    assert code == 1 and len(err.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists(), err
    assert "fails on float inputs but runs on integers (token ids): pass --vocab-size N" in err
    assert "hetsplit.profile(model, sample, devices)" in err and "profiling" not in out
    code, out, err = _run(capsys, *argv, "--vocab-size", "50")
    assert code == 0 and "(input (6,), token ids < 50, float32, synthetic data)" in out, err
    prof = Profile.load(tmp_path / "p.json")
    assert prof.model["dtype"] == "int64" and prof.model["input_shape"] == [[6]]
    assert all(len(prof.entry(name).measurements) == 2 for name in prof.devices)
