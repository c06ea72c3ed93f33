"""HeteroTrainer's ``evaluate()`` gives the plain Trainer's ``eval_loss``; its measured step leaves evaluation out.

The plain Trainer divides an evaluation batch's summed token loss by its own count of the
labels (``num_items_in_batch``): unshifted for GPT-2, whose ``loss_type`` is None though its
loss shifts them. HeteroTrainer divided by the shifted count, 16/15 of the plain
``eval_loss`` for blocks of 16 (run_clm's setting). And the plain Trainer's ``eval_loss`` is
the mean over the batches, weighted by samples, of each batch's loss: for padded batches of
different label counts not the loss over every label of the set, which HeteroTrainer gave. The two-process
cases (``tests/trainer_eval_job.py``) run in tests/trainer_job.py's launch and are judged in
tests/test_hf_trainer.py; the rest runs in this process (one-process HeteroTrainer, ``devices="cpu"``).
"""

from __future__ import annotations

import accelerate  # noqa: F401  (a test extra: missing, fail; never skip)
import pytest
import torch
import transformers  # noqa: F401  (a test extra: missing, fail; never skip)
from trainer_eval_job import LENGTHS, REL, arguments, blocks, gpt2, pad, padded, plain_eval_loss


def test_eval_loss_of_a_gpt2_is_the_plain_trainer_s_in_one_process(tmp_path):
    from transformers import Trainer

    from hetsplit.transformers import HeteroTrainer

    data = blocks(9, seed=3)  # 9 blocks in batches of 4: a short last batch too
    losses = []
    for cls, kwargs in ((Trainer, {}), (HeteroTrainer, {"devices": "cpu"})):
        args = arguments(str(tmp_path / cls.__name__), per_device_eval_batch_size=4)
        trainer = cls(model=gpt2(), args=args, eval_dataset=data, **kwargs)
        losses.append(trainer.evaluate()["eval_loss"])
    plain, hetero = losses
    assert plain == pytest.approx(plain_eval_loss(gpt2(), data), rel=REL, abs=0), "the job's reference"
    assert hetero == pytest.approx(plain, rel=REL, abs=0), f"HeteroTrainer {hetero}, the plain Trainer {plain}"


def test_eval_loss_of_padded_batches_is_the_plain_trainer_s_mean_over_batches_in_one_process(tmp_path):
    # Each batch's loss over its own labels, weighted by samples (the plain Trainer's rule); the mean
    # over every label of the set differs here by percents, and was HeteroTrainer's.
    from transformers import Trainer

    from hetsplit.transformers import HeteroTrainer

    data = padded(LENGTHS, seed=5)  # batches of 4: short sequences, long ones, a last batch of 2
    reference = plain_eval_loss(gpt2(), data, batch=4)
    over_labels = plain_eval_loss(gpt2(), data)  # one batch: the mean over every label
    assert abs(reference - over_labels) > 0.01 * reference, "the data must tell the two rules apart"
    losses = []
    for cls, kwargs in ((Trainer, {}), (HeteroTrainer, {"devices": "cpu"})):
        args = arguments(str(tmp_path / cls.__name__), per_device_eval_batch_size=4)
        trainer = cls(model=gpt2(), args=args, eval_dataset=data, data_collator=pad, **kwargs)
        losses.append(trainer.evaluate()["eval_loss"])
    plain, hetero = losses
    assert plain == pytest.approx(reference, rel=REL, abs=0), "the job's reference"
    assert hetero == pytest.approx(plain, rel=REL, abs=0), f"HeteroTrainer {hetero}, the plain Trainer {plain}"


class _Clock:
    """A clock the test moves: a training forward takes 0.1 s, an evaluation 10 s, a checkpoint 20 s."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_measured_step_leaves_out_evaluation_and_checkpoints_between_steps(tmp_path, capsys, monkeypatch):
    # Timed start to start, a step after an evaluation held the evaluation's time (and a checkpoint's):
    # the "measured step" beside the predicted one was the evaluation's. Timed from the Trainer's
    # on_step_begin to its on_step_end, before it evaluates or saves, each step here is 0.1 s.
    from torch import nn
    from transformers import TrainerCallback

    from hetsplit.transformers import HeteroTrainer

    monkeypatch.delenv("HETSPLIT_QUIET", raising=False)
    clock = _Clock()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1).double()

        def forward(self, x, labels):
            clock.now += 0.1 if self.training else 0.0
            return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}

    class Slow(TrainerCallback):  # what evaluating and saving take, on the test's clock
        def on_evaluate(self, args, state, control, **kwargs):
            clock.now += 10.0

        def on_save(self, args, state, control, **kwargs):
            clock.now += 20.0

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, dtype=torch.float64, generator=g), "labels": torch.tensor(1.0, dtype=torch.float64)}]
    args = arguments(
        str(tmp_path), per_device_train_batch_size=1, max_steps=5, eval_strategy="steps", eval_steps=1,
        save_strategy="steps", save_steps=2,
    )  # fmt: skip
    trainer = HeteroTrainer(model=Net(), args=args, train_dataset=data * 5, eval_dataset=data, devices="cpu")
    trainer.add_callback(Slow())
    trainer.accelerator.report.clock = clock
    trainer.train()
    said = [line for line in capsys.readouterr().out.splitlines() if "measured step" in line]
    assert len(said) == 1 and "measured step 100.0 ms (median of 4 after 1 warm-up" in said[0], said
