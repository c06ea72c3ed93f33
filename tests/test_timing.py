"""Laps: busy time measured without synchronising a device (a clock on the CPU, events on CUDA)."""

import time

import pytest
import torch

from hetsplit import timing
from hetsplit.devices import parse_device
from hetsplit.timing import Lap


def test_a_lap_stopped_by_hand_adds_its_extra():
    manual = Lap(parse_device("cpu"))
    manual.stop()
    first = manual.seconds()
    manual.extra = 0.5
    assert manual.seconds() == pytest.approx(first + 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lap_reads_events_without_synchronising_first():
    dev = parse_device("cuda:0")
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with timing.lap(dev) as lap:
        for _ in range(20):
            a = a @ a / 4096
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert lap.ready() and 0 < lap.seconds() <= wall * 1.05  # GPU time of the work, read from events
