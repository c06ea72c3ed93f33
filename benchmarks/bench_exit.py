"""Ranks that exit right after a collective: how often one aborts at exit, with and without hetsplit's exit wait.

Run: python benchmarks/bench_exit.py [--runs 20] [--load 1]

Each run is a two-rank gloo job (torchrun, one thread per rank) whose ranks do ten
barrier + all-reduce pairs and end. Runs alternate: one with
:func:`hetsplit.distributed.teardown.drain_at_exit` registered (what every rank that
uses hetsplit's distributed pieces does), one without. ``--load N`` keeps N busy
processes spinning meanwhile, as a test suite running beside it does. A run counts as
aborted when torchrun reports a rank killed by a signal (SIGABRT: "terminate called
without an active exception", gloo's worker taking the GIL during finalization).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK_SCRIPT = """
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
if os.environ["DRAIN"] == "1":
    from hetsplit.distributed import drain_at_exit
    drain_at_exit()
x = torch.ones(1000)
for _ in range(10):
    dist.barrier()
    dist.all_reduce(x)
"""


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _run(script: Path, drain: bool) -> tuple[bool, float]:
    env = dict(os.environ, DRAIN="1" if drain else "0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    begin = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    aborted = res.returncode != 0 and ("exitcode: -" in res.stderr or "terminate called" in res.stderr)
    if res.returncode != 0 and not aborted:
        raise RuntimeError(f"a run failed for another reason:\n{res.stderr[-2000:]}")
    return aborted, time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each kind (alternating)")
    parser.add_argument("--load", type=int, default=1, help="busy processes spinning meanwhile")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    load = [ctx.Process(target=_spin, args=(24 * 3600,), daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    counts = {False: [0, 0], True: [0, 0]}
    seconds = {False: [], True: []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "ranks.py"
            script.write_text(RANK_SCRIPT)
            for i in range(2 * args.runs):
                drain = i % 2 == 1
                aborted, took = _run(script, drain)
                counts[drain][0] += aborted
                counts[drain][1] += 1
                seconds[drain].append(took)
    finally:
        for p in load:
            p.terminate()
    print(f"{args.runs} runs of each kind, {args.load} busy process(es) beside, {os.cpu_count()} CPUs")
    for drain in (False, True):
        aborted, runs = counts[drain]
        label = "with the exit wait   " if drain else "without the exit wait"
        mean = sum(seconds[drain]) / len(seconds[drain])
        print(f"{label}: {aborted} of {runs} runs aborted at exit; {mean:.2f} s a run (torchrun included)")


if __name__ == "__main__":
    main()
