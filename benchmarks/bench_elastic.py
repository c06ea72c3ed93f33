"""Benchmark elastic training (torchft, or torchrun's restarts): a device leaves and joins again; steps lost, recovery.

Run: python benchmarks/bench_elastic.py --engine torchft --devices cpu,cpu@0.5,cpu@0.25 --steps 40
     --leave 2@12 --join 2@26 [--json OUT]        (--engine torchrun: the same events, the same JSON)

``--engine torchrun``: one ``hetsplit launch --nnodes 1:N`` agent per device (a node each) at a
rendezvous store this process hosts; each start re-plans with ``hd.Checkpoint`` from the stored
curves (its ``replan_seconds`` reported), resumes from the checkpoint written after every step
(``checkpoint_load_seconds``) and trains on; a leave kills the node's agent and rank by process
id once step K has committed, a join starts a new agent once step M has. The seconds to the
first commit include the whole restart: the dead node's heartbeats missed, the rendezvous, the
ranks' interpreter and imports, the re-plan and the checkpoint loaded.

The benchmark starts the torchft lighthouse itself (over gloo, on this machine) and one
process per device, each an ``ElasticGroup`` training a float64 MLP on synthetic global
batches. ``--leave G@K``: group G is killed by its process id (SIGKILL) once step K has
committed. ``--join G@M``: a new process for group G, started earlier and waiting with
its imports done (an interpreter's start is not torchft's to pay), is told to join once
step M has committed. The profile the groups plan from is measured before the run (the
``cpu`` step at two batch sizes, each emulated device's declared speed applied), as a
stored profile would be: nothing is measured on the hot path.

Reported (``--json``): each committed step's members and shares; ``steps_lost`` (global
batches never committed: the goal is 0) and ``steps_rerun`` (discarded attempts run again
on the same global batch); the seconds from the kill, and from the join signal, to the
first committed step after it (heartbeat timeout included); throughput (samples/s over the
steady committed steps of each phase, the step after an event left out) beside
``ideal_during``: the throughput before the leave scaled by the present groups' summed
speed over all groups'; ``max_param_diff_vs_plain``: group 0's parameters against one plain
process over the same global batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

IN, HIDDEN, CLASSES, BATCH = 256, 1024, 10, 384


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic global batch ``step`` (the same on every group and in the plain run)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def _profile(devices: list[str]) -> dict[str, list[tuple[int, float]]]:
    """The ``cpu`` step timed at two sizes here, each device's curve its declared speed's share of it."""
    from hetsplit.devices import parse_device

    torch.set_num_threads(1)  # as each group runs (OMP_NUM_THREADS=1)
    model, _ = _model()
    times = {}
    for b in (16, BATCH):
        x, y = _batch(0)
        for _ in range(3):
            _step(model, x[:b], y[:b])
        start = time.perf_counter()
        for _ in range(10):
            _step(model, x[:b], y[:b])
        times[b] = (time.perf_counter() - start) / 10
    return {d: [(b, t / parse_device(d).speed) for b, t in times.items()] for d in dict.fromkeys(devices)}


def worker(a: argparse.Namespace) -> None:
    """One replica group: wait for ``--go`` if given, then train, logging each committed step as a JSON line."""
    from hetsplit.devices import parse_device
    from hetsplit.distributed.elastic import ElasticGroup
    from hetsplit.planning import Profile

    devices = a.devices.split(",")
    dev = parse_device(devices[a.group])
    model, opt = _model()
    prof = Profile.from_measurements(json.loads(Path(a.profile).read_text()))
    while a.go and not os.path.exists(a.go):  # the joiner: imports done, told when to join
        time.sleep(0.01)
    joined = time.time()
    group = ElasticGroup(
        model,
        opt,
        batch_size=BATCH,
        devices=devices,
        group=a.group,
        lighthouse=a.lighthouse,
        profile=prof,
        timeout=30,
        quorum_timeout=120,
    )
    if not a.go:  # the first groups start together: every one is in step 0's quorum
        Path(f"{a.log}.ready").touch()
        while len(list(Path(a.log).parent.glob("*.ready"))) < len(devices):
            time.sleep(0.01)
    with open(a.log, "a", buffering=1) as log:  # a line per step: the benchmark reads it while we run
        log.write(json.dumps({"joined": joined}) + "\n")
        tries = 0
        while group.step < a.steps:
            step = group.begin()
            x, y = group.local_batch(_batch(step))
            with dev.throttle():
                _step(model, x, y)
            tries += 1
            if group.commit():
                log.write(
                    json.dumps(
                        {
                            "step": step,
                            "t": time.time(),
                            "members": group.members,
                            "sizes": list(group.plan.sizes),
                            "tries": tries,
                        }
                    )
                    + "\n"
                )
    torch.save([p.detach() for p in model.parameters()], a.log + ".pt")
    group.shutdown()


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _event(text: str) -> tuple[int, int]:
    g, _, k = text.partition("@")
    return int(g), int(k)


def _throughput(steps: list[dict], lo: int, hi: int) -> float | None:
    """Samples per second over committed steps lo+1..hi (their commit times; the step at lo starts the clock).

    ``None`` (JSON ``null``) where the phase has no such step: a joiner that arrived at the run's end.
    """
    t = {s["step"]: s["t"] for s in steps}
    if lo not in t or hi not in t or hi <= lo:
        return None
    return BATCH * (hi - lo) / (t[hi] - t[lo])


def _summary(a: argparse.Namespace, steps: list[dict], params: Path, events: dict, first: int) -> dict:
    """What both engines report: the committed steps, the seconds to the first commit after each event,
    the parameters against one plain process over the same global batches, each phase's throughput.

    ``events``: ``leave`` and ``join`` (group, step), ``t_leave``/``t_join`` and the first committed
    step after each (``after_leave``/``after_join``); ``first``: the step whose commit starts "before".
    """
    from hetsplit.devices import parse_device

    (leave_g, leave_k), (_, join_m) = events["leave"], events["join"]
    after_leave, after_join = events["after_leave"], events["after_join"]
    model, opt = _model()
    for k in range(a.steps):
        opt.zero_grad()
        _step(model, *_batch(k))
        opt.step()
    got = torch.load(str(params) + ".pt")
    diff = max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), got))
    speeds = [parse_device(d).speed for d in a.devices.split(",")]
    before = _throughput(steps, first, leave_k)
    present = sum(v for i, v in enumerate(speeds) if i != leave_g) / sum(speeds)
    return {
        "steps": [
            {"step": s["step"], "members": s["members"], "sizes": s["sizes"], "global_batch": sum(s["sizes"])}
            for s in steps
        ],
        "seconds_to_first_commit_after_leave": round(after_leave["t"] - events["t_leave"], 3),
        "seconds_to_first_commit_after_join": round(after_join["t"] - events["t_join"], 3),
        "max_param_diff_vs_plain": diff,
        "throughput": {
            "before": before,
            "during": _throughput(steps, after_leave["step"] + 1, join_m),
            "after": _throughput(steps, after_join["step"] + 1, a.steps - 1),
            "ideal_during": before * present if before is not None else None,
        },
    }


def run_torchft(a: argparse.Namespace, out: Path) -> dict:
    from hetsplit.distributed.elastic import lighthouse

    devices = a.devices.split(",")
    (out / "profile.json").write_text(json.dumps(_profile(devices)))
    (leave_g, leave_k), (join_g, join_m) = _event(a.leave), _event(a.join)
    env = {**os.environ, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
    lh = lighthouse(1, heartbeat_ms=a.heartbeat_ms)

    def start(g: int, tag: str, go: str | None = None) -> subprocess.Popen:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--group",
            str(g),
            "--devices",
            a.devices,
            "--steps",
            str(a.steps),
            "--lighthouse",
            lh.address(),
            "--profile",
            str(out / "profile.json"),
            "--log",
            str(out / f"{tag}.jsonl"),
        ] + (["--go", go] if go else [])
        return subprocess.Popen(cmd, env=env)

    procs = {g: start(g, f"g{g}") for g in range(len(devices))}
    joiner = start(join_g, f"g{join_g}b", str(out / "join"))  # waits, imports done
    main = out / "g0.jsonl"

    def committed() -> int:
        steps = [s for s in _read(main) if "step" in s]
        return steps[-1]["step"] if steps else -1

    while committed() < leave_k:
        time.sleep(0.01)
    os.kill(procs[leave_g].pid, signal.SIGKILL)
    t_leave = time.time()
    while committed() < join_m:
        time.sleep(0.01)
    t_join = time.time()
    (out / "join").touch()
    for p in [*procs.values(), joiner]:
        if p.pid != procs[leave_g].pid:
            p.wait(timeout=600)
    lh.shutdown()
    procs[leave_g].wait()

    steps = [s for s in _read(main) if "step" in s]
    every = {s["step"] for f in out.glob("*.jsonl") for s in _read(f) if "step" in s}  # committed by any group
    events = {
        "leave": (leave_g, leave_k),
        "join": (join_g, join_m),
        "t_leave": t_leave,
        "t_join": t_join,
        "after_leave": next(s for s in steps if s["t"] > t_leave),
        "after_join": next(s for s in steps if join_g in s["members"] and s["t"] > t_join),
    }
    return {
        **_summary(a, steps, main, events, 2),
        "steps_lost": a.steps - len(every),
        "steps_rerun": steps[-1]["tries"] - len(steps),
    }


def rank_worker(a: argparse.Namespace) -> None:
    """One torchrun rank (``--engine torchrun``): re-plan from stored curves, resume, train, checkpoint each step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hetsplit.distributed as hd
    from hetsplit.planning import Profile

    started = time.time()
    dev = hd.init(timeout=30)
    rank = dist.get_rank()
    members = [None] * dist.get_world_size()
    dist.all_gather_object(members, a.group)
    model, opt = _model()
    ddp = DistributedDataParallel(model)
    ckpt = hd.Checkpoint(Path(a.log).parent / "ckpt")
    t0 = time.perf_counter()
    prof = Profile.from_measurements(json.loads(Path(a.profile).read_text()))  # the first start's stored profile
    x, y = _batch(0)
    plan = ckpt.plan(ddp, x[:8], BATCH, device=dev, target=y[:8], profile=prof, calibrate=0, quiet=True)
    t1 = time.perf_counter()
    step = ckpt.load(ddp, opt)
    t2 = time.perf_counter()
    with open(a.log, "a", buffering=1) as log:
        pids = _gathered(os.getpid())
        if rank == 0:
            started = {"start": started, "from": step, "stored": ckpt.stored, "replan": t1 - t0, "load": t2 - t1}
            log.write(json.dumps({**started, "members": members, "pids": pids}) + "\n")
        while step < a.steps:
            opt.zero_grad()
            xb, yb = hd.local_batch(_batch(step), plan, check=False)
            with dev.throttle():
                _step(ddp, xb, yb)
            opt.step()
            step += 1
            ckpt.save(step, ddp, opt)
            if rank == 0:
                record = {"step": step - 1, "t": time.time(), "members": members, "sizes": list(plan.sizes)}
                log.write(json.dumps(record) + "\n")
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], a.log + ".pt")
    dist.destroy_process_group()


def _gathered(value: object) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_torchrun(a: argparse.Namespace, out: Path) -> dict:
    """Agents of ``hetsplit launch --nnodes 1:N`` (one device each) at a rendezvous store hosted here."""
    from torch.distributed import TCPStore

    devices = a.devices.split(",")
    (out / "profile.json").write_text(json.dumps(_profile(devices)))
    (leave_g, leave_k), (join_g, join_m) = _event(a.leave), _event(a.join)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    log = out / "steps.jsonl"

    def start(g: int, go: str = "") -> subprocess.Popen:
        # Not --log: torchrun's parser refuses an abbreviation of its own --log-dir among the script's arguments.
        cmd = [
            sys.executable, __file__, "--agent", go, "launch", "--nnodes", f"1:{len(devices)}",
            "--max-restarts", "10", "--devices", devices[g], "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false", __file__, "--rank-worker", "--group", str(g), "--steps", str(a.steps),
            "--profile", str(out / "profile.json"), "--jsonl", str(log),
        ]  # fmt: skip
        with open(out / f"agent{g}-{time.time_ns()}.out", "w") as sink:
            return subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)

    def committed() -> int:
        failed = [g for g, p in agents.items() if p.poll() not in (None, 0) and g not in gone]
        if failed:
            raise RuntimeError(f"agent {failed[0]} failed: see {out}/agent{failed[0]}-*.out")
        steps = [s for s in _read(log) if "step" in s]
        return steps[-1]["step"] if steps else -1

    gone: set[int] = set()
    agents = {g: start(g) for g in range(len(devices))}
    agents[len(devices)] = start(join_g, str(out / "join"))  # waits, imports done (as torchft's joiner)
    while committed() < leave_k:
        time.sleep(0.01)
    rank_pid = [s for s in _read(log) if "pids" in s][-1]
    worker = rank_pid["pids"][rank_pid["members"].index(leave_g)]
    for pid in (agents[leave_g].pid, worker):  # the node goes: its agent and its rank
        os.kill(pid, signal.SIGKILL)
    t_leave = time.time()
    gone.add(leave_g)
    agents[leave_g].wait()
    while committed() < join_m:
        time.sleep(0.01)
    t_join = time.time()
    (out / "join").touch()
    codes = [p.wait(timeout=900) for g, p in agents.items() if g != leave_g]

    lines = _read(log)
    last = {s["step"]: s for s in lines if "step" in s}  # a step run again after a restart: its last commit
    steps = [last[k] for k in sorted(last)]
    events = {
        "leave": (leave_g, leave_k),
        "join": (join_g, join_m),
        "t_leave": t_leave,
        "t_join": t_join,
        "after_leave": next(s for s in steps if s["t"] > t_leave and leave_g not in s["members"]),
        "after_join": next(s for s in steps if s["t"] > t_join and join_g in s["members"]),
    }
    full = next(s["step"] for s in steps if len(s["members"]) == len(devices))  # every node has met
    starts = [s for s in lines if "start" in s and s["from"] > 0]
    return {
        **_summary(a, steps, log, events, full + 2),
        "steps_lost": a.steps - len(steps),
        "steps_rerun": sum("step" in s for s in lines) - len(steps),
        "agents_exit_codes": codes,
        "replan_seconds": [round(s["replan"], 3) for s in starts],
        "replanned_from_stored_curves": all(s["stored"] for s in starts),
        "checkpoint_load_seconds": [round(s["load"], 3) for s in starts],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["torchft", "torchrun"], default="torchft")
    ap.add_argument("--devices", default="cpu,cpu@0.5,cpu@0.25")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--leave", default="2@12")
    ap.add_argument("--join", default="2@26")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="a folder for the groups' logs (default: a temporary one)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    for name in ("--group", "--lighthouse", "--profile", "--log", "--go"):
        ap.add_argument(name, type=int if name == "--group" else str, help=argparse.SUPPRESS)
    ap.add_argument("--agent", metavar="GO", help=argparse.SUPPRESS)
    ap.add_argument("launch", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.agent is not None:  # an agent: hetsplit launch, once the file named exists (if one is)
        from hetsplit.apps import cli, launch  # noqa: F401 -- imported before the wait, as a standby joiner would be

        while a.agent and not os.path.exists(a.agent):
            time.sleep(0.01)
        raise SystemExit(cli.main(a.launch))
    if a.rank_worker:
        a.log = a.jsonl
        return rank_worker(a)
    import tempfile

    out = Path(a.out or tempfile.mkdtemp(prefix="bench_elastic_"))
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "engine": a.engine,
        "devices": a.devices,
        "batch": BATCH,
        "host": platform.node(),
        "load": os.getloadavg(),
        **(run_torchft(a, out) if a.engine == "torchft" else run_torchrun(a, out)),
    }
    text = json.dumps(result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
