"""Upstream-script patterns with each integration, one two-process gloo job per scenario.

Each test launches ``tests/integration_jobs.py SCENARIO`` under torchrun (world size 2,
one thread per rank) and requires both ranks to pass its asserts; the scenario's name is
the test's, so a failure says which pattern broke.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _run(name: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "integration_jobs.py"), name]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    for rank in (0, 1):
        assert f"OK {name} rank {rank}" in res.stdout, res.stdout[-2000:]


def test_accelerate_zero_share_batch_keeps_its_type():
    _run("accelerate_zero_share_batch_keeps_its_type")


def test_accelerate_cpu_false_on_a_cpu_only_machine_is_one_job():
    _run("accelerate_cpu_false_on_a_cpu_only_machine_is_one_job")


def test_accelerate_profiles_on_the_device_accelerate_names():
    _run("accelerate_profiles_on_the_device_accelerate_names")


def test_accelerate_resume_draws_the_orders_of_an_uninterrupted_run():
    _run("accelerate_resume_draws_the_orders_of_an_uninterrupted_run")


def test_torchrun_weights_split_every_global_batch_in_proportion():
    _run("torchrun_weights_split_every_global_batch_in_proportion")


def test_trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job():
    _run("trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job")


def test_lightning_zero_share_never_reaches_the_step_empty():
    _run("lightning_zero_share_never_reaches_the_step_empty")


def test_lightning_sync_dist_metrics_cover_500_samples_once():
    _run("lightning_sync_dist_metrics_cover_500_samples_once")
