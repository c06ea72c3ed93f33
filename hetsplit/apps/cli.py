"""CLI: `hetsplit demo | devices | profile | plan | bench | show` on top of the library."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .commands import DTYPES, CLIError, cmd_bench, cmd_demo, cmd_devices, cmd_profile, cmd_show
from .launch import cmd_launch
from .whatif import cmd_plan


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(kind: type, *, zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: a positive (or with ``zero``, non-negative) ``int`` or ``float``, naming the value."""
    if kind is int:
        noun = "a whole number >= 0" if zero else "a positive integer"
    else:
        noun = "a number >= 0" if zero else "a positive number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not ((value > 0 or (zero and value == 0)) and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        return value

    return parse


_positive_int, _positive_float, _count = _positive(int), _positive(float), _positive(int, zero=True)
_non_negative_float = _positive(float, zero=True)


def _budget(parser: argparse.ArgumentParser, default: float, *, removed: str | None = None) -> None:
    """``--budget SECONDS``, one spelling for every command; ``removed``, a former spelling, is refused naming it."""
    parser.add_argument(
        "--budget",
        dest="budget",
        type=_positive_float,
        default=default,
        help=f"seconds to spend profiling the devices (default {default:g})",
    )
    if removed is not None:
        _removed(parser, removed, "use --budget SECONDS")


def _model(parser: argparse.ArgumentParser, default: str) -> None:
    """``--model`` and ``--input-shape``, as ``demo``, ``profile`` and ``bench`` take them."""
    parser.add_argument(
        "--model",
        default=default,
        help=f"built-in model (cnn, lenet, resnet18, mlp) or package.module:factory (default {default})",
    )
    parser.add_argument("--input-shape", type=_ints, help="shape of one sample, e.g. 3,32,32 (for your own model)")


def _threads(parser: argparse.ArgumentParser) -> None:
    """``--threads``, the one CPU-thread rule of ``demo``, ``profile`` and ``bench`` (``timing.cpu_threads``)."""
    parser.add_argument(
        "--threads",
        type=_positive_int,
        help="torch intra-op CPU threads (default: 1 when every device is the CPU, real or emulated, "
        "the steadiest for emulated CPUs; else torch's choice)",
    )


def _removed(parser: argparse.ArgumentParser, option: str, instead: str) -> None:
    """A former option: refused in one line saying what replaced it (argparse's own error would not)."""
    parser.add_argument(option, action=_Removed, nargs="?", help=argparse.SUPPRESS, const=instead, default=None)


class _Removed(argparse.Action):
    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        parser.error(f"{option} was removed: {self.const}")


def build_parser() -> argparse.ArgumentParser:
    """The ``hetsplit`` argument parser, one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="hetsplit",
        description="Split training batches unevenly across mixed devices so that all finish together.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "demo",
        help="a one-minute demo: profile, then train even vs balanced, and a verdict",
        description="Profile a built-in model on every local device (plus an emulated cpu@0.25 when "
        "there is only one), train it on each device alone, on the even split and on the balanced "
        "split in threads, then the balanced split in processes (torchrun ranks), and print which wins. "
        "Synthetic data.",
    )
    p.add_argument("--devices", help="comma-separated devices (default: every local device, plus cpu@0.25 if only one)")
    _model(p, "cnn")
    p.add_argument("--batch-size", type=_positive_int, default=128, help="samples per step (default 128)")
    p.add_argument("--steps", type=_positive_int, default=15, help="timed steps per configuration (default 15)")
    _budget(p, 10.0)
    _threads(p)
    p.add_argument("--json", type=Path, help="also write the results to this JSON file (for 'hetsplit show')")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--threads-only", action="store_true", help="skip the process engine (torchrun ranks)")

    p = sub.add_parser(
        "devices",
        help="list usable devices",
        description="List the devices this machine can train on and what a profile depends on: name, memory, "
        "driver and, for GPUs, the UUID that matches stored profiles across CUDA_VISIBLE_DEVICES changes.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser(
        "profile",
        help="time a training step on each device and store the profile",
        description="Time real training steps (forward, loss, backward) of a model on each device over a ladder of "
        "batch sizes, find memory caps, save the profile (versioned JSON) and show the split of --batch-size.",
    )
    p.add_argument(
        "--devices",
        help="comma-separated devices, e.g. cuda:0,cpu or cpu,cpu@0.25 "
        "(default: every local device, plus an emulated cpu@0.25 when there is only one)",
    )
    _model(p, "lenet")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter and input dtype (default float32)")
    p.add_argument(
        "--vocab-size",
        type=_positive_int,
        help="your model takes token ids: inputs are integers drawn from 0..N-1 (int64, whatever --dtype)",
    )
    p.add_argument("--batch-sizes", type=_ints, help="the ladder of batch sizes (default 2,4,8,...,256)")
    p.add_argument("--batch-size", type=_positive_int, default=256, help="batch to show the split of (default 256)")
    _budget(p, 30.0)
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed steps per batch size (default 5)")
    p.add_argument("--out", type=Path, help="profile file to write (default: a new file in the profile directory)")
    p.add_argument("--profile-dir", type=Path, help="profile directory (default $HETSPLIT_PROFILE_DIR or ./profiles)")
    _threads(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "bench",
        help="train on one device, the even split and the balanced split; compare",
        description="Compare the fastest single device, the even split and the balanced split; "
        "with --rebalance, train with online rebalancing from the even split instead.",
    )
    p.add_argument(
        "--devices",
        help="two or more devices (default cpu,cpu@0.25; with --change DEV=..., cpu and DEV)",
    )
    _model(p, "lenet")
    p.add_argument("--batch-size", type=_positive_int, default=256, help="samples per step (default 256)")
    p.add_argument(
        "--steps", type=_positive_int, help="timed steps per configuration (default 20; 120 with --rebalance)"
    )
    p.add_argument(
        "--mode",
        choices=("gather", "local"),
        default="gather",
        help="gather: loss on gathered outputs (DataParallel); local: loss per device (default gather)",
    )
    _budget(p, 20.0, removed="--profile-budget")
    _removed(p, "--sync", "leave it out (replicas take the parameters one way now)")
    p.add_argument(
        "--calibrate",
        type=_count,
        default=5,
        help="balanced steps that calibrate the plan inside the split before timing (default 5; 0: off)",
    )
    p.add_argument(
        "--calibrate-seconds",
        type=_non_negative_float,
        default=2.0,
        help="calibrate on, --calibrate steps at a time, until they took this long (default 2; 0: just --calibrate)",
    )
    _threads(p)
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="train --steps steps (default then 120) with online rebalancing, starting from the even split",
    )
    p.add_argument(
        "--every", type=_positive_int, default=5, help="with --rebalance: steps between re-solves (default 5)"
    )
    p.add_argument(
        "--change",
        metavar="DEVICE=SPEED@STEP",
        help="with --rebalance: an emulated device's new speed from a step on, e.g. cpu@1=0.25@30",
    )

    p = sub.add_parser(
        "plan",
        help="solve the split of a batch for stored profiles; what-if for devices you don't have together",
        description="Solve the split of a batch for one or more profiles. With several profiles (from different "
        "machines) or --use, plan a combined set of devices you may not have together yet, with an estimate of the "
        "gradient all-reduce over a link of --link-gbps. Every figure is a prediction from the profiles' curves.",
    )
    p.add_argument(
        "profile", type=Path, nargs="*", help="profile files written by 'hetsplit profile' (all their devices)"
    )
    p.add_argument(
        "--use",
        action="append",
        default=[],
        metavar="FILE:DEVICE[*N]",
        help="one device of a profile, N times (e.g. profiles/a.json:cuda:0*8); repeatable",
    )
    p.add_argument("--batch-size", type=_positive_int, required=True, help="samples per step")
    p.add_argument("--devices", help="with one profile: use only these of its devices, in this order")
    p.add_argument(
        "--link-gbps",
        type=_positive_float,
        help="bandwidth of the slowest link between the devices (Gbit/s), to estimate the all-reduce "
        "(default: no estimate)",
    )
    p.add_argument(
        "--accumulate",
        action="store_true",
        help="let a device with a memory cap take more than its cap, run as micro-batches (gradient accumulation)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")

    p = sub.add_parser(
        "show",
        help="draw a profile (curves, memory caps, split) or a bench (step timeline) to PNG",
        description="Draw a profile file (step time and throughput against batch size, memory caps, "
        "the split) or a results file of 'hetsplit bench/demo --json' (one step per device, even vs "
        "balanced). Needs matplotlib: pip install 'hetsplit[plot]'.",
    )
    p.add_argument("file", type=Path, help="a profile file, or a bench results file")
    p.add_argument("--plan", type=Path, help="a plan file (from 'hetsplit plan --json > FILE') to draw as the split")
    p.add_argument("--batch-size", type=_positive_int, help="draw the split of this batch (default: largest measured)")
    p.add_argument("--out", type=Path, help="picture to write (default: FILE with .png)")

    p = sub.add_parser(
        "launch",
        help="run a training script in one process per device (torchrun underneath)",
        description="Start SCRIPT once per listed device through torchrun; in the script, "
        "hetsplit.distributed.init() returns that process's device and joins the process group "
        "(NCCL when every device is a GPU, else gloo). --devices lists one device per global rank, the same "
        "on every node; node R runs the R-th slice.",
    )
    p.add_argument("--devices", required=True, help="one device per process, e.g. cuda:0,cuda:1,cpu or cpu,cpu@0.25")
    p.add_argument(
        "--nnodes", default="1", help="number of nodes (default 1), or MIN:MAX for nodes that join and leave"
    )
    p.add_argument("--max-restarts", type=int, default=0, help="times torchrun restarts the job (default 0)")
    p.add_argument(
        "--rdzv-conf",
        default="",
        help="torchrun's rendezvous settings, KEY=VALUE,... (default: with MIN:MAX, a 1 s "
        "heartbeat and 2 s for late nodes)",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node (several nodes)")
    p.add_argument("--rdzv-backend", default="c10d", help="torchrun's rendezvous backend (default c10d)")
    # Optional to argparse, checked in main: a missing script was "required: script, script_args".
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(usage_error=p.error)
    return parser


_COMMANDS = {
    "demo": cmd_demo,
    "devices": cmd_devices,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "bench": cmd_bench,
    "show": cmd_show,
    "launch": cmd_launch,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (errors are one line on stderr, status 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "launch" and not args.script:
        args.usage_error("give the training script to run, e.g. hetsplit launch --devices cpu,cpu@0.25 train.py")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("hetsplit: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        if args.debug:
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"hetsplit {args.command}: error: {message}", file=sys.stderr)
        return 1


def run() -> None:
    """The ``hetsplit`` command: :func:`main`, then exit with its status.

    After Ctrl-C the one line is printed and the process ends at once with 130: letting
    the interpreter finalise after an interrupt ended it by SIGINT (status -2) once
    under load, whatever ``main`` returned.
    """
    status = main()
    if status == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(status)


if __name__ == "__main__":
    run()
