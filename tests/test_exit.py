"""Jobs that join the group through an integration but never train exit cleanly (status 0).

Each case is one kind of job from tests/exit_jobs.py (Lightning validate alone, test then
predict, HeteroTrainer.evaluate alone, HeteroAccelerator prepare and gather alone). The
kinds share a launch (its start-up is most of a launch's time), and a launch's runs go at
once, as a loaded machine runs them (``EXIT_RUNS`` adds a busy process):
each kind must register hetsplit's exit wait on both ranks, and every launch with the wait
must exit 0. With ``EXIT_RUNS=N`` each launch runs N times, and as often without the wait
(taken off at its very end) to measure how often it aborts instead, for docs/benchmarks.md
(printed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import lightning  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import launch

ROOT = Path(__file__).resolve().parents[1]
# One launch: its ranks' start-up (torch, Lightning, the Trainer's imports) is most of its time.
LAUNCHES = [("lightning_validate", "lightning_test_then_predict", "trainer_evaluate", "accelerate_prepare_gather")]
KINDS = [kind for kinds in LAUNCHES for kind in kinds]
RUNS = int(os.environ.get("EXIT_RUNS", "1"))


@pytest.fixture(scope="module")
def busy():
    # The measurement (EXIT_RUNS) adds a process that spins on one core. In the suite the
    # launch below already loads the machine (its ranks, beside the other pytest worker): a
    # spinner there only slowed every other test down.
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if "EXIT_RUNS" in os.environ else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def _launch(kinds: tuple[str, ...], wait: bool) -> subprocess.CompletedProcess:
    return launch("exit_jobs.py", *kinds, timeout=240, NO_EXIT_WAIT="0" if wait else "1")


def _aborted(res: subprocess.CompletedProcess) -> bool:
    return res.returncode != 0 and ("exitcode: -" in res.stderr or "terminate called" in res.stderr)


@pytest.fixture(scope="module")
def runs(busy) -> dict[str, tuple[list, list]]:
    # Every launch's runs at once (independent launches; their start-up is most of the time):
    # a loaded machine. Each run must register the wait on both ranks and exit 0. Runs without
    # the wait only measure how often a job then aborts (EXIT_RUNS, for docs/benchmarks.md).
    bare = RUNS if "EXIT_RUNS" in os.environ else 0
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            kinds: (
                [pool.submit(_launch, kinds, True) for _ in range(RUNS)],
                [pool.submit(_launch, kinds, False) for _ in range(bare)],
            )
            for kinds in LAUNCHES
        }
        done = {kinds: ([f.result() for f in w], [f.result() for f in b]) for kinds, (w, b) in futures.items()}
    return {kind: done[kinds] for kinds in LAUNCHES for kind in kinds}


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_that_never_trains_exits_cleanly(kind, runs):
    waited, bare = runs[kind]
    for res in bare:  # without the wait a run may abort at exit; any other failure is a broken job
        assert res.returncode == 0 or _aborted(res), res.stdout[-2000:] + res.stderr[-4000:]
    print(f"{kind}: aborted at exit with the wait {sum(map(_aborted, waited))} of {RUNS}, "
          f"without it {sum(map(_aborted, bare))} of {len(bare)}")  # fmt: skip
    for res in waited:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert res.stdout.count(f"WAIT {kind} True") == 2, res.stdout[-2000:]  # this kind registered it on both ranks
