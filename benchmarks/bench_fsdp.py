"""Benchmark FSDP2 on unequal ranks: the even split vs hetsplit's shares (and micro-batches under a cap).

Run: hetsplit launch --devices cpu,cpu@0.25 benchmarks/bench_fsdp.py [--json OUT]
(or torchrun --standalone --nproc_per_node=2 benchmarks/bench_fsdp.py --devices cpu,cpu@0.25)

A tiny Llama (random weights from a config; SYNTHETIC tokens), fully_shard per decoder
layer and at the root. One launch, three configurations measured side by side in
rounds (each round runs every configuration once, in a shuffled order, so a drifting
machine slows them alike):

1. FSDP2's even split (every rank B / world samples, FSDP's plain mean: exact for equal shares).
2. hetsplit's shares (``hd.plan`` profiles each rank's device; ``hd.weight_gradients``).
3. The same with rank 1's memory capped at ``--cap`` samples (``:max{cap}``), solved with
   ``accumulate=True``: micro-batches, every rank running as many (``hd.micro_batches``).

Each configuration's predicted step time (the plan's: the slowest rank's compute from the
profiles, plus the step's collectives timed once) is printed next to the measured median
(slowest rank, a barrier before each step).

``--plans N`` first profiles and plans N times and prints each plan's shares: the ranks
are timed by their own compute, apart from their waits in FSDP2's collectives, so on
``cpu,cpu@0.25`` rank 1 should get about a fifth of the batch (its fixed work per step is
slowed 4x too, so a little less), on a quiet machine and a busy one alike. With
``--plans-only`` nothing else runs:

  hetsplit launch --devices cpu,cpu@0.25 benchmarks/bench_fsdp.py --hidden 256 --plans 5 --plans-only Then the heap
memory a rank holds after its first micro-batch, above the sharded model, with
hetsplit's equal micro-batch counts, against keeping the parameters gathered across
the micro-batches with gradient sync only in the last (``unshard()``,
``set_reshard_after_forward(False)``, ``set_requires_gradient_sync(False)``), the way
hetsplit did not take.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

import hetsplit
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes
from hetsplit.planning.plan import even_sizes

EVEN, SHARES, CAPPED = "FSDP2 even split", "hetsplit shares", "hetsplit shares, micro-batches under a cap"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default=os.environ.get("HETSPLIT_DEVICES") or "cpu,cpu@0.25")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--cap", type=int, default=4, help="rank 1's emulated memory, in samples, for configuration 3")
    p.add_argument("--budget", type=float, default=5.0, help="profiling seconds (the ranks take equal turns)")
    p.add_argument("--plans", type=int, default=0, help="plan this many times first and print each plan's shares")
    p.add_argument("--plans-only", action="store_true", help="stop after --plans")
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def tokens(args: argparse.Namespace, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, args.seq_len), generator=torch.Generator().manual_seed(1))  # SYNTHETIC


def share(plan, batch) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """This rank's rows of the global batch; a share of 0 runs one real sample (weighted 0), as hd.data_loader does."""
    rank = dist.get_rank()
    start, size = sum(plan.sizes[:rank]), plan.sizes[rank]
    rows = batch[start : start + size] if size else batch[:1]
    return {"input_ids": rows, "labels": rows}


def run_steps(model, plan, dev, batch, steps: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of a step (the slowest rank's), ``steps`` back to back after one untimed step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mine = share(plan, batch)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for micro in hd.micro_batches(model, mine, plan, device=dev):
            with dev.throttle():
                model(**micro).loss.backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def heap_bytes() -> int:
    """Bytes of this process's heap in use now (glibc's mallinfo2: small blocks plus mmapped ones).

    torch's CPU allocator takes its tensors from malloc, so this counts every live tensor
    (parameters, gradients, gathered copies, activations) at the moment it is read.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def memory(args, dev, plan, batch) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Heap bytes in use after the first of a rank's micro-batches (above the model's sharded state), both ways."""
    mine = share(plan, batch)
    micro = max(1, max(len(m) for m in plan.micro_batches))
    out = {}
    gc.collect()
    model = build(args, dev.torch_device)
    hd.weight_gradients(model, plan)
    base = heap_bytes()  # the sharded parameters are in place
    for j, piece in enumerate(hd.micro_batches(model, mine, plan, device=dev)):
        model(**piece).loss.backward()
        if j == 0:
            out["equal counts (hetsplit)"] = heap_bytes() - base
    del model
    gc.collect()
    # The other way: parameters gathered for the whole step, gradient sync only in the last micro-batch.
    model = build(args, dev.torch_device)
    base = heap_bytes()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    x = mine["input_ids"][: max(1, len(mine["input_ids"]) // micro)]
    model(input_ids=x, labels=x).loss.backward()  # one micro-batch without sync
    out["kept gathered"] = heap_bytes() - base
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    model(input_ids=x, labels=x).loss.backward()  # the last: reduce-scatters and reshards
    for m in modules:
        m.reshard()
    out["parameters (all)"] = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    return out


def repeated_plans(args, model, sample, dev, say) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """``--plans`` plans of the model, each profiled afresh: the shares, the last rank's part, the load."""
    out = []
    for i in range(args.plans):
        load = os.getloadavg()[0]
        plan = hd.plan(model, sample, args.batch_size, device=dev, loss_fn=lambda o: o.loss, time_budget=args.budget)
        last = plan.sizes[-1] / args.batch_size
        out.append({"sizes": plan.sizes, "last_share": last, "step_ms": plan.step_time * 1e3, "load": load})
        say(f"plan {i + 1}/{args.plans}: {plan.sizes}, rank {len(plan.sizes) - 1} {last:.1%} of the batch, "
            f"predicted step {plan.step_time * 1e3:.1f} ms (load {load:.1f} before profiling)")  # fmt: skip
    if out:
        parts = sorted(p["last_share"] for p in out)
        say(f"rank {len(out[0]['sizes']) - 1}'s share over {len(out)} plans: {parts[0]:.1%} to {parts[-1]:.1%}, "
            f"median {statistics.median(parts):.1%}")  # fmt: skip
    return out


def main() -> None:
    args = parse_args()
    dev = hd.init(120, devices=args.devices)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    batch = tokens(args, args.batch_size)
    sample = {"input_ids": batch[:8], "labels": batch[:8]}
    loss = lambda out: out.loss

    model = build(args, dev.torch_device)
    plans = repeated_plans(args, model, sample, dev, say)
    if args.plans_only:
        if args.json and rank == 0:
            with open(args.json, "w") as fh:
                json.dump({"devices": args.devices, "batch": args.batch_size, "plans": plans}, fh, indent=1)
        dist.barrier()
        dev.set_speed(None)
        dist.destroy_process_group()
        return
    shares = hd.plan(model, sample, args.batch_size, device=dev, loss_fn=loss, time_budget=args.budget)
    capped_dev = hetsplit.emulate(dev.base, speed=dev.speed, max_batch=args.cap) if rank == 1 else dev
    capped = hd.plan(
        model, sample, args.batch_size, device=capped_dev, loss_fn=loss, accumulate=True, time_budget=args.budget
    )
    even = plan_from_sizes(None, [f"rank{r}" for r in range(world)], even_sizes(args.batch_size, world))
    configs = {EVEN: (even, None, dev), SHARES: (shares, shares, dev), CAPPED: (capped, capped, capped_dev)}
    predicted = {EVEN: shares.even_time, SHARES: shares.step_time, CAPPED: capped.step_time}
    measured: dict[str, list[float]] = {k: [] for k in configs}
    order = list(configs)
    for _ in range(args.rounds):
        random.Random(len(measured[EVEN])).shuffle(order)  # the same order on every rank
        for name in order:
            plan, weighted, device = configs[name]
            model = build(args, dev.torch_device)
            if weighted is not None:
                hd.weight_gradients(model, weighted)
            measured[name].append(run_steps(model, plan, device, batch, args.steps))
            del model
    mem = memory(args, capped_dev, capped, batch)
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "devices": args.devices,
        "batch": args.batch_size,
        "model": f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}",
        "plans": {k: {"sizes": c[0].sizes, "micro": c[0].micro_batches} for k, c in configs.items()},
        "repeated_plans": plans,
        "steps": {
            k: {
                "predicted_ms": predicted[k] * 1e3,
                "measured_ms": statistics.median(v) * 1e3,
                "rounds_ms": [t * 1e3 for t in v],
            }
            for k, v in measured.items()
        },
        "memory": mems,
    }
    say(f"bench_fsdp: {result['model']}, batch {args.batch_size}, devices {args.devices} (SYNTHETIC tokens)")
    say(f"{'configuration':45s} {'shares':>10s} {'micro-batches':>22s} {'predicted':>10s} {'measured':>10s}")
    for name, row in result["steps"].items():
        plan = configs[name][0]
        micro = str([len(m) for m in plan.micro_batches]) + " (run: equal)" if name == CAPPED else "-"
        say(f"{name:45s} {plan.sizes!s:>10s} {micro:>22s} {row['predicted_ms']:8.1f}ms {row['measured_ms']:8.1f}ms")
    for r, m in enumerate(mems):
        say(f"rank {r} memory between micro-batches: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in m.items()))
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dev.set_speed(None)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(f"bench_fsdp.py: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
