"""Commands: what each ``hetsplit`` subcommand does, given its parsed arguments."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CLIError",
    "DTYPES",
    "default_devices",
    "cmd_devices",
    "cmd_profile",
    "cmd_plan",
    "cmd_show",
    "cmd_bench",
    "cmd_demo",
]

DTYPES = ("float32", "float64", "float16", "bfloat16")

# The solver takes ~40 ms for 10,000 devices; far beyond that a what-if is a typo.
MAX_COPIES = 10_000
# A plan table longer than this shows the first rows and sums up the rest.
MAX_ROWS = 40


class CLIError(Exception):
    """A user error reported as one line, without a traceback."""


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _fmt_time(t: float) -> str:
    if not math.isfinite(t):
        return "inf"
    return f"{t * 1000:.2f} ms" if t < 10 else f"{t:.2f} s"


def _threads(n: int) -> str:
    return f"{n} CPU thread" + ("" if n == 1 else "s")


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
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
    print(_table(rows, ["device", "kind", "name", "memory", "capability", "driver", "uuid"]))
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

    from .. import profiler, store
    from ..devices import parse_devices
    from ..planning import solver
    from .bench import cpu_threads
    from .models import BUILTIN_MODELS, build_model, load_model, synthetic_batch

    devs = parse_devices(args.devices) if args.devices is not None else parse_devices(default_devices())
    if args.out is not None:  # where the result goes is checked before any profiling
        store.check_writable(args.out)
    else:
        store.check_writable(store.profile_dir(args.profile_dir), directory=True)
    torch.set_num_threads(cpu_threads(devs, args.threads))
    spec = load_model(args.model, tuple(args.input_shape) if args.input_shape else None)
    dtype = getattr(torch, args.dtype)
    model = build_model(spec).to(dtype)
    x, y = synthetic_batch(spec, 16, dtype=dtype)
    builtin = args.model in BUILTIN_MODELS
    emulated = [d.name for d in devs if d.emulated]
    print(
        f"profiling {spec.name} (input {tuple(spec.input_shape)}, {args.dtype}, synthetic data) on "
        f"{', '.join(d.name for d in devs)}; {_threads(torch.get_num_threads())}"
    )
    if emulated:
        print(f"emulated devices: {', '.join(emulated)} (a real device slowed down by sleeping; not real hardware)")
    prof = profiler.profile(
        model,
        x,
        devs,
        F.cross_entropy if builtin else None,
        args.batch_sizes,
        target=y if builtin else None,
        repeats=args.repeats,
        time_budget=args.budget,
        progress=False if args.quiet else None,
        model_name=spec.name,
    )
    path = store.save_profile(prof, args.out, directory=args.profile_dir)
    plan = solver.solve(prof, args.batch_size)
    rows = []
    for e, size in zip(prof.entries, plan.sizes):
        top = e.measurements[-1].batch
        rows.append(
            [
                e.name + (" (emulated)" if e.info.emulated else ""),
                e.info.description,
                f"{prof.throughput(e.name, top):,.0f} @ {top}",
                "-" if e.memory_cap is None else str(e.memory_cap),
                f"{size} ({size / args.batch_size:.0%})",
            ]
        )
    print(_table(rows, ["device", "hardware", "samples/s @ batch", "memory cap", f"share of {args.batch_size}"]))
    print(
        f"\npredicted step {_fmt_time(plan.step_time)}: {plan.speedup_vs_even:.2f}x the even split, "
        f"{plan.speedup_vs_single:.2f}x {plan.single_device} alone"
    )
    print(f"profile written to {path}")
    return 0


def _parse_use(text: str) -> tuple[Path, str, int]:
    """``profiles/a.json:cuda:0*8`` -> (path, "cuda:0", 8)."""
    head, star, count = text.rpartition("*")
    if not star:
        head, count = text, "1"
    path, sep, device = head.partition(".json:")
    if not sep:
        path, sep, device = head.partition(":")
    else:
        path += ".json"
    try:
        n = int(count)
    except ValueError:
        n = 0
    if not sep or not device or n < 1:
        raise CLIError(f"bad --use {text!r}; write FILE:DEVICE or FILE:DEVICE*N, e.g. profiles/a.json:cuda:0*8")
    if n > MAX_COPIES:
        raise CLIError(f"--use {text!r} asks for {n:,} copies; plan for at most {MAX_COPIES:,} devices of one kind")
    return Path(path), device, n


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planning import Profile, solver

    if not args.profile and not args.use:
        raise CLIError("give a profile file, or --use FILE:DEVICE[*N] (see 'hetsplit plan --help')")
    if args.devices and (len(args.profile) != 1 or args.use):
        raise CLIError("--devices picks devices of one profile; with several, use --use FILE:DEVICE[*N]")
    loaded: dict[Path, Profile] = {}

    def load(path: Path) -> Profile:
        if path not in loaded:
            loaded[path] = Profile.load(path)
        return loaded[path]

    parts: list[tuple[Profile, str, int]] = []
    for path in args.profile:
        prof = load(path)
        wanted = [d for d in args.devices.split(",") if d] if args.devices else prof.devices
        parts += [(prof, d, 1) for d in wanted]
    for text in args.use:
        path, device, n = _parse_use(text)
        parts.append((load(path), device, n))
    try:
        combined = Profile.merge(parts)
    except KeyError as e:
        raise CLIError(f"{e.args[0]}") from None
    whatif = len(loaded) > 1 or bool(args.use)
    plan = solver.solve(combined, args.batch_size)
    fingerprints = {p.model.get("fingerprint") for p in loaded.values()}
    params = [p.model.get("parameter_bytes") for p in loaded.values()]
    comm = None
    if args.link_gbps:
        if None in params:
            raise CLIError(
                "--link-gbps needs the model's size, which these profiles do not record; "
                "re-profile with this hetsplit version"
            )
        comm = solver.allreduce_time(max(params), sum(1 for s in plan.sizes if s > 0), args.link_gbps)
    if args.json:
        doc = plan.to_dict()
        if comm is not None:
            doc["allreduce_time"] = comm
        print(json.dumps(doc, indent=1))
        return 0
    rows = []
    for name, size, t, extra in zip(plan.devices, plan.sizes, plan.times, plan.extrapolated):
        notes = [n for n, on in (("emulated", name in plan.emulated), ("beyond measured sizes", extra)) if on]
        rows.append([name, str(size), f"{size / plan.batch_size:.1%}", _fmt_time(t), ", ".join(notes)])
    model = next(iter(loaded.values())).model.get("name", "model")
    sources = ", ".join(f"{path} ({p.host}, {p.created[:10]})" for path, p in loaded.items())
    print(f"{'what-if ' if whatif else ''}split of a batch of {plan.batch_size} ({model}; profiles: {sources})")
    if len(fingerprints) > 1:
        print("warning: the profiles are of different models; their times do not add up to one job")
    if len(rows) > MAX_ROWS:
        hidden = rows[MAX_ROWS:]
        rows = [*rows[:MAX_ROWS], [f"... {len(hidden):,} more", str(sum(int(r[1]) for r in hidden)), "", "", ""]]
    print(_table(rows, ["device", "samples", "share", "predicted time", "note"]))
    print(f"\npredicted compute per step {_fmt_time(plan.step_time)}")
    if comm is not None:
        print(
            f"predicted gradient all-reduce {_fmt_time(comm)} ({max(params) / 2**20:.1f} MiB over "
            f"{args.link_gbps:g} Gbit/s, ring, not overlapped); step {_fmt_time(plan.step_time + comm)} at most"
        )
    elif len(plan.devices) > 1:
        print("gradient exchange not included (give --link-gbps to estimate it)")
    total = plan.step_time + (comm or 0.0)
    n_dev = len(plan.devices)
    even_comm = solver.allreduce_time(max(params), n_dev, args.link_gbps) if comm is not None else 0.0
    even_total = plan.even_time + even_comm
    print(f"even split: {_fmt_time(even_total)} -> balanced is {even_total / total:.2f}x faster")
    print(
        f"{plan.single_device} alone: {_fmt_time(plan.single_time)} (no exchange) -> balanced is "
        f"{plan.single_time / total:.2f}x "
        + ("faster" if plan.single_time >= total else "as fast: adding devices loses")
    )
    if whatif and len(parts) > 1:
        print(
            "\nwhat each addition is worth (step without it" + (", all-reduce included):" if comm is not None else "):")
        )
        for k, (prof, device, n) in enumerate(parts):
            rest = solver.solve(Profile.merge(parts[:k] + parts[k + 1 :]), args.batch_size)
            t = rest.step_time
            if comm is not None:
                t += solver.allreduce_time(max(params), sum(1 for s in rest.sizes if s > 0), args.link_gbps)
            label = f"{device}{'*' + str(n) if n > 1 else ''} of {prof.host}"
            print(f"  without {label}: {_fmt_time(t)} ({t / total:.2f}x the full set's step)")
    print("\nThese are predictions from the profiles' fitted curves, not measurements.")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .. import store
    from ..planning import Plan, Profile
    from .bench import BenchResult
    from .bench_rebalance import RebalanceResult
    from .show import plot_profile, plot_rebalance, plot_timeline

    doc = store.read_json(args.file, ("profile", "bench", "bench-rebalance"))
    out = args.out or args.file.with_suffix(".png")
    if doc["kind"] == "bench-rebalance":
        try:
            path = plot_rebalance(RebalanceResult.from_dict(doc["result"]), out)
        except (KeyError, TypeError, ValueError) as e:
            raise CLIError(
                f"{args.file}: damaged rebalance results ({type(e).__name__}: {e}); re-run the bench"
            ) from None
        print(f"picture written to {path}")
        return 0
    if doc["kind"] == "bench":
        if args.plan or args.batch_size:
            raise CLIError(f"{args.file} holds bench results; --plan and --batch-size are for profiles")
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
            try:
                raw = json.loads(args.plan.read_text(encoding="utf-8"))
                plan = Plan.from_dict(raw.get("plan", raw) if isinstance(raw, dict) else raw)
            except FileNotFoundError:
                raise CLIError(f"{args.plan}: no such file") from None
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CLIError(
                    f"{args.plan}: not a plan ({type(e).__name__}: {e}); write one with "
                    "'hetsplit plan PROFILE --batch-size N --json > FILE'"
                ) from None
            missing = [d for d in plan.devices if d not in prof.devices]
            if missing:
                raise CLIError(f"{args.plan}: devices {missing} are not in the profile {args.file} ({prof.devices})")
        path = plot_profile(prof, out, plan=plan, batch_size=args.batch_size)
    print(f"picture written to {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .. import store
    from ..devices import parse_devices
    from .bench import bench, cpu_threads
    from .bench_rebalance import bench_rebalance, parse_change
    from .models import load_model

    if args.change and not args.rebalance:
        raise CLIError("--change needs --rebalance (it changes a device's speed during a rebalancing run)")
    change = parse_change(args.change) if args.change else None
    spec_devices = args.devices
    if spec_devices is None:  # the default pair, or the CPU and the device whose speed --change changes
        spec_devices = f"cpu,{change[0]}" if change is not None and change[0] != "cpu" else "cpu,cpu@0.25"
    devs = parse_devices(spec_devices)
    if change is not None and change[0] not in [d.name for d in devs]:
        raise CLIError(
            f"--change names {change[0]}, which is not among the devices ({spec_devices}); list it in --devices"
        )
    spec = load_model(args.model, tuple(args.input_shape) if args.input_shape else None)
    if args.json is not None:
        store.check_writable(args.json)
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
            store.write_json(args.json, "bench-rebalance", {"result": outcome.to_dict()})
            print(f"results written to {args.json}")
        return 0
    result = bench(
        spec, devs, batch_size=args.batch_size, steps=steps, mode=args.mode, profile_budget=args.profile_budget, log=log
    )
    print(result.table())
    if args.json:
        store.write_json(args.json, "bench", {"result": result.to_dict()})
        print(f"results written to {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .. import store
    from ..devices import parse_devices
    from .demo import run_demo
    from .models import load_model

    devices = parse_devices(args.devices) if args.devices is not None else None
    if args.json is not None:
        store.check_writable(args.json)
    result = run_demo(
        devices,
        model=load_model(args.model, tuple(args.input_shape) if args.input_shape else None),
        batch_size=args.batch_size,
        steps=args.steps,
        profile_budget=args.budget,
        threads=args.threads,
        progress=not args.quiet and sys.stderr.isatty(),
    )
    if args.json:
        store.write_json(args.json, "bench", {"result": result.to_dict()})
        print(f"results written to {args.json} (draw them with: hetsplit show {args.json})")
    return 0
