"""run_parallel: per-device work in worker threads that carry the caller's grad mode and autocast."""

import copy
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import assert_same_grads

from hetsplit import parse_devices, run_parallel
from hetsplit.parallel.apply import cpu_cores

DEVICES = ["cpu", "cpu@0.25"]


def test_worker_threads_carry_grad_mode_and_autocast():
    seen = []

    def probe():
        seen.append(
            (
                threading.current_thread() is not threading.main_thread(),
                torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
            )
        )

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run_parallel([probe, probe], parse_devices(DEVICES))  # the first runs in the calling thread
        assert sorted(seen) == [(False, False, True, torch.bfloat16), (True, False, True, torch.bfloat16)]
        seen.clear()
        run_parallel([probe, probe], parse_devices(DEVICES), inline=None)  # both in workers
    assert seen == [(True, False, True, torch.bfloat16)] * 2


def _cores_seen(devices, inline=0):
    """Each job's allowed cores while it ran, and the calling thread's before and after the call."""
    seen = {}

    def probe(i):
        return lambda: seen.__setitem__(i, os.sched_getaffinity(0))

    before = os.sched_getaffinity(0)
    run_parallel([probe(i) for i in range(len(devices))], parse_devices(devices), inline=inline)
    return [seen[i] for i in range(len(devices))], before, os.sched_getaffinity(0)


@pytest.fixture(autouse=True)
def _default_pinning(monkeypatch):
    # A developer's HETSPLIT_PIN_CPU=0 must not change what these tests see.
    monkeypatch.delenv("HETSPLIT_PIN_CPU", raising=False)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity exists on Linux only")
@pytest.mark.parametrize("inline", [0, None])
def test_cpu_jobs_computing_in_one_thread_each_get_a_core_of_their_own(inline, one_thread, monkeypatch):
    allowed = os.sched_getaffinity(0)
    devices = ["cpu", "cpu@0.25", "cpu@0.5"][: max(2, min(3, len(allowed)))]
    seen, before, after = _cores_seen(devices, inline)
    if len(allowed) >= 2:  # one allowed core each, all different, the calling thread's job included
        assert all(len(s) == 1 and s <= allowed for s in seen) and len(set().union(*seen)) == len(devices)
        assert _cores_seen(devices, inline)[0] == seen  # chosen once, kept
    else:  # a single allowed core: nothing to spread, nothing pinned
        assert cpu_cores(parse_devices(devices), inline) is None and seen == [allowed] * len(devices)
    assert after == before  # the calling thread gets its cores back
    seen, _, _ = _cores_seen(["cpu"] * (len(allowed) + 1), inline)  # more CPU jobs than cores
    assert seen == [allowed] * (len(allowed) + 1)
    _cores_seen(devices, inline)
    monkeypatch.setenv("HETSPLIT_PIN_CPU", "0")
    assert _cores_seen(devices, inline)[0] == [allowed] * len(devices)  # a worker pinned before is let go


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity exists on Linux only")
def test_nothing_is_pinned_when_torch_computes_with_several_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pinned thread's intra-op threads would share its one core
    try:
        assert cpu_cores(parse_devices(["cpu", "cpu@0.5"]), 0) is None
        seen, _, _ = _cores_seen(["cpu", "cpu@0.5"])
        assert seen == [os.sched_getaffinity(0)] * 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity exists on Linux only")
def test_a_worker_started_inside_a_pinned_job_is_not_confined_to_its_core():
    # In a fresh process: a job pinned to one core runs a step of its own (nested), which
    # starts a worker there. That worker, and every unpinned job later, may use every core.
    code = (
        "import os, torch, hetsplit\n"
        "torch.set_num_threads(1)\n"
        "seen = {}\n"
        "probe = lambda i: (lambda: seen.__setitem__(i, len(os.sched_getaffinity(0))))\n"
        "devs = hetsplit.parse_devices(['cpu', 'cpu@0.5'])\n"
        "nested = lambda: hetsplit.run_parallel([probe('outer'), probe('new worker')], devs)\n"
        "hetsplit.run_parallel([lambda: None, nested], devs)\n"
        "os.environ['HETSPLIT_PIN_CPU'] = '0'\n"
        "hetsplit.run_parallel([probe(0), probe(1), probe(2)], devs[:1] * 3, inline=None)\n"
        "print(seen['outer'], seen['new worker'], seen[0], seen[1], seen[2])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    allowed = len(os.sched_getaffinity(0))
    assert out == [str(1 if allowed >= 2 else allowed)] + [str(allowed)] * 4


class _Stop(Exception):
    pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity exists on Linux only")
def test_a_step_interrupted_while_waiting_gives_the_caller_its_cores_back(one_thread):
    # A signal (Ctrl-C in a notebook) lands while the calling thread waits for a worker.
    def stop(signum, frame):
        raise _Stop

    old = signal.signal(signal.SIGUSR1, stop)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    before, during = os.sched_getaffinity(0), []
    try:
        timer.start()
        with pytest.raises(_Stop):
            run_parallel(
                [lambda: during.append(os.sched_getaffinity(0)), lambda: time.sleep(3)], parse_devices(DEVICES)
            )
        assert os.sched_getaffinity(0) == before
        assert len(during[0]) == (1 if len(before) >= 2 else len(before))  # it was pinned while it ran its job
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


def test_pinned_replicas_still_give_the_full_batch_gradients(one_thread):
    # The cores change where replicas run, never what they compute: float64, exact.
    import hetsplit

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(5)
    ).double()
    x, y = torch.randn(24, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (24,))
    net(x[:2])  # materialise the lazy layer
    ref = copy.deepcopy(net)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@0.5"], weights=[17, 7])
    torch.nn.functional.cross_entropy(dp(x), y).backward()
    expected = cpu_cores(parse_devices(["cpu", "cpu@0.5"]), 0)
    assert (expected is not None) == (hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2)
    assert_same_grads(net, ref, rtol=1e-12, atol=1e-12)


def test_run_parallel_takes_device_strings():
    assert run_parallel([lambda: 1, lambda: 2], ["cpu", "cpu@1"]) == [1, 2]
    with pytest.raises(ValueError, match="2 callables and 1 devices"):
        run_parallel([lambda: 1, lambda: 2], ["cpu"])


class _Custom(Exception):
    def __init__(self, code, detail):
        super().__init__(code, detail)
        self.code = code


def _raise(e):
    raise e


@pytest.mark.parametrize(
    "error",
    [
        _Custom(7, "detail"),
        FileNotFoundError(2, "No such file or directory", "data.csv"),
        KeyError("missing"),
    ],
    ids=["custom-arguments", "oserror", "keyerror"],
)
def test_a_replica_s_exception_is_raised_as_itself_with_the_replica_named(error):
    with pytest.raises(type(error), match="in replica 1 on device cpu@1") as info:
        run_parallel([lambda: 1, lambda: _raise(error)], ["cpu", "cpu@1"])
    assert info.value is error  # class, errno, file name and the user's own attributes all survive
    if isinstance(error, OSError):
        assert (info.value.errno, info.value.filename) == (2, "data.csv")


def test_a_one_string_message_names_the_replica_in_str():
    with pytest.raises(ValueError) as info:
        run_parallel([lambda: 1, lambda: _raise(ValueError("bad label"))], ["cpu", "cpu@1"])
    assert str(info.value) == "in replica 1 on device cpu@1: bad label"
