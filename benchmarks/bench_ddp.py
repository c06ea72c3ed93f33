"""Benchmark DDP on unequal ranks: equal vs balanced shares, and what shard weighting costs.

Run: torchrun --standalone --nproc_per_node=2 benchmarks/bench_ddp.py --devices cpu,cpu@0.25 [--json OUT]
(``--devices cpu,cpu`` measures the weighting without emulation.)

Two phases in one launch, both interleaved so that a drifting machine slows every
configuration alike; synthetic data.

1. Epochs. Equal shares (what DistributedSampler gives) with DDP's plain mean take turns
   epoch by epoch, in a shuffled order, with balanced shares and hetsplit's
   shard-weighted gradients (each method). Each round gives paired ratios equal/balanced.
2. Steps. On the balanced shares, DDP's built-in mean, hetsplit's weighting (both
   methods: the comm hook, and scaling at the outputs) and torch's own do-nothing
   Python all-reduce hook take turns in blocks of ``--block``
   steps run back to back (as in training: no barrier between steps). A step's time is
   the slowest rank's block time from a common barrier, per step; each round gives
   paired ratios to the built-in mean, summarised by their median with a bootstrap 95 %
   interval. Each rank's CPU time per step (work, not waiting; an emulated rank's
   sleep is not in it) is compared the same way.
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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.stats import bootstrap
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetsplit
import hetsplit.distributed as hd
from hetsplit.apps.bench import keep_freed_memory
from hetsplit.planning import plan_from_sizes
from hetsplit.planning.plan import even_sizes
from hetsplit.profiler import train_step

EQUAL, BALANCED, BALANCED_OUT = (
    "equal shares, plain DDP mean",
    "balanced, weighted by comm hook",
    "balanced, weighted at outputs",
)
PLAIN, WEIGHTED, OUTPUTS, PYHOOK = ("built-in mean", "hetsplit, comm hook", "hetsplit, outputs", "torch's Python hook")


def median_interval(ratios: list[float]) -> tuple[float, float, float]:
    """The median of ``ratios`` and a bootstrap 95 % confidence interval for it."""
    data = np.asarray(ratios)
    ci = bootstrap(
        (data,),
        np.median,
        confidence_level=0.95,
        n_resamples=2000,
        method="percentile",
        random_state=np.random.default_rng(0),
    ).confidence_interval
    return float(np.median(data)), float(ci.low), float(ci.high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu@0.25")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096, help="samples per epoch")
    parser.add_argument("--rounds", type=int, default=10, help="epochs of each configuration in phase 1")
    parser.add_argument("--steps", type=int, default=300, help="steps of each configuration in phase 2")
    parser.add_argument("--block", type=int, default=5, help="steps run back to back between barriers in phase 2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="lenet", help="built-in model: lenet, mlp, resnet18")
    parser.add_argument("--json")
    args = parser.parse_args()

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    dev = hd.init(300, devices=args.devices, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = hetsplit.models.load_model(args.model)
    data = TensorDataset(*hetsplit.models.synthetic_batch(spec, args.samples))

    torch.manual_seed(0)
    x0, y0 = data.tensors[0][:16], data.tensors[1][:16]
    balanced = hd.plan(
        spec.factory(), x0, args.batch_size, device=dev, loss_fn=F.cross_entropy, target=y0, time_budget=20
    )
    equal = plan_from_sizes(None, balanced.devices, even_sizes(args.batch_size, world))

    def make(plan, hook):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = DDP(spec.factory())
        if hook == WEIGHTED:
            hd.weight_gradients(model, plan)
        elif hook == OUTPUTS:
            hd.weight_gradients(model, plan, method="outputs")
        elif hook == PYHOOK:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model, opt, x, y) -> None:  # type: ignore[no-untyped-def]
        opt.zero_grad(set_to_none=True)
        train_step(model, x, y, F.cross_entropy, dev)  # waiting for other ranks is not slowed
        opt.step()

    # Phase 1: whole epochs, equal vs balanced shares.
    epochs: dict[str, list[float]] = {EQUAL: [], BALANCED: [], BALANCED_OUT: []}
    runs = {}
    for name, plan, hook in ((EQUAL, equal, None), (BALANCED, balanced, WEIGHTED), (BALANCED_OUT, balanced, OUTPUTS)):
        sampler = hd.HeteroDistributedSampler(data, plan, seed=0)
        runs[name] = (
            *make(plan, hook),
            sampler,
            DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate),
            plan.sizes[rank],
        )
    for rnd in range(args.rounds + 1):  # the first round warms up
        order = list(runs)
        random.Random(rnd).shuffle(order)  # the same order on every rank
        for name in order:
            model, opt, sampler, loader, size = runs[name]
            sampler.set_epoch(rnd)
            batches = iter(loader)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(sampler.steps):
                x, y = next(batches) if size > 0 else (x0[:0], y0[:0])
                step(model, opt, x, y)
            dist.barrier()
            if rnd:
                epochs[name].append(time.perf_counter() - start)

    # Phase 2: single steps on the balanced shares, built-in mean vs Python hooks.
    local = balanced.sizes[rank]
    x, y = data.tensors[0][:local], data.tensors[1][:local]
    configs = {name: make(balanced, name if name != PLAIN else None) for name in (PLAIN, WEIGHTED, OUTPUTS, PYHOOK)}
    blocks = args.steps // args.block
    wall = torch.zeros(blocks, len(configs), dtype=torch.float64)
    cpu = torch.zeros(blocks, len(configs), dtype=torch.float64)  # this process's CPU time: work, not waiting
    for i in range(-1, blocks):  # block -1 warms up
        order = list(configs)
        random.Random(10_000 + i).shuffle(order)
        for name in order:
            model, opt = configs[name]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                step(model, opt, x, y)
            if i >= 0:
                j = list(configs).index(name)
                wall[i, j] = (time.perf_counter() - start) / args.block
                cpu[i, j] = (time.process_time() - start_cpu) / args.block
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    cpus = [torch.zeros_like(cpu) for _ in range(world)]
    dist.all_gather(cpus, cpu)

    if rank == 0:
        ratios = {n: [e / b for e, b in zip(epochs[EQUAL], epochs[n])] for n in (BALANCED, BALANCED_OUT)}
        names = list(configs)
        step_ms = {n: 1e3 * float(wall[:, j].median()) for j, n in enumerate(names)}
        overhead = {n: median_interval((wall[:, j] / wall[:, 0] - 1.0).tolist()) for j, n in enumerate(names) if j}
        cpu_ms = {n: [1e3 * float(c[:, j].median()) for c in cpus] for j, n in enumerate(names)}
        cpu_added = {
            n: [median_interval((c[:, j] / c[:, 0] - 1.0).tolist()) for c in cpus] for j, n in enumerate(names) if j
        }
        result = {
            "date": datetime.date.today().isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "devices": [d.strip() for d in args.devices.split(",")],
            "batch_size": args.batch_size,
            "model": spec.name,
            "samples": args.samples,
            "threads": args.threads,
            "balanced_sizes": balanced.sizes,
            "epoch_s": {n: statistics.median(v) for n, v in epochs.items()},
            "speedup_per_round": ratios,
            "speedup_median": {n: statistics.median(r) for n, r in ratios.items()},
            "step_ms": step_ms,
            "overhead_median_ci95": overhead,
            "cpu_ms_per_rank": cpu_ms,
            "cpu_added_median_ci95_per_rank": cpu_added,
        }
        for n, v in epochs.items():
            print(f"{n:32s} epoch {statistics.median(v):6.3f} s  (median of {len(v)})")
        for n, r in ratios.items():
            print(
                f"{n} {balanced.sizes}: {statistics.median(r):.2f}x faster per epoch than equal shares "
                f"(median of {len(r)} paired rounds; {min(r):.2f}-{max(r):.2f})"
            )
        print(f"per step, slowest rank, vs DDP's built-in mean ({step_ms[PLAIN]:.2f} ms); CPU time per rank:")
        for n, (mid, low, high) in overhead.items():
            work = ", ".join(
                f"rank {r} {cpu_ms[n][r]:.2f} ms {c[0]:+.1%} ({c[1]:+.1%} .. {c[2]:+.1%})"
                for r, c in enumerate(cpu_added[n])
            )
            print(f"  {n:20s} {step_ms[n]:6.2f} ms {mid:+.2%} (95% CI {low:+.2%} .. {high:+.2%}); CPU: {work}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
    dist.barrier()  # tear down together: a rank leaving while the other still reads can abort at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
