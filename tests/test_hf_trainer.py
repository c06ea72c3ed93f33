"""HeteroTrainer in 2-process gloo jobs: exact token-weighted steps, accumulation, a zero share, eval, micro-batches.

``tests/trainer_job.py`` runs every scenario in one two-process launch (the start-up is most
of the time); each scenario below is its own test, failing with its own traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import ROOT, check, job_fixture

SCENARIOS = (
    "tokens", "short-last", "accumulate", "zero", "classify", "evaluate", "profiled", "rebalance",
    "micro", "micro-accumulate", "micro-classify", "micro-masked", "micro-memory", "micro-solved",
    "fsdp2", "fsdp2-profiled", "fsdp2-micro",
)  # fmt: skip


job = job_fixture("trainer_job.py", timeout=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_the_single_process_reference(job, name):
    check(job, name)


def test_the_example_runs_under_hetsplit_launch(tmp_path):
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", "cpu,cpu@0.25",
           str(ROOT / "examples" / "hf_trainer_hetero.py"), "--steps", "2", "--train-size", "64",
           "--profile-budget", "1", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HETSPLIT_DEVICES="")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    plan = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    assert plan.endswith("of 32"), plan  # the Trainer's global batch: 2 processes x 16
    assert "eval loss" in res.stdout and "SYNTHETIC" in res.stdout


def test_the_trainer_s_fsdp1_is_refused_in_one_line_naming_fsdp2(tmp_path):
    # A one-process run reaches the same check every process of a launch does, before any
    # accelerator is built (FSDP1 shards in a way hetsplit cannot weight; FSDP2 runs).
    import torch
    from transformers import TrainingArguments

    from hetsplit.transformers import HeteroTrainer

    # (DeepSpeed is refused by the same check; TrainingArguments needs the deepspeed package to take it.)
    fsdp = {"fsdp": True, "fsdp_config": {"version": 1}}
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fsdp)
    with pytest.raises(ValueError) as info:
        HeteroTrainer(model=torch.nn.Linear(3, 1), args=args, devices="cpu")
    message = str(info.value)
    assert "fsdp=True (FSDP1)" in message and "fsdp_config={'version': 2" in message, message


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
def test_a_length_grouped_order_is_refused_naming_the_trainer_s_own_setting(tmp_path, strategy):
    # The Trainer's setting, not the shuffle= a DataLoader takes (a Trainer user never builds the loader).
    import torch
    from transformers import TrainingArguments

    from hetsplit.transformers import HeteroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, train_sampling_strategy=strategy)
    with pytest.raises(ValueError) as info:
        HeteroTrainer(model=torch.nn.Linear(3, 1), args=args, devices="cpu")
    message = str(info.value)
    assert f"TrainingArguments(train_sampling_strategy={strategy!r})" in message, message
    assert "train_sampling_strategy='sequential'" in message and "shuffle=" not in message, message
