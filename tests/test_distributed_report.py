"""hd.SplitReport: the split and its predicted step at the start, the measured step beside it at the end."""

import hetsplit.distributed as hd
from hetsplit import Plan


def test_a_step_measured_by_the_caller_is_said_beside_the_prediction(capsys, monkeypatch):
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu@0.25"], [6, 2], [0.010, 0.009], 8)
    report = hd.SplitReport("train.py", 0)
    report.announce(plan)  # what hd.plan does when the plan is made
    report.step(plan)  # the first step of that plan does not say it again
    report.end(plan, measured=0.011)
    assert capsys.readouterr().out.splitlines() == [
        "hetsplit: train.py: global batch 8 split rank0:cpu 6 (75%), rank1:cpu@0.25 2 (25%); predicted step "
        "10.0 ms; emulated (a real device slowed down or capped, not real hardware): cpu@0.25",
        "hetsplit: train.py: measured step 11.0 ms (yours), predicted 10.0 ms (error -9%)",
    ]
    hd.SplitReport("train.py", 1).end(plan, measured=0.011)
    hd.SplitReport("train.py", 0, quiet=True).end(plan, measured=0.011)
    assert capsys.readouterr().out == ""  # rank 1 and quiet say nothing


def test_a_torchrun_script_on_hd_plan_s_plan_hears_its_measured_step_at_exit(capsys, monkeypatch):
    """hd.plan follows its plan: weight_gradients times each training step of it, and the end is said at exit.

    The steps are counted where weight_gradients counts them (a training forward), on a clock
    the test sets: 0.5 s of warm-up, then 0.125 s a step.
    """
    from hetsplit.distributed import report as report_module
    from hetsplit.distributed.comm_hooks import WeightingState

    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    monkeypatch.setattr(report_module, "_FOLLOWED", [])
    plan = Plan(["rank0:cpu", "rank1:cpu@0.25"], [6, 2], [0.10, 0.08], 8)  # predicted 100 ms
    now = [0.0]
    said = hd.SplitReport("hd.plan", 0, clock=lambda: now[0])
    said.announce(plan, follow=True)  # as hd.plan does
    quiet = Plan(["rank0:cpu", "rank1:cpu"], [4, 4], [0.1, 0.1], 8)
    hd.SplitReport("hd.plan", 0, quiet=True).announce(quiet, follow=True)  # an integration's plan: it reports itself
    state = WeightingState(None, "mean", 0, 2)
    state.set_plan(plan)
    for period in [0.5, 0.125, 0.125, 0.125, 0.125]:
        state.started()
        now[0] += period
    state.started()
    other = WeightingState(None, "mean", 0, 2)
    other.set_plan(quiet)
    assert state.report is said and other.report is None
    report_module._end_runs()  # what runs at exit
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "hetsplit: hd.plan: measured step 125.0 ms (median of 4 after 1 warm-up, rank 0, start to start), "
        "predicted 100.0 ms (error -20%)"
    ], lines
    report_module._end_runs()
    assert capsys.readouterr().out == ""  # said once
