"""Inside balanced steps: each device's busy time against the same work alone, the serial rest, sleep overshoot.

Run: python benchmarks/bench_swing.py [--model cnn] [--batch 128] [--sizes 110,18] [--steps 40] [--runs 5]
     python benchmarks/bench_swing.py --rebalance [--steps 300] [--runs 1]   # plan changes while rebalancing

With ``--rebalance`` each run instead profiles the model, trains ``--steps`` steps with
``HeteroDataParallel(rebalance=Rebalancer(profile))`` from the profiled plan, and prints
every plan change with the rebalancer's predicted step before and after it, and the
range of shares the quarter-speed device was given: on a steady machine the plan should
hardly change, and beside busy processes (``python -c "while True: pass" &``) it should
not swing (the devices are timed by their compute, which a busy machine slows alike).

Each run builds a fresh HeteroDataParallel on cpu + cpu@0.25 with the given split and
takes --steps training steps, interleaved step by step with plain steps of each shard's
size on the module alone (the profile's view of that work). Per run it reports the step
time, each device's busy time per phase (forward, backward; the emulated device's
includes its sleep), the phase's wall time, the rest of the step (loss, gather, optimizer,
Python), and how far each emulation sleep overshot what it asked for. One intra-op
thread, freed memory kept (as `hetsplit bench` does). The figures' spread over the runs
is the run-to-run swing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import hetsplit
from hetsplit import emulation
from hetsplit.apps.bench import keep_freed_memory
from hetsplit.apps.models import build_model, load_model, synthetic_batch
from hetsplit.devices import parse_device
from hetsplit.parallel import data_parallel
from hetsplit.planning import plan_from_sizes

DEVICES = ["cpu", "cpu@0.25"]


def one_run(spec, x, y, sizes: list[int], steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    net = build_model(spec)
    dp = hetsplit.HeteroDataParallel(net, DEVICES, plan=plan_from_sizes(None, DEVICES, sizes))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    phases: list[tuple[str, float, dict[str, float]]] = []
    run = data_parallel.HeteroDataParallel._run

    def timed_run(self, fns, what, active, inline=0):  # the phase's wall time and the laps so far
        start = time.perf_counter()
        out = run(self, fns, what, active, inline) if what else run(self, fns, what, active)
        laps = {k: sum(lap.seconds() for lap in v) for k, v in self._log.current.items()}
        phases.append((what or "forward", time.perf_counter() - start, laps))
        return out

    sleeps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        start = time.perf_counter()
        real_sleep(seconds)
        sleeps.append(time.perf_counter() - start - seconds)

    data_parallel.HeteroDataParallel._run = timed_run
    emulation.time.sleep = sleep
    alone = {n: [] for n in sizes if n}
    step_times = []
    try:
        for i in range(steps + 3):
            for n in alone:  # the same shard's work on the module alone, taking turns with the split
                start = time.perf_counter()
                net.zero_grad(set_to_none=True)
                F.cross_entropy(net(x[:n]), y[:n]).backward()
                if i >= 3:
                    alone[n].append(time.perf_counter() - start)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(dp(x), y).backward()
            opt.step()
            if i >= 3:
                step_times.append(time.perf_counter() - start)
            else:
                phases.clear()
                sleeps.clear()
    finally:
        data_parallel.HeteroDataParallel._run = run
        emulation.time.sleep = real_sleep
    med = statistics.median
    fwd = [p for p in phases if p[0] == "forward"]
    bwd = [p for p in phases if p[0] != "forward"]
    out = {"step": med(step_times), "forward wall": med(p[1] for p in fwd), "backward wall": med(p[1] for p in bwd)}
    for name, n in zip(DEVICES, sizes):
        if n:
            out[f"{name} busy"] = med(p[2][name] for p in bwd)
            out[f"{name} work alone x{1 / parse_device(name).speed:g}"] = med(alone[n]) / parse_device(name).speed
    out["rest"] = out["step"] - out["forward wall"] - out["backward wall"]
    out["sleep overshoot median"] = med(sleeps) if sleeps else 0.0
    out["sleep overshoot max"] = max(sleeps) if sleeps else 0.0
    return out


def rebalance_run(spec, x, y, steps: int, budget: float) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """``steps`` training steps rebalancing from a fresh profile: the plan changes and the shares given."""
    torch.manual_seed(0)
    net = build_model(spec)
    prof = hetsplit.profile(net, x[:8], DEVICES, F.cross_entropy, target=y[:8], time_budget=budget, progress=False)
    changes: list[hetsplit.planning.PlanChange] = []
    reb = hetsplit.Rebalancer(prof, on_change=changes.append)
    dp = hetsplit.HeteroDataParallel(net, DEVICES, profile=prof, rebalance=reb)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    start, shares = dp.sizes_for(len(x)), []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        shares.append(dp.plan.sizes[1])  # the plan the step ran
    return {"start": start, "changes": changes, "slow share": (min(shares), max(shares))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sizes", default="110,18")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rebalance", action="store_true", help="count plan changes while rebalancing instead")
    parser.add_argument("--budget", type=float, default=3.0, help="profiling seconds (--rebalance)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = keep_freed_memory()
    spec = load_model(args.model)
    sizes = [int(s) for s in args.sizes.split(",")]
    x, y = synthetic_batch(spec, args.batch)
    if args.rebalance:
        head = f"{args.model}, batch {args.batch} on {DEVICES}, {args.steps} steps rebalancing, 1 thread"
        print(f"{head}, SYNTHETIC data")
        for r in range(args.runs):
            load = os.getloadavg()[0]
            res = rebalance_run(spec, x, y, args.steps, args.budget)
            low, high = res["slow share"]
            print(f"run {r + 1} (load {load:.2f}): profiled plan {res['start']}, {len(res['changes'])} plan changes, "
                  f"{DEVICES[1]} given {low} to {high} of {args.batch}")  # fmt: skip
            for c in res["changes"]:
                print(f"  {c} (predicted {c.old_time * 1e3:.2f} -> {c.new_time * 1e3:.2f} ms)")
        return
    print(f"{args.model}, batch {args.batch}, split {sizes} on {DEVICES}, 1 thread, freed memory kept: {kept}")
    results = []
    for r in range(args.runs):
        load = os.getloadavg()[0]
        res = one_run(spec, x, y, sizes, args.steps)
        results.append(res)
        print(f"run {r + 1} (load {load:.2f}): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in res.items()))
    print("spread over the runs (min - median - max, ms):")
    for key in results[0]:
        vals = sorted(r[key] * 1e3 for r in results)
        print(f"  {key}: {vals[0]:.2f} - {statistics.median(vals):.2f} - {vals[-1]:.2f}")


if __name__ == "__main__":
    main()
