"""`hetsplit launch` and `hetsplit.distributed.init`: one process per device on top of torchrun."""

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, launch, subprocess_env

from hetsplit.apps.cli import main
from hetsplit.apps.launch import torchrun_args
from hetsplit.distributed.setup import choose_backend, init, rank_devices

SCRIPT = """
import os, signal, sys
import torch.distributed as dist
import hetsplit.distributed as hd

dev = hd.init(timeout=10)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {dev.name} emulated={dev.emulated} "
      f"backend={dist.get_backend()}", flush=True)
if sys.argv[1:] == ["kill"] and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
"""


def _launch(tmp_path, *args):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    start = time.perf_counter()
    proc = launch("cpu,cpu@0.25", script, *args, cwd=tmp_path, timeout=120)
    return proc, time.perf_counter() - start


def test_each_rank_runs_on_its_own_device(listening_job):
    proc, _ = listening_job  # the launch of LISTENERS below: each rank says its device first
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 of 2: cpu emulated=False backend=gloo" in proc.stdout
    assert "rank 1 of 2: cpu@0.25 emulated=True backend=gloo" in proc.stdout


def test_a_killed_rank_stops_the_job_with_one_clear_line(tmp_path):
    proc, seconds = _launch(tmp_path, "kill")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "hetsplit launch: error: rank 1 failed with signal 9 (its output above says why); the other ranks were stopped"
    )
    assert seconds < 60  # rank 0 waits in a barrier; torchrun stops it as soon as rank 1 dies, not at the timeout


def test_torchrun_arguments_for_one_and_several_nodes():
    argv, local = torchrun_args("cpu,cpu@0.25", "train.py", ["--lr", "0.1"])
    assert local == ["cpu", "cpu@0.25"]
    assert argv[-3:] == ["train.py", "--lr", "0.1"] and "--standalone" in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    argv, local = torchrun_args("cpu,cpu,cpu@0.5,cpu@0.5", "t.py", nnodes=2, node_rank=1, rdzv_endpoint="h:29500")
    assert local == ["cpu@0.5", "cpu@0.5"] and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "h:29500" and "--standalone" not in argv


@pytest.mark.parametrize(
    "devices, options, fragment",
    [
        ("cpu,cpu,cpu", {"nnodes": 2, "rdzv_endpoint": "h:1"}, "3 devices cannot be shared evenly by 2 nodes"),
        ("cpu,cpu", {"nnodes": 2}, "needs --rdzv-endpoint"),
        ("cpu,cpu", {"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node rank 2 is out of range"),
        ("cpu,cuda:7", {}, "'cuda:7' is not available"),
        ("cpu,gpu", {}, "cannot parse device 'gpu'"),
        ("", {}, "no devices"),
    ],
)
def test_bad_launches_fail_before_anything_starts(devices, options, fragment):
    with pytest.raises(ValueError, match=fragment):
        torchrun_args(devices, "t.py", **options)


@pytest.fixture
def no_ranks(monkeypatch):
    """torchrun's ``run`` replaced: a launch that gets as far as starting ranks fails the test."""

    def started(_args):
        raise AssertionError("torchrun started the ranks")

    monkeypatch.setattr("torch.distributed.run.run", started)


def _one_line(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return code, err.strip()


def test_a_rendezvous_port_held_by_another_program_is_refused_at_once(tmp_path, capsys, no_ranks):
    script = tmp_path / "train.py"
    script.write_text("")
    with socket.socket() as other:  # another program listening on the port
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        for host in ("127.0.0.1", "localhost"):
            code, err = _one_line(capsys, "launch", "--devices", "cpu,cpu@0.25", "--rdzv-endpoint", f"{host}:{port}",
                                  str(script))  # fmt: skip
            assert code == 1 and f"port {port} is already in use on this machine" in err  # was: silent for 120 s
        # node 1 joins the store node 0 hosts on that port: not checked
        torchrun_args("cpu,cpu", "t.py", nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}")
    torchrun_args("cpu,cpu", "t.py", rdzv_endpoint=f"127.0.0.1:{port}")  # free again


def test_a_missing_script_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    code, err = _one_line(capsys, "launch", "--devices", "cpu,cpu@0.25", "nosuch.py", "--lr", "0.1")
    assert code == 1 and err == (
        f"hetsplit launch: error: no such script: nosuch.py (looked in {tmp_path}); give the path of the training "
        "script"
    )


def test_ctrl_c_ends_the_launch_with_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    script = tmp_path / "train.py"
    script.write_text("")

    def signalled(sig):  # what torchrun's agent raises after stopping the ranks on a signal
        def run(_args):
            raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)

        return run

    monkeypatch.setattr("torch.distributed.run.run", signalled(signal.SIGINT))
    code, err = _one_line(capsys, "launch", "--devices", "cpu,cpu@0.25", str(script))
    assert (code, err) == (130, "hetsplit: interrupted")  # was torch's traceback and status 1
    assert "HETSPLIT_DEVICES" not in __import__("os").environ  # the ranks' environment, not the caller's
    monkeypatch.setattr("torch.distributed.run.run", signalled(signal.SIGTERM))
    code, err = _one_line(capsys, "launch", "--devices", "cpu,cpu@0.25", str(script))
    assert (code, err) == (1, "hetsplit launch: error: stopped by SIGTERM; the ranks were stopped")


def test_init_checks_the_device_list_before_the_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"2 devices \['cpu', 'cpu@0.25'\] for 3 processes"):
        init(devices="cpu,cpu@0.25")
    monkeypatch.delenv("HETSPLIT_DEVICES", raising=False)
    with pytest.raises(ValueError, match="hetsplit launch --devices"):
        init()
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE are not set"):
        init(devices="cpu")


def test_backend_follows_the_device_mix():
    assert choose_backend(["cpu", "cpu@0.5"]) == "gloo"
    assert choose_backend(["cuda:0", "cpu"]) == "gloo"  # one CPU rank makes the whole job gloo
    # NCCL refuses two ranks on one GPU: an emulated rank beside its real one runs over gloo.
    assert choose_backend(["cuda:0", "cuda:0@0.5"]) == "gloo"
    assert choose_backend(["cuda:1", "cuda:0:max64", "cuda:1@0.25"]) == "gloo"
    assert rank_devices(" cuda:0, cuda:1 ", 2) == ["cuda:0", "cuda:1"]


def test_a_per_rank_device_list_is_one_rule_for_a_string_and_a_list():
    # A list is parsed as it is (accelerate hands hd.init its checked names), never joined to be split again.
    assert rank_devices(["cpu:0", " cpu@0.25 "], 2) == rank_devices("cpu:0, cpu@0.25", 2) == ["cpu", "cpu@0.25"]
    with pytest.raises(ValueError, match=r"1 device \['cpu'\] for 2 processes"):
        rank_devices(["cpu"], 2)


def test_the_torchrun_example_runs_under_hetsplit_launch(tmp_path):
    # The example under hetsplit launch (torchrun underneath), with online rebalancing and the
    # outputs weighting: one run covers the launcher and the example's distributed features.
    proc = launch(
        "cpu,cpu@0.25", ROOT / "examples" / "torchrun_ddp.py",
        "--steps", "2", "--budget", "1", "--data", "synthetic", "--train-size", "512", "--test-size", "128",
        "--threads", "1", "--timeout", "60", "--rebalance", "1", "--weighting", "outputs", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks on cpu, cpu@0.25 (gloo)" in proc.stdout and "2 steps in" in proc.stdout
    assert "plan: rank0:cpu" in proc.stdout and "epoch 1: 2 steps" in proc.stdout and "SYNTHETIC" in proc.stdout
    assert "plan changes; final shares" in proc.stdout  # --rebalance ran its exchanges


LISTENERS = """
import os
import torch.distributed as dist
import hetsplit.distributed as hd

dev = hd.init(timeout=20)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {dev.name} emulated={dev.emulated} "
      f"backend={dist.get_backend()}", flush=True)
dist.barrier()  # the ranks' gloo connections exist now
inodes = set()
for fd in os.listdir("/proc/self/fd") if os.path.exists("/proc/net/tcp") else []:  # Linux only (the test skips)
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
addresses = []
for table in ("/proc/net/tcp", "/proc/net/tcp6") if inodes else ():
    for line in open(table).read().splitlines()[1:]:
        parts = line.split()
        if parts[3] == "0A" and parts[9] in inodes:  # LISTEN, one of this rank's sockets
            addresses.append(parts[1].rsplit(":", 1)[0])
with open(f"rank{dist.get_rank()}.txt", "w") as fh:
    fh.write(f"gloo on {os.environ.get('GLOO_SOCKET_IFNAME')} listens on {sorted(addresses)}")
dist.barrier()
dist.destroy_process_group()
"""

LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net writes them


@pytest.fixture(scope="module")
def listening_job(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    # One launch for two tests (each rank's device; its sockets): the ranks' start-up is most of its time.
    folder = tmp_path_factory.mktemp("listeners")
    script = folder / "listeners.py"
    script.write_text(LISTENERS)
    env = {k: v for k, v in subprocess_env().items() if not k.endswith("_SOCKET_IFNAME")}
    return launch("cpu,cpu@0.25", script, cwd=folder, timeout=120, env=env), folder


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from Linux's /proc")
def test_a_single_machine_job_keeps_its_ranks_sockets_on_the_loopback(listening_job):
    assert "--local-addr" in torchrun_args("cpu,cpu@0.25", "t.py")[0]
    proc, folder = listening_job
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [(folder / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert all(line.startswith("gloo on lo ") for line in lines), lines  # not the host name's address
    for line in lines:  # the ranks' listening sockets: the loopback only
        listening = eval(line.split("listens on ")[1])
        assert listening and set(listening) <= LOOPBACK_HEX, line


def test_a_rank_stopped_by_ctrl_c_ends_quietly_with_status_130(tmp_path):
    # Ctrl-C reaches every rank; the launcher says "hetsplit: interrupted" once, so a rank prints nothing.
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text("print('started', flush=True)\nraise KeyboardInterrupt\n")
    cmd = [sys.executable, "-m", "hetsplit.distributed._rank_main", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.stdout == "started\n"
    assert (proc.returncode, proc.stderr) == (130, ""), proc.stderr[-2000:]  # was a traceback and signal 2


def test_ctrl_c_during_a_launch_prints_one_line_and_no_rank_traceback(tmp_path):
    # A real Ctrl-C: SIGINT to the launcher's whole process group, as a terminal sends it.
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import time\nimport torch.distributed as dist\nimport hetsplit.distributed as hd\n"
        "hd.init(timeout=60)\nprint(f'ready {dist.get_rank()}', flush=True)\ntime.sleep(120)\n"
    )
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", "cpu,cpu@0.25", str(script)]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=tmp_path, env=subprocess_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while out.read_text().count("ready") < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert out.read_text().count("ready") == 2, err.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.read_text()
    assert code == 130 and text.strip().splitlines()[-1] == "hetsplit: interrupted", text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_torchrun_arguments_for_nodes_that_join_and_leave():
    argv, local = torchrun_args("cpu@0.5", "t.py", nnodes="1:3", rdzv_endpoint="h:29500", max_restarts=4)
    assert local == ["cpu@0.5"] and argv[argv.index("--nnodes") + 1] == "1:3"  # this node's devices
    assert argv[argv.index("--nproc-per-node") + 1] == "1" and argv[argv.index("--max-restarts") + 1] == "4"
    conf = argv[argv.index("--rdzv-conf") + 1]
    assert conf == "keep_alive_interval=1,last_call_timeout=2" and "--node-rank" not in argv
    argv, _ = torchrun_args("cpu", "t.py", nnodes="2:2", rdzv_endpoint="h:1", rdzv_conf="last_call_timeout=9")
    assert argv[argv.index("--rdzv-conf") + 1].endswith(",last_call_timeout=9")  # the user's last: it wins
    for nnodes, fragment in (("3:1", "1 <= MIN <= MAX"), ("a", "give a number of nodes"), ("1:2", "--rdzv-endpoint")):
        with pytest.raises(ValueError, match=fragment):
            torchrun_args("cpu", "t.py", nnodes=nnodes)


def test_init_takes_a_nodes_own_devices_under_nnodes_min_max(monkeypatch):
    # Three ranks on two nodes of torchrun --nnodes 1:4: this node lists its 2 devices, rank 0 is its local rank 1.
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="'cuda:7' is not available"):  # the local rank's device, checked here
        init(devices="cpu,cuda:7")
    with pytest.raises(ValueError, match="'cuda:7' is not available"):
        init(devices="cuda:7,cpu,cpu")  # a list of the world's length is the world's: global rank 0's
