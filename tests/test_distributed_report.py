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
        "hetsplit: train.py: global batch 8 split rank0:cpu 6 (75%, 10.0 ms), rank1:cpu@0.25 2 (25%, 9.0 ms); "
        "predicted step 10.0 ms; emulated (a real device slowed down or capped, not real hardware): cpu@0.25",
        "hetsplit: train.py: measured step 11.0 ms (yours), predicted 10.0 ms (error -9%)",
    ]
    hd.SplitReport("train.py", 1).end(plan, measured=0.011)
    hd.SplitReport("train.py", 0, quiet=True).end(plan, measured=0.011)
    assert capsys.readouterr().out == ""  # rank 1 and quiet say nothing


def test_a_torchrun_script_on_hd_plan_s_plan_hears_its_measured_step_at_exit(capsys, monkeypatch):
    """hd.plan follows its plan: weight_gradients times each training step of it, and the end is said at exit.

    The steps are counted where weight_gradients counts them (a training forward), on a clock
    the test sets: 0.5 s of warm-up, then steps of 100 to 150 ms (median 125, ±10 % step to step).
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
    for period in [0.5, 0.1, 0.125, 0.125, 0.15]:
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
        "predicted 100.0 ms (error -20%, noise ±10%)"
    ], lines
    report_module._end_runs()
    assert capsys.readouterr().out == ""  # said once


def test_a_step_of_accumulated_batches_is_timed_whole_and_predicted_as_that_many(capsys, monkeypatch):
    """The Trainer's step_end(batches): the optimizer step is timed whole, not divided into its batches."""
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu"], [4, 4], [0.02, 0.02], 8)  # one global batch: 20 ms
    now = [0.0]
    report = hd.SplitReport("HeteroTrainer", 0, clock=lambda: now[0])
    for _ in range(3):
        report.step(plan)
        now[0] += 0.09  # four global batches of the step
        report.step_end(4)
        now[0] += 1.0  # evaluation: no step's time
    report.end(plan)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        "hetsplit: HeteroTrainer: measured step 90.0 ms (median of 2 after 1 warm-up, rank 0, start to end; "
        "4 global batches accumulated each), predicted 4 x 20.0 ms = 80.0 ms (error -11%)"
    ), line


def _accumulating(ctx):
    """Steps of 4 accumulated global batches (nanoGPT's require_backward_grad_sync, DDP's no_sync()) and of
    the plan's 3 micro-batches (hd.micro_batches), on a clock each forward moves by 10 ms: rank 0's end line."""
    import contextlib
    import io

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetsplit.distributed import report as report_module

    now = [0.0]

    class Timed(torch.nn.Linear):
        def forward(self, x):
            now[0] += 0.01
            return super().forward(x)

    said = {}
    for mode in ("require_backward_grad_sync", "no_sync", "micro_batches"):
        micro = [[2, 2, 2], [2]] if mode == "micro_batches" else [[6], [2]]
        plan = Plan(["rank0:cpu", "rank1:cpu"], [6, 2], [0.008, 0.008], 8, micro_batches=micro)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            report = hd.SplitReport("hd.plan", ctx.rank, clock=lambda: now[0])
            report.announce(plan, follow=True)
            ddp = DDP(Timed(3, 1).double())
            hd.weight_gradients(ddp, plan)
            x, y = torch.randn(plan.sizes[ctx.rank], 3).double(), torch.randn(plan.sizes[ctx.rank], 1).double()
            for _ in range(5):
                if mode == "micro_batches":
                    for xm, ym in hd.micro_batches(ddp, (x, y), plan):
                        F.mse_loss(ddp(xm), ym).backward()
                    continue
                for k in range(4):
                    last = k == 3
                    if mode == "no_sync":
                        with contextlib.nullcontext() if last else ddp.no_sync():
                            F.mse_loss(ddp(x), y).backward()
                    else:
                        ddp.require_backward_grad_sync = last
                        F.mse_loss(ddp(x), y).backward()
            report.end()
            report_module._FOLLOWED.clear()
        said[mode] = out.getvalue().splitlines()[1:]
    return said


def test_the_measured_step_is_an_optimizer_step_over_its_accumulated_batches(tmp_path, monkeypatch):
    from helpers import run_ranks

    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    said = run_ranks({"accumulating": _accumulating}, tmp_path)["accumulating"]
    four = (
        "hetsplit: hd.plan: measured step 40.0 ms (median of 3 after 1 warm-up, rank 0, start to start; "
        "4 global batches accumulated each), predicted 4 x 8.0 ms = 32.0 ms (error -20%, noise ±0%)"
    )
    assert said[0]["require_backward_grad_sync"] == [four], said[0]
    assert said[0]["no_sync"] == [four], said[0]
    # The plan's own micro-batches are one global batch: 3 forwards of rank 0 a step, predicted once.
    assert said[0]["micro_batches"] == [
        "hetsplit: hd.plan: measured step 30.0 ms (median of 3 after 1 warm-up, rank 0, start to start), "
        "predicted 8.0 ms (error -73%, noise ±0%)"
    ], said[0]
    assert said[1] == {mode: [] for mode in said[0]}  # rank 1 says nothing


def _said(plan, **kwargs):
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        hd.SplitReport("train.py", 0).announce(plan, **kwargs)
    return out.getvalue().strip()


def test_each_share_is_said_with_the_time_its_curve_predicts_for_it(monkeypatch):
    import math

    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu@0.25"], [205, 51], [0.0251, 0.0248], 256)
    assert _said(plan).startswith(
        "hetsplit: train.py: global batch 256 split rank0:cpu 205 (80%, 25.1 ms), rank1:cpu@0.25 51 (20%, 24.8 ms); "
        "predicted step 25.1 ms"
    )
    # An unknown time (NaN) and an unused device: the share alone.
    unknown = Plan(["rank0:cpu", "rank1:cpu", "rank2:cpu"], [6, 2, 0], [0.01, math.nan, 0.0], 8)
    assert "split rank0:cpu 6 (75%, 10.0 ms), rank1:cpu 2 (25%), rank2:cpu 0 (0%);" in _said(unknown)
    # A quick calibration's plan times the calibration's model, not the user's: said as such.
    quick = Plan(["rank0:cpu", "rank1:cpu"], [6, 2], [0.01, 0.009], 8, stand_in="calibration-mlp")
    assert "split rank0:cpu 6 (75%, calibration 10.0 ms), rank1:cpu 2 (25%, calibration 9.0 ms); no predicted" in (
        _said(quick)
    )


def test_a_plan_on_an_emulated_rank_measured_off_its_speed_says_so_in_its_own_line(monkeypatch):
    from hetsplit.profiler import EmulationFault, fault_note

    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu@0.25"], [32, 8], [0.04, 0.04], 40)
    fast = EmulationFault("rank1:cpu@0.25", "cpu", 2.4, 4.0, False)
    assert _said(plan, note=fault_note([fast])).endswith(
        "not real hardware): cpu@0.25; emulation unreliable: rank1:cpu@0.25 measured 2.4x slower than cpu, not 4x, "
        "planned at 4x"
    )
    # Calibrated in the split afterwards: the share followed those steps, and the line says so.
    assert fault_note([fast], calibrated=True).endswith("not 4x, planned at 4x, then calibrated in the split")
    slow = EmulationFault("rank1:cpu@0.25", "cpu", 6.0, 4.0, False)  # slower than declared: its measured share
    assert fault_note([slow]) == "emulation unreliable: rank1:cpu@0.25 measured 6.0x slower than cpu, not 4x"
    assert fault_note([]) == ""


def test_a_prediction_inside_large_noise_is_said_unreliable_not_as_a_number(capsys, monkeypatch):
    """Past 25 % step-to-step noise (the steps' own, or the profile's: Plan.noise) no predicted step is said."""
    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    plan = Plan(["rank0:cpu", "rank1:cpu"], [4, 4], [0.02, 0.02], 8)  # predicted 20 ms
    now = [0.0]
    report = hd.SplitReport("train.py", 0, clock=lambda: now[0])
    for period in [0.5, 0.02, 0.04, 0.02, 0.04, 0.03, 0.03]:  # median 30 ms, ±10 ms a step (33 %)
        report.step(plan)
        now[0] += period
    report.step(plan)
    report.end(plan)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "hetsplit: train.py: measured step 30.0 ms (median of 6 after 1 warm-up, rank 0, start to start), "
        "predicted: unreliable here (noise ±33%)"
    )
    noisy = Plan(["rank0:cpu", "rank1:cpu"], [4, 4], [0.02, 0.02], 8, noise=0.4)
    hd.SplitReport("train.py", 0).end(noisy, measured=0.03)
    quiet = Plan(["rank0:cpu", "rank1:cpu"], [4, 4], [0.02, 0.02], 8, noise=0.2)
    hd.SplitReport("train.py", 0).end(quiet, measured=0.03)
    assert capsys.readouterr().out.splitlines() == [
        "hetsplit: train.py: measured step 30.0 ms (yours), predicted: unreliable here (noise ±40%)",
        "hetsplit: train.py: measured step 30.0 ms (yours), predicted 20.0 ms (error -33%)",
    ]
