"""What a micro-batched Lightning step costs: HeteroDDPStrategy following a plan with micro-batches.

Run: torchrun --standalone --nproc_per_node=2 benchmarks/bench_lightning_micro.py [--steps 22] [--micro 4]

Two CPU ranks (gloo, one thread each), torchvision's ``mobilenet_v3_small`` (BatchNorm,
dropout) on 64 x 64 images, a global batch of 64: both ranks run their share of 32 as
``--micro`` micro-batches (``cpu:max8``: a forward on more than 8 samples raises), then,
for comparison, as one batch. The figure is rank 0's CPU time for each step
(``on_train_batch_start`` to ``on_train_batch_end``: forward, backward and optimizer
step; waiting for rank 1 is not work) as a 10 %-trimmed mean over the steps after the
first two, so a loaded machine's noise mostly cancels; the wall time's median is given
too. Synthetic data. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import mobilenet_v3_small

import hetsplit
from hetsplit.lightning import HeteroDDPStrategy


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mobilenet_v3_small(num_classes=10)
        self.times: list[tuple[float, float]] = []  # (CPU, wall) seconds per step
        self._start = (0.0, 0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self._start = (time.process_time(), time.perf_counter())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.times.append((time.process_time() - self._start[0], time.perf_counter() - self._start[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    ordered = sorted(values)
    k = int(len(ordered) * cut)
    return statistics.fmean(ordered[k : len(ordered) - k])


def run(steps: int, micro: int) -> tuple[float, float]:
    torch.manual_seed(0)
    n, share = 64 * steps, 32
    data = TensorDataset(torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,)))
    parts = [[share // micro] * micro] * 2 if micro > 1 else [[share]] * 2
    plan = hetsplit.Plan(["rank0", "rank1"], [share, share], [0.0, 0.0], 2 * share, micro_batches=parts)
    devices = f"cpu:max{share // micro},cpu:max{share // micro}"
    model = Net()
    trainer = L.Trainer(
        strategy=HeteroDDPStrategy(devices=devices, plan=plan), accelerator="cpu", devices=2, max_steps=steps,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=share))
    cpu, wall = zip(*model.times[2:])
    return trimmed_mean(list(cpu)), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    split = run(args.steps, args.micro)
    whole = run(args.steps, 1)
    if int(os.environ.get("RANK", 0)) == 0:
        result = {"micro_batches": args.micro, "cpu_s_micro": round(split[0], 4), "cpu_s_whole": round(whole[0], 4)}
        result.update(ratio=round(split[0] / whole[0], 3), wall_s_micro=round(split[1], 4))
        result.update(wall_s_whole=round(whole[1], 4))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
