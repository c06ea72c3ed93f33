"""HeteroAccelerator in 2-process gloo jobs: plan shares, exact steps, accumulation, metrics, zero share, bad input.

``tests/accelerate_job.py`` runs every scenario in one two-process launch (the start-up is
most of the time); each scenario below is its own test, failing with its own traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
from integration_launch import ACCELERATE_PATTERNS, ROOT, check, job_fixture

SCENARIOS = (
    "step", "accumulate", "micro", "micro_hf", "zero", "metrics", "epochs", "profiled", "prepare_order", "micro_zero",
    "rebalance", "refused", "fsdp2_steps", "fsdp2_micro", "fsdp2_cpu_flag", "fsdp2_profiled",
    "fsdp2_model_first", "fsdp2_placement",
)  # fmt: skip


job = job_fixture("accelerate_job.py", timeout=240)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_the_single_process_reference(job, name):
    check(job, name)


# tests/integration_jobs.py's accelerate scenarios, first in the same launch: a collate's batch type kept
# for a zero share, cpu=False on a CPU-only machine still one job, profiling on the device accelerate
# names, a resumed run drawing the uninterrupted run's orders.
@pytest.mark.parametrize("name", ACCELERATE_PATTERNS)
def test_an_upstream_script_pattern_matches_plain_accelerate(job, name):
    check(job, name)


def test_the_example_runs_under_accelerate_launch():
    # accelerate's own launcher (--multi_gpu starts one process per device, on a CPU-only
    # machine too); the example profiles both processes and splits the global batch between them.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", str(ROOT / "examples" / "accelerate_hetero.py"), "--devices", "cpu,cpu@0.25",
           "--epochs", "1", "--train-size", "512", "--test-size", "300", "--budget", "1"]  # fmt: skip
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    plan = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    fast, slow = (int(part.split()[-1]) for part in plan.removeprefix("plan: ").split(" of ")[0].split(", "))
    assert fast + slow == 256, plan  # which gets more is what the profiles measured (a loaded machine moves it)
    assert "(300 samples)" in res.stdout, res.stdout[-2000:]  # gather_for_metrics: every test sample once


# One process, three epochs of three steps each, an evaluation-like pause between them: the split is said at
# the first step only, the measured step once, at end_training() (or at exit for a script that never calls it).
_EPOCHS = textwrap.dedent("""
    import sys, torch
    from torch.utils.data import DataLoader, TensorDataset
    from hetsplit.accelerate import HeteroAccelerator

    acc = HeteroAccelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True))
    for epoch in range(3):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        print("epoch", epoch, flush=True)
    if sys.argv[1] == "end_training":
        acc.end_training()
    print("done", flush=True)
""")


@pytest.mark.parametrize("ending", ["end_training", "exit"])
def test_the_split_and_the_measured_step_are_said_once_per_run(ending):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="", HETSPLIT_QUIET="")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    res = subprocess.run(
        [sys.executable, "-c", _EPOCHS, ending], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith(("hetsplit:", "epoch", "done"))]
    said = [line for line in lines if line.startswith("hetsplit: HeteroAccelerator:")]
    assert len(said) == 2 and "global batch 4 split rank0" in said[0] and lines[0] == said[0], lines
    # 2 timed steps an epoch (start to start, the last one's end is the pass's), less the first: warm-up.
    assert "measured step" in said[1] and "(median of 5 after 1 warm-up, rank 0, start to start)" in said[1], lines
    last = ["epoch 2", said[1], "done"] if ending == "end_training" else ["epoch 2", "done", said[1]]
    assert lines[-3:] == last, lines
