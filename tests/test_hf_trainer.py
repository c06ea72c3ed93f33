"""HeteroTrainer in 2-process gloo jobs: exact token-weighted steps, accumulation, a zero share, eval, micro-batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = (
    "tokens", "accumulate", "zero", "classify", "evaluate", "profiled",
    "micro", "micro-accumulate", "micro-classify", "micro-masked", "micro-memory", "micro-solved",
)  # fmt: skip


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="")


def test_every_scenario_matches_the_single_process_reference():
    # One torchrun launch for all scenarios of tests/trainer_job.py (a tiny Llama from a
    # config, float64); each rank prints "OK <scenario>" only after its asserts pass.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer_job.py")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for name in SCENARIOS:
        for rank in (0, 1):
            assert f"OK {name} rank {rank}" in res.stdout, (name, rank, res.stdout[-2000:])


def test_the_example_runs_under_hetsplit_launch(tmp_path):
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", "cpu,cpu@0.25",
           str(ROOT / "examples" / "hf_trainer_hetero.py"), "--steps", "2", "--train-size", "64",
           "--profile-budget", "1", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    plan = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    assert plan.endswith("of 32"), plan  # the Trainer's global batch: 2 processes x 16
    assert "eval loss" in res.stdout and "SYNTHETIC" in res.stdout
