"""What HeteroDataParallel adds to a training step: a plain step against the wrapped one, side by side.

Run: python benchmarks/bench_overhead.py [--devices cpu] [--model mlp|lenet] [--batch 256] [--steps 300]
Each round times the plain module and the wrapper in turns (median of --steps steps each),
with one intra-op thread, so both see the same state of the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hetsplit
from hetsplit.apps.models import lenet


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    if name == "lenet":
        return lenet(), torch.randn(1, 1, 28, 28)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(1, 64)


def _median_step(step, n: int) -> float:
    for _ in range(max(10, n // 10)):
        step()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--model", choices=("mlp", "lenet"), default="mlp")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, one = _model(args.model)
    x = one.repeat(args.batch, *([1] * (one.dim() - 1))) + torch.randn(args.batch, *one.shape[1:])
    y = torch.randint(0, 10, (args.batch,))
    devices = hetsplit.parse_devices(args.devices)
    dp = hetsplit.HeteroDataParallel(net, devices, weights=[1] * len(devices))

    def plain() -> None:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    def wrapped() -> None:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()

    print(f"{args.model}, batch {args.batch}, devices {args.devices}, torch {torch.__version__}, 1 thread")
    for r in range(args.rounds):
        a, b = _median_step(plain, args.steps), _median_step(wrapped, args.steps)
        print(f"round {r + 1}: plain {a * 1e6:7.0f} us   wrapped {b * 1e6:7.0f} us   overhead {b / a - 1:+.1%}")


if __name__ == "__main__":
    main()
