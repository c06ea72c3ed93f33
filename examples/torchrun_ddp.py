"""DistributedDataParallel across unequal ranks: each rank's share from one plan, shard-weighted gradients.

Launch one process per device:

  hetsplit launch --devices cpu,cpu@0.25 examples/torchrun_ddp.py                      # CPU-only machine
  hetsplit launch --devices cuda:0,cuda:1,cpu examples/torchrun_ddp.py                 # two GPUs and the CPU
  torchrun --nproc_per_node=2 examples/torchrun_ddp.py --devices cpu,cpu@0.25          # plain torchrun
  torchrun --nproc_per_node=2 examples/torchrun_ddp.py --devices cuda:0,cuda:1         # two GPUs
  torchrun --nnodes=2 --node_rank=N --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
           --nproc_per_node=1 examples/torchrun_ddp.py --devices cuda:0,cpu            # across nodes

--devices lists exactly one device per global rank (a list of another length is an error
on every rank, before any work). Data: Fashion-MNIST from --data-dir when present, else
SYNTHETIC (labelled so; nothing is downloaded).

A failure ends in one line on stderr and exit status 1 on each rank that sees it: a rank
that dies or hangs becomes hd.DistributedError on the others, naming the step, the rank
and the timeout (--timeout); --debug adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import accuracy, add_data_args, load, run_rank

import hetsplit
import hetsplit.distributed as hd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        default=os.environ.get("HETSPLIT_DEVICES", "cpu,cpu@0.25"),
        help="one device per rank, e.g. cuda:0,cpu (default: what 'hetsplit launch --devices' set, else cpu,cpu@0.25)",
    )
    parser.add_argument("--batch-size", type=int, default=256, help="global batch per step, across all ranks")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run every epoch fully)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--equal", action="store_true", help="equal shares (as DistributedSampler), for comparison")
    parser.add_argument(
        "--weighting",
        choices=("hook", "outputs", "none"),
        default="hook",
        help="shard weighting: a DDP comm hook (general), scaling at the model's outputs "
        "(cheapest; leaves the comm hook free), or none (DDP's plain mean: biased)",
    )
    parser.add_argument("--budget", type=float, default=10.0, help="seconds each rank profiles")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a dead or hung rank is an error")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0: torch's choice)")
    parser.add_argument(
        "--rebalance",
        type=int,
        default=0,
        metavar="K",
        help="re-solve the shares from measured step times every K steps (0: off)",
    )
    parser.add_argument(
        "--slow-down",
        metavar="STEP",
        type=int,
        default=0,
        help="demo: from this step on, emulated ranks run 4x slower than their --devices speed",
    )
    parser.add_argument("--log-every", type=int, default=0, metavar="K", help="print the loss every K steps (rank 0)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    add_data_args(parser)
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    # hd.init checks the device list against torchrun's WORLD_SIZE before joining the
    # group (a list of another length fails on every rank, before any work), selects this
    # rank's device and picks the backend: NCCL when every rank is a GPU, else gloo.
    try:
        with hd.guard(what="joining the process group"):
            dev = hd.init(args.timeout, devices=args.devices, backend=None if args.backend == "auto" else args.backend)
    except ValueError as e:
        raise ValueError(f"--devices {args.devices}: {e}") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    devices = [d.strip() for d in args.devices.split(",")]  # hd.init checked: one per rank
    backend = dist.get_backend()
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    train_iter, test_iter, label = load(args, args.batch_size)
    train_set = train_iter.dataset
    say(f"data: {label}")
    say(f"{world} ranks on {', '.join(devices)} ({backend}); timeout {args.timeout:g} s")
    if any("@" in d for d in devices):
        say("emulated devices are real devices slowed down by sleeping; not real hardware")

    torch.manual_seed(0)
    model = hetsplit.models.lenet().to(dev.torch_device)
    x0, y0 = next(iter(train_iter))
    plan = hd.plan(
        model,
        x0[:16],
        args.batch_size,
        device=dev,
        loss_fn=F.cross_entropy,
        target=y0[:16],
        weights=[1] * world if args.equal else None,  # --equal: DistributedSampler's shares
        time_budget=args.budget,
    )
    say("plan:", ", ".join(f"{d} {s}" for d, s in zip(plan.devices, plan.sizes)))

    with hd.guard(what="setting up DDP"):  # DDP broadcasts the model from rank 0
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        grads = None if args.weighting == "none" else hd.weight_gradients(ddp, plan, method=args.weighting)
    # One list of indices per step: the shares can change between steps (--rebalance).
    loader = hd.data_loader(train_set, plan, shuffle=True, seed=0)
    sampler = loader.batch_sampler
    rebalancer = None
    if args.rebalance:
        rebalancer = hd.DistributedRebalancer(
            plan,
            hetsplit.Rebalancer(every=args.rebalance, on_change=lambda c: say(f"  plan change at {c}")),
            sampler=sampler,
            gradients=grads,
            model=ddp,
            device=dev,
        )
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    done = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        steps = 0
        for x, y in loader:
            if args.slow_down and done == args.slow_down and dev.emulated:
                dev.set_speed(dev.speed / 4)
                print(f"rank {rank}: {dev.name} now runs at {dev.speed / 4:g}x", flush=True)
            x, y = x.to(dev.torch_device), y.to(dev.torch_device)
            # A dead or hung rank surfaces in backward (DDP's all-reduce, the comm hook) or in
            # the rebalancer's exchange: the guard makes it one DistributedError naming the step.
            with hd.guard(step=done):
                opt.zero_grad(set_to_none=True)
                with rebalancer.step() if rebalancer else contextlib.nullcontext():
                    # Forward, loss, backward, each at the device's (emulated) speed; DDP's
                    # backward also waits for the other ranks, and only work is slowed.
                    with dev.throttle():
                        loss = F.cross_entropy(ddp(x), y)
                    with dev.throttle():
                        loss.backward()
                opt.step()
            if args.log_every and done % args.log_every == 0:
                say(f"step {done}: loss {loss.item():.3f}")
            done += 1
            steps += 1
            if args.steps and done >= args.steps:
                break
        seconds = time.perf_counter() - start
        if rank == 0:
            acc = accuracy(model, test_iter, dev.torch_device)
            say(
                f"epoch {epoch + 1}: {steps} steps in {seconds:.2f} s ({seconds / max(steps, 1) * 1e3:.1f} ms/step), "
                f"loss {loss.item():.3f}, test acc {acc:.3f}"
            )
        if args.steps and done >= args.steps:
            break
    if rebalancer is not None:
        say(f"{len(rebalancer.history)} plan changes; final shares {rebalancer.plan.sizes}")
    dev.set_speed(None)
    # Tear the group down together: a rank that destroys it while another still reads from
    # its gloo connections can make that rank abort at exit ("terminate called without an
    # active exception"), seen here about once in five runs on a loaded 2-core machine.
    with hd.guard(what="finishing"):
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    run_rank(train, args, "torchrun_ddp.py")


if __name__ == "__main__":
    main()
