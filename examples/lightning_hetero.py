"""Lightning on unequal devices: HeteroDDPStrategy gives each rank its share of every batch, with exact gradients.

  python examples/lightning_hetero.py --devices cpu,cpu@0.25      # CPU only: the CPU + an emulated 1/4-speed CPU
  python examples/lightning_hetero.py --devices cuda:0,cuda:1     # two unequal GPUs, same script
  torchrun --nproc_per_node=2 examples/lightning_hetero.py --devices cpu,cpu@0.25   # ranks started by torchrun

The only change from a plain Lightning DDP script is the strategy:

  L.Trainer(strategy="ddp", accelerator=..., devices=2)
  L.Trainer(strategy=HeteroDDPStrategy(devices="cpu,cpu@0.25"), accelerator=..., devices=2)

Each rank profiles the model on its own device, rank 0 solves the split of the global
batch (--batch-size, the global batch plain DDP would run with loaders of
--batch-size / ranks), and DDP's gradients are weighted by shard, so every step equals
a full-batch step. Emulated devices are the real CPU slowed down by sleeping, labelled
as such. Data: Fashion-MNIST from --data-dir when present, else SYNTHETIC (labelled so;
nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import add_data_args, load

import hetsplit
from hetsplit.lightning import HeteroDDPStrategy


class LitLeNet(L.LightningModule):
    """LeNet-5 as a LightningModule: nothing in it knows about hetsplit."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = hetsplit.models.lenet()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # sync_dist: the strategy weights each rank's value by its samples (the global batch's mean).
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EpochTimer(L.Callback):
    """Prints each epoch's time, steps and validation metrics (rank 0)."""

    def on_train_epoch_start(self, trainer, pl_module):
        self.start, self.steps = time.perf_counter(), trainer.global_step

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or not trainer.is_global_zero or not hasattr(self, "start"):
            return
        seconds, steps = time.perf_counter() - self.start, trainer.global_step - self.steps
        m = trainer.callback_metrics
        print(
            f"epoch {trainer.current_epoch + 1}: {steps} steps in {seconds:.2f} s "
            f"({seconds / max(steps, 1) * 1e3:.1f} ms/step incl. validation), "
            f"val loss {float(m['val_loss']):.3f}, val acc {float(m['val_acc']):.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25", help="one device per rank (default: cpu,cpu@0.25)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch per step, across all ranks")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds each rank profiles")
    parser.add_argument("--rebalance", type=int, default=0, metavar="K", help="re-solve the shares every K steps")
    add_data_args(parser)
    parser.set_defaults(train_size=4096, test_size=1024)
    args = parser.parse_args()

    names = [d.strip() for d in args.devices.split(",") if d.strip()]
    gpu = all(n.startswith("cuda") for n in names)
    L.seed_everything(0, verbose=False)
    train, test, label = load(args, args.batch_size // len(names))  # per-rank loaders, as for plain DDP
    strategy = HeteroDDPStrategy(
        devices=args.devices,
        global_batch_size=args.batch_size,
        rebalance=args.rebalance,
        plan_kwargs={"time_budget": args.budget},
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if gpu else "cpu",
        devices=len(names),
        max_epochs=args.epochs,
        callbacks=[EpochTimer()],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    if trainer.is_global_zero:
        print(f"data: {label}", flush=True)
        emulated = [n for n in names if "@" in n]
        if emulated:
            print(f"emulated devices: {', '.join(emulated)} (the real CPU slowed down by sleeping)", flush=True)
    trainer.fit(LitLeNet(args.lr), train, test)
    if trainer.is_global_zero:
        plan = strategy.plan
        print("plan:", ", ".join(f"{d} {s}" for d, s in zip(plan.devices, plan.sizes)), f"of {plan.batch_size}")


if __name__ == "__main__":
    main()
