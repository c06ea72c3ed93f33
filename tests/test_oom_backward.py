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

# Both jobs' model: its Allocates node (each job's own) raises out of memory where a GPU would.
_NET = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(Allocates.apply(torch.tanh(self.a(x))))
"""

BACKWARD_OOM_JOB = (
    """
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


"""
    + _NET
    + """

model = Net().double()
if sys.argv[1] == "fsdp2":
    fully_shard(model.a), fully_shard(model.b), fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model)
plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 4])
hd.weight_gradients(model, plan)
"""
)
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


GUARDED_OOM_JOB = (
    """
import datetime, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
import hetsplit.distributed as hd
from hetsplit.distributed import _group
from hetsplit.planning import plan_from_sizes

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, where = dist.get_rank(), sys.argv[1]


class Allocates(torch.autograd.Function):  # rank 1 runs out of memory in its second step, as a GPU would
    @staticmethod
    def forward(ctx, x):
        if where == "forward" and rank == 1 and step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if where == "backward" and rank == 1 and step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad


"""
    + _NET
    + """

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(Net().double())
plan = plan_from_sizes(None, ["rank0", "rank1", "rank2"], [5, 3, 2])
hd.weight_gradients(model, plan)
for step in range(3):
    x, y = torch.randn(plan.sizes[rank], 6, dtype=torch.float64), torch.randint(0, 3, (plan.sizes[rank],))
    try:
        with hd.guard(step=step):
            F.cross_entropy(model(x), y).backward()
    except hd.DistributedError as e:
        with open(f"line{rank}.txt", "w") as f:
            f.write(str(e))
        break
if rank == 0:  # torchrun's agent holds the store: wait for every rank's notes, then say who noted what
    time.sleep(4)
    with open("notes.txt", "w") as f:
        f.write(repr(sorted(_group.failure_notes(None, 3))))
import os; os._exit(0)  # rank 1 too: torchrun stops the others at a rank's failure, not at its success
"""
)


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_a_rank_out_of_memory_under_guard_is_named_on_every_rank_and_noted_by_it_alone(tmp_path, where):
    import subprocess
    import sys

    from helpers import subprocess_env

    script = tmp_path / "job.py"
    script.write_text(GUARDED_OOM_JOB)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script), where]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    lines = {r: (tmp_path / f"line{r}.txt").read_text() for r in range(3) if (tmp_path / f"line{r}.txt").exists()}
    assert sorted(lines) == [0, 1, 2], (lines, proc.stdout[-2000:], proc.stderr[-3000:])
    own = "rank 1, step 1: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); every rank stops"
    assert lines[1].startswith(own), lines
    for rank in (0, 2):  # was: "rank 0, step 1: out of memory (... four lines ...); ... give this rank a smaller share"
        assert lines[rank].startswith(
            f"rank {rank}, step 1: gradient all-reduce failed: rank 1 ran out of memory at step 1 (CUDA out of memory"
        ), lines
    assert all("\n" not in line and "smaller share" not in lines[r] for r, line in lines.items() if r != 1), lines
    # Only rank 1 noted an out-of-memory error (was [0, 1, 2]: every survivor noted one of its own).
    assert (tmp_path / "notes.txt").read_text() == "[1]", proc.stderr[-3000:]
