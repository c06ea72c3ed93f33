"""Hugging Face accelerate on unequal devices: HeteroAccelerator gives each process its share of every batch.

  hetsplit launch --devices cpu,cpu@0.25 examples/accelerate_hetero.py        # CPU + an emulated 1/4-speed CPU
  accelerate launch --multi_gpu --num_processes 2 examples/accelerate_hetero.py --devices cpu,cpu@0.25
  hetsplit launch --devices cuda:0,cuda:1 examples/accelerate_hetero.py       # two unequal GPUs, same script

The only change from a plain accelerate script is the accelerator:

  accelerator = Accelerator()
  accelerator = HeteroAccelerator()      # devices from 'hetsplit launch --devices', or devices="cpu,cpu@0.25"

(`accelerate launch --cpu` starts one process whatever --num_processes says; --multi_gpu
starts one per device, on a CPU-only machine too.) Each process profiles the model on
its own device at prepare(), process 0 solves the split of the global batch (processes
× the loader's batch_size, as accelerate counts it), and gradients are weighted by
shard, so every step equals a full-batch step. Data: Fashion-MNIST from --data-dir when
present, else SYNTHETIC (labelled so; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import add_data_args, load

import hetsplit
from hetsplit.accelerate import HeteroAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None, help="one device per process (default: $HETSPLIT_DEVICES)")
    parser.add_argument("--batch-size", type=int, default=128, help="the loader's batch size per process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds each process profiles")
    add_data_args(parser)
    parser.set_defaults(train_size=4096, test_size=1024)
    args = parser.parse_args()

    accelerator = HeteroAccelerator(devices=args.devices, plan_kwargs={"time_budget": args.budget})
    torch.manual_seed(0)
    train, test, label = load(args, args.batch_size)
    model = hetsplit.models.lenet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Everything below is a plain accelerate script.
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)
    accelerator.print(f"data: {label}")
    plan = accelerator.plan
    accelerator.print("plan:", ", ".join(f"{d} {s}" for d, s in zip(plan.devices, plan.sizes)), f"of {plan.batch_size}")
    for epoch in range(args.epochs):
        model.train()
        start = time.perf_counter()
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seconds = time.perf_counter() - start
        model.eval()
        right = total = 0
        losses = []
        with torch.no_grad():
            for x, y in test:
                logits = model(x)
                losses.append(accelerator.reduce(F.cross_entropy(logits, y), "mean"))  # weighted by samples
                pred, y = accelerator.gather_for_metrics((logits.argmax(1), y))  # every sample once
                right += int((pred == y).sum())
                total += len(y)
        accelerator.print(
            f"epoch {epoch + 1}: {len(train)} steps in {seconds:.2f} s ({seconds / len(train) * 1e3:.1f} ms/step), "
            f"test loss {torch.stack(losses).mean().item():.3f}, test acc {right / total:.3f} ({total} samples)"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
