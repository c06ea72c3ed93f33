"""Prediction accuracy: each engine's predicted step against the measured one, over models and device sets.

Run: python benchmarks/bench_predict.py [--quick] [--json OUT] [--markdown] [--devices SET ...] [--models a,b]

For every device set (default ``cpu,cpu@0.25``; ``cpu,cpu@0.5:max8``; ``cpu,cpu@0.5,cpu@0.25``)
and model (an MLP, LeNet, ResNet-18, a tiny GPT-2, a tiny Llama, a BERT-tiny classifier,
all built here with random weights; SYNTHETIC data, nothing downloaded), one configuration
after another, never two at once:

- **threads** (``HeteroDataParallel``, one process): predicted as ``hetsplit bench`` predicts
  its balanced step (``hetsplit.profile`` of the devices, ``solve``, then
  ``hetsplit.apps.bench.calibrate_plan``: balanced steps inside the split, each device's busy time
  against its curve, the step's time outside the devices' work added).
- **ddp** (one torchrun rank per device through ``hetsplit launch``, gloo): predicted by
  ``hd.plan`` (each rank's profile, then DDP calibration steps: 16, or more until 1 s of
  them) as docs/torchrun.md runs it, with ``hd.weight_gradients``; ``plan.step_time``.
- **fsdp2** (the same launch, a tiny Llama under ``fully_shard`` per layer and at the root):
  ``hd.plan(..., accumulate=True)`` on the sharded model (the ranks profile it in the same
  steps, then calibrate on its own steps, as DDP's); ``plan.step_time``.

The span predicted and measured is the same in every engine: forward, loss and backward of
the whole global batch (every micro-batch), up to every device synchronised; no optimizer
step, no data loading. Threads: the wrapper's scatter, replicas, gather, the loss and the
backward that sums the devices' gradients into the module. Processes: the steps run back
to back after one barrier, as a training loop runs them, each from the end of the previous
one to the end of its last backward (DDP: the gradient all-reduce inside it; FSDP2: its
all-gathers and reduce-scatters); the step is the slowest rank's. (A barrier before every
step would add its exit skew to the slowest rank's wall, a span no training loop has.)
Measured: the median of ``--steps`` timed steps after warm-up, taken after the prediction;
beside it NeuSight's noise-suppressed truth, the mean of the fastest 5 of the first 25 steps.
Error = (predicted - measured) / measured. Then the same steps are measured once more: "again"
= (measured - measured again) / measured again, the error of a prediction that *was* the first
measurement. Its median over the configurations is this machine's noise floor for the error.
Beside it, to tell a wrong prediction from a span
it leaves out: the slowest device's own compute in those steps (work; waits not counted) and,
for DDP, one bare all-reduce of the gradients. On CUDA each row also compares the profile's
predicted peak memory (``DeviceProfile.memory`` at the share run at once) with
``torch.cuda.max_memory_allocated`` over the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DEVICE_SETS = ["cpu,cpu@0.25", "cpu,cpu@0.5:max8", "cpu,cpu@0.5,cpu@0.25"]
ENGINES = ("threads", "ddp", "fsdp2")
FSDP_MODEL = "llama-fsdp2"


# -- the workloads -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its SYNTHETIC data and its loss; ``data(n)`` gives ``(inputs, target or None)``."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int], tuple[Any, Any]]
    loss: Callable[..., torch.Tensor]
    batch: int


def _images(shape: tuple[int, ...], classes: int = 10) -> Callable[[int], tuple[Any, Any]]:
    def data(n: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(0)  # SYNTHETIC: random inputs and labels
        return torch.randn((n, *shape), generator=gen), torch.randint(0, classes, (n,), generator=gen)

    return data


def _tokens(seq: int, vocab: int = 256, classes: int | None = None) -> Callable[[int], tuple[Any, Any]]:
    """SYNTHETIC token sequences; labels are the tokens (causal LM) or a class per sequence."""

    def data(n: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (n, seq), generator=gen)
        labels = ids if classes is None else torch.randint(0, classes, (n,), generator=gen)
        return {"input_ids": ids, "labels": labels}, None

    return data


def _hf_loss(output: Any) -> torch.Tensor:
    return output.loss  # the model's own loss from its labels (causal LM: shifted tokens)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)  # the same weights on every rank
        return make()

    return build


def _mlp() -> nn.Module:
    import hetsplit

    return hetsplit.models.mlp(width=1024, in_features=512)


def _lenet() -> nn.Module:
    import hetsplit

    return hetsplit.models.lenet()


def _resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )


def _llama(layers: int = 2, hidden: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
        max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("mlp", _seeded(_mlp), _images((512,)), F.cross_entropy, 512),
        Workload("lenet", _seeded(_lenet), _images((1, 28, 28)), F.cross_entropy, 256),
        Workload("resnet18", _seeded(_resnet18), _images((3, 32, 32)), F.cross_entropy, 16),
        Workload("gpt2", _seeded(_gpt2), _tokens(32), _hf_loss, 32),
        Workload("llama", _seeded(_llama), _tokens(32), _hf_loss, 32),
        Workload("bert", _seeded(_bert), _tokens(32, classes=2), _hf_loss, 32),
        Workload(FSDP_MODEL, _seeded(lambda: _llama(layers=4, hidden=128)), _tokens(32), _hf_loss, 32),
    )
}


def _rows(tree: Any, start: int, stop: int) -> Any:
    if isinstance(tree, dict):
        return {k: v[start:stop] for k, v in tree.items()}
    return tree[start:stop] if tree is not None else None


def _step_loss(model: nn.Module, inputs: Any, target: Any, loss: Callable[..., torch.Tensor]) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return loss(out, target) if target is not None else loss(out)


def _to(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, dict):
        return {k: v.to(device) for k, v in tree.items()}
    return tree.to(device) if tree is not None else None


# -- summary (pure) ----------------------------------------------------------------------


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: -0.1 means the step took longer than predicted."""
    if not (math.isfinite(predicted) and math.isfinite(measured) and measured > 0):
        return math.nan
    return (predicted - measured) / measured


def fastest(seconds: Sequence[float], k: int = 5, of: int = 25) -> float:
    """The mean of the fastest ``k`` of the first ``of`` steps (NeuSight's truth: the fastest 5 of 25 runs)."""
    first = sorted(seconds[:of])[:k]
    return statistics.fmean(first) if first else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine and ``all``: configurations ``n`` (with an error), ``failed``, median and 95th percentile of
    |error|, and the median signed error (``bias``: below 0, steps longer than predicted).

    Beside them the machine's own noise floor, ``again_median_abs`` and ``again_p95_abs``: the
    same of |again|, where ``again`` is each configuration's second measurement of the same steps
    against its first, i.e. the error of a prediction that was the first measurement itself.
    No prediction can be expected to beat it. ``fastest_*``: the same four against the
    mean of the fastest 5 of 25 steps (:func:`fastest`), the figure NeuSight quotes."""
    out = {}
    for engine in [*dict.fromkeys(r["engine"] for r in rows), "all"]:
        mine = [r for r in rows if engine in ("all", r["engine"])]
        errors = [r["error"] for r in mine if r.get("error") is not None and math.isfinite(r["error"])]
        agains = _finite_abs(mine, "again")
        fast, fast_agains = _finite_abs(mine, "fastest_error"), _finite_abs(mine, "fastest_again")
        out[engine] = {
            "n": len(errors),
            "failed": len(mine) - len(errors),
            "median_abs": statistics.median(abs(e) for e in errors) if errors else math.nan,
            "p95_abs": percentile([abs(e) for e in errors], 95),
            "bias": statistics.median(errors) if errors else math.nan,
            "again_median_abs": statistics.median(agains) if agains else math.nan,
            "again_p95_abs": percentile(agains, 95),
            "fastest_median_abs": statistics.median(fast) if fast else math.nan,
            "fastest_p95_abs": percentile(fast, 95),
            "fastest_again_median_abs": statistics.median(fast_agains) if fast_agains else math.nan,
            "fastest_again_p95_abs": percentile(fast_agains, 95),
        }
    return out


def _finite_abs(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [abs(r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]


def memory_verdict(predicted: float | None, measured: float | None) -> str:
    """``ok`` when the predicted peak is at least the measured one and at most 10 % above; else why not."""
    if predicted is None or measured is None or measured <= 0:
        return "n/a"
    if predicted < measured:
        return "below"
    return "ok" if predicted <= 1.10 * measured else "over 10 %"


# -- threads ----------------------------------------------------------------------------


def _memory_rows(prof: Any, plan: Any, devs: Sequence[Any], measured: dict[str, int]) -> list[dict[str, Any]]:
    """Per physical CUDA device: the profile's predicted peaks of the shares it runs at once, summed, and the measured.

    Several emulated devices on one GPU (``cuda:0,cuda:0@0.5``) share its memory, so their peaks add up.
    """
    out = []
    for physical, seen in measured.items():
        mine = [(prof.entry(d.name), m) for d, m in zip(devs, plan.micro_batches) if d.base == physical and m]
        known = bool(mine) and all(e.memory is not None for e, _ in mine)
        predicted = sum(e.memory(max(m)) for e, m in mine) if known else None
        out.append(
            {
                "device": physical + (f" ({len(mine)} shares)" if len(mine) > 1 else ""),
                "predicted_bytes": predicted,
                "measured_bytes": seen,
                "verdict": memory_verdict(predicted, seen),
            }
        )
    return out


def _cuda_bases(devs: Sequence[Any]) -> list[str]:
    return list(dict.fromkeys(d.base for d in devs if d.type == "cuda"))


def run_threads(work: Workload, devices: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on the thread engine, predicted as ``hetsplit bench`` predicts its balanced step."""
    from hetsplit import HeteroDataParallel, timing
    from hetsplit import profile as run_profile
    from hetsplit.apps.bench import calibrate_plan, home_device, time_steps
    from hetsplit.devices import parse_devices
    from hetsplit.planning.sizes import batchnorm_minimum, model_call, with_minimum_shares
    from hetsplit.planning.solver import solve
    from hetsplit.profiler import default_ladder, emulation_warning
    from hetsplit.tree import batch_length

    devs = parse_devices(devices)
    torch.set_num_threads(timing.cpu_threads(devs))
    base = work.build()
    inputs, target = work.data(work.batch)
    prof = run_profile(
        base, _rows(inputs, 0, 16), devs, work.loss, default_ladder(work.batch), target=_rows(target, 0, 16),
        time_budget=args.budget, progress=False, model_name=work.name, threads=torch.get_num_threads(),
    )  # fmt: skip
    plan = solve(prof, work.batch)
    sample = _rows(inputs, 0, 16)  # as hetsplit bench plans: no share too small for BatchNorm's statistics
    minimum = batchnorm_minimum(base, *model_call(sample), batch_length(sample))
    plan = with_minimum_shares(plan, minimum, profile=prof)
    home = home_device(devs)
    dp = HeteroDataParallel(copy.deepcopy(base).to(home), devs, plan=plan, quiet=True)
    x, y = _to(inputs, dp.output_device), _to(target, dp.output_device)
    busy: list[dict[str, float]] = []

    def step() -> None:
        dp.zero_grad(set_to_none=True)
        _step_loss(dp, x, y, work.loss).backward()
        busy.append(dp.step_times)

    plan, cal = calibrate_plan(
        prof, plan, step, busy, devs, 5, args.warmup, seconds=args.calibrate_seconds,
        minimum=minimum, set_plan=dp.set_plan,
    )  # fmt: skip
    dp.set_plan(plan)
    physical = _cuda_bases(devs)
    for d in physical:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    first: dict[str, list[float]] = {}
    measured = time_steps({"balanced": step}, devs, args.steps, args.warmup, samples=first)["balanced"]
    # A plan with one active device runs the module's own step, which logs no busy time (and dp.step_times
    # then still holds the last split step's): no work figure for it.
    split = sum(1 for size in plan.sizes if size) > 1
    busiest = [max(b.values(), default=0.0) for b in busy[-args.steps :]] if split else []
    peaks = {d: int(torch.cuda.max_memory_allocated(d)) for d in physical}
    second: dict[str, list[float]] = {}
    again = time_steps({"balanced": step}, devs, args.steps, 0, samples=second)["balanced"]  # once more: the noise
    return {
        "sizes": list(plan.sizes),
        "micro_batches": [list(m) for m in plan.micro_batches],
        "predicted_s": cal["step"],
        "uncalibrated": {"sizes": cal["sizes"], "predicted_s": cal["predicted"]},  # the profile's plan and step
        "measured_s": measured,
        "measured_again_s": again,
        "fastest_s": fastest(first["balanced"]),
        "fastest_again_s": fastest(second["balanced"]),
        "work_s": statistics.median(busiest) if busiest else None,
        "noise": _noise(plan),
        "calibration_steps": cal["steps"],
        "memory": _memory_rows(prof, plan, devs, peaks),
        "warning": emulation_warning(prof),
    }


# -- processes: one torchrun rank per device ---------------------------------------------


def _slowest(times: list[float]) -> list[float]:
    """Each step's slowest rank's time (every rank calls this)."""
    import torch.distributed as dist

    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _slowest_median(times: list[float]) -> float:
    """The median over steps of the slowest rank's time (every rank calls this)."""
    return statistics.median(_slowest(times))


def _timed_steps(
    model: nn.Module, mine: tuple[Any, Any], plan: Any, dev: Any, work: Workload, n: int
) -> tuple[list[float], list[float], int]:
    """Each of ``n`` steps on this rank, back to back after one barrier: seconds from the previous step's end to
    its last backward's end, and its own compute in them (``hetsplit.timing.lap``: waits for the other ranks not
    counted); the most samples run at once."""
    import torch.distributed as dist

    import hetsplit.distributed as hd
    from hetsplit import timing
    from hetsplit.profiler import train_step
    from hetsplit.tree import batch_length

    walls, computes, largest = [], [], 0
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        with timing.lap(dev) as lap:
            for inputs, target in hd.micro_batches(model, mine, plan, device=dev):
                largest = max(largest, batch_length(inputs))
                train_step(model, inputs, target, work.loss, dev)  # forward and backward throttled, waits not
            dev.synchronize()
        end = time.perf_counter()
        walls.append(end - start)
        start = end
        computes.append(lap.seconds())
    return walls, computes, largest


def _rank_case(engine: str, work: Workload, dev: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on every rank: plan with ``hd.plan``, then time it; the result (rank 0's view)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetsplit
    import hetsplit.distributed as hd
    from hetsplit.distributed.sharded_profile import profile_sharded
    from hetsplit.distributed.zero_share import STAND_IN

    rank, world = dist.get_rank(), dist.get_world_size()
    model = work.build().to(dev.torch_device)
    inputs, target = work.data(work.batch)
    sample, sample_target = _rows(inputs, 0, 16), _rows(target, 0, 16)
    if engine == "fsdp2":
        mesh = init_device_mesh(dev.torch_device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # The profile hd.plan takes of a sharded model (the ranks in the same steps), passed in for its memory model.
        prof = profile_sharded(
            model, sample, dev, work.loss, target=sample_target, batch_size=work.batch, time_budget=args.budget
        )
        plan = hd.plan(model, sample, work.batch, device=dev, loss_fn=work.loss, accumulate=True, profile=prof)
        runner: nn.Module = model
    else:
        # The profile hd.plan takes of an unsharded model, passed in likewise; hd.plan still calibrates with DDP steps.
        prof = hetsplit.profile(
            model, sample, [dev], work.loss, target=sample_target, time_budget=args.budget, progress=False
        )
        plan = hd.plan(model, sample, work.batch, device=dev, loss_fn=work.loss, target=sample_target, profile=prof)
        runner = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    hd.weight_gradients(runner, plan)
    # A zero share runs two real samples weighted 0, as hd.data_loader serves it (an empty batch fails some models).
    start, size = (sum(plan.sizes[:rank]), plan.sizes[rank]) if plan.sizes[rank] else (0, STAND_IN)
    mine = (
        _to(_rows(inputs, start, start + size), dev.torch_device),
        _to(_rows(target, start, start + size), dev.torch_device),
    )
    _timed_steps(runner, mine, plan, dev, work, args.warmup)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev.torch_device)
        torch.cuda.reset_peak_memory_stats(dev.torch_device)
    walls, computes, largest = _timed_steps(runner, mine, plan, dev, work, args.steps)
    slowest, compute = _slowest(walls), _slowest_median(computes)
    slowest_again = _slowest(_timed_steps(runner, mine, plan, dev, work, args.steps)[0])  # once more: the noise
    by_rank: list[float] = [0.0] * world
    dist.all_gather_object(by_rank, statistics.median(computes))
    memory = None
    if dev.type == "cuda":  # the profile's peak at the most samples this rank ran at once
        entry = prof.entries[0]
        predicted = entry.memory(largest) if entry.memory is not None else None
        memory = {"device": f"rank{rank}:{dev.name}", "predicted_bytes": predicted,
                  "measured_bytes": int(torch.cuda.max_memory_allocated(dev.torch_device))}  # fmt: skip
        memory["verdict"] = memory_verdict(predicted, memory["measured_bytes"])
    memories = [None] * world
    dist.all_gather_object(memories, memory)
    allreduce = _allreduce_seconds(model, dev) if engine == "ddp" else None
    del runner, model
    gc.collect()
    return {
        "sizes": list(plan.sizes),
        "micro_batches": [list(m) for m in plan.micro_batches],
        "predicted_s": plan.step_time,
        "measured_s": statistics.median(slowest),
        "measured_again_s": statistics.median(slowest_again),
        "fastest_s": fastest(slowest),
        "fastest_again_s": fastest(slowest_again),
        "work_s": compute,
        "work_by_rank_s": by_rank,
        "predicted_by_rank_s": list(plan.times),  # each rank's compute on its share, as the plan predicts it
        "allreduce_s": allreduce,
        "noise": _noise(plan),
        "memory": [m for m in memories if m is not None],
    }


def _noise(plan: Any) -> float | None:
    """The plan's own relative ± of its predictions where the library records one (else ``None``)."""
    noise = getattr(plan, "noise", None)
    return float(noise) if noise is not None and math.isfinite(noise) else None


def _allreduce_seconds(model: nn.Module, dev: Any) -> float:
    """Median seconds of one bare all-reduce of the model's gradients (what DDP runs after the last gradient)."""
    import torch.distributed as dist

    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev.torch_device)
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        dev.synchronize()
        times.append(time.perf_counter() - start)
    return _slowest_median(times)


def worker(args: argparse.Namespace) -> None:
    """A torchrun rank: every DDP model, then the FSDP2 Llama; rank 0 writes the results to ``args.worker``."""
    import torch.distributed as dist

    import hetsplit.distributed as hd
    from hetsplit import timing
    from hetsplit.apps.bench import keep_freed_memory
    from hetsplit.devices import parse_devices

    keep_freed_memory()
    dev = hd.init(timeout=120, backend="gloo")  # gloo: two ranks may share a GPU (NCCL refuses), CPU ranks need it
    devices = parse_devices(os.environ["HETSPLIT_DEVICES"].split(","))  # what hetsplit launch --devices set
    torch.set_num_threads(timing.cpu_threads(devices))  # the thread engine's rule: 1 each when all are the CPU
    kinds = sorted({d.type for d in devices})
    rank = dist.get_rank()
    results: list[dict[str, Any]] = []
    for engine, name in _rank_cases(args):
        began = time.perf_counter()
        if engine == "fsdp2" and len(kinds) > 1:  # decided alike on every rank: nothing waits in a collective
            result = {"failed": f"not run: an FSDP2 mesh holds one device type, these ranks mix {kinds}"}
        else:
            try:
                result = _rank_case(engine, WORKLOADS[name], dev, args)
            except Exception as e:
                # The other ranks may wait in a collective this rank will never join: end the launch (torchrun
                # stops them); the cases done so far are in the file already.
                print(f"bench_predict: rank {rank} ({dev.name}), {engine} {name}: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)  # fmt: skip
                os._exit(1)
        result.update(engine=engine, model=name, seconds=time.perf_counter() - began)
        results.append(result)
        if rank == 0:
            print(f"  {engine} {name}: {_line(result)}", file=sys.stderr, flush=True)
            with open(args.worker, "w", encoding="utf-8") as f:
                json.dump(results, f)
    dist.destroy_process_group()


def _rank_cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (engine, model) cases a launch runs, in order: every DDP model, then the FSDP2 Llama."""
    cases = [("ddp", m) for m in args.models if m != FSDP_MODEL and "ddp" in args.engines]
    return cases + ([("fsdp2", FSDP_MODEL)] if "fsdp2" in args.engines else [])


def run_ranks(devices: str, args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    """Launch one torchrun rank per device (``hetsplit launch``) and read what rank 0 wrote."""
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", devices, os.path.abspath(__file__),
           "--worker", out, "--models", ",".join(args.models), "--engines", ",".join(args.engines),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--budget", str(args.budget)]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=args.launch_timeout)
        why = f"the launch on {devices} ended ({code}) without this case's result (its output above says why)"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: this process group only
        proc.wait()
        why = f"the launch on {devices} took over {args.launch_timeout:g} s and was stopped before this case ended"
    done = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            done = json.load(f)
    rest = [{"engine": e, "model": m, "failed": why} for e, m in _rank_cases(args)[len(done) :]]
    return done + rest


# -- the run ---------------------------------------------------------------------------


def _line(r: dict[str, Any]) -> str:
    if "failed" in r:
        return f"FAILED: {r['failed']}"
    err = error(r["predicted_s"], r["measured_s"])
    again = f", noise {100 * abs(r['again']):.1f} %" if r.get("again") is not None and math.isfinite(r["again"]) else ""
    return (f"plan {r['sizes']}, predicted {1e3 * r['predicted_s']:.1f} ms, measured {1e3 * r['measured_s']:.1f} ms "
            f"(error {100 * err:+.1f} %{again})")  # fmt: skip


def table(rows: Sequence[dict[str, Any]], summary: dict[str, dict[str, float]], markdown: bool = True) -> str:
    """The results: one row per configuration, then the summary per engine (markdown, or aligned plain text)."""
    memory = any(r.get("memory") for r in rows)
    head = ["engine", "model", "devices", "batch", "plan", "predicted ms", "measured ms", "error", "again",
            "work ms", "all-reduce ms"] + (["memory, predicted / measured MiB"] if memory else [])  # fmt: skip
    body = []
    for r in rows:
        cells = [r["engine"], r["model"], r["devices"]]
        if "failed" in r:
            cells += ["", f"failed: {r['failed']}", "", "", "", "", "", ""]
        else:
            micro = "" if all(len(m) <= 1 for m in r["micro_batches"]) else f" as {r['micro_batches']}"
            err = f"{100 * r['error']:+.1f} %" + (" (emulation unreliable)" if r.get("warning") else "")
            again = _pct(r["again"], "+") if r.get("again") is not None else ""
            cells += [str(r["batch"]), f"{r['sizes']}{micro}", _ms(r["predicted_s"]), _ms(r["measured_s"]), err,
                      again, _ms(r.get("work_s")), _ms(r.get("allreduce_s"))]  # fmt: skip
        if memory:
            cells.append("; ".join(_memory_cell(m) for m in r.get("memory") or []))
        body.append(cells)
    totals = []
    for engine, s in summary.items():
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        totals.append([engine, f"{s['n']}{failed}", _pct(s["median_abs"]), _pct(s["p95_abs"]), _pct(s["bias"], "+"),
                       _pct(s.get("again_median_abs", math.nan)), _pct(s.get("again_p95_abs", math.nan)),
                       _pct(s.get("fastest_median_abs", math.nan)), _pct(s.get("fastest_p95_abs", math.nan)),
                       _pct(s.get("fastest_again_median_abs", math.nan)),
                       _pct(s.get("fastest_again_p95_abs", math.nan))])  # fmt: skip
    heads = ["engine", "configurations", "median abs error", "95th percentile abs error", "median error",
             "noise floor: median abs again", "95th percentile abs again",
             "fastest 5 of 25: median abs error", "95th percentile", "its noise: median",
             "95th percentile"]  # fmt: skip
    return _render(head, body, markdown) + "\n\n" + _render(heads, totals, markdown)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.1f}"


def _pct(x: float, sign: str = "") -> str:
    return "" if not math.isfinite(x) else f"{100 * x:{sign}.1f} %"


def _render(head: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body])


def _memory_cell(m: dict[str, Any]) -> str:
    mib = 1 << 20
    pred = "?" if m["predicted_bytes"] is None else f"{m['predicted_bytes'] / mib:.1f}"
    return f"{m['device']} {pred} / {m['measured_bytes'] / mib:.1f} ({m['verdict']})"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: two models, short profiles, 3 timed steps")
    p.add_argument("--json", metavar="OUT", help="write the rows, the summary and the conditions here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (for docs/benchmarks.md)")
    p.add_argument("--devices", action="append", help=f"a device set; repeat for several (default: {DEVICE_SETS})")
    p.add_argument("--models", help=f"comma-separated, of {[n for n in WORKLOADS if n != FSDP_MODEL]}")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of threads,ddp,fsdp2")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 30; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the calibration and the timing")
    p.add_argument("--budget", type=float, help="profiling seconds per configuration (default 3; --quick 1)")
    p.add_argument("--calibrate-seconds", type=float, help="threads: calibration, as bench (default 2; --quick 0.3)")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds a torchrun launch may take")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set in the torchrun ranks this script launches
    args = p.parse_args(argv)
    quick = args.quick
    args.steps = args.steps or (3 if quick else 30)
    args.budget = args.budget or (1.0 if quick else 3.0)
    args.calibrate_seconds = args.calibrate_seconds if args.calibrate_seconds is not None else (0.3 if quick else 2.0)
    default_models = ["mlp", "gpt2"] if quick else [n for n in WORKLOADS if n != FSDP_MODEL]
    args.models = args.models.split(",") if isinstance(args.models, str) else default_models
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [m for m in args.models if m not in WORKLOADS] + [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown models or engines {unknown}; models: {sorted(WORKLOADS)}, engines: {list(ENGINES)}")
    if args.steps < 1 or args.warmup < 0 or not args.budget > 0:
        p.error(f"need --steps >= 1, --warmup >= 0, --budget > 0; got {args.steps}, {args.warmup}, {args.budget}")
    args.devices = args.devices or DEVICE_SETS
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # configs of tiny models warn about unused defaults
    if args.worker:
        worker(args)
        return
    from hetsplit.apps.bench import keep_freed_memory
    from hetsplit.devices import parse_devices

    for spec in args.devices:
        parse_devices(spec)  # every device set exists here: fail before the first configuration
    keep_freed_memory()
    began, load = time.perf_counter(), os.getloadavg()
    rows: list[dict[str, Any]] = []
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else os.getcwd()
    for i, devices in enumerate(args.devices):
        if "threads" in args.engines:
            for name in args.models:
                if name == FSDP_MODEL:
                    continue
                t0 = time.perf_counter()
                try:
                    result = run_threads(WORKLOADS[name], devices, args)
                except Exception as e:  # one configuration's failure is a row, the others still run
                    result = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                result.update(engine="threads", model=name, seconds=time.perf_counter() - t0)
                rows.append(_finish(result, devices))
                print(f"  threads {name} on {devices}: {_line(result)}", file=sys.stderr, flush=True)
                gc.collect()
        if {"ddp", "fsdp2"} & set(args.engines):
            out = os.path.join(out_dir, f".bench_predict_ranks_{os.getpid()}_{i}.json")
            print(f"  torchrun ranks on {devices} ...", file=sys.stderr, flush=True)
            for result in run_ranks(devices, args, out):
                rows.append(_finish(result, devices))
                if "failed" in result:
                    print(f"  {result['engine']} {result['model']}: {_line(result)}", file=sys.stderr)
            if os.path.exists(out):
                os.remove(out)
    summary = summarise(rows)
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_before": load,
            "load_after": os.getloadavg(),
            "wall_s": time.perf_counter() - began,
            "data": "synthetic",
            "quick": args.quick,
            "steps": args.steps,
            "budget_s": args.budget,
            "calibrate_s": args.calibrate_seconds,
        },
        "rows": rows,
        "summary": summary,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(table(rows, summary, args.markdown))
    m = report["meta"]
    print(f"\n{len(rows)} configurations in {m['wall_s']:.0f} s; load {load[0]:.1f} before, "
          f"{m['load_after'][0]:.1f} after; SYNTHETIC data; {m['date']}")  # fmt: skip


def _finish(result: dict[str, Any], devices: str) -> dict[str, Any]:
    result["devices"] = devices
    if "failed" not in result:
        result["batch"] = WORKLOADS[result["model"]].batch
        result["error"] = error(result["predicted_s"], result["measured_s"])
        if result.get("measured_again_s") is not None:
            result["again"] = error(result["measured_s"], result["measured_again_s"])
        if result.get("fastest_s") is not None:
            result["fastest_error"] = error(result["predicted_s"], result["fastest_s"])
        if result.get("fastest_again_s") is not None:
            result["fastest_again"] = error(result["fastest_s"], result["fastest_again_s"])
    return result


if __name__ == "__main__":
    main()
