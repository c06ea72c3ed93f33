"""What the shard-weighting comm hook costs, on equal CPU ranks without emulation.

Run: torchrun --standalone --nproc_per_node=2 benchmarks/bench_hook.py [--steps 200]

DDP copies of LeNet take turns step by step: DDP's built-in mean, torch's own Python
all-reduce hook (the cost of any Python hook), hetsplit's weighting hook with a plan
(constant weights) and without one (any step sizes). Synthetic data, 128 samples per rank.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hetsplit
import hetsplit.distributed as hd
from hetsplit.solver import plan_from_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = hetsplit.models.load_model("lenet")
    x, y = hetsplit.models.synthetic_batch(spec, 128)
    plan = plan_from_sizes(None, [f"rank{r}" for r in range(world)], [128] * world)

    def make(kind: str) -> DDP:
        torch.manual_seed(0)
        model = DDP(spec.factory())
        if kind == "torch Python hook":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif kind == "hetsplit hook, plan":
            hd.weight_gradients(model, plan)
        elif kind == "hetsplit hook, any size":
            hd.weight_gradients(model)
        return model

    models = {k: make(k) for k in ("plain DDP", "torch Python hook", "hetsplit hook, plan", "hetsplit hook, any size")}
    times: dict[str, list[float]] = {k: [] for k in models}
    for step in range(args.steps + 5):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            if step >= 5:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        base = statistics.median(times["plain DDP"])
        for name, ts in times.items():
            print(f"{name:22s} {statistics.median(ts) * 1e3:6.2f} ms  ({statistics.median(ts) / base - 1:+.1%})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
