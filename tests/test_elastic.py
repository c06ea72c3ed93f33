"""Elastic groups on torchft: a group leaves and rejoins, and the parameters equal one plain process's.

Each group is a process of tests/elastic_job.py; the lighthouse runs in the test's process. The
assertions are on behaviour (who was present at each committed step, the parameters), never
on wall time: rendezvous timeouts are generous for a loaded 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, subprocess_env

torchft = pytest.importorskip("torchft", reason="the elastic extra: pip install 'hetsplit[elastic]'")

from hetsplit.distributed.elastic import ElasticGroup, lighthouse  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import elastic_job  # noqa: E402

JOB = ROOT / "tests" / "elastic_job.py"
ENV = subprocess_env(RUST_LOG="warn")  # torchft's servers log every quorum at INFO
STEPS, BATCH = 14, 24


def _group(tmp: Path, name: str, group: int, address: str, optim: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(JOB), str(tmp / f"{name}.pt"), str(group), "cpu,cpu@0.5", address, str(STEPS), optim]
    return subprocess.Popen([*cmd, *extra], env=ENV, stderr=subprocess.PIPE, text=True, cwd=tmp)


def _plain(optim: str) -> list[torch.Tensor]:
    model, opt = elastic_job.model_and_opt(optim)
    for step in range(STEPS):
        x, y = elastic_job.global_batch(step, BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-2000:]
    return err


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_group_leaves_mid_step_and_rejoins_exactly(tmp_path, optim):
    lh = lighthouse(1)
    try:
        up0, up1, back = (str(tmp_path / n) for n in ("up0", "up1", "back"))  # both start together
        g0 = _group(tmp_path, "g0", 0, lh.address(), optim, "--ready", up0, "--wait-at", "0", up1, "--wait-at", "9", back)
        g1 = _group(tmp_path, "g1", 1, lh.address(), optim, "--ready", up1, "--wait-at", "0", up0, "--die-at", "4")
        g1.communicate(timeout=240)  # gone inside step 4, after its backward
        rejoin = _group(tmp_path, "g1b", 1, lh.address(), optim, "--ready", back)
        _finish(g0), _finish(rejoin)
    finally:
        lh.shutdown()
    first, back = torch.load(tmp_path / "g0.pt"), torch.load(tmp_path / "g1b.pt")
    steps = [r["step"] for r in first["log"]]
    assert steps == list(range(STEPS))  # every global batch committed once: none dropped, none twice
    members = [r["members"] for r in first["log"]]
    assert members[4] == [0] and members[-1] == [0, 1], members  # left at 4 (the step re-run alone), back by the end
    assert [0, 1] in members[:4], members
    assert {tuple(r["sizes"]) for r in first["log"]} == {(16, 8), (24,)}  # re-solved from the profile, B constant
    expected = _plain(optim)
    for got in (first["params"], back["params"]):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
