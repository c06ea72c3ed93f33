"""The concise version: ResNet-18 (1-channel input) wrapped in HeteroDataParallel instead of nn.DataParallel.

For each device set it trains from the same initial weights and prints test accuracy
and seconds per epoch, so single-device and mixed-device runs can be compared.

Run: python examples/resnet18_dataparallel.py --devices cpu --devices cpu,cpu@0.25 [--data synthetic]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from common import accuracy, add_data_args, load
from torch import nn

import hetsplit


def train(net: nn.Module, devices: str, train_iter, test_iter, epochs: int, lr: float, budget: float) -> None:
    devs = hetsplit.parse_devices(devices)
    x0, y0 = next(iter(train_iter))
    if len(devs) > 1:
        prof = hetsplit.profile(
            net,
            x0[:8],
            devs,
            F.cross_entropy,
            target=y0[:8],
            batch_sizes=sorted({4, 8, 16, 32, len(x0)}),
            time_budget=budget,
            progress=False,
        )
        dp = hetsplit.HeteroDataParallel(net, devs, profile=prof)
    else:
        dp = hetsplit.HeteroDataParallel(net, devs, weights=[1])
    opt = torch.optim.SGD(dp.parameters(), lr=lr)
    for epoch in range(epochs):
        net.train()
        start = time.perf_counter()
        for x, y in train_iter:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(dp(x), y)  # outputs gathered on the module's device, as with nn.DataParallel
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - start
        net.eval()
        acc = accuracy(net, test_iter, torch.device("cpu"))
        print(
            f"  epoch {epoch + 1}: loss {float(loss.detach()):.3f}, test acc {acc:.3f}, {seconds:.1f} s/epoch, "
            f"split {dict(zip(dp.device_names, dp.plan.sizes))}"
            + "".join(f"; {note}" for note in dp.plan.notes)  # e.g. a device sitting out for BatchNorm's sake
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", action="append", help="a device set, e.g. cpu,cpu@0.25 (repeatable)")
    # 32 steps an epoch of the 1,024 samples: enough for ResNet-18 to learn them in one epoch
    # (at 128, its 8 steps ended at chance accuracy).
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--image-size", type=int, default=28, help="resize images to this size")
    parser.add_argument("--budget", type=float, default=20.0)
    add_data_args(parser)
    parser.set_defaults(train_size=1024, test_size=512)
    args = parser.parse_args()
    device_sets = args.devices or ["cpu", "cpu,cpu@0.25"]

    train_iter, test_iter, label = load(args, args.batch_size, size=args.image_size)
    print(f"data: {label}")
    torch.manual_seed(0)
    # torch's default initialisation: the course's normal(std=0.01) leaves activations so small
    # that BatchNorm's running statistics (what evaluation uses) lag far behind a short run's
    # training, and test accuracy stayed at chance while the training loss fell.
    base = hetsplit.models.resnet18(num_classes=10, in_channels=1)
    for devices in device_sets:
        emulated = [d.name for d in hetsplit.parse_devices(devices) if d.emulated]
        print(f"devices {devices}" + (f" (emulated: {', '.join(emulated)})" if emulated else ""))
        train(copy.deepcopy(base), devices, train_iter, test_iter, args.epochs, args.lr, args.budget)


if __name__ == "__main__":
    main()
