"""A rank that runs out of memory in its *backward* and stops: its peer says so in one line naming it.

The forward's case is in tests/test_fsdp.py (``OOM_JOB``): the failing rank notes why it
stopped in the process group's store, and the peer's failure line quotes it. In backward
nothing noted it: the peer said only that rank 1 "died or lost its connection". The
out-of-memory error is raised where a GPU's allocator would raise it in backward, inside
an autograd node of rank 1's second step; rank 1 catches it, as a user would, and ends.
"""

from __future__ import annotations

import pytest
from helpers import OOM_LOOP, two_ranks

BACKWARD_OOM_JOB = """
import datetime, sys
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
torch.manual_seed(0)


class Allocates(torch.autograd.Function):  # rank 1's memory runs out in its second backward, as a GPU's would
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if rank == 1 and steps == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(Allocates.apply(torch.tanh(self.a(x))))


model = Net().double()
if sys.argv[1] == "fsdp2":
    fully_shard(model.a), fully_shard(model.b), fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model)
plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 4])
hd.weight_gradients(model, plan)
"""
BACKWARD_OOM_JOB += OOM_LOOP  # the loop both out-of-memory jobs run


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_a_peer_of_a_rank_that_ran_out_of_memory_in_backward_gets_one_line_naming_it(tmp_path, kind):
    script = tmp_path / "job.py"
    script.write_text(BACKWARD_OOM_JOB)
    (code0, out0, err0), (_, out1, err1) = two_ranks(script, kind, cwd=tmp_path)
    assert "skipped the step" in out1, (out1, err1[-3000:])
    assert code0 == 1 and "finished" not in out0, (out0, err0[-3000:])
    lines = err0.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err0, err0[-3000:]
    what = "gradient all-reduce" if kind == "ddp" else "training step"
    assert lines[0].startswith(
        f"hetsplit: rank 0, step 1: {what} failed: rank 1 ran out of memory at step 1 (CUDA out of memory"
    ), lines
