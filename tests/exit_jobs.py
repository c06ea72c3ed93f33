"""Two-rank jobs that use the group through an integration but never train, behind tests/test_exit.py.

``torchrun --standalone --nproc_per_node=2 tests/exit_jobs.py KIND [KIND ...]`` runs the
jobs in turn and ends right after the last one's last collective, where a rank whose exit
does not wait for gloo's worker threads can abort (SIGABRT). After each job it prints
``WAIT KIND <bool>``: whether that job registered hetsplit's exit wait (forgotten before the
next job, which must register it again). With ``NO_EXIT_WAIT=1`` the wait is taken off
again at the very end, to measure what the same job does without it.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hetsplit.distributed import teardown
from hetsplit.planning import plan_from_sizes

N = 24
torch.manual_seed(0)
X, Y = torch.randn(N, 3), torch.randn(N, 1)
PLAN = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
DEVICES = "cpu,cpu@0.5"
JOBS = {}


def job(fn):
    JOBS[fn.__name__] = fn
    return fn


def lightning(stage):
    import lightning as L

    from hetsplit.lightning import HeteroDDPStrategy

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.layer(x)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

    trainer = L.Trainer(
        strategy=HeteroDDPStrategy(devices=DEVICES, plan=PLAN),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    getattr(trainer, stage)(Net(), DataLoader(TensorDataset(X, Y), batch_size=4))


@job
def lightning_validate():
    lightning("validate")


@job
def lightning_test_then_predict():
    lightning("test")
    lightning("predict")


@job
def trainer_evaluate():
    from transformers import TrainingArguments

    from hetsplit.transformers import HeteroTrainer

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def forward(self, x, labels=None):
            out = self.layer(x)
            return {"loss": F.mse_loss(out, labels), "logits": out}

    data = [{"x": x, "labels": y} for x, y in zip(X, Y)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], per_device_eval_batch_size=4)
    HeteroTrainer(model=Net(), args=args, eval_dataset=data, devices=DEVICES, plan=PLAN).evaluate()


@job
def accelerate_prepare_gather():
    from hetsplit.accelerate import HeteroAccelerator

    acc = HeteroAccelerator(plan=PLAN)  # no device list: accelerate makes the group (as accelerate launch runs it)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(N), X), batch_size=4))
    seen = [acc.gather_for_metrics(idx) for idx, _ in loader]
    assert sorted(torch.cat(seen).tolist()) == list(range(N)), seen


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for kind in sys.argv[1:]:
        if kind != sys.argv[1]:  # the next job must register the wait itself
            teardown.drain_at_exit.cache_clear()
        JOBS[kind]()
        print(f"WAIT {kind} {teardown.drain_at_exit.cache_info().currsize > 0}", flush=True)
    if os.environ.get("NO_EXIT_WAIT") == "1":
        atexit.unregister(teardown.wait_for_workers)
