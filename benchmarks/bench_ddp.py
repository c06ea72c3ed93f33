"""Benchmark DDP on unequal ranks: equal shares vs balanced shares, and the cost of shard weighting.

Run: torchrun --standalone --nproc_per_node=2 benchmarks/bench_ddp.py --devices cpu,cpu@0.25 [--json OUT]

In one launch, full epochs of the configurations take turns in a shuffled order (so a
drifting machine slows them alike): equal shares (what DistributedSampler gives) with DDP's plain mean,
balanced shares with hetsplit's shard-weighted gradients, and balanced shares without
the weighting (to measure what the weighting costs). Synthetic data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
import hetsplit.distributed as hd
from hetsplit.bench import keep_freed_memory
from hetsplit.solver import even_sizes, plan_from_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096, help="samples per epoch")
    parser.add_argument("--rounds", type=int, default=3, help="epochs of each configuration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="lenet", help="built-in model: lenet, mlp, resnet18")
    parser.add_argument("--json")
    args = parser.parse_args()

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = hetsplit.parse_device(hd.rank_device(args.devices, rank))
    spec = hetsplit.models.load_model(args.model)
    data = TensorDataset(*hetsplit.models.synthetic_batch(spec, args.samples))

    torch.manual_seed(0)
    base = spec.factory()
    x0, y0 = data.tensors[0][:16], data.tensors[1][:16]
    balanced = hd.plan(base, x0, args.batch_size, device=dev, loss_fn=F.cross_entropy, target=y0, time_budget=20)
    equal = plan_from_sizes(None, balanced.devices, even_sizes(args.batch_size, world))

    def setup(plan, weighted):
        model = DDP(spec.factory())
        if weighted == "python-hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif weighted:
            hd.weight_gradients(model, plan)
        sampler = hd.HeteroDistributedSampler(data, plan, seed=0)
        size = plan.sizes[rank]
        loader = DataLoader(data, batch_size=max(size, 1), sampler=sampler)
        return model, sampler, loader, torch.optim.SGD(model.parameters(), lr=0.01), size

    configs = {"equal shares, plain DDP mean": setup(equal, False),
               "balanced shares, weighted": setup(balanced, "hook"),
               "balanced shares, plain mean": setup(balanced, False),
               "balanced, torch's Python hook": setup(balanced, "python-hook")}
    epochs = {name: [] for name in configs}
    steps_time = {name: [] for name in configs}
    for rnd in range(args.rounds + 1):  # the first round warms up
        order = list(configs)
        random.Random(rnd).shuffle(order)  # the same order on every rank; no position bias
        for name in order:
            model, sampler, loader, opt, size = configs[name]
            sampler.set_epoch(rnd)
            batches = iter(loader)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(sampler.steps):
                t0 = time.perf_counter()
                x, y = next(batches) if size > 0 else (x0[:0], y0[:0])
                with dev.throttle(cpu_time=True):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                with dev.throttle(cpu_time=True):
                    loss.backward()
                opt.step()
                if rnd:
                    steps_time[name].append(time.perf_counter() - t0)
            dist.barrier()
            if rnd:
                epochs[name].append(time.perf_counter() - start)
    if rank == 0:
        eq, bal = statistics.median(epochs["equal shares, plain DDP mean"]), statistics.median(
            epochs["balanced shares, weighted"])
        s_bal, s_plain, s_py = (statistics.median(steps_time[n]) for n in (
            "balanced shares, weighted", "balanced shares, plain mean", "balanced, torch's Python hook"))
        result = {
            "date": datetime.date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
            "devices": [hd.rank_device(args.devices, r) for r in range(world)], "batch_size": args.batch_size,
            "model": spec.name, "samples": args.samples, "threads": args.threads, "balanced_sizes": balanced.sizes,
            "epoch_s": {n: statistics.median(v) for n, v in epochs.items()},
            "speedup_balanced_vs_equal": eq / bal,
            "weighting_overhead": s_bal / s_plain - 1.0,
            "python_hook_overhead": s_py / s_plain - 1.0,
        }
        for n, v in epochs.items():
            print(f"{n:32s} epoch {statistics.median(v):6.2f} s  (median of {len(v)})")
        print(f"balanced shares {balanced.sizes}: {eq / bal:.2f}x faster per epoch than equal shares")
        print(f"shard weighting: {s_bal / s_plain - 1.0:+.1%} per step (median step {s_bal * 1e3:.1f} vs "
              f"{s_plain * 1e3:.1f} ms); torch's plain Python all-reduce hook: {s_py / s_plain - 1.0:+.1%}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
