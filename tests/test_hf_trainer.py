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
import torch
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from integration_launch import ROOT, TRAINER_PATTERNS, check, job_fixture

SCENARIOS = (
    "tokens", "short-last", "accumulate", "zero", "classify", "evaluate", "profiled", "rebalance",
    "micro", "micro-accumulate", "micro-classify", "micro-masked", "micro-memory", "micro-solved",
    "fsdp2", "fsdp2-save", "fsdp2-profiled", "fsdp2-micro",
)  # fmt: skip


job = job_fixture("trainer_job.py", timeout=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_the_single_process_reference(job, name):
    check(job, name)


# tests/integration_jobs.py's Trainer and torchrun scenarios, first in the same launch: run_clm.py's arguments
# without use_cpu still one two-process job; weights splitting every global batch; a zero share's stand-in left
# out of the weighting without a plan and out of the rebalancer's timings.
@pytest.mark.parametrize("name", TRAINER_PATTERNS)
def test_an_upstream_script_pattern_matches_the_plain_trainer_or_torchrun(job, name):
    check(job, name)


# tests/test_trainer_eval.py's two-process cases run in this job's launch (tests/trainer_eval_job.py).
def test_eval_loss_of_a_gpt2_is_the_plain_trainer_s_on_two_uneven_processes(job):
    check(job, "gpt2-eval")


def test_eval_loss_of_padded_batches_is_the_plain_trainer_s_on_two_uneven_processes(job):
    check(job, "gpt2-eval-padded")


def test_the_example_runs_under_hetsplit_launch(tmp_path):
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", "cpu,cpu@0.25",
           str(ROOT / "examples" / "hf_trainer_hetero.py"), "--steps", "2", "--train-size", "64",
           "--budget", "1", "--output-dir", str(tmp_path / "out")]  # fmt: skip
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


def _padded(n, seed):
    """``n`` token sequences of unequal lengths, right-padded per batch (labels -100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 50, (3 + (5 * i) % 11,), generator=g)} for i in range(n)]


def _collate(items):
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])] = labels[i, : len(x["input_ids"])] = x["input_ids"]
    return {"input_ids": ids, "attention_mask": labels.ne(-100).long(), "labels": labels}


def _causal_lm(name):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":  # loss_type None: the Trainer counts every label, position 0 too
        config = GPT2Config(
            n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config).double()
    config = LlamaConfig(  # loss_type "ForCausalLM": the Trainer counts the shifted labels
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_steps_and_logged_losses_are_the_plain_trainer_s(tmp_path, name):
    # The Trainer divides the summed token loss by its own count of the labels (num_items_in_batch):
    # unshifted for GPT-2, whose loss shifts them all the same. HeteroTrainer divided by the shifted
    # count (the model's own mean), 16/15 of the Trainer's loss and gradient for blocks of 16.
    from transformers import Trainer, TrainingArguments

    from hetsplit.transformers import HeteroTrainer

    data = _padded(12, seed=1)
    trainers, models = [], []
    for cls, kwargs in ((Trainer, {}), (HeteroTrainer, {"devices": "cpu"})):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4, max_steps=3, learning_rate=0.5,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
            save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        models.append(_causal_lm(name))
        trainers.append(cls(model=models[-1], args=args, train_dataset=data, data_collator=_collate, **kwargs))
        trainers[-1].train()
    plain, hetero = ([log["loss"] for log in t.state.log_history if "loss" in log] for t in trainers)
    # The causal-LM loss is computed in float32 (a mean here, a sum / count there): a rounding of
    # ~1e-7 relative, against a difference of 1/15 when the count differs.
    assert len(plain) == 3 and hetero == pytest.approx(plain, rel=1e-6, abs=0), (hetero, plain)
    err = max((p - q).abs().max().item() for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert err < 1e-10, f"{name}: HeteroTrainer's parameters differ from the plain Trainer's by {err}"
