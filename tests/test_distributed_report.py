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
        "hetsplit: train.py: measured step 11.0 ms (yours), predicted 10.0 ms (+10%)",
    ]
    hd.SplitReport("train.py", 1).end(plan, measured=0.011)
    hd.SplitReport("train.py", 0, quiet=True).end(plan, measured=0.011)
    assert capsys.readouterr().out == ""  # rank 1 and quiet say nothing
