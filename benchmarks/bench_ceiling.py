"""What share of the ideal this machine allows at all: the split run by two independent processes.

Run: python benchmarks/bench_ceiling.py [--model cnn] [--batch 128] [--sizes 106,22] [--steps 20] [--rounds 5]

The bench's ideal adds each device's throughput *alone*. On a machine whose devices share
the host (here `cpu` and `cpu@0.25`, an emulated device whose real work runs on the same
two vCPUs), no engine can beat what the two shares reach when they run at the same time
with nothing between them. This measures that ceiling: each share trains in a process of
its own (plain module, plain SGD, one intra-op thread, no gradient exchange, no shared
interpreter), the two meeting at a barrier before and after every step, so a step lasts
as long as the slower share — an engine with zero communication cost. Beside it, in the
same rounds, taking turns: each device alone on the whole batch (the ideal), each share
alone (what the profile sees), and `HeteroDataParallel` on the same split (threads).

Per round it prints medians; at the end the spread over rounds of
- ceiling = ideal step / independent processes' step,
- threads = ideal step / HeteroDataParallel's step,
- each share's busy time beside the other / alone, in the processes and in threads,
- the threads' step outside the devices' work (scatter, gather, loss, gradient sum, optimizer).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import statistics
import time

DEFAULT_SIZES = {("cnn", 128): "106,22", ("lenet", 256): "215,41", ("resnet18", 64): "52,12"}
DEVICES = ["cpu", "cpu@0.25"]


def _setup(model: str, batch: int):
    import torch

    from hetsplit.apps.bench import keep_freed_memory
    from hetsplit.apps.models import build_model, load_model, synthetic_batch

    torch.set_num_threads(1)
    keep_freed_memory()
    spec = load_model(model)
    torch.manual_seed(0)
    return build_model(spec), *synthetic_batch(spec, batch, seed=0)


def _worker(rank: int, model: str, batch: int, sizes: list[int], barrier, orders, results) -> None:
    """One share in a process of its own: on each order, ``n`` steps, each between two barriers."""
    from hetsplit.apps.bench import plain_step
    from hetsplit.devices import parse_devices

    net, x, y = _setup(model, batch)
    start = sum(sizes[:rank])
    dev = parse_devices([DEVICES[rank]])[0]
    step = plain_step(net, dev, x[start : start + sizes[rank]], y[start : start + sizes[rank]])
    step()  # warm-up
    results.put((rank, [], []))  # ready: the timing starts once both processes have built their share
    while (n := orders.get()) is not None:
        walls, busy = [], []
        for _ in range(n):
            barrier.wait()
            begin = time.perf_counter()
            step()
            busy.append(time.perf_counter() - begin)
            barrier.wait()
            walls.append(time.perf_counter() - begin)
        results.put((rank, walls, busy))


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        begin = time.perf_counter()
        fn()
        out.append(time.perf_counter() - begin)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sizes", help="the split, e.g. 106,22 (default: one measured for the model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or DEFAULT_SIZES.get((args.model, args.batch), "")).split(",") if s]
    if len(sizes) != 2 or sum(sizes) != args.batch:
        raise SystemExit(f"--sizes must be two shares adding up to --batch {args.batch}, got {sizes}")

    import hetsplit
    from hetsplit.apps.bench import dp_step, plain_step
    from hetsplit.devices import parse_devices
    from hetsplit.planning import plan_from_sizes

    net, x, y = _setup(args.model, args.batch)
    devs = parse_devices(DEVICES)
    alone = {d.name: plain_step(copy.deepcopy(net), d, x, y) for d in devs}
    cut = [slice(0, sizes[0]), slice(sizes[0], args.batch)]
    shares = {d.name: plain_step(copy.deepcopy(net), d, x[c], y[c]) for d, c in zip(devs, cut)}
    dp = hetsplit.HeteroDataParallel(copy.deepcopy(net), DEVICES, plan=plan_from_sizes(None, DEVICES, sizes))
    seen: list[dict[str, float]] = []  # each threads step's busy seconds per device
    threads = dp_step(dp, x, y, "gather", seen)
    for fn in [*alone.values(), *shares.values(), threads]:
        fn()

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    orders = [ctx.Queue() for _ in DEVICES]
    procs = [
        ctx.Process(target=_worker, args=(r, args.model, args.batch, sizes, barrier, orders[r], results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        results.get()
    print(f"{args.model}, batch {args.batch}, split {sizes} on {' + '.join(DEVICES)}; {args.steps} steps a phase")
    print(
        "round | ideal | independent procs | threads | ceiling | threads/ideal | busy beside the other / alone "
        "(cpu, cpu@0.25): in processes | in threads | threads' rest of the step"
    )
    rows = []
    try:
        for r in range(args.rounds):
            med = statistics.median
            single = {n: med(_timed(fn, args.steps)) for n, fn in alone.items()}
            share = {n: med(_timed(fn, args.steps)) for n, fn in shares.items()}
            for q in orders:
                q.put(args.steps)
            got = dict((rank, (walls, busy)) for rank, walls, busy in (results.get() for _ in DEVICES))
            indep = med(got[0][0])
            beside = {DEVICES[k]: med(got[k][1]) for k in got}
            seen.clear()
            walls = _timed(threads, args.steps)
            thr = med(walls)
            in_threads = {n: med(b[n] for b in seen) for n in DEVICES}
            rest = med(w - max(b.values()) for w, b in zip(walls, seen))
            ideal = args.batch / sum(args.batch / t for t in single.values())
            row = {
                "ideal": ideal,
                "independent": indep,
                "threads": thr,
                "ceiling": ideal / indep,
                "threads_eff": ideal / thr,
                "contention": {n: beside[n] / share[n] for n in share},
                "in_threads": {n: in_threads[n] / share[n] for n in share},
                "rest": rest,
            }
            rows.append(row)
            cont = ", ".join(f"{v:.2f}" for v in row["contention"].values())
            cont += " | " + ", ".join(f"{v:.2f}" for v in row["in_threads"].values()) + f" | {rest * 1e3:.1f} ms"
            print(
                f"{r + 1} | {ideal * 1e3:.1f} ms | {indep * 1e3:.1f} ms | {thr * 1e3:.1f} ms | "
                f"{row['ceiling']:.0%} | {row['threads_eff']:.0%} | {cont}"
            )
    finally:
        for q in orders:
            q.put(None)
        for p in procs:
            p.join(timeout=30)

    def spread(values: list[float], fmt: str = "{:.0%}") -> str:
        return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))

    print("spread over rounds (min / median / max):")
    print(f"  ceiling (ideal / independent processes): {spread([r['ceiling'] for r in rows])}")
    print(f"  HeteroDataParallel (ideal / threads):    {spread([r['threads_eff'] for r in rows])}")
    print(f"  threads / ceiling:                       {spread([r['threads_eff'] / r['ceiling'] for r in rows])}")
    for n in DEVICES:
        print(f"  {n} busy beside the other / alone, processes: {spread([r['contention'][n] for r in rows], '{:.2f}')}")
        print(f"  {n} busy beside the other / alone, threads:   {spread([r['in_threads'][n] for r in rows], '{:.2f}')}")
    print(f"  threads' step outside the devices' work: {spread([r['rest'] * 1e3 for r in rows], '{:.1f} ms')}")


if __name__ == "__main__":
    main()
