"""What HeteroDataParallel adds to a training step: a plain step against the wrapped one, interleaved.

Run: python benchmarks/bench_overhead.py [--model mlp|lenet] [--batch 256] [--steps 300] [--rounds 3]
Every configuration takes one step in turn (plain module, wrapper on one device, wrapper on
two devices whose plan gives the second nothing, the even split on two devices), so all see
the same state of a shared machine; one intra-op thread. Medians per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hetsplit
from hetsplit.apps.models import lenet
from hetsplit.planning import plan_from_sizes


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    if name == "lenet":
        return lenet(), torch.randn(1, 1, 28, 28)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(1, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "lenet"), default="mlp")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("gather", "local"), default="gather")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, one = _model(args.model)
    x = one.repeat(args.batch, *([1] * (one.dim() - 1))) + torch.randn(args.batch, *one.shape[1:])
    y = torch.randint(0, 10, (args.batch,))
    pair = ["cpu", "cpu@0.25"]
    wrappers = {
        "one device": hetsplit.HeteroDataParallel(net, ["cpu"]),
        "cpu+cpu@0.25, plan [B, 0]": hetsplit.HeteroDataParallel(
            net, pair, plan=plan_from_sizes(None, pair, [args.batch, 0])
        ),
        "cpu+cpu, even": hetsplit.HeteroDataParallel(net, ["cpu", "cpu"], weights=[1, 1]),
    }

    def plain() -> None:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    def wrapped(dp: hetsplit.HeteroDataParallel):
        def step() -> None:
            net.zero_grad(set_to_none=True)
            if args.mode == "local":
                dp.train_step(x, y, F.cross_entropy)
            else:
                F.cross_entropy(dp(x), y).backward()

        return step

    steps = {"plain": plain, **{k: wrapped(dp) for k, dp in wrappers.items()}}
    load = os.getloadavg()[0]
    print(f"{args.model}, batch {args.batch}, {args.mode}, torch {torch.__version__}, 1 thread, load {load:.2f}")
    for r in range(args.rounds):
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i in range(args.steps + max(10, args.steps // 10)):
            for name, fn in steps.items():
                start = time.perf_counter()
                fn()
                if i >= max(10, args.steps // 10):  # warm-up steps are not kept
                    times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"plain {med['plain'] * 1e6:.0f} us"] + [
            f"{k} {med[k] * 1e6:.0f} us ({med[k] / med['plain'] - 1:+.1%})" for k in wrappers
        ]
        print(f"round {r + 1}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
