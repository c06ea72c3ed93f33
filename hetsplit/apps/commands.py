"""Commands: what each ``hetsplit`` subcommand does, given its parsed arguments."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports torch and the library on first use, so its start stays instant
    from ..planning.records import MemoryModel

DTYPES = ("float32", "float64", "float16", "bfloat16")


class CLIError(Exception):
    """A user error reported as one line, without a traceback."""


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _memory_text(model: MemoryModel) -> str:
    """A fitted memory curve as ``1.2 GiB + 3.40 MiB per sample``."""
    base, per = model.base, model.per_sample
    return f"m(b) = {base / 2**30:.2f} GiB + {per / 2**20:.2f} MiB per sample (fitted to {len(model.peaks)} peaks)"


def _micro_note(micro: list[int]) -> str:
    return f" as {len(micro)} micro-batches" if len(micro) > 1 else ""


def fmt_time(t: float) -> str:
    """Seconds as ``12.34 ms`` (below 10 s) or ``12.34 s``; ``inf`` for an infinite time."""
    if not math.isfinite(t):
        return "inf"
    return f"{t * 1000:.2f} ms" if t < 10 else f"{t:.2f} s"


def even_note(plan: Any, caps: Mapping[str, int | None]) -> str:
    """Why the even split of ``plan``'s batch cannot run: the devices whose even share exceeds their memory cap.

    The plan's ``even_time`` is then infinite, which printed as ``inf`` (``infx faster``).
    """
    from ..planning.plan import even_sizes

    over = [
        f"{d} holds at most {caps[d]} samples, its even share is {s}"
        for d, s in zip(plan.devices, even_sizes(plan.batch_size, len(plan.devices)))
        if (cap := caps.get(d)) is not None and s > cap
    ]
    shown = "; ".join(over[:3]) + (f"; and {len(over) - 3} more" if len(over) > 3 else "")
    return f"does not fit in memory ({shown or 'a device cannot take its even share'}; --accumulate runs it)"


def alone_note(plan: Any, caps: Mapping[str, int | None]) -> str:
    """Why no single device can take ``plan``'s whole batch: every device's memory cap, in short."""
    known = [f"{d} at most {caps[d]}" for d in plan.devices if caps.get(d) is not None]
    return f"batch {plan.batch_size}; " + (", ".join(known[:3]) or "each is above its memory cap")


def _threads(n: int) -> str:
    return f"{n} CPU thread" + ("" if n == 1 else "s")


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table: the header, a rule, then the rows, in left-aligned columns."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def cmd_devices(args: argparse.Namespace) -> int:
    from ..devices import discover

    infos = discover()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=1))
        return 0
    rows = [
        [i.name, i.kind, i.description, _fmt_bytes(i.memory_bytes), i.capability or "-", i.driver or "-", i.uuid or "-"]
        for i in infos
    ]
    print(table(rows, ["device", "kind", "name", "memory", "capability", "driver", "uuid"]))
    import torch

    from ..version import __version__

    cuda = f", built for CUDA {torch.version.cuda}" if torch.version.cuda else ""
    usable = "" if torch.cuda.is_available() else " (no CUDA device usable here)" if torch.version.cuda else ""
    print(f"\nhetsplit {__version__}, torch {torch.__version__}{cuda}{usable}")
    print("GPUs are matched to stored profiles by UUID, so a profile survives CUDA_VISIBLE_DEVICES changes.")
    print("Emulate a slower device with NAME@SPEED, e.g. cpu@0.25 (the CPU at a quarter speed).")
    return 0


def default_devices() -> list[str]:
    from ..devices import discover

    names = [i.name for i in discover()]
    if len(names) == 1:
        # One device shows no split: add an emulated slower CPU, labelled as such everywhere.
        names.append("cpu@0.25")
    return names


def cmd_profile(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from .. import files, profiler, store
    from ..devices import parse_devices
    from ..planning import solver
    from ..timing import cpu_threads
    from .models import BUILTIN_MODELS, build_model, load_model, synthetic_batch

    listed = parse_devices(args.devices) if args.devices is not None else parse_devices(default_devices())
    devs = list(dict.fromkeys(listed))  # a profile measures each device once
    ladder = profiler.check_ladder(args.batch_sizes)
    if args.out is not None:  # where the result goes is checked before any profiling
        files.check_writable(args.out)
    else:
        files.check_writable(store.profile_dir(args.profile_dir), directory=True)
    replacing = args.out is not None and args.out.exists()
    torch.set_num_threads(cpu_threads(devs, args.threads))
    builtin = args.model in BUILTIN_MODELS
    if builtin and args.vocab_size is not None:
        raise ValueError(
            f"--vocab-size is for your own model taking token ids; the built-in {args.model!r} takes floats"
        )
    spec = load_model(args.model, tuple(args.input_shape) if args.input_shape else None, args.vocab_size)
    if spec.takes_ids and spec.vocab is None:  # else the first step fails in torch's words about an embedding
        raise ValueError(
            f"model {args.model!r} fails on float inputs but runs on integers (token ids): pass --vocab-size N "
            "(ids drawn from 0..N-1), or profile it from Python with hetsplit.profile(model, sample, devices)"
        )
    dtype = getattr(torch, args.dtype)
    model = build_model(spec).to(dtype)
    x, y = synthetic_batch(spec, 16, dtype=dtype, targets=builtin)  # your model: its output summed, any shape
    emulated = [d.name for d in devs if d.emulated]
    inputs = f"token ids < {spec.vocab}, " if spec.vocab else ""
    print(
        f"profiling {spec.name} (input {tuple(spec.input_shape)}, {inputs}{args.dtype}, synthetic data) on "
        f"{', '.join(d.name for d in devs)}; {_threads(torch.get_num_threads())}"
    )
    if emulated:
        print(f"emulated devices: {', '.join(emulated)} (a real device slowed down by sleeping; not real hardware)")
    if len(devs) < len(listed):
        print("a device listed more than once is profiled once; its curve serves every copy in a split")
    prof = profiler.profile(
        model,
        x,
        devs,
        F.cross_entropy if builtin else None,
        ladder,
        target=y if builtin else None,
        repeats=args.repeats,
        time_budget=args.budget,
        progress=False if args.quiet else None,
        model_name=spec.name,
    )
    faults = profiler.emulation_faults(prof)  # an emulated device faster than declared is planned at its declared speed
    plan = solver.solve(
        profiler.held_to_declared_speed(prof, faults), args.batch_size, accumulate=True
    )  # micro-batches
    rows: list[list[str]] = []
    for e, size, t in zip(prof.entries, plan.sizes, plan.times):
        top = e.measurements[-1].batch
        rows.append(
            [
                e.name + (" (emulated)" if e.info.emulated else ""),
                e.info.description,
                f"{prof.throughput(e.name, top):,.0f} @ {top}",
                "-" if e.memory_cap is None else f"{e.memory_cap}" + (" (emulated)" if e.info.max_batch else ""),
                f"{size} ({size / args.batch_size:.0%}"
                + (f", {fmt_time(t)})" if size > 0 and math.isfinite(t) else ")")
                + _micro_note(plan.micro_batches[len(rows)]),
            ]
        )
    print(table(rows, ["device", "hardware", "samples/s @ batch", "memory cap", f"share of {args.batch_size}"]))
    for e in prof.entries:
        if e.memory is not None:  # CUDA: the fitted memory curve
            print(f"{e.name} peak memory: {_memory_text(e.memory)}")
    caps = prof.memory_caps()
    even = (
        f"{plan.speedup_vs_even:.2f}x the even split"
        if math.isfinite(plan.even_time)
        else f"the even split {even_note(plan, caps)}"
    )
    alone = (
        f"{plan.speedup_vs_single:.2f}x {plan.single_device} alone"
        if math.isfinite(plan.single_time)
        else f"no device alone holds the batch ({alone_note(plan, caps)})"
    )
    note = profiler.fault_note(faults)
    print(f"\npredicted step {fmt_time(plan.step_time)}: {even}, {alone}" + (f"; {note}" if note else ""))
    # Saved after the results are shown: a full disk then costs the file, not the measurements' summary.
    path = store.save_profile(prof, args.out, directory=args.profile_dir)
    print(f"profile written to {path}" + (" (it replaced the file there)" if replacing else ""))
    return 0


def _read_plan(path: Any) -> Any:
    """The plan in ``path``, written by ``hetsplit plan --json`` (a bare plan, or one under ``"plan"``).

    Raises:
        CLIError: Naming the file, when it is missing or holds no plan.
    """
    from ..files import MAX_FILE_BYTES
    from ..planning import Plan

    try:
        if path.stat().st_size > MAX_FILE_BYTES or not path.is_file():  # never a FIFO or /dev/zero
            raise ValueError(f"not a regular file of at most {MAX_FILE_BYTES // 2**20} MiB")
        raw = json.loads(path.read_text(encoding="utf-8"))
        return Plan.from_dict(raw.get("plan", raw) if isinstance(raw, dict) else raw)
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as e:
        raise CLIError(
            f"{path}: not a plan ({type(e).__name__}: {e}); write one with "
            "'hetsplit plan PROFILE --batch-size N --json > FILE'"
        ) from None


def _shown_file(path: Any) -> dict[str, Any]:
    """What ``hetsplit show`` draws: a hetsplit file of a profile or bench results, or a plan file.

    A plan file (``hetsplit plan --json``) has no hetsplit header: it is tried when the
    file is no hetsplit file, and the original error stands when it is no plan either.
    """
    from ..files import ProfileFileError, read_json

    try:
        return read_json(path, ("profile", "bench", "bench-rebalance"))
    except ProfileFileError as error:
        try:
            return {"kind": "plan", "plan": _read_plan(path)}
        except CLIError:
            raise error from None  # no plan either: what the file is not, as read_json says


def cmd_show(args: argparse.Namespace) -> int:
    from .. import files
    from ..planning import Profile
    from .bench_result import BenchResult, RebalanceResult
    from .show import plot_plan, plot_profile, plot_rebalance, plot_timeline

    doc = _shown_file(args.file)
    out = args.out or args.file.with_suffix(".png")
    files.check_writable(out)  # before drawing, naming the picture's path
    if doc["kind"] != "profile" and (args.plan or args.batch_size):
        raise CLIError(f"{args.file} holds a {doc['kind']}; --plan and --batch-size are for profiles")
    if doc["kind"] == "plan":
        path = plot_plan(doc["plan"], out)
    elif doc["kind"] == "bench-rebalance":
        try:
            path = plot_rebalance(RebalanceResult.from_dict(doc["result"]), out)
        except (KeyError, TypeError, ValueError) as e:
            raise CLIError(
                f"{args.file}: damaged rebalance results ({type(e).__name__}: {e}); re-run the bench"
            ) from None
    elif doc["kind"] == "bench":
        try:
            result = BenchResult.from_dict(doc["result"])
        except (KeyError, TypeError, ValueError) as e:
            raise CLIError(f"{args.file}: damaged bench results ({type(e).__name__}: {e}); re-run the bench") from None
        if not result.busy:
            raise CLIError(f"{args.file}: no per-device busy times (made by an older hetsplit); re-run the bench")
        path = plot_timeline(result, out)
    else:
        prof = Profile.load(args.file)
        plan = None
        if args.plan:
            plan = _read_plan(args.plan)
            missing = [d for d in plan.devices if d not in prof.devices]
            if missing:
                raise CLIError(f"{args.plan}: devices {missing} are not in the profile {args.file} ({prof.devices})")
            if args.batch_size is not None and args.batch_size != plan.batch_size:
                raise CLIError(
                    f"--batch-size {args.batch_size}, but the plan {args.plan} splits a batch of {plan.batch_size}; "
                    "give --plan to draw that split, or --batch-size to solve one"
                )
        for entry in prof.entries:  # the caps and, on CUDA, the memory curve, also as text
            if entry.memory_cap is not None or entry.memory is not None:
                cap = "not reached" if entry.memory_cap is None else f"{entry.memory_cap} samples"
                kind = " (emulated)" if entry.info.max_batch else ""
                extra = f"; peak memory {_memory_text(entry.memory)}" if entry.memory is not None else ""
                print(f"{entry.name}: memory cap {cap}{kind}{extra}")
        path = plot_profile(prof, out, plan=plan, batch_size=args.batch_size)
    print(f"picture written to {path}")
    return 0


def _check_splittable(batch_size: int, n: int, command: str) -> None:
    """Refuse a batch too small to give every device a sample: its even split leaves a device out.

    With fewer samples than devices every configuration is one device alone (or a few)
    under another name, and the comparison reads noise as a speedup.
    """
    if batch_size < n:
        raise CLIError(
            f"--batch-size {batch_size} cannot be split across {n} devices (the even split leaves a device "
            f"without a sample, so {command} would compare one device with itself); give --batch-size {n} or more"
        )


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .. import files
    from ..devices import parse_devices
    from ..timing import cpu_threads
    from .bench import bench, bench_rebalance, parse_change
    from .models import load_model

    if args.change and not args.rebalance:
        raise CLIError("--change needs --rebalance (it changes a device's speed during a rebalancing run)")
    change = parse_change(args.change) if args.change else None
    spec_devices = args.devices
    if spec_devices is None:  # the default pair, or the CPU and the device whose speed --change changes
        spec_devices = f"cpu,{change[0]}" if change is not None and change[0] != "cpu" else "cpu,cpu@0.25"
    devs = parse_devices(spec_devices)
    if len(devs) < 2:
        what = "rebalancing moves samples between devices" if args.rebalance else "bench compares splits"
        raise CLIError(f"{what}, so it needs two or more devices; got {[d.name for d in devs]}")
    if not args.rebalance:
        _check_splittable(args.batch_size, len(devs), "bench")
    if change is not None and change[0] not in [d.name for d in devs]:
        raise CLIError(
            f"--change names {change[0]}, which is not among the devices ({spec_devices}); list it in --devices"
        )
    spec = load_model(args.model, tuple(args.input_shape) if args.input_shape else None)
    if args.json is not None:
        files.check_writable(args.json)
    torch.set_num_threads(cpu_threads(devs, args.threads))
    steps = args.steps or (120 if args.rebalance else 20)
    emulated = [d.name for d in devs if d.emulated]
    what = "with online rebalancing from the even split" if args.rebalance else "each"
    print(
        f"bench {spec.name} on {', '.join(d.name for d in devs)}: batch {args.batch_size}, {steps} steps {what}, "
        f"{args.mode} mode, synthetic data, {_threads(torch.get_num_threads())}"
    )
    if emulated:
        print(f"emulated devices: {', '.join(emulated)} (a real device slowed down by sleeping; not real hardware)")
    log = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    if args.rebalance:
        outcome = bench_rebalance(
            spec, devs, batch_size=args.batch_size, steps=steps, every=args.every, change=change, log=log
        )
        print(outcome.table())
        if args.json:
            files.write_json(args.json, "bench-rebalance", {"result": outcome.to_dict()})
            print(f"results written to {args.json}")
        return 0
    result = bench(
        spec,
        devs,
        batch_size=args.batch_size,
        steps=steps,
        mode=args.mode,
        profile_budget=args.budget,
        calibrate=args.calibrate,
        calibrate_seconds=args.calibrate_seconds,
        log=log,
    )
    print(result.table())
    if args.json:
        files.write_json(args.json, "bench", {"result": result.to_dict()})
        print(f"results written to {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .. import files
    from ..devices import parse_devices
    from .demo import run_demo
    from .models import load_model

    devices = parse_devices(args.devices) if args.devices is not None else None
    if devices is not None and len(devices) < 2:
        raise CLIError(f"the demo compares splits, so it needs two or more devices; got {[d.name for d in devices]}")
    _check_splittable(args.batch_size, len(devices) if devices is not None else 2, "demo")
    if args.json is not None:
        files.check_writable(args.json)
    result = run_demo(
        devices,
        model=load_model(args.model, tuple(args.input_shape) if args.input_shape else None),
        batch_size=args.batch_size,
        steps=args.steps,
        profile_budget=args.budget,
        threads=args.threads,
        progress=not args.quiet and sys.stderr.isatty(),
        processes=not args.threads_only,
    )
    if args.json:
        files.write_json(args.json, "bench", {"result": result.to_dict()})
        print(f"results written to {args.json} (draw them with: hetsplit show {args.json})")
    return 0
