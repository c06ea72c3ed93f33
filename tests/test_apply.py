"""run_parallel: per-device work in worker threads that carry the caller's grad mode and autocast."""

import threading

import torch

from hetsplit import parse_devices, run_parallel

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
