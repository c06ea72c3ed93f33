"""Pictures: a profile (curves, caps, split) and a bench timeline render to real PNG files."""

import builtins

import pytest

from hetsplit import Profile, solve
from hetsplit.apps.bench import BenchResult
from hetsplit.apps.show import MissingPlotExtra, plot_profile, plot_timeline

PNG = b"\x89PNG\r\n\x1a\n"


def _profile():
    return Profile.from_measurements(
        {
            "cuda:0": [(2, 0.004), (16, 0.0045), (64, 0.006), (256, 0.012)],
            "cpu": [(2, 0.001), (16, 0.006), (64, 0.02), (256, 0.08)],
        },
        memory_caps={"cuda:0": 512},
        model={"name": "lenet"},
        host="box",
    )


def _bench():
    prof = _profile()
    plan = solve(prof, 256)
    return BenchResult(
        devices=["cuda:0", "cpu"],
        model="lenet",
        batch_size=256,
        mode="gather",
        single={"cuda:0": 21000.0, "cpu": 3200.0},
        even=6000.0,
        balanced=19000.0,
        plan=plan,
        step_times={"even": 0.043, "balanced": 0.0135, "single:cuda:0": 0.012, "single:cpu": 0.08},
        overhead=0.02,
        busy={"even": {"cuda:0": 0.007, "cpu": 0.041}, "balanced": {"cuda:0": 0.011, "cpu": 0.0105}},
        meta={"date": "2026-11-21", "host": "box", "emulated": []},
    )


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == PNG and len(data) > 20_000  # a real picture, not an empty canvas


def test_profile_picture_with_solved_and_given_plans(tmp_path):
    out = plot_profile(_profile(), tmp_path / "sub" / "p.png", batch_size=200)
    assert out == tmp_path / "sub" / "p.png" and _is_png(out)
    plan = solve(_profile(), 100)
    assert _is_png(plot_profile(_profile(), tmp_path / "q.png", plan=plan))
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary file left behind


def test_timeline_picture(tmp_path):
    assert _is_png(plot_timeline(_bench(), tmp_path / "t.png"))


def test_bench_result_round_trips_through_a_dict():
    r = _bench()
    back = BenchResult.from_dict(r.to_dict())
    assert back.plan.sizes == r.plan.sizes and back.busy == r.busy and back.speedup_vs_even == r.speedup_vs_even


def test_missing_matplotlib_gives_a_one_line_hint(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(MissingPlotExtra, match=r"pip install 'hetsplit\[plot\]'"):
        plot_profile(_profile(), tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_show_draws_a_rebalance_run(tmp_path, capsys):
    import matplotlib  # noqa: F401  (a test extra: missing, fail; never skip)

    from hetsplit import store
    from hetsplit.apps.bench_result import RebalanceResult
    from hetsplit.apps.cli import main

    result = RebalanceResult(
        devices=["cpu", "cpu@1"], model="mlp", batch_size=64, every=3,
        change={"device": "cpu@1", "speed": 0.25, "step": 4}, step_times=[0.002] * 4 + [0.004] * 8,
        sizes=[[32, 32]] * 6 + [[48, 16]] * 6, changes=[{"step": 6, "old_sizes": [32, 32], "new_sizes": [48, 16]}],
        optimum=0.0025, optimum_sizes=[50, 14], settle=4, rebalancer_seconds=0.0001,
        meta={"date": "2026-11-23"},
    )  # fmt: skip
    path = store.write_json(tmp_path / "reb.json", "bench-rebalance", {"result": result.to_dict()})
    assert main(["show", str(path)]) == 0
    assert (tmp_path / "reb.png").stat().st_size > 10_000 and "picture written" in capsys.readouterr().out


def test_pictures_follow_the_umask_as_json_files_do(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        out = plot_profile(_profile(), tmp_path / "p.png")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644  # was 0600, mkstemp's mode


def test_the_timeline_title_says_when_one_device_alone_is_faster():
    from hetsplit.apps.show import timeline_title

    r = _bench()  # balanced 19,000 samples/s: 3.17x the even split, but cuda:0 alone does 21,000
    assert "balanced is 3.17x the even split, but cuda:0 alone is faster (1.11x the balanced split)" in timeline_title(
        r
    )
    r.balanced = 25200.0
    assert timeline_title(r).endswith("balanced is 4.20x the even split, 1.20x cuda:0 alone")


def test_show_draws_a_plan_file_alone(tmp_path, capsys):
    import json

    import matplotlib  # noqa: F401  (a test extra: missing, fail; never skip)

    from hetsplit.apps.cli import main

    prof = _profile().save(tmp_path / "p.json")
    assert main(["plan", str(prof), "--batch-size", "100", "--json"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)  # as 'hetsplit plan ... --json > plan.json'
    assert json.loads((tmp_path / "plan.json").read_text())["sizes"]
    assert main(["show", str(tmp_path / "plan.json")]) == 0  # was: "not a hetsplit file"
    assert "picture written to" in capsys.readouterr().out and _is_png(tmp_path / "plan.png")
    (tmp_path / "other.json").write_text('{"a": 1}')  # neither a hetsplit file nor a plan: as before
    assert main(["show", str(tmp_path / "other.json")]) == 1
    assert capsys.readouterr().err.strip() == f"hetsplit show: error: {tmp_path / 'other.json'}: not a hetsplit file"


def test_a_balanced_split_that_is_one_device_alone_says_so():
    # batch 8 on cpu + a slow device: the plan gives cpu all 8, so "balanced vs cpu alone" would
    # compare cpu with itself, reading noise as a speedup.
    from hetsplit.planning import plan_from_sizes

    r = _bench()
    r.plan = plan_from_sizes(None, ["cuda:0", "cpu"], [256, 0])
    text = r.table()
    assert "the balanced split [256, 0] is cuda:0 alone: at a batch of 256 the other devices would only slow" in text
    assert "balanced vs cuda:0 alone" not in text
    assert "balanced vs cuda:0 alone: 0.90x" in _bench().table()  # a real split keeps its verdict
    from hetsplit.apps.show import timeline_title

    assert timeline_title(r).endswith("balanced is 3.17x the even split, the balanced split is cuda:0 alone (nothing "
                                      "split at this batch)")  # fmt: skip


def test_a_plan_split_by_the_quick_calibration_says_whose_step_it_predicts(tmp_path):
    import dataclasses

    from hetsplit.apps.show import plot_plan, step_words

    plan = dataclasses.replace(solve(_profile(), 100), stand_in="calibration-mlp")
    ms = f"{plan.slowest * 1e3:.2f} ms"
    assert step_words(plan) == f"predicted step of calibration-mlp {ms} (a stand-in, not your model)"
    assert "nan" not in step_words(plan)  # was: "predicted step nan ms"
    assert step_words(solve(_profile(), 100)) == f"predicted step {solve(_profile(), 100).step_time * 1e3:.2f} ms"
    assert _is_png(plot_plan(plan, tmp_path / "p.png"))
