"""Upstream-script patterns with each integration, one two-process gloo job per scenario.

Each test launches ``tests/integration_jobs.py SCENARIO`` under torchrun (world size 2,
one thread per rank) and requires both ranks to pass its asserts; the scenario's name is
the test's, so a failure says which pattern broke.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import lightning  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import launch

SCENARIOS = [
    "accelerate_zero_share_batch_keeps_its_type",
    "accelerate_cpu_false_on_a_cpu_only_machine_is_one_job",
    "accelerate_profiles_on_the_device_accelerate_names",
    "accelerate_resume_draws_the_orders_of_an_uninterrupted_run",
    "torchrun_weights_split_every_global_batch_in_proportion",
    "torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out",
    "torchrun_rebalancer_does_not_time_a_zero_shares_stand_in",
    "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job",
    "lightning_zero_share_never_reaches_the_step_empty",
    "lightning_sync_dist_metrics_cover_500_samples_once",
    "lightning_steps_without_batch_idx_are_profiled_and_weighted",
    "lightning_zero_share_logs_no_nan_without_sync_dist",
]


# Scenarios that share a launch: one framework's, whose process-wide state (accelerate's
# singleton, an initialised process group) the next scenario reuses as a script would.
# The suite's time is mostly the launches' start-up (torch and a framework imported by
# three processes). A scenario about how a launch starts (one job, not two copies) runs
# first in its launch, before any other has made the group or accelerate's state.
LAUNCHES = [
    [
        "accelerate_cpu_false_on_a_cpu_only_machine_is_one_job",
        "accelerate_zero_share_batch_keeps_its_type",
        "accelerate_profiles_on_the_device_accelerate_names",
        "accelerate_resume_draws_the_orders_of_an_uninterrupted_run",
    ],
    [
        "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job",
        *(s for s in SCENARIOS if s.startswith("torchrun_")),
    ],
    [s for s in SCENARIOS if s.startswith("lightning_")],
]
assert sorted(s for group in LAUNCHES for s in group) == sorted(SCENARIOS)


def _launch(names: list[str]) -> subprocess.CompletedProcess:
    return launch("integration_jobs.py", *names)


@pytest.fixture(scope="module")
def jobs() -> dict[str, subprocess.CompletedProcess]:
    # Independent two-process launches, at once; each scenario judged by its own test below.
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(_launch, LAUNCHES))
    return {name: res for group, res in zip(LAUNCHES, results) for name in group}


def _run(jobs: dict[str, subprocess.CompletedProcess], name: str) -> None:
    res = jobs[name]
    for rank in (0, 1):
        if f"OK {name} rank {rank}" not in res.stdout:  # failed, or an earlier scenario of its launch did
            pytest.fail(f"{name} did not pass on rank {rank}:\n" + res.stdout[-3000:] + res.stderr[-6000:])


def test_accelerate_zero_share_batch_keeps_its_type(jobs):
    _run(jobs, "accelerate_zero_share_batch_keeps_its_type")


def test_accelerate_cpu_false_on_a_cpu_only_machine_is_one_job(jobs):
    _run(jobs, "accelerate_cpu_false_on_a_cpu_only_machine_is_one_job")


def test_accelerate_profiles_on_the_device_accelerate_names(jobs):
    _run(jobs, "accelerate_profiles_on_the_device_accelerate_names")


def test_accelerate_resume_draws_the_orders_of_an_uninterrupted_run(jobs):
    _run(jobs, "accelerate_resume_draws_the_orders_of_an_uninterrupted_run")


def test_torchrun_weights_split_every_global_batch_in_proportion(jobs):
    _run(jobs, "torchrun_weights_split_every_global_batch_in_proportion")


def test_torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out(jobs):
    _run(jobs, "torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out")


def test_torchrun_rebalancer_does_not_time_a_zero_shares_stand_in(jobs):
    _run(jobs, "torchrun_rebalancer_does_not_time_a_zero_shares_stand_in")


def test_trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job(jobs):
    _run(jobs, "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job")


def test_lightning_zero_share_never_reaches_the_step_empty(jobs):
    _run(jobs, "lightning_zero_share_never_reaches_the_step_empty")


def test_lightning_sync_dist_metrics_cover_500_samples_once(jobs):
    _run(jobs, "lightning_sync_dist_metrics_cover_500_samples_once")


def test_lightning_steps_without_batch_idx_are_profiled_and_weighted(jobs):
    _run(jobs, "lightning_steps_without_batch_idx_are_profiled_and_weighted")


def test_lightning_zero_share_logs_no_nan_without_sync_dist(jobs):
    _run(jobs, "lightning_zero_share_logs_no_nan_without_sync_dist")
