"""An emulated CPU timed by its runnable time (now) against thread CPU time and wall time (before), side by side.

Run: python benchmarks/bench_emulation_clock.py [--model cnn] [--batch 128] [--sizes 110,18] [--steps 30]

One HeteroDataParallel on cpu + cpu@0.25 with a fixed split; each round takes one step
with the emulated device's work measured by its runnable time (`emulation.work_clock`,
the default with one intra-op thread: on a core or queued for one), one by thread CPU
time alone (the rule before: on a loaded machine the emulated device stops being slower),
one by wall time (the rule before that: waits slowed too), and one plain step of the
whole batch on the CPU alone. Prints the median step of each and each device's busy time;
run it on a quiet machine and beside busy processes.
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
from hetsplit.planning import plan_from_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sizes", default="110,18")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    spec, devs = load_model(args.model), ["cpu", "cpu@0.25"]
    torch.manual_seed(0)
    net = build_model(spec)
    x, y = synthetic_batch(spec, args.batch)
    dp = hetsplit.HeteroDataParallel(
        net, devs, plan=plan_from_sizes(None, devs, [int(s) for s in args.sizes.split(",")])
    )
    clocks = {
        "runnable time": emulation.work_clock,
        "thread CPU time": lambda d: time.thread_time,
        "wall time": lambda d: emulation._wall_time,
    }
    times: dict[str, list[float]] = {**{k: [] for k in clocks}, "cpu alone": []}
    busy: dict[str, list[dict[str, float]]] = {k: [] for k in clocks}
    load = os.getloadavg()[0]
    try:
        for i in range(args.steps + 3):
            for name in times:
                emulation.work_clock = clocks.get(name, clocks["runnable time"])
                start = time.perf_counter()
                net.zero_grad(set_to_none=True)
                F.cross_entropy((net if name == "cpu alone" else dp)(x), y).backward()
                if i >= 3:
                    times[name].append(time.perf_counter() - start)
                    if name in busy:
                        busy[name].append(dp.step_times)
    finally:
        emulation.work_clock = clocks["runnable time"]
    med = statistics.median
    print(
        f"{args.model}, batch {args.batch}, split {args.sizes}, 1 thread, load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    for name, ts in times.items():
        line = f"{name}: step {med(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"
        if name in busy:
            line += "; busy " + ", ".join(f"{d} {med(b[d] for b in busy[name]) * 1e3:.1f} ms" for d in devs)
        print(line)


if __name__ == "__main__":
    main()
