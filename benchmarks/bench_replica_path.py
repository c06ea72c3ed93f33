"""The replica path's cost per step: two CPU replicas (``cpu`` + ``cpu@1``, no sleeping), an even split.

Run: python benchmarks/bench_replica_path.py [--model mlp|lenet] [--mode gather|local] [--steps 300]
Median and 10th percentile of the step time, one intra-op thread; run it in two trees one
after the other (``PYTHONPATH=...``) to compare engines. ``HETSPLIT_PIN_CPU=0`` leaves the
replicas' threads unpinned.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hetsplit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "lenet"), default="mlp")
    parser.add_argument("--mode", choices=("gather", "local"), default="gather")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model == "lenet":
        net, x = hetsplit.models.lenet(), torch.randn(args.batch, 1, 28, 28)
    else:
        net, x = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(args.batch, 64)
    y = torch.randint(0, 10, (args.batch,))
    dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@1"], weights=[1, 1])
    times = []
    for i in range(args.steps + 10):
        start = time.perf_counter()
        net.zero_grad(set_to_none=True)
        if args.mode == "local":
            dp.train_step(x, y, F.cross_entropy)
        else:
            F.cross_entropy(dp(x), y).backward()
        if i >= 10:  # warm-up steps are not kept
            times.append(time.perf_counter() - start)
    times.sort()
    median, p10 = statistics.median(times) * 1e6, times[len(times) // 10] * 1e6
    print(f"{args.model} {args.mode}, 2 x {args.batch // 2} rows: median {median:.0f} us, p10 {p10:.0f} us")


if __name__ == "__main__":
    main()
