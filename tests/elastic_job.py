"""One torchft replica group of the elastic tests: trains a float64 MLP on synthetic global batches, logs each step.

``python tests/elastic_job.py OUT GROUP DEVICES LIGHTHOUSE STEPS OPTIM [--die-at K] [--wait-at M FILE]
[--ready FILE] [--batch B] [--hidden H]`` trains until ``STEPS`` steps are committed, then writes
``OUT`` (its parameters and one record per committed step: step, members, sizes). ``--die-at K``
exits mid-step (after the backward of step K, before the all-reduce), as a killed process does;
``--go FILE`` waits for FILE before joining; ``--checkpoint F`` resumes from F and saves it after every committed step;
``--wait-at M FILE`` waits before step M until FILE exists (a rejoiner's ``--ready``), so the
rejoin lands inside the run on a loaded machine. A group of several ranks (``DEVICES`` as
``cpu+cpu@0.5,cpu@0.25``: ranks joined by ``+``) is one process per rank, started with
torch.distributed's ``RANK``/``WORLD_SIZE``/``MASTER_PORT``; ``--fsdp`` shards it with FSDP2, and
``--die-in-reduce-scatter K`` exits as this rank enters FSDP2's reduce-scatter at step K. Each
committed step is also appended to ``OUT.log`` (what a group that dies later leaves).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

from hetsplit.distributed.elastic import ElasticGroup
from hetsplit.planning import Profile

IN, OUT_F, CLASSES = 6, 3, 3


def model_and_opt(optim: str, hidden: int = 16, fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, CLASSES))
    model = model.double()
    if fsdp:  # FSDP2 over this group's ranks, each layer and the root
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    if optim == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def global_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, the same global batch for a step on every group and in the plain run."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, IN, generator=g, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (batch,), generator=g)


def profile() -> Profile:
    """Synthetic timings: ``cpu@0.5`` half as fast as ``cpu`` (the shares 2:1, so a mean by groups would show)."""
    curves = {"cpu": [(8, 0.008), (32, 0.032)], "cpu@0.5": [(8, 0.016), (32, 0.064)]}
    return Profile.from_measurements({**curves, "cpu@0.25": [(8, 0.032), (32, 0.128)]})


def _dying(collective, group, step):
    """``collective``, but this process ends as it enters it at ``step``."""

    def dying(*args, **kwargs):
        if group.step == step:
            os._exit(0)
        return collective(*args, **kwargs)

    return dying


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("out", "group", "devices", "lighthouse", "steps", "optim"):
        ap.add_argument(name)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--wait-at", nargs=2, action="append", default=[])
    ap.add_argument("--ready", default=None)
    ap.add_argument("--go", default=None)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--async-quorum", action="store_true")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quorum-timeout", type=float, default=60)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--die-in-reduce-scatter", type=int, default=-1)
    a = ap.parse_args()
    try:
        run(a)
    except (ValueError, TimeoutError, ConnectionError) as e:  # one line, as a user's script would end
        sys.exit(f"elastic_job.py: {type(e).__name__}: {e}")


def run(a: argparse.Namespace) -> None:
    while a.go and not os.path.exists(a.go):  # started early, imports done: joins when told
        time.sleep(0.05)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, opt = model_and_opt(a.optim, a.hidden, a.fsdp)
    group = ElasticGroup(
        model,
        opt,
        batch_size=a.batch,
        devices=[d.split("+") for d in a.devices.split(",")],
        group=int(a.group),
        lighthouse=a.lighthouse,
        profile=None if a.no_profile else profile(),
        timeout=20,
        quorum_timeout=a.quorum_timeout,
        use_async_quorum=a.async_quorum,
        checkpoint=a.checkpoint,
    )
    if a.ready and group.rank == 0:  # rank 0 holds the group's place in torchft's quorum
        Path(a.ready).touch()
    if a.die_in_reduce_scatter >= 0:  # gone as this rank enters the reduce-scatter: its peers are inside it
        # FSDP2 calls reduce_scatter_single in newer torch, reduce_scatter_tensor in 2.8.
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, _dying(getattr(dist, name), group, a.die_in_reduce_scatter))
    log, tries = [], 0
    while group.step < int(a.steps):
        for at, path in [w for w in a.wait_at if int(w[0]) == group.step]:
            Path(f"{path}.waiting").touch()  # the test may now start the group it waits for
            while not os.path.exists(path):
                time.sleep(0.05)
            a.wait_at.remove([at, path])
        step = group.begin()
        x, y = group.local_batch(global_batch(step, a.batch))
        F.cross_entropy(model(x), y).backward()
        if step == a.die_at:
            os._exit(0)  # gone mid-step, as a killed process
        tries += 1
        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if group.commit():
            log.append(
                {"step": step, "members": list(group.members), "sizes": list(group.plan.sizes), "t": time.time()}
            )
            if group.rank == 0:
                with open(f"{a.out}.log", "a") as f:
                    print(json.dumps(log[-1]), file=f)
            if a.checkpoint:
                group.save()
        elif not _same(before, (model.state_dict(), opt.state_dict())):
            raise RuntimeError(f"step {step} was discarded but the model or optimizer changed")
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    if group.rank == 0:
        torch.save({"params": params, "log": log, "tries": tries}, a.out)
    group.shutdown()
    print(json.dumps({"group": a.group, "steps": len(log)}), file=sys.stderr)


def _same(a, b) -> bool:
    """Whether two nests of tensors (sharded ones compared by their local part) hold the same values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        local = (lambda t: t.to_local()) if hasattr(a, "to_local") else (lambda t: t)
        return torch.equal(local(a), local(b))
    return a == b


if __name__ == "__main__":
    main()
