"""CPU replicas on cores of their own, or where the scheduler puts them: the bench's configurations side by side.

Run: python benchmarks/bench_pinning.py [--model cnn] [--batch 128] [--sizes 106,22] [--rounds 16] [--steps 4]

`hetsplit bench` times its configurations round-robin (each device alone, the even split,
the balanced split, the one-device wrapper), so between two balanced steps other work runs
on the calling thread alone. This takes the same turns and switches `HETSPLIT_PIN_CPU`
every round: on (each CPU replica on a core of its own, hetsplit's default with one
intra-op thread) and off (the scheduler's placement). One intra-op thread, freed memory
kept, as the bench runs. Prints each configuration's median step both ways and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import hetsplit
from hetsplit.apps.bench import dp_step, keep_freed_memory, plain_step
from hetsplit.apps.models import build_model, load_model, synthetic_batch
from hetsplit.devices import parse_devices
from hetsplit.planning import plan_from_sizes

DEVICES = ["cpu", "cpu@0.25"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sizes", default="106,22")
    parser.add_argument("--rounds", type=int, default=16, help="rounds, switching on and off each round")
    parser.add_argument("--steps", type=int, default=4, help="round-robin passes a round")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    keep_freed_memory()
    spec = load_model(args.model)
    torch.manual_seed(0)
    net = build_model(spec)
    x, y = synthetic_batch(spec, args.batch, seed=0)
    devs = parse_devices(DEVICES)
    Hdp = hetsplit.HeteroDataParallel
    configs = {f"{d.name} alone": plain_step(copy.deepcopy(net), d, x, y) for d in devs}
    configs["even split"] = dp_step(Hdp(copy.deepcopy(net), DEVICES, weights=[1, 1]), x, y, "gather")
    balanced = Hdp(copy.deepcopy(net), DEVICES, plan=plan_from_sizes(None, DEVICES, sizes))
    configs[f"balanced {sizes}"] = dp_step(balanced, x, y, "gather")
    configs["one-device wrapper"] = dp_step(Hdp(copy.deepcopy(net), DEVICES[:1]), x, y, "gather")
    for fn in configs.values():
        fn()
    times: dict[str, dict[str, list[float]]] = {mode: {n: [] for n in configs} for mode in ("on", "off")}
    previous = os.environ.get("HETSPLIT_PIN_CPU")
    try:
        for r in range(args.rounds):
            mode = "on" if r % 2 == 0 else "off"
            os.environ["HETSPLIT_PIN_CPU"] = "1" if mode == "on" else "0"
            for _ in range(args.steps):
                for name, fn in configs.items():
                    begin = time.perf_counter()
                    fn()
                    times[mode][name].append(time.perf_counter() - begin)
    finally:
        if previous is None:
            os.environ.pop("HETSPLIT_PIN_CPU", None)
        else:
            os.environ["HETSPLIT_PIN_CPU"] = previous
    print(f"{args.model}, batch {args.batch}, {args.rounds} rounds of {args.steps} round-robin passes, median ms")
    print("configuration | cores of their own | scheduler's placement | own / scheduler's")
    for name in configs:
        on, off = (statistics.median(times[m][name]) * 1e3 for m in ("on", "off"))
        print(f"{name} | {on:.2f} | {off:.2f} | {on / off:.3f}")


if __name__ == "__main__":
    main()
