"""What shard weighting adds to a DDP step, as CPU time, in one process (no emulation, no peers).

Run: python benchmarks/bench_hook.py [--steps 4000] [--batch 16 128]

A one-rank gloo group; DDP copies of LeNet take turns in random order, step by step:
DDP's built-in mean, hetsplit's weighting (comm hook, and ``method="outputs"``) and
torch's own do-nothing Python all-reduce hook. The figure is this process's CPU time
for forward and backward (work only: no other rank to wait for), as a 10 %-trimmed mean,
so the VM's noise that swamps wall-clock comparisons of a few tens of microseconds
mostly cancels. Synthetic data.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hetsplit
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean of ``values`` without the lowest and highest ``cut`` fraction."""
    ordered = sorted(values)
    k = int(len(ordered) * cut)
    return statistics.fmean(ordered[k : len(ordered) - k])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000, help="steps over all configurations, per batch size")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    spec = hetsplit.models.load_model("lenet")
    rng = random.Random(0)
    for batch in args.batch:
        x, y = hetsplit.models.synthetic_batch(spec, batch)
        plan = plan_from_sizes(None, ["rank0"], [batch])

        def make(kind: str, plan=plan) -> DDP:
            torch.manual_seed(0)
            model = DDP(spec.factory())
            if kind == "hetsplit, comm hook":
                hd.weight_gradients(model, plan)
            elif kind == "hetsplit, outputs":
                hd.weight_gradients(model, plan, method="outputs")
            elif kind == "torch's Python hook":
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            return model

        models = {
            k: make(k) for k in ("built-in mean", "hetsplit, comm hook", "hetsplit, outputs", "torch's Python hook")
        }
        cpu: dict[str, list[float]] = {k: [] for k in models}
        for i in range(args.steps + 40):
            name = rng.choice(list(models))
            start = time.process_time()
            F.cross_entropy(models[name](x), y).backward()
            if i >= 40:
                cpu[name].append(time.process_time() - start)
        base = trimmed_mean(cpu["built-in mean"])
        print(f"batch {batch}: built-in mean {base * 1e6:.0f} us of CPU per step")
        for name, values in cpu.items():
            if name != "built-in mean":
                extra = trimmed_mean(values) - base
                print(f"  {name:20s} {extra * 1e6:+6.0f} us ({extra / base:+.1%}; {len(values)} steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
