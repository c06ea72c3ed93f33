"""How far this machine's own speed drifts: the same step, timed over a minute, nothing else changed.

Run: python benchmarks/bench_drift.py [--model lenet] [--batch 256] [--seconds 60] [--window 20]

A prediction is made from steps timed before training and judged against steps timed
after it, seconds later. On a machine whose speed moves between the two, no prediction
can be closer than that move. This times one step over and over in one process (one
intra-op thread, SYNTHETIC data, the model built here with random weights, forward, loss
and backward, no optimizer), in windows of ``--window`` steps, and reports:

- each window's median step, and their spread (min / median / max over the windows);
- the drift: |window k+g median - window k median| / window k median, its median and 95th
  percentile, for g = 1 (back to back: what bench_predict's "again" column sees) and for
  the gap between a prediction and its measurement in bench_predict (``--gap`` seconds);
- the same for a matrix product that stays in the core's cache (``--matmul``), to tell the
  core's own speed from what the step shares with the host (memory, caches).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _model_step(model: str, batch: int) -> Callable[[], None]:
    import torch.nn.functional as F

    from hetsplit.apps.models import build_model, load_model, synthetic_batch

    spec = load_model(model)
    net = build_model(spec)
    x, y = synthetic_batch(spec, batch)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()

    return step


def _matmul_step() -> Callable[[], None]:
    import torch

    a = torch.randn(192, 192)  # 144 KiB: in the core's L2

    def step() -> None:
        for _ in range(40):
            a @ a

    return step


def windows(step: Callable[[], None], seconds: float, window: int) -> list[tuple[float, float]]:
    """(time since start, median step seconds) of each window of ``window`` steps, for ``seconds``."""
    for _ in range(3):
        step()
    began, out = time.perf_counter(), []
    while time.perf_counter() - began < seconds:
        times = []
        for _ in range(window):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out.append((time.perf_counter() - began, statistics.median(times)))
    return out


def drift(seen: Sequence[tuple[float, float]], gap_s: float) -> dict[str, float]:
    """The spread of the window medians, and their relative change over one window and over ``gap_s``."""
    medians = [m for _, m in seen]
    ends = [t for t, _ in seen]
    per = (ends[-1] / len(ends)) if ends else 1.0
    gap = max(1, round(gap_s / per))
    back = [abs(b - a) / a for a, b in itertools.pairwise(medians)]
    later = [abs(b - a) / a for a, b in zip(medians, medians[gap:])]
    return {
        "windows": len(medians),
        "window_s": per,
        "min_ms": 1e3 * min(medians),
        "median_ms": 1e3 * statistics.median(medians),
        "max_ms": 1e3 * max(medians),
        "back_to_back_median": statistics.median(back) if back else float("nan"),
        "back_to_back_p95": _percentile(back, 0.95) if back else float("nan"),
        "gap_windows": gap,
        "gap_median": statistics.median(later) if later else float("nan"),
        "gap_p95": _percentile(later, 0.95) if later else float("nan"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", help="a hetsplit.apps.models name (default lenet)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seconds", type=float, default=60.0, help="how long to time each workload")
    p.add_argument("--window", type=int, default=20, help="steps per window (bench_predict times 30)")
    p.add_argument("--gap", type=float, default=10.0, help="seconds between a prediction and its measurement")
    p.add_argument("--matmul", action="store_true", help="also time a cache-resident matrix product")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.window < 1 or args.batch < 1 or args.gap <= 0:
        p.error(f"need --seconds > 0, --window >= 1, --batch >= 1, --gap > 0; got {vars(args)}")
    import os

    import torch

    from hetsplit.apps.bench import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    loads = [(f"{args.model}@{args.batch}", _model_step(args.model, args.batch))]
    if args.matmul:
        loads.append(("matmul 192x192 x40 (in cache)", _matmul_step()))
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {load:.1f}, one thread, SYNTHETIC data")
    print("workload | windows x s | window median min / median / max ms | drift back to back: median / p95 "
          f"| drift over {args.gap:g} s: median / p95")  # fmt: skip
    for name, step in loads:
        d = drift(windows(step, args.seconds, args.window), args.gap)
        print(f"{name} | {d['windows']} x {d['window_s']:.2f} | {d['min_ms']:.2f} / {d['median_ms']:.2f} / "
              f"{d['max_ms']:.2f} | {100 * d['back_to_back_median']:.1f} % / {100 * d['back_to_back_p95']:.1f} % "
              f"| {100 * d['gap_median']:.1f} % / {100 * d['gap_p95']:.1f} %")  # fmt: skip


if __name__ == "__main__":
    main()
