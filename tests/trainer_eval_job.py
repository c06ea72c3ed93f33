"""HeteroTrainer's eval_loss against the plain Trainer's: the helpers of tests/test_trainer_eval.py, two scenarios.

A tiny GPT-2 built from its config (float64, nothing downloaded) on SYNTHETIC blocks of
16 tokens, run_clm's setting, and on padded sequences of different lengths. The helpers
serve the one-process tests; :func:`run_scenarios` runs the two-process ones inside
tests/trainer_job.py's launch (a launch of its own would import transformers on two more
processes, most of its time), each printing ``OK <scenario> rank <r>`` or its traceback
(``tests/integration_launch.py``), judged by tests/test_hf_trainer.py.
"""

from __future__ import annotations

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

BLOCK = 16
# HF's causal-LM loss is computed in float32 (it casts the logits): a mean there and a sum over
# a count here round differently at ~1e-7 relative, against 1/15 when the count differs.
REL = 1e-6
# Short sequences in the first batch of 4, long ones in the second: a mean over the batches and
# a mean over every label differ by percents (tests/test_trainer_eval.py checks that they do).
LENGTHS = [3, 5, 4, 3, 16, 14, 15, 16, 9, 6]


def blocks(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` token blocks of 16, labels the inputs (as run_clm's ``group_texts`` makes them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n, BLOCK), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def gpt2() -> GPT2LMHeadModel:
    """A GPT-2 of one layer, float64, seeded; ``loss_type`` None (the plain Trainer counts its labels unshifted)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=BLOCK, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).double()


def arguments(folder: str, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=folder, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=1,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def padded(lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Token sequences of the given lengths, labels the inputs: batches of them hold different numbers of labels."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, 50, (n,), generator=g) for n in lengths]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A data collator padding to the batch's longest sequence on the right: token 0, unattended, label -100."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch: dict[str, list[torch.Tensor]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for s in samples:
        n = len(s["input_ids"])
        batch["input_ids"].append(torch.nn.functional.pad(s["input_ids"], (0, longest - n), value=0))
        batch["attention_mask"].append((torch.arange(longest) < n).long())
        batch["labels"].append(torch.nn.functional.pad(s["labels"], (0, longest - n), value=-100))
    return {k: torch.stack(v) for k, v in batch.items()}


def plain_eval_loss(model: GPT2LMHeadModel, data: list[dict[str, torch.Tensor]], batch: int | None = None) -> float:
    """The one-process plain Trainer's eval_loss on ``data`` in batches of ``batch`` (default: one batch).

    The Trainer takes each batch's summed token loss (labels shifted) over the batch's labels
    counted unshifted (GPT-2's ``loss_type`` is None), then the mean over the batches weighted
    by their samples. For blocks of one length that is the summed loss over 16 a block
    whatever the batches; for padded sequences of different lengths it depends on them.
    """
    batch = batch or len(data)
    means, weights = [], []
    for at in range(0, len(data), batch):
        rows = pad(data[at : at + batch])
        with torch.no_grad():
            logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
        labels = rows["labels"]
        summed = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="sum"
        )
        means.append(summed.item() / labels.ne(-100).sum().item())
        weights.append(len(labels))
    return sum(m * w for m, w in zip(means, weights)) / sum(weights)


def run_scenarios() -> None:
    """Run the two-process scenarios here, on the ranks of a launch (tests/trainer_job.py's)."""
    from integration_launch import scenario  # tests/ is the script's folder
    from transformers import Trainer

    from hetsplit.planning import plan_from_sizes
    from hetsplit.transformers import HeteroTrainer

    @scenario("gpt2-eval", folder=True)
    def _(folder):
        # The plain Trainer divides each batch's summed loss by all its labels (GPT-2's loss_type is
        # None), so HeteroTrainer must too (was: 16/15 of it). 8 blocks in global batches of 4: 2 + 2
        # for the plain Trainer, 3 + 1 under the plan; the same eval_loss.
        plan = plan_from_sizes(None, ["rank0", "rank1"], [3, 1])
        data = blocks(8, seed=3)
        plain = Trainer(model=gpt2(), args=arguments(os.path.join(folder, "plain")), eval_dataset=data)
        expected = plain.evaluate()["eval_loss"]
        hetero = HeteroTrainer(
            model=gpt2(), args=arguments(os.path.join(folder, "hetero")), eval_dataset=data, plan=plan
        )
        loss = hetero.evaluate()["eval_loss"]
        assert abs(loss - expected) <= REL * abs(expected), f"HeteroTrainer {loss}, the plain Trainer {expected}"
        # 9 blocks: the last global batch padded. The plain Trainer on 2 processes counts the padding's
        # duplicate into that batch's loss; its one-process run (tests/test_trainer_eval.py) does not.
        data = blocks(9, seed=3)
        loss = hetero.evaluate(eval_dataset=data)["eval_loss"]
        expected = plain_eval_loss(gpt2(), data)
        assert abs(loss - expected) <= REL * abs(expected), f"HeteroTrainer {loss}, the plain Trainer {expected}"

    @scenario("gpt2-eval-padded", folder=True)
    def _(folder):
        # Padded sequences of different lengths: each global batch holds its own number of labels, and
        # the plain Trainer's eval_loss is the mean over the batches (weighted by samples) of each
        # one's loss over its labels, not the loss over every label of the set. 3 + 1 under the plan,
        # global batches of 4 (the last, of 2, padded), against the one-process plain Trainer's.
        plan = plan_from_sizes(None, ["rank0", "rank1"], [3, 1])
        data = padded(LENGTHS, seed=5)
        args = arguments(os.path.join(folder, "hetero"))
        hetero = HeteroTrainer(model=gpt2(), args=args, eval_dataset=data[:8], data_collator=pad, plan=plan)
        for rows in (8, 10):
            loss = hetero.evaluate(eval_dataset=data[:rows])["eval_loss"]
            expected = plain_eval_loss(gpt2(), data[:rows], batch=4)
            assert abs(loss - expected) <= REL * abs(expected), f"{rows}: HeteroTrainer {loss}, plain {expected}"
        # The plain Trainer on these 2 processes (2 + 2, no padding with 8) gives the same.
        plain = Trainer(model=gpt2(), args=arguments(os.path.join(folder, "plain")), data_collator=pad)
        expected = plain.evaluate(eval_dataset=data[:8])["eval_loss"]
        loss = hetero.evaluate(eval_dataset=data[:8])["eval_loss"]
        assert abs(loss - expected) <= REL * abs(expected), f"HeteroTrainer {loss}, the plain Trainer {expected}"
