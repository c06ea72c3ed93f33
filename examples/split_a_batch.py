"""Profile two devices on LeNet, solve the split of a batch, and scatter it (synthetic data).

Run: python examples/split_a_batch.py --devices cpu,cpu@0.25 --batch-size 256
"""

import argparse

import torch
import torch.nn.functional as F

import hetsplit
from hetsplit.apps.models import BUILTIN_MODELS, lenet, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25", help="comma-separated devices")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--budget", type=float, default=10.0, help="profiling time budget in seconds")
    args = parser.parse_args()

    print("data: synthetic (random 1x28x28 images, random labels)")
    x, y = synthetic_batch(BUILTIN_MODELS["lenet"], args.batch_size)
    prof = hetsplit.profile(lenet(), x[:16], args.devices, F.cross_entropy, target=y[:16], time_budget=args.budget)
    if prof.emulated:
        print(f"emulated devices: {', '.join(prof.emulated)}")
    plan = hetsplit.solve(prof, args.batch_size)
    for name, size, t in zip(plan.devices, plan.sizes, plan.times):
        print(f"{name:>12}: {size:4d} samples, predicted {t * 1e3:.2f} ms")
    print(
        f"predicted speedup: {plan.speedup_vs_even:.2f}x over the even split, "
        f"{plan.speedup_vs_single:.2f}x over {plan.single_device} alone"
    )
    shards = hetsplit.parallel.scatter((x, y), plan.devices, plan.sizes)
    assert torch.equal(hetsplit.parallel.gather(shards, "cpu")[0], x)
    print("scattered and gathered back exactly:", [tuple(s[0].shape) for s in shards])


if __name__ == "__main__":
    main()
