"""One rank of test_restart's elastic torchrun job: a float64 MLP on SYNTHETIC data, checkpointed every step.

Run by ``hetsplit launch --nnodes 1:3 ... restart_job.py CKPT OPTIM STEPS LOG``: every start
re-plans through ``hd.Checkpoint``, resumes at the checkpoint's global batch and appends JSON
lines to LOG (a start: its world, plan and re-plan time; rank 0's committed steps). While a
file ``pause`` beside LOG holds a step number, the ranks wait after reaching it (the test's hold for a joiner).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import hetsplit.distributed as hd

BATCH, N = 12, 60  # 5 global batches an epoch: a run of 16 steps crosses epochs


def dataset() -> TensorDataset:
    """SYNTHETIC inputs and labels, seeded."""
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(N, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    )


def model_and_opt(optim: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    if optim == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _held(pause: str, step: int) -> bool:
    try:
        with open(pause) as f:
            return step >= int(f.read())
    except (OSError, ValueError):
        return False


def main() -> None:
    ckpt_dir, optim, steps, log_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dev = hd.init(timeout=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    pause = os.path.join(os.path.dirname(log_path), "pause")
    model, opt = model_and_opt(optim)
    ddp = DistributedDataParallel(model)
    data = dataset()
    ckpt = hd.Checkpoint(ckpt_dir)
    x, y = data.tensors
    replan = time.perf_counter()
    plan = ckpt.plan(
        ddp, x[:4], BATCH, device=dev, loss_fn=F.cross_entropy, target=y[:4], quiet=True, time_budget=0.5,
        calibrate=2, calibrate_seconds=0,
    )  # fmt: skip
    replan = time.perf_counter() - replan
    loader = hd.data_loader(data, plan, shuffle=True, seed=0)
    sampler = loader.batch_sampler
    step = ckpt.load(ddp, opt, sampler)
    with open(log_path, "a", buffering=1) as log:
        start = {"pid": os.getpid(), "device": dev.name, "rank": rank, "world": world, "from": step}
        log.write(json.dumps({**start, "sizes": plan.sizes, "stored": ckpt.stored, "replan": replan}) + "\n")
        while step < steps:
            sampler.set_epoch(step // len(sampler))
            for xb, yb in loader:
                opt.zero_grad()
                with dev.throttle():
                    F.cross_entropy(ddp(xb), yb).backward()
                opt.step()
                step += 1
                ckpt.save(step, ddp, opt)
                if rank == 0:
                    log.write(json.dumps({"step": step, "world": world, "sizes": plan.sizes, "t": time.time()}) + "\n")
                while _held(pause, step):  # the test holds the run here until a joiner has restarted it
                    time.sleep(0.05)
                if step >= steps:
                    break
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(ckpt_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
