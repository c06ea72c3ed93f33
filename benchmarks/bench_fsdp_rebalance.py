"""FSDP2 on two ranks, rank 1 slowed 2x mid-run and back: does DistributedRebalancer follow, and only then?

Run (two CPU ranks, rank 1 emulated at full speed, halved at --slow-at, restored at --recover-at):

  hetsplit launch --devices cpu,cpu@1 benchmarks/bench_fsdp_rebalance.py [--json r.json]

The model is a tiny Llama from a config (4 decoder layers, hidden 256: random weights, nothing
downloaded), sharded with ``fully_shard`` per layer and at the root; data are SYNTHETIC tokens.
The ranks start from ``hd.plan`` (each profiles the sharded model), train with
``hd.DistributedRebalancer`` at its defaults but ``every`` (``--every``), and rank 1's speed is
set by ``dev.set_speed`` on the real clock: nothing in the rebalancer is told. Rank 0 prints
each step's shares and wall time, and at the end how many steps each move took after the
change of speed, and how many plan changes came in between (a swing is a change back and
forth while the speed stays put). The predicted step of each change (the rebalancer's own,
old against new) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from fsdp_hetero import SyntheticTokens, build_model  # the example's model (from a config) and synthetic data

import hetsplit
import hetsplit.distributed as hd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=os.environ.get("HETSPLIT_DEVICES", "cpu,cpu@1"))
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences) per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--slow-at", type=int, default=15, help="step at which rank 1 drops to half its speed")
    parser.add_argument("--recover-at", type=int, default=42, help="step at which rank 1 is back to its speed")
    parser.add_argument("--every", type=int, default=4, help="the rebalancer looks every this many steps")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds each rank profiles")
    parser.add_argument("--json", help="write the run (shares, times, changes) here, from rank 0")
    return parser.parse_args()


class _Traced(hetsplit.Rebalancer):
    """The rebalancer at its defaults, keeping what it saw and concluded at each look (for --json)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.trace: list[dict] = []

    def record(self, plan, step_times) -> None:
        super().record(plan, step_times)
        self.trace.append({"sizes": list(plan.sizes), "ms": {k: v * 1e3 for k, v in step_times.items()}})

    def propose(self, plan, step=None):
        new = super().propose(plan, step)
        look = {"look_at": step, "sizes": list(plan.sizes), "factors": self.factors()}
        look["comm_ms"], look["uncertainty"] = self.communication * 1e3, self.uncertainty(plan.devices)
        curves = {d: self.corrected(plan.devices).entry(d).curve for d in plan.devices}  # as corrected now
        look["curves_ms"] = {d: [c.intercept * 1e3, c.slope * 1e3] for d, c in curves.items()}
        look["new"] = list(new.sizes) if new is not None else None
        self.trace.append(look)
        return new


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core a rank, as the suite and the other benchmarks run
    dev = hd.init(timeout=300, devices=args.devices)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, dev.torch_device)
    mesh = init_device_mesh(dev.torch_device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = SyntheticTokens(args.batch_size * 16, args.seq_len, 256)
    plan = hd.plan(model, data[:8], args.batch_size, device=dev, loss_fn=lambda out: out.loss, time_budget=args.budget)
    grads = hd.weight_gradients(model, plan)
    loader = hd.data_loader(data, plan, shuffle=True, seed=0)
    rb = hd.DistributedRebalancer(
        plan, _Traced(every=args.every), sampler=loader.batch_sampler, gradients=grads, model=model,
        device=dev,
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps: list[dict] = []
    done = 0
    while done < args.steps:
        loader.batch_sampler.set_epoch(done)
        for batch in loader:
            if rank == 1 and done == args.slow_at:
                dev.set_speed(0.5)
            if rank == 1 and done == args.recover_at:
                dev.set_speed(1.0)
            dist.barrier()
            start = time.perf_counter()
            with rb.step():
                for micro in hd.micro_batches(model, batch, rb.plan, device=dev):
                    with dev.throttle():
                        loss = model(**micro).loss
                        loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            steps.append({"step": done, "sizes": list(rb.plan.sizes), "ms": (time.perf_counter() - start) * 1e3})
            done += 1
            if done >= args.steps:
                break
    dev.set_speed(None)
    changes = [{"at": at, "sizes": list(p.sizes)} for at, p in rb.schedule[1:]]  # (first step, plan) after the start
    history = [
        {"old": list(c.old_sizes), "new": list(c.new_sizes), "old_ms": c.old_time * 1e3, "new_ms": c.new_time * 1e3}
        for c in rb.history
    ]
    if rank == 0:
        emulated = f"rank 1 emulated: the CPU slowed by sleeping, 0.5x from step {args.slow_at} to {args.recover_at}"
        print(f"devices {args.devices} ({emulated}); plan {plan.sizes}, predicted {plan.step_time * 1e3:.0f} ms")
        for s in steps:
            print(f"step {s['step']:3d}: shares {s['sizes']}, {s['ms']:.0f} ms")
        for c, h in zip(changes, history):
            predicted = f"predicted {h['old_ms']:.0f} -> {h['new_ms']:.0f} ms"
            print(f"change from step {c['at']}: {h['old']} -> {h['new']}, {predicted}")
        slow = [c["at"] for c in changes if args.slow_at <= c["at"] < args.recover_at]
        back = [c["at"] for c in changes if c["at"] >= args.recover_at]
        before = [c["at"] for c in changes if c["at"] < args.slow_at]
        summary = {
            "devices": args.devices,
            "start": plan.sizes,
            "changes_before_slowdown": len(before),
            "first_move_after_slowdown": (slow[0] - args.slow_at) if slow else None,
            "changes_while_slow": len(slow),
            "first_move_after_recovery": (back[0] - args.recover_at) if back else None,
            "changes_after_recovery": len(back),
            "rank1_share_while_slow": [s["sizes"][1] for s in steps if args.slow_at <= s["step"] < args.recover_at],
        }
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                run = {"summary": summary, "steps": steps, "changes": history, "args": vars(args)}
                json.dump({**run, "trace": rb.rebalancer.trace}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
