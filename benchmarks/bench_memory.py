"""Memory-aware splitting: micro-batched plan vs cap-limited plan vs even split, predicted and measured.

Run: python benchmarks/bench_memory.py [--rounds 12] [--json OUT]
Two cases on emulated devices (synthetic LeNet data, labelled so): the issue's
``cpu:max64`` (full speed, memory for 64 samples) + ``cpu@0.25`` at batch 512, and
``cpu:max32`` + ``cpu@0.5:max256`` at batch 512, where the batch is larger than both caps
together. Each case profiles its devices (the caps are found by the profiler's
out-of-memory probe), solves the plans, then times one local-loss training step
(``HeteroDataParallel.train_step``) of each plan in turn, round after round, so all
plans see the same state of a shared machine. One intra-op thread per device.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import hetsplit
from hetsplit.apps.models import BUILTIN_MODELS, lenet, synthetic_batch
from hetsplit.planning import plan_from_sizes
from hetsplit.planning.memory import capped_plan

CASES = [("cpu:max64", "cpu@0.25", 512), ("cpu:max32", "cpu@0.5:max256", 512)]


def _plans(prof: hetsplit.Profile, batch: int) -> dict[str, hetsplit.Plan | str]:
    names = prof.devices
    caps = {n: c for n, c in prof.memory_caps().items() if c is not None}
    plans: dict[str, hetsplit.Plan | str] = {"micro-batched": hetsplit.solve(prof, batch, accumulate=True)}
    try:
        plans["cap-limited"] = hetsplit.solve(prof, batch)
    except ValueError as e:
        plans["cap-limited"] = f"no plan: {e}"
    even = hetsplit.planning.plan.even_sizes(batch, len(names))
    # The even split only runs with micro-batches where a share is above a cap.
    plans["even split"] = capped_plan(plan_from_sizes(prof, names, even), caps, accumulate=True)
    return plans


def _predicted(prof: hetsplit.Profile, plan: hetsplit.Plan) -> float:
    # Each device's time for its micro-batches as planned: the sum of its curve over them.
    times = [sum(prof.curve(d)(m) for m in micro) for d, micro in zip(plan.devices, plan.micro_batches)]
    return max(times)


def run_case(fast: str, slow: str, batch: int, rounds: int) -> dict:
    torch.manual_seed(0)
    x, y = synthetic_batch(BUILTIN_MODELS["lenet"], batch)
    prof = hetsplit.profile(
        lenet(), x[:64], [fast, slow], F.cross_entropy, target=y[:64], time_budget=20, max_probe=1024, progress=False
    )
    plans = _plans(prof, batch)
    runnable = {k: p for k, p in plans.items() if isinstance(p, hetsplit.Plan)}
    net = lenet()
    dps = {k: hetsplit.HeteroDataParallel(net, prof.devices, plan=p) for k, p in runnable.items()}
    times: dict[str, list[float]] = {k: [] for k in runnable}
    for r in range(rounds + 2):  # two warm-up rounds
        for k, dp in dps.items():
            net.zero_grad(set_to_none=True)
            start = time.perf_counter()
            dp.train_step(x, y, F.cross_entropy)
            if r >= 2:
                times[k].append(time.perf_counter() - start)
    out = {"devices": prof.devices, "batch": batch, "caps": prof.memory_caps(), "plans": {}}
    for k, p in plans.items():
        if isinstance(p, str):
            out["plans"][k] = {"error": p}
            continue
        out["plans"][k] = {
            "sizes": p.sizes,
            "micro_batches": p.micro_batches,
            "predicted_ms": 1e3 * _predicted(prof, p),
            "measured_ms": 1e3 * statistics.median(times[k]),
            "measured_min_ms": 1e3 * min(times[k]),
        }
    return out


def _micro_text(micro: list[int]) -> str:
    """``[61, 61, 61, 60]`` as ``4x60-61``; one batch as its size."""
    if len(micro) <= 1:
        return str(sum(micro))
    return f"{len(micro)}x{micro[-1]}" + (f"-{micro[0]}" if micro[0] != micro[-1] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"machine": platform.platform(), "cpus": torch.get_num_threads(), "cases": []}
    for fast, slow, batch in CASES:
        case = run_case(fast, slow, batch, args.rounds)
        results["cases"].append(case)
        print(f"\n{' + '.join(case['devices'])}, batch {batch}, caps {case['caps']} (synthetic LeNet data)")
        base = case["plans"]["micro-batched"].get("measured_ms")
        for k, p in case["plans"].items():
            if "error" in p:
                print(f"  {k:14s} {p['error'][:110]}")
                continue
            micro = [_micro_text(m) for m in p["micro_batches"]]
            print(
                f"  {k:14s} sizes {p['sizes']} ({', '.join(micro)}): predicted {p['predicted_ms']:.1f} ms, "
                f"measured {p['measured_ms']:.1f} ms (min {p['measured_min_ms']:.1f}); "
                f"{p['measured_ms'] / base:.2f}x the micro-batched plan's step"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
