"""HeteroAccelerator in 2-process gloo jobs: plan shares, exact steps, accumulation, metrics, zero share, bad input.

``tests/accelerate_job.py`` runs every scenario in one two-process launch (the start-up is
most of the time); each scenario below is its own test, failing with its own traceback.
"""

from __future__ import annotations

import subprocess
import sys

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
from integration_launch import ROOT, check, job_fixture

SCENARIOS = (
    "step", "accumulate", "micro", "micro_hf", "zero", "metrics", "epochs", "profiled", "prepare_order", "micro_zero",
    "rebalance", "refused", "fsdp2_steps", "fsdp2_micro", "fsdp2_cpu_flag", "fsdp2_profiled",
    "fsdp2_model_first", "fsdp2_placement",
)  # fmt: skip


job = job_fixture("accelerate_job.py", timeout=240)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_the_single_process_reference(job, name):
    check(job, name)


def test_the_example_runs_under_accelerate_launch():
    # accelerate's own launcher (--multi_gpu starts one process per device, on a CPU-only
    # machine too); the example profiles both processes and splits the global batch between them.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", str(ROOT / "examples" / "accelerate_hetero.py"), "--devices", "cpu,cpu@0.25",
           "--epochs", "1", "--train-size", "512", "--test-size", "300", "--profile-budget", "2"]  # fmt: skip
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    plan = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    fast, slow = (int(part.split()[-1]) for part in plan.removeprefix("plan: ").split(" of ")[0].split(", "))
    assert fast + slow == 256, plan  # which gets more is what the profiles measured (a loaded machine moves it)
    assert "(300 samples)" in res.stdout, res.stdout[-2000:]  # gather_for_metrics: every test sample once
