"""One torchft replica group of the elastic tests: trains a float64 MLP on synthetic global batches, logs each step.

``python tests/elastic_job.py OUT GROUP DEVICES LIGHTHOUSE STEPS OPTIM [--die-at K] [--wait-at M FILE]
[--ready FILE] [--batch B] [--hidden H]`` trains until ``STEPS`` steps are committed, then writes
``OUT`` (its parameters and one record per committed step: step, members, sizes). ``--die-at K``
exits mid-step (after the backward of step K, before the all-reduce), as a killed process does;
``--go FILE`` waits for FILE before joining; ``--checkpoint F`` resumes from F and saves it after every committed step;
``--wait-at M FILE`` waits before step M until FILE exists (a rejoiner's ``--ready``), so the
rejoin lands inside the run on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hetsplit.distributed.elastic import ElasticGroup
from hetsplit.planning import Profile

IN, OUT_F, CLASSES = 6, 3, 3


def model_and_opt(optim: str, hidden: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, CLASSES))
    model = model.double()
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
    return Profile.from_measurements({"cpu": [(8, 0.008), (32, 0.032)], "cpu@0.5": [(8, 0.016), (32, 0.064)]})


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
    a = ap.parse_args()
    try:
        run(a)
    except (ValueError, TimeoutError, ConnectionError) as e:  # one line, as a user's script would end
        sys.exit(f"elastic_job.py: {type(e).__name__}: {e}")


def run(a: argparse.Namespace) -> None:
    model, opt = model_and_opt(a.optim, a.hidden)
    while a.go and not os.path.exists(a.go):  # started early, imports done: joins when told
        time.sleep(0.05)
    group = ElasticGroup(
        model,
        opt,
        batch_size=a.batch,
        devices=a.devices.split(","),
        group=int(a.group),
        lighthouse=a.lighthouse,
        profile=None if a.no_profile else profile(),
        timeout=20,
        quorum_timeout=a.quorum_timeout,
        use_async_quorum=a.async_quorum,
        checkpoint=a.checkpoint,
    )
    if a.ready:
        Path(a.ready).touch()
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
        if group.commit():
            log.append(
                {"step": step, "members": list(group.members), "sizes": list(group.plan.sizes), "t": time.time()}
            )
            if a.checkpoint:
                group.save()
    torch.save({"params": [p.detach() for p in model.parameters()], "log": log, "tries": tries}, a.out)
    group.shutdown()
    print(json.dumps({"group": a.group, "steps": len(log)}), file=sys.stderr)


if __name__ == "__main__":
    main()
