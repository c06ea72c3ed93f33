"""Faults with real processes: a two-rank gloo job of examples/torchrun_ddp.py, one rank killed or stopped.

Each rank is started directly (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so that the test can signal one rank by its pid and read each rank's own
stderr; torchrun's agent would stop the survivor itself as soon as a child dies. The
survivor must end in exactly one line naming the step, the failed rank and the timeout,
and exit 1 at once for a dead peer, at the process group's timeout for a hung one.
"""

import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, subprocess_env

import hetsplit.distributed as hd
from hetsplit.distributed._group import as_error, is_failure
from hetsplit.distributed.setup import rank_device

EXAMPLE = ROOT / "examples" / "torchrun_ddp.py"
TIMEOUT = 5  # the process group's timeout in these jobs, seconds
# Serial: two tests time a real process group's timeout (gloo's clock, not the test's), run alone, not
# beside the other pytest worker. Their margins: a dead peer is noticed within TIMEOUT (at once: the
# survivor's socket closes; the rest is its one-line exit), and a hung one after TIMEOUT - 1 s (the
# timeout itself, never sooner) and before TIMEOUT + 4 s (the survivor's exit under load).
pytestmark = pytest.mark.serial
TRAIN = [
    "--equal",
    "--threads",
    "1",
    "--data",
    "synthetic",
    "--train-size",
    "512",
    "--test-size",
    "64",
    "--batch-size",
    "64",
    "--epochs",
    "1000",
    "--log-every",
    "5",
    "--timeout",
    str(TIMEOUT),
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, args, world=2):
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        out = open(tmp_path / f"rank{rank}.out", "w")  # noqa: SIM115 - closed with the process
        err = open(tmp_path / f"rank{rank}.err", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, str(EXAMPLE), *args],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=out,
                stderr=err,
                cwd=tmp_path,
            )
        )
        out.close()
        err.close()
    return procs


def _read(tmp_path, rank, stream):
    return (tmp_path / f"rank{rank}.{stream}").read_text()


def _stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL also ends a stopped process
            p.wait(timeout=30)


def _wait_for_training(tmp_path, procs, line="step 10:", limit=90):
    """Wait until rank 0 has printed ``line`` (both ranks are then past step 9)."""
    deadline = time.monotonic() + limit
    while line not in _read(tmp_path, 0, "out"):
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        assert not dead, f"rank {dead} ended before training: {_read(tmp_path, dead[0], 'err')[-2000:]}"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("victim", "weighting"),
    [
        (1, ["--weighting", "hook"]),  # fails inside the comm hook's future, in loss.backward()
        (0, ["--weighting", "none", "--rebalance", "2"]),  # the store's host; DDP's own all-reduce, the rebalancer
    ],
)
def test_a_killed_rank_ends_the_survivor_in_one_line_at_once(tmp_path, victim, weighting):
    procs = _start(tmp_path, ["--devices", "cpu,cpu", *TRAIN, *weighting])
    survivor = 1 - victim
    try:
        _wait_for_training(tmp_path, procs)
        start = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        code = procs[survivor].wait(timeout=TIMEOUT + 30)
        seconds = time.monotonic() - start
    finally:
        _stop_all(procs)
    err = _read(tmp_path, survivor, "err").strip().splitlines()
    assert code == 1
    assert len(err) == 1, err  # one line, no gloo traceback
    found = re.fullmatch(rf"torchrun_ddp\.py: DistributedError: rank {survivor}, step (\d+): .* failed: (.*)", err[0])
    assert found, err[0]
    assert int(found.group(1)) >= 9  # the step it was in: rank 0 had printed step 10
    assert found.group(2).startswith(f"rank {victim} died or lost its connection (")
    assert f"process-group timeout {TIMEOUT} s" in err[0]
    assert seconds < TIMEOUT, seconds  # a dead peer is noticed at once, not at the timeout


def test_a_stopped_rank_ends_the_survivor_in_one_line_at_the_timeout(tmp_path):
    procs = _start(tmp_path, ["--devices", "cpu,cpu@0.5", *TRAIN, "--weighting", "outputs"])
    try:
        _wait_for_training(tmp_path, procs)
        start = time.monotonic()
        procs[1].send_signal(signal.SIGSTOP)  # hangs: its sockets stay open
        code = procs[0].wait(timeout=TIMEOUT + 30)
        seconds = time.monotonic() - start
        assert procs[1].poll() is None  # still stopped: only the timeout could end rank 0
    finally:
        _stop_all(procs)
    err = _read(tmp_path, 0, "err").strip().splitlines()
    assert code == 1
    assert len(err) == 1, err
    found = re.fullmatch(r"torchrun_ddp\.py: DistributedError: rank 0, step (\d+): training step failed: (.*)", err[0])
    assert found, err[0]
    assert int(found.group(1)) >= 9
    assert found.group(2).startswith(f"rank 1 did not answer within the {TIMEOUT} s timeout: it hangs")
    assert TIMEOUT - 1 < seconds < TIMEOUT + 4, seconds


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("cpu,cpu@0.25,cpu@0.5", "3 devices ['cpu', 'cpu@0.25', 'cpu@0.5'] for 2 processes"),
        ("cpu", "1 device ['cpu'] for 2 processes"),
    ],
)
def test_a_device_list_of_another_length_than_the_world_fails_on_every_rank(tmp_path, devices, expected):
    procs = _start(tmp_path, ["--devices", devices, *TRAIN])
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        _stop_all(procs)
    assert codes == [1, 1]
    for rank in range(2):
        err = _read(tmp_path, rank, "err").strip().splitlines()
        assert err == [
            f"torchrun_ddp.py: ValueError: rank {rank}: --devices {devices}: {expected}; list exactly one device "
            "per process (repeat a device to run several processes on it, e.g. 'cpu,cpu@0.25')"
        ]
        assert _read(tmp_path, rank, "out") == ""  # before any work: no data, no plan, no step


def test_rank_device_is_strict(monkeypatch):
    assert rank_device("cpu, cpu@0.25", 1, world=2) == "cpu@0.25"
    with pytest.raises(ValueError, match=r"3 devices \['cpu', 'cpu', 'cpu'\] for 2 processes"):
        rank_device(["cpu"] * 3, 0, world=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank_device("cuda:0,cpu") == "cpu"  # torchrun's environment before init_process_group
    with pytest.raises(ValueError, match=r"1 device \['cpu'\] for 2 processes"):
        rank_device("cpu")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="pass rank= and world="):
        rank_device("cpu")


GLOO_DEAD = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:4593: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_HUNG = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


def test_failure_lines_name_the_rank_step_and_timeout():
    dead = as_error(RuntimeError(GLOO_DEAD), rank=0, world=2, step=7, timeout=5.0)
    assert str(dead) == (
        "rank 0, step 7: training step failed: rank 1 died or lost its connection (Read error [127.0.0.1]:4593: "
        "Connection reset by peer); process-group timeout 5 s; that rank's own output says why"
    )
    assert (dead.step, dead.ranks, dead.timeout) == (7, [1], 5.0)
    hung = as_error(RuntimeError(GLOO_HUNG), rank=2, world=4, step=3, what="exchanging step times", timeout=20)
    assert str(hung) == (
        "rank 2, step 3: exchanging step times failed: another rank did not answer within the 20 s timeout: it "
        "hangs, is stopped, or is slower than the timeout allows (Timed out waiting 5000ms for recv)"
    )
    assert hung.ranks is None  # gloo does not say which of three peers
    # The comm hook's own line, as torch re-raises it from loss.backward(), comes back unchanged.
    quoted = RuntimeError(f"Got the following error when running the callback: DistributedError: {dead}\n\nAt:\n  x")
    again = as_error(quoted, rank=0, world=2)
    assert str(again) == str(dead) and again.step == 7
    assert "\n" not in str(again)


def test_only_communication_failures_are_converted():
    assert is_failure(RuntimeError(GLOO_DEAD)) and is_failure(RuntimeError(GLOO_HUNG))
    assert not is_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not is_failure(ValueError("Connection reset by peer, gloo"))  # not a RuntimeError
    assert not is_failure(hd.DistributedError("already one line"))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), hd.guard(step=1):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    expected = r"^this rank, step 4: training step failed: another rank died"  # no process group: rank unknown
    with pytest.raises(hd.DistributedError, match=expected), hd.guard(step=4):
        raise RuntimeError(GLOO_DEAD)
