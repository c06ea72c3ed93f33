"""Benchmark the core: solver time for 10 and 10,000 devices, profiler wall time.

Run: python benchmarks/bench_core.py [--json OUT]
Timings, not tests: the numbers go to docs/benchmarks.md with date, machine and command.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

import torch

import hetsplit
from hetsplit.apps.models import BUILTIN_MODELS, lenet, synthetic_batch


def bench_solver(n_devices: int, repeats: int = 15, accumulate: bool = False) -> dict:
    rng = random.Random(n_devices)
    meas = {
        f"d{i}": [(b, rng.uniform(1e-3, 1e-2) + b * rng.uniform(1e-4, 1e-2)) for b in (1, 4, 16, 64, 256)]
        for i in range(n_devices)
    }
    caps = {f"d{i}": rng.randint(64, 4096) for i in range(0, n_devices, 3)}
    batch = 100 * n_devices
    cold, warm = [], []
    for _ in range(repeats):
        profile = hetsplit.Profile.from_measurements(meas, caps)  # fresh: curves not packed yet
        # Collect the garbage of building 10,000 curves first: otherwise a full collection of
        # the whole interpreter (torch included, ~150 ms on this VM) lands inside the timing at
        # random. The solver's own collections still count. (timeit turns the collector off.)
        gc.collect()
        start = time.perf_counter()
        hetsplit.solve(profile, batch, accumulate=accumulate)
        cold.append(time.perf_counter() - start)
        gc.collect()
        start = time.perf_counter()
        plan = hetsplit.solve(profile, batch - 1, accumulate=accumulate)  # same profile: packed curves reused
        warm.append(time.perf_counter() - start)
    return {
        "devices": n_devices,
        "batch": batch,
        "accumulate": accumulate,
        "median_ms": 1e3 * statistics.median(cold),
        "min_ms": 1e3 * min(cold),
        "warm_median_ms": 1e3 * statistics.median(warm),
        "speedup_vs_even": plan.speedup_vs_even,
    }


def bench_profiler() -> dict:
    torch.manual_seed(0)
    x, y = synthetic_batch(BUILTIN_MODELS["lenet"], 16)
    start = time.perf_counter()
    profile = hetsplit.profile(
        lenet(), x, ["cpu", "cpu@0.25"], torch.nn.functional.cross_entropy, target=y, time_budget=30, progress=False
    )
    wall = time.perf_counter() - start
    plan = hetsplit.solve(profile, 256)
    return {
        "model": "lenet",
        "devices": profile.devices,
        "budget_s": 30,
        "wall_s": wall,
        "ladder": [m.batch for m in profile.entries[0].measurements],
        "throughput_ratio_at_256": profile.throughput("cpu", 256) / profile.throughput("cpu@0.25", 256),
        "split_of_256": plan.sizes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        # Interleaved per size: plain, then micro-batched (accumulate=True) on the same curves.
        "solver": [bench_solver(n, accumulate=a) for n in (10, 10_000) for a in (False, True)],
        "profiler": bench_profiler(),
    }
    for r in results["solver"]:
        print(
            f"solve {r['devices']:>6} devices, batch {r['batch']:>9}{', accumulate' * r['accumulate']}: "
            f"median {r['median_ms']:.2f} ms "
            f"(min {r['min_ms']:.2f} ms); again on the same profile: median {r['warm_median_ms']:.2f} ms"
        )
    p = results["profiler"]
    print(
        f"profile lenet on {p['devices']}: {p['wall_s']:.1f} s wall (budget {p['budget_s']} s), ladder {p['ladder']}, "
        f"throughput ratio at 256 = {p['throughput_ratio_at_256']:.2f}, split of 256 = {p['split_of_256']}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
