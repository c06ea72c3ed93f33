"""What-if: ``hetsplit plan``, the split of a batch for stored profiles and for sets of devices not at hand."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .commands import CLIError, alone_note, even_note, fmt_time, table

if TYPE_CHECKING:
    from ..planning import Profile

# A plan table longer than this shows the first rows and sums up the rest.
_MAX_ROWS = 40
# "What each addition is worth" re-solves once per addition (twice for copies); past this
# many additions the rest are not evaluated, and the output says so.
_MAX_WORTH = 40


# Example profiles shipped inside the package (made-up timings for the what-if guide): a
# profile named that is not on disk is one of these, so the guide runs from any directory,
# in a clone or after installing the wheel.
SHIPPED = Path(__file__).parent / "shipped"


def profile_path(path: Path) -> Path:
    """``path``, or the shipped example profile of that name where ``path`` is not on disk."""
    shipped = SHIPPED / path.name
    return shipped if not path.exists() and path.name.startswith("example-") and shipped.is_file() else path


def _parse_use(text: str, limit: int) -> tuple[Path, str, int]:
    """``profiles/a.json:cuda:0*8`` -> (path, "cuda:0", 8), with at most ``limit`` copies.

    Raises:
        CLIError: Naming the text, if it is malformed or asks for too many copies.
    """
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
    if n > limit:
        raise CLIError(f"--use {text!r} asks for {n:,} copies; plan for at most {limit:,} devices in all")
    return profile_path(Path(path)), device, n


def cmd_plan(args: argparse.Namespace) -> int:
    """Solve and print the split of ``--batch-size`` for the profiles and ``--use`` picks."""
    from ..planning import Profile, checks, solver

    if not args.profile and not args.use:
        raise CLIError("give a profile file, or --use FILE:DEVICE[*N] (see 'hetsplit plan --help')")
    if args.devices is not None and (len(args.profile) != 1 or args.use):
        raise CLIError("--devices picks devices of one profile; with several, use --use FILE:DEVICE[*N]")
    loaded: dict[Path, Profile] = {}

    def pick(path: Path, device: str, n: int) -> None:
        if path not in loaded:
            loaded[path] = Profile.load(path)
        try:
            name = loaded[path].entry(device).name
        except KeyError as e:
            raise CLIError(f"{path}: {e.args[0]}") from None
        # A device named twice is one device with more copies (numbered on, never a name clash).
        picks[path, name] = picks.get((path, name), 0) + n
        if sum(picks.values()) > checks.MAX_DEVICES:
            raise CLIError(f"the what-if set has over {checks.MAX_DEVICES:,} devices; plan for at most that many")

    args.profile = [profile_path(path) for path in args.profile]
    uses = [_parse_use(text, checks.MAX_DEVICES) for text in args.use]
    whole = {path.resolve(): path for path in args.profile}
    both = [(whole[path.resolve()], device) for path, device, _ in uses if path.resolve() in whole]
    if both:  # a profile named alone means all its devices: with its --use picks, they came twice
        path, device = both[0]
        raise CLIError(
            f"{path} is given whole (all its devices) and again in --use {path}:{device}, so its devices would "
            f"count twice; give it one way: only --use picks (--use {path}:{device}*N ...), or the whole file"
        )
    picks: dict[tuple[Path, str], int] = {}
    for path in args.profile:
        if path not in loaded:
            loaded[path] = Profile.load(path)
        wanted = loaded[path].devices
        if args.devices is not None:
            from ..devices import device_list

            wanted = device_list(args.devices)
            if not wanted:
                raise CLIError(f"--devices {args.devices!r} names no device; pick some of {loaded[path].devices}")
        for device in wanted:
            pick(path, device, 1)
    for use in uses:
        pick(*use)
    parts = [(loaded[path], name, n) for (path, name), n in picks.items()]
    combined = Profile.merge(parts)
    whatif = len(loaded) > 1 or bool(args.use)
    plan = solver.solve(combined, args.batch_size, accumulate=args.accumulate)
    fingerprints = {p.model.get("fingerprint") for p in loaded.values()}
    params = [p.model.get("parameter_bytes") for p in loaded.values()]
    known = [float(b) for b in params if b is not None]
    largest = max(known) if known and len(known) == len(params) else None  # the model's, when every profile has it
    comm = None
    if args.link_gbps:
        if largest is None:
            raise CLIError(
                "--link-gbps needs the model's size, which these profiles do not record; "
                "re-profile with this hetsplit version"
            )
        comm = solver.allreduce_time(largest, sum(1 for s in plan.sizes if s > 0), args.link_gbps)
    if args.json:
        doc = plan.to_dict()
        if comm is not None:
            doc["allreduce_time"] = comm
        print(json.dumps(doc, indent=1))
        return 0
    rows: list[list[str]] = []
    for name, size, t, extra in zip(plan.devices, plan.sizes, plan.times, plan.extrapolated):
        notes = [n for n, on in (("emulated", name in plan.emulated), ("beyond measured sizes", extra)) if on]
        micro = plan.micro_batches[len(rows)]
        if len(micro) > 1:  # run as micro-batches with gradient accumulation
            notes.insert(
                0, f"{len(micro)} micro-batches of {micro[-1]}" + (f"-{micro[0]}" if micro[0] != micro[-1] else "")
            )
        rows.append([name, str(size), f"{size / plan.batch_size:.1%}", fmt_time(t), ", ".join(notes)])
    model = next(iter(loaded.values())).model.get("name", "model")
    sources = ", ".join(f"{path} ({p.host}, {p.created[:10]})" for path, p in loaded.items())
    print(f"{'what-if ' if whatif else ''}split of a batch of {plan.batch_size} ({model}; profiles: {sources})")
    if len(fingerprints) > 1:
        print("warning: the profiles are of different models; their times do not add up to one job")
    for path, prof in loaded.items():
        for note in _notes(path, prof):
            print(note)
    if len(rows) > _MAX_ROWS:
        hidden = rows[_MAX_ROWS:]
        rows = [*rows[:_MAX_ROWS], [f"... {len(hidden):,} more", str(sum(int(r[1]) for r in hidden)), "", "", ""]]
    print(table(rows, ["device", "samples", "share", "predicted time", "note"]))
    print(f"\npredicted compute per step {fmt_time(plan.step_time)}")

    def exchange(sizes: list[int], participants: int | None = None) -> float:
        if comm is None or largest is None:
            return 0.0
        n = participants if participants is not None else sum(1 for s in sizes if s > 0)
        return solver.allreduce_time(largest, n, args.link_gbps)

    if comm is not None and largest is not None:
        print(
            f"predicted gradient all-reduce {fmt_time(comm)} ({largest / 2**20:.1f} MiB over "
            f"{args.link_gbps:g} Gbit/s, ring, not overlapped); step {fmt_time(plan.step_time + comm)} at most"
        )
    elif len(plan.devices) > 1:
        print("gradient exchange not included (give --link-gbps to estimate it)")
    total = plan.step_time + (comm or 0.0)
    even_total = plan.even_time + exchange(plan.sizes, len(plan.devices))
    caps = combined.memory_caps()
    if math.isfinite(even_total):
        print(f"even split: {fmt_time(even_total)} -> balanced is {even_total / total:.2f}x faster")
    else:
        print(f"even split: {even_note(plan, caps)} -> only an uneven split runs")
    if math.isfinite(plan.single_time):
        print(
            f"{plan.single_device} alone: {fmt_time(plan.single_time)} (no exchange) -> balanced is "
            f"{plan.single_time / total:.2f}x "
            + ("faster" if plan.single_time >= total else "as fast: adding devices loses")
        )
    else:
        print(f"one device alone: none holds the whole batch ({alone_note(plan, caps)})")
    for note in plan.noise_notes(step=total, even=even_total, single=plan.single_time):
        print(note)
    if whatif and len(parts) > 1:
        _print_worth(
            combined, parts, args.batch_size, total, exchange, with_comm=comm is not None, accumulate=args.accumulate
        )
    print("\nThese are predictions from the profiles' fitted curves, not measurements.")
    return 0


def _notes(path: Path, prof: Profile) -> list[str]:
    """Lines on what a profile's times rest on: example timings, or this machine under another torch.

    torch's kernels change between versions, so a profile measured here under another
    torch may no longer hold; a profile of another machine records that machine's torch,
    which is fine. The example profiles shipped with hetsplit (``example-*.json``) are made up for the guide.
    """
    import platform

    import torch

    notes = []
    if prof.source.startswith("example"):
        notes.append(f"note: {path} holds example timings, not measurements; 'hetsplit profile' measures yours")
    then = prof.versions.get("torch")
    if then and then != torch.__version__ and prof.host == platform.node():
        notes.append(
            f"note: {path} was measured on this machine under torch {then}, which is now torch "
            f"{torch.__version__}; its times may be off — re-profile ('hetsplit profile') to refresh it"
        )
    return notes


def _print_worth(
    combined: Profile,
    parts: Sequence[tuple[Profile, str, int]],
    batch_size: int,
    total: float,
    exchange: Callable[[list[int]], float],
    *,
    with_comm: bool,
    accumulate: bool = False,
) -> None:
    """For each addition, the step without it (and, for copies, without one of them).

    Each line is one solve over a subset of the combined profile's devices (no re-merging):
    linear in the number of additions, and copies of one device share their answer, since
    removing any one of them is the same.
    """
    from ..planning import solver

    print("\nwhat each addition is worth (step without it" + (", all-reduce included):" if with_comm else "):"))
    names, start = combined.devices, 0
    for k, (prof, device, n) in enumerate(parts):
        end = start + n
        if k == _MAX_WORTH:
            print(f"  ... {len(parts) - k:,} more additions not evaluated (at most {_MAX_WORTH} are)")
            break
        label = f"{device}{'*' + str(n) if n > 1 else ''} of {prof.host}"
        cases = [(f"without {label}", names[:start] + names[end:])]
        if n > 1:  # every copy is worth the same: one solve says it for all of them
            one = f"without one {device} of {prof.host} (any of the {n} copies)"
            cases.append((one, names[: end - 1] + names[end:]))
        for text, rest_names in cases:
            rest = solver.solve(combined, batch_size, devices=rest_names, accumulate=accumulate)
            t = rest.step_time + exchange(rest.sizes)
            print(f"  {text}: {fmt_time(t)} ({t / total:.2f}x the full set's step)")
        start = end
