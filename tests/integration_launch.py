"""Launching the integrations' two-process jobs and judging each scenario of a job on its own.

A job (``tests/accelerate_job.py``, ``tests/trainer_job.py``, ``tests/integration_jobs.py``)
runs its scenarios on two gloo ranks and prints, per scenario and rank, ``OK NAME rank R``
or a ``FAIL NAME rank R`` block with the traceback (``END NAME rank R`` closes it): one
failing scenario does not hide the others. :func:`check` turns one scenario's lines into
one test's verdict, naming the scenario and showing only its own traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch(script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 tests/SCRIPT ARGS``: a thread a rank, no device list, plus ``env``."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="", PYTHONWARNINGS="ignore", **env
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / script), *args]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # what it printed until then still judges the scenarios that ran
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return subprocess.CompletedProcess(cmd, -9, out, err + f"\n(the job ran past its {timeout} s)")


def job_fixture(script: str, timeout: float) -> Callable[[], subprocess.CompletedProcess]:
    """A module-scoped fixture that launches ``script`` once (the start-up is most of a job's time)."""

    def job() -> subprocess.CompletedProcess:
        return launch(script, timeout=timeout)

    return pytest.fixture(scope="module", name="job")(job)


def check(res: subprocess.CompletedProcess, name: str, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Fail unless every rank printed ``OK NAME``: with that scenario's traceback, or the job's tail."""
    for rank in ranks:
        if f"OK {name} rank {rank}" in res.stdout:
            continue
        tag = rf"{re.escape(name)} rank {rank}"
        block = re.search(rf"FAIL {tag}\n(.*?)END {tag}", res.stdout, re.S)
        if block:
            raise AssertionError(f"scenario {name!r} failed on rank {rank}:\n{block.group(1)}")
        raise AssertionError(
            f"scenario {name!r} did not report on rank {rank} (the job stopped first, exit status "
            f"{res.returncode}):\n{res.stdout[-2500:]}\n{res.stderr[-4000:]}"
        )


def run_scenario(name: str, fn: Callable[[], object], rank: int) -> None:
    """Run one scenario in a job; print ``OK`` or the ``FAIL`` block that :func:`check` reads."""
    try:
        fn()
    except Exception:
        print(f"FAIL {name} rank {rank}\n{traceback.format_exc()}END {name} rank {rank}", flush=True)
    else:
        print(f"OK {name} rank {rank}", flush=True)


# The upstream-script patterns of tests/integration_jobs.py that run in a framework's own job,
# after (Lightning: tests/test_lightning.py) or before (accelerate: tests/accelerate_job.py; the
# Trainer and torchrun: tests/trainer_job.py; one of each checks how a job starts) its
# scenarios: a launch less each, whose start-up (torch and the framework imported by three
# processes) is most of its time.
ACCELERATE_PATTERNS = (
    "accelerate_cpu_false_on_a_cpu_only_machine_is_one_job",  # first: before any accelerator exists
    "accelerate_zero_share_batch_keeps_its_type",
    "accelerate_profiles_on_the_device_accelerate_names",
    "accelerate_resume_draws_the_orders_of_an_uninterrupted_run",
)
LIGHTNING_PATTERNS = (
    "lightning_zero_share_never_reaches_the_step_empty",
    "lightning_sync_dist_metrics_cover_500_samples_once",
    "lightning_steps_without_batch_idx_are_profiled_and_weighted",
    "lightning_zero_share_logs_no_nan_without_sync_dist",
)
# The Trainer's and torchrun's, first in the Trainer's job (tests/trainer_job.py), the Trainer's first of
# all: how a launch starts (one job, not two copies) before anything made the process group or accelerate's
# state; the torchrun ones then reuse them, as a script would.
TRAINER_PATTERNS = (
    "trainer_without_use_cpu_on_a_cpu_only_machine_is_one_job",
    "torchrun_weights_split_every_global_batch_in_proportion",
    "torchrun_weighting_without_a_plan_leaves_a_zero_shares_stand_in_out",
    "torchrun_rebalancer_does_not_time_a_zero_shares_stand_in",
)


def run_patterns(names: tuple[str, ...]) -> None:
    """Run these scenarios of tests/integration_jobs.py here, each under :func:`run_scenario`.

    The environment is restored after each (one pattern drops ``HETSPLIT_DEVICES``, as a
    launch without a device list has it), so the job's own scenarios see the launch's.
    """
    import runpy

    found = runpy.run_path(str(Path(__file__).with_name("integration_jobs.py")), run_name="integration_jobs")
    rank = int(os.environ["RANK"])
    for name in names:
        saved = dict(os.environ)
        try:
            run_scenario(name, found["SCENARIOS"][name], rank)
        finally:
            os.environ.clear()
            os.environ.update(saved)


def scenario(name: str, *, folder: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A job's scenario: the decorated function runs at once, under :func:`run_scenario`, if the job asked for it.

    A job runs the scenarios its first argument names (``job.py a,b``), every one without
    an argument. With ``folder`` the function is given a fresh temporary folder, removed
    after it.
    """
    wanted = sys.argv[1].split(",") if len(sys.argv) > 1 else None

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if wanted is None or name in wanted:
            rank = int(os.environ["RANK"])
            if folder:
                with tempfile.TemporaryDirectory() as path:
                    run_scenario(name, lambda: fn(path), rank)
            else:
                run_scenario(name, fn, rank)
        return fn

    return register
