"""HeteroAccelerator in a 2-process gloo job: plan shares, exact step, uneven gather, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

__all__: list[str] = []

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from hetsplit.accelerate import HeteroAccelerator
    from hetsplit.planning import plan_from_sizes

    torch.manual_seed(0)
    X = torch.randn(16, 3, dtype=torch.float64)
    y = torch.randn(16, 1, dtype=torch.float64)
    model = torch.nn.Linear(3, 1).double()
    ref = torch.nn.Linear(3, 1).double()
    ref.load_state_dict(model.state_dict())
    plan = plan_from_sizes(None, ["rank0", "rank1"], [6, 2])
    acc = HeteroAccelerator(plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(16), X, y), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen, steps = [], 0
    for idx, xb, yb in loader:
        assert len(idx) == plan.sizes[acc.process_index], len(idx)
        if steps == 0:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            first = idx
        seen.append(acc.gather_for_metrics(idx))
        steps += 1
    allidx = torch.cat(seen)
    assert sorted(allidx.tolist()) == list(range(16)), allidx
    b0 = acc.gather_for_metrics(first)
    rl = torch.nn.functional.mse_loss(ref(X[b0]), y[b0])
    rl.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.data, q.data - 0.1 * q.grad, atol=1e-12), (p, q)
    bad = HeteroAccelerator(plan=plan_from_sizes(None, ["a", "b", "c"], [1, 1, 2]))
    try:
        bad.prepare(DataLoader(TensorDataset(X), batch_size=4))
        raise SystemExit("no error")
    except ValueError as e:
        assert "3 shares" in str(e)
    print("OK", acc.process_index)
    """
)


def test_two_process_step_shares_gather(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=80, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("OK") == 2
