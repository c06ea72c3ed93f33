"""Upstream-script patterns with the HF Trainer and torchrun, in one two-process gloo job.

The test launches ``tests/integration_jobs.py SCENARIO...`` under torchrun (world size 2,
one thread per rank) and each test requires both ranks to pass its scenario's asserts; the
scenario's name is the test's, so a failure says which pattern broke.
"""

from __future__ import annotations

import subprocess

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import launch

# One launch: the Trainer's scenario about how a launch starts (one job, not two copies) runs
# first, before any other has made the process group or accelerate's state; the torchrun
# scenarios reuse them as a script would. The accelerate and Lightning scenarios of
# tests/integration_jobs.py run in their framework's own launch and are judged there
# (test_accelerate.py, test_lightning.py): a launch's start-up (torch and a framework
# imported by three processes) is most of its time.
SCENARIOS = [
    "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job",
    "torchrun_weights_split_every_global_batch_in_proportion",
    "torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out",
    "torchrun_rebalancer_does_not_time_a_zero_shares_stand_in",
]


@pytest.fixture(scope="module")
def job() -> subprocess.CompletedProcess:
    return launch("integration_jobs.py", *SCENARIOS)


def _run(job: subprocess.CompletedProcess, name: str) -> None:
    for rank in (0, 1):
        if f"OK {name} rank {rank}" not in job.stdout:  # failed, or an earlier scenario of the launch did
            pytest.fail(f"{name} did not pass on rank {rank}:\n" + job.stdout[-3000:] + job.stderr[-6000:])


def test_torchrun_weights_split_every_global_batch_in_proportion(job):
    _run(job, "torchrun_weights_split_every_global_batch_in_proportion")


def test_torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out(job):
    _run(job, "torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out")


def test_torchrun_rebalancer_does_not_time_a_zero_shares_stand_in(job):
    _run(job, "torchrun_rebalancer_does_not_time_a_zero_shares_stand_in")


def test_trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job(job):
    _run(job, "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job")
