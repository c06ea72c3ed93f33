"""Nodes that join and leave under torchrun: every restart re-plans for the new world and resumes exactly.

Start one agent per node, each listing its own devices (nodes join and leave while it runs):

  hetsplit launch --nnodes 1:4 --max-restarts 10 --rdzv-endpoint HEAD:29400 --devices cuda:0 \\
      examples/elastic_torchrun.py --checkpoint /shared/ckpt
  hetsplit launch --devices cpu,cpu@0.25 examples/elastic_torchrun.py     # one machine, a fixed world

Plain torchrun: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --max-restarts=10
--rdzv-backend=c10d --rdzv-endpoint=HEAD:29400 examples/elastic_torchrun.py --devices cuda:0.
Every start plans with hd.Checkpoint (from the curves stored by an earlier start: no
profiling), loads the newest checkpoint (model, optimizer, the global-batch position) and
saves one after every --save-every steps; the global batch is --batch-size whatever the
world. Data: SYNTHETIC (labelled so; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import run_rank

import hetsplit.distributed as hd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None, help="this node's devices (default: what hetsplit launch set)")
    parser.add_argument("--checkpoint", default="ckpt", help="the checkpoint folder, seen by every node")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch per step, whatever the world")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints (a restart redoes fewer)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds a device never seen before profiles")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    dev = hd.init(60, devices=args.devices)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 32, generator=gen), torch.randint(0, 10, (4096,), generator=gen)
    data = TensorDataset(x, y)  # SYNTHETIC
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev.torch_device)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ckpt = hd.Checkpoint(args.checkpoint)
    plan = ckpt.plan(ddp, x[:16], args.batch_size, device=dev, loss_fn=F.cross_entropy, target=y[:16],
                     time_budget=args.budget)  # fmt: skip
    loader = hd.data_loader(data, plan, shuffle=True, seed=0)
    step = ckpt.load(ddp, opt, loader.batch_sampler)  # 0 on the first start
    how = "from stored curves" if ckpt.stored else "profiled"
    say(f"SYNTHETIC data; {world} ranks, plan {how}: {plan.sizes}; resuming at step {step}")
    while step < args.steps:
        loader.batch_sampler.set_epoch(step // len(loader))
        for xb, yb in loader:
            opt.zero_grad()
            with dev.throttle():
                loss = F.cross_entropy(ddp(xb.to(dev.torch_device)), yb.to(dev.torch_device))
                loss.backward()
            opt.step()
            step += 1
            if step % args.save_every == 0 or step == args.steps:
                ckpt.save(step, ddp, opt)
            if step >= args.steps:
                break
    say(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(train, parse_args(), "elastic_torchrun.py")
