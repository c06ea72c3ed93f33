"""Online rebalancing: an emulated device slows down 4x mid-run; how fast does the split follow?

Run: python benchmarks/bench_rebalance.py [--steps 120] [--slow-at 30]

HeteroDataParallel on cpu + cpu@1 (the CPU emulated at full speed), starting from an
even split, rebalancing every 5 steps; at step --slow-at cpu@1 drops to 0.25x speed.
Prints every plan change and the median step time per 10 steps. LeNet, synthetic data.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import hetsplit
from hetsplit.bench import keep_freed_memory
from hetsplit.models import BUILTIN_MODELS, lenet, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--slow-at", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = synthetic_batch(BUILTIN_MODELS["lenet"], args.batch_size)
    reb = hetsplit.Rebalancer(every=5, on_change=lambda c: print(f"  plan change at {c}"))
    dp = hetsplit.HeteroDataParallel(lenet(), ["cpu", "cpu@1"], weights=[1, 1], rebalance=reb)
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    emulated = hetsplit.parse_device("cpu@1")
    times = []
    try:
        for step in range(args.steps):
            if step == args.slow_at:
                emulated.set_speed(0.25)
                print(f"  step {step}: cpu@1 now runs at 0.25x")
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(dp(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
    finally:
        emulated.set_speed(None)
    for a in range(0, args.steps, 10):
        print(f"steps {a:3d}-{a + 9:3d}: median {statistics.median(times[a:a + 10]) * 1e3:6.1f} ms")
    print(f"{len(reb.history)} plan changes; final split {dp.plan.sizes}")


if __name__ == "__main__":
    main()
