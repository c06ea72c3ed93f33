"""The classic DataParallel tutorial with uneven shards: a model that prints the input size each device sees.

Run: python examples/dataparallel_tutorial.py --devices cpu,cpu@0.25 [--weights 3,1]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hetsplit


class RandomDataset(Dataset):
    """``length`` random vectors of ``size`` features (synthetic data)."""

    def __init__(self, size: int, length: int) -> None:
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)


class Model(nn.Module):
    """A linear layer that reports the batch it receives, and where."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        # x.device is where the work runs: "cpu" for cpu@0.25 too (the CPU, slowed down), so
        # which device took which shard is printed outside, from the split.
        print(f"\tIn Model: input size {tuple(x.shape)}, output size {tuple(out.shape)}")
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25")
    parser.add_argument("--weights", default="3,1", help="relative speeds, one per device (e.g. 3,1)")
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--data-size", type=int, default=100)
    args = parser.parse_args()

    devices = hetsplit.parse_devices(args.devices)
    weights = [float(w) for w in args.weights.split(",")]
    print("data: synthetic (random vectors)")
    if any(d.emulated for d in devices):
        print("emulated devices:", ", ".join(d.name for d in devices if d.emulated))
    model = hetsplit.HeteroDataParallel(Model(5, 2), devices, weights=weights)
    loader = DataLoader(RandomDataset(5, args.data_size), batch_size=args.batch_size, shuffle=True)
    labels = [d.name + (" (emulated)" if d.emulated else "") for d in devices]
    for batch in loader:
        output = model(batch)
        shards = ", ".join(f"{label} {size}" for label, size in zip(labels, model.plan.sizes))
        print(f"Outside: input size {tuple(batch.shape)}, output size {tuple(output.shape)}; rows per device: {shards}")


if __name__ == "__main__":
    main()
