"""Demo ranks: the demo's process engine, one torchrun rank per device training the demo model with DDP.

Run by ``hetsplit demo`` through torchrun, on synthetic data; rank 0 writes the timings to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    """Train ``--steps`` DDP steps on this rank's share of the batch; rank 0 writes the timings."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetsplit.distributed as hd
    from hetsplit.apps.models import build_model, load_model, synthetic_batch
    from hetsplit.devices import rank_label
    from hetsplit.planning import plan_from_sizes
    from hetsplit.profiler import train_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--sizes", required=True, help="each rank's share of the batch, e.g. 200,56")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-shape", help="shape of one sample, for a package.module:factory model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dev = hd.init(timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) for s in args.sizes.split(",")]
    shape = tuple(int(n) for n in args.input_shape.split(",")) if args.input_shape else None
    spec = load_model(args.model, shape)
    torch.manual_seed(args.seed)
    model = build_model(spec).to(dev.torch_device)
    x, y = synthetic_batch(spec, sum(sizes), seed=args.seed)
    start = sum(sizes[:rank])
    x, y = x[start : start + sizes[rank]].to(dev.torch_device), y[start : start + sizes[rank]].to(dev.torch_device)
    names = [rank_label(r) for r in range(world)]
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    hd.weight_gradients(ddp, plan_from_sizes(None, names, sizes))  # shard-weighted: exact full-batch gradients
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        begin = time.perf_counter()
        with hd.guard(step=step):
            opt.zero_grad(set_to_none=True)
            train_step(ddp, x, y, F.cross_entropy, dev)  # waiting for the other rank is not slowed
            opt.step()
        dev.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
    # Each rank's own work, the same steps without the gradient all-reduce (DDP's no_sync),
    # started together: the step above less the slowest rank's is what the engine adds.
    own = []
    for step in range(args.steps):
        with hd.guard(step=step, what="timing this rank's own work"):  # a dead peer: one clear line
            dist.barrier()
            begin = time.perf_counter()
            with ddp.no_sync():
                opt.zero_grad(set_to_none=True)
                train_step(ddp, x, y, F.cross_entropy, dev)
                opt.step()
            dev.synchronize()
            own.append(time.perf_counter() - begin)
    work = [0.0] * world
    with hd.guard(what="gathering the ranks' own work"):
        dist.all_gather_object(work, statistics.median(own))
    # What the process engine pays that threads do not: one all-reduce of the gradients.
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev.torch_device)
    reduce = []
    with hd.guard(what="timing an all-reduce of the gradients"):
        for _ in range(10):
            dist.barrier()
            begin = time.perf_counter()
            dist.all_reduce(flat)
            reduce.append(time.perf_counter() - begin)
    if rank == 0:
        result = {
            "step": statistics.median(times),
            "steps": times,
            "allreduce": statistics.median(reduce),
            "work": work,
            "gradient_bytes": flat.numel() * flat.element_size(),
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
