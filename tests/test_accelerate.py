"""HeteroAccelerator in 2-process gloo jobs: plan shares, exact steps, accumulation, metrics, zero share, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("step", "accumulate", "micro", "micro_hf", "zero", "metrics", "epochs", "profiled", "refused")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="")


def test_every_scenario_matches_the_single_process_reference():
    # One torchrun launch (hetsplit launch runs the same launcher) for all scenarios of
    # tests/accelerate_job.py; each rank prints "OK <scenario>" only after its asserts pass.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "accelerate_job.py")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for name in SCENARIOS:
        for rank in (0, 1):
            assert f"OK {name} rank {rank}" in res.stdout, (name, rank, res.stdout[-2000:])


def test_the_example_runs_under_accelerate_launch():
    # accelerate's own launcher (--multi_gpu starts one process per device, on a CPU-only
    # machine too); the example profiles both processes and gives the slower one less.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", str(ROOT / "examples" / "accelerate_hetero.py"), "--devices", "cpu,cpu@0.25",
           "--epochs", "1", "--train-size", "512", "--test-size", "300", "--profile-budget", "2"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    plan = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    fast, slow = (int(part.split()[-1]) for part in plan.removeprefix("plan: ").split(" of ")[0].split(", "))
    assert fast + slow == 256 and fast > slow, plan
    assert "(300 samples)" in res.stdout, res.stdout[-2000:]  # gather_for_metrics: every test sample once
