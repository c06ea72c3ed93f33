"""Scripts that draw their own global batches: every rank must draw the same one (hd.local_batch checks;
hd.shared_batch draws from a stream of its own), and nanoGPT's shape trains as one process does."""

from __future__ import annotations

import sys

import torch
from helpers import ROOT, launch, subprocess_env, two_ranks

EXAMPLES = ROOT / "examples"

# Rank 0 draws one extra random number before global batch DRIFT (its generator drifts);
# MODE "local": the script draws with torch's generator and cuts with hd.local_batch;
# "shared": it draws with hd.shared_batch. Each rank prints its rows' digest per step.
_DRIFT = """
import sys
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import hetsplit.distributed as hd
from hetsplit.planning import plan_from_sizes

mode, drift, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hd.init(timeout=30, devices="cpu,cpu")
rank = torch.distributed.get_rank()
torch.manual_seed(0)  # the same generator on every rank
plan = plan_from_sizes(None, ["rank0", "rank1"], [5, 3])
model = DDP(torch.nn.Linear(4, 1).double())
hd.weight_gradients(model, plan)
draw = lambda: (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))
try:
    for step in range(steps):
        if rank == 0 and step == drift:
            torch.rand(1)  # an evaluation on rank 0 alone, say
        x, y = hd.shared_batch(draw, plan=plan) if mode == "shared" else hd.local_batch(draw(), plan)
        F.mse_loss(model(x), y).backward()
        print("rows", step, x.sum().item(), flush=True)
except hd.DistributedError as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
"""


def _drift(tmp_path, mode: str, drift: int, steps: int):
    script = tmp_path / "drift.py"
    script.write_text(_DRIFT)
    return two_ranks(script, mode, str(drift), str(steps), cwd=tmp_path, timeout=120)


def test_a_generator_drifting_on_one_rank_is_refused_on_every_rank_at_its_batch(tmp_path):
    # Drifts at batch 3 (checked: one of the first 10) and at batch 15 (caught at batch 100).
    for drift, caught, steps in ((3, 3, 6), (15, 100, 102)):
        ranks = _drift(tmp_path, "local", drift, steps)
        for rank, (status, out, err) in enumerate(ranks):
            assert status == 1, (rank, out[-500:], err[-2000:])
            lines = err.strip().splitlines()
            assert len(lines) == 1, err
            assert lines[0].startswith(f"DistributedError: rank {rank}: global batch {caught} differs across ranks")
            assert "random generators drifted apart" in lines[0] and "hd.shared_batch" in lines[0]
            assert f"rows {caught - 1} " in out and f"rows {caught} " not in out  # stopped at that batch
    ranks = _drift(tmp_path, "local", -1, 12)  # no drift: every batch the same, nothing said
    assert [status for status, _, _ in ranks] == [0, 0], ranks[0][2][-2000:] + ranks[1][2][-2000:]


def test_shared_batch_draws_the_same_batches_whatever_one_rank_draws_besides(tmp_path):
    ranks = _drift(tmp_path, "shared", 3, 12)
    assert [status for status, _, _ in ranks] == [0, 0], ranks[0][2][-2000:] + ranks[1][2][-2000:]
    # The same stream as without the extra draw: rank 0's rows are those of a run without it.
    clean = _drift(tmp_path, "shared", -1, 12)
    assert ranks[0][1] == clean[0][1] and ranks[1][1] == clean[1][1]


def test_shared_batch_gives_torch_s_generator_back_and_continues_its_own_stream():
    import hetsplit.distributed as hd
    from hetsplit.distributed import sampler

    sampler._STREAMS.pop(7, None)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    first = hd.shared_batch(lambda: torch.rand(2), plan=None, seed=7)
    assert torch.equal(torch.rand(3), expected)  # torch's generator as if nothing had been drawn
    second = hd.shared_batch(lambda: torch.rand(2), plan=None, seed=7)
    stream = torch.Generator().manual_seed(7)
    assert torch.equal(first, torch.rand(2, generator=stream)) and torch.equal(second, torch.rand(2, generator=stream))


def test_nanogpt_example_on_unequal_ranks_equals_one_process(tmp_path):
    """nanoGPT's shape (draws its own batches, require_backward_grad_sync accumulation, (logits, loss), AdamW,
    rank 0 evaluating alone) on cpu + cpu@0.5 ends with the parameters of one process, in float64."""
    import subprocess

    one = subprocess.run(
        [sys.executable, str(EXAMPLES / "nanogpt_hetero.py"), "--batch_size=16", "--gradient_accumulation_steps=2",
         f"--out_file={tmp_path / 'one.pt'}"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=subprocess_env(),
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    # Shares set by hand, 12 and 4 of 16: a profiled plan beside busy processes may come out even,
    # which would hide a wrong weighting (the profiled path is the docs test's).
    two = launch(
        "cpu,cpu@0.5",
        EXAMPLES / "nanogpt_hetero.py",
        f"--out_file={tmp_path / 'two.pt'}",
        "--plan_weights=[3,1]",
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "SYNTHETIC" in two.stdout and "global batch 16 split rank0:cpu " in two.stdout, two.stdout
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert a.keys() == b.keys() and all(v.dtype == torch.float64 for v in a.values())
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-12, f"max parameter difference {worst:.3g} from one process"
    assert int(two.stdout.split("split rank0:cpu ")[1].split()[0]) == 12, two.stdout


_TWICE = """
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import hetsplit.distributed as hd

hd.init(timeout=30, devices="cpu,cpu")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1).double()
ref = torch.nn.Linear(4, 1).double()
ref.load_state_dict(net.state_dict())
x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
ddp = DDP(net)
plan = hd.plan(ddp, x[:2], 8, weights=[5, 3], quiet=True)  # weights the gradients too
assert hd.weight_gradients(ddp, plan) is hd.weight_gradients(ddp, plan)  # the same weighting, not a second
try:
    hd.weight_gradients(ddp, plan, method="outputs")
except ValueError as e:
    print("refused:", e)
mine = hd.local_batch((x, y), plan)
F.mse_loss(ddp(mine[0]), mine[1]).backward()
F.mse_loss(ref(x), y).backward()
assert torch.allclose(net.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-14), (net.weight.grad, ref.weight.grad)
print("exact")
"""


def test_a_model_weighted_by_hd_plan_is_not_weighted_twice(tmp_path):
    script = tmp_path / "twice.py"
    script.write_text(_TWICE)
    for rank, (status, out, err) in enumerate(two_ranks(script, cwd=tmp_path)):
        assert status == 0, (rank, err[-3000:])
        refused = next(line for line in out.splitlines() if line.startswith("refused:"))
        assert "weighted already" in refused and "set_plan(plan)" in refused and "exact" in out
