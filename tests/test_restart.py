"""torchrun's elastic restarts: a node leaves and joins again, and the parameters equal one plain process's.

Three ``hetsplit launch --nnodes 1:3`` agents (one device each) meet at a rendezvous store the
test hosts; the test kills one node (its agent and its rank, by process id) once step K is
checkpointed and starts it again once step M is. Every restart re-plans from the stored
curves and resumes from the checkpoint at its global batch. Assertions are on behaviour,
never on wall time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "tests"))
import restart_job

import hetsplit.distributed as hd
from hetsplit.planning.solver import plan_from_sizes

JOB = ROOT / "tests" / "restart_job.py"
STEPS, LEAVE, JOIN = 16, 4, 9


def _plain(optim: str) -> list[torch.Tensor]:
    """One process over the same global batches: the sampler's, for one rank holding all of each."""
    model, opt = restart_job.model_and_opt(optim)
    data = restart_job.dataset()
    one = plan_from_sizes(None, ["cpu"], [restart_job.BATCH])
    sampler = hd.HeteroDistributedSampler(data, one, num_replicas=1, rank=0, shuffle=True, seed=0)
    step = 0
    while step < STEPS:
        sampler.set_epoch(step // len(sampler))
        for idx in sampler:
            x, y = data[idx]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step == STEPS:
                break
    return [p.detach() for p in model.parameters()]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(log: Path, done, agents, what: str, timeout: float = 300) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lines = _lines(log)
        if done(lines):
            return lines
        failed = [a.args for a in agents if a.poll() not in (None, 0)]
        assert not failed, f"an agent failed while waiting for {what}: {failed}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {_lines(log)[-5:]}")


@pytest.mark.serial
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_node_leaves_and_joins_again_and_the_run_stays_exact(tmp_path, optim):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    log = tmp_path / "log.jsonl"

    def agent(device: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "hetsplit.apps.cli", "launch", "--nnodes", "1:3", "--max-restarts", "3",
            "--devices", device, "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false",
            str(JOB), str(tmp_path / "ckpt"), optim, str(STEPS), str(log),
        ]  # fmt: skip
        with open(tmp_path / f"{device}-{time.monotonic_ns()}.out", "w") as out:
            return subprocess.Popen(cmd, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)

    (tmp_path / "pause").write_text(str(JOIN))  # the ranks hold at step M: the run cannot end before the join
    agents = {d: agent(d) for d in ("cpu", "cpu@0.5", "cpu@0.25")}
    steps = lambda lines: [s for s in lines if "step" in s]
    lines = _wait(log, lambda ls: any(s["step"] >= LEAVE and s["world"] == 3 for s in steps(ls)), agents.values(), "K")
    leaving = [s["pid"] for s in lines if s.get("device") == "cpu@0.25"][-1]
    for pid in (agents["cpu@0.25"].pid, leaving):  # the node goes: its agent and its rank
        os.kill(pid, signal.SIGKILL)
    agents["cpu@0.25"].wait()
    gone = dict(agents)
    gone.pop("cpu@0.25")
    _wait(log, lambda ls: any(s["step"] >= JOIN and s["world"] == 2 for s in steps(ls)), gone.values(), "M")
    gone["cpu@0.25 again"] = agent("cpu@0.25")
    _wait(log, lambda ls: any(s.get("world") == 3 and s.get("from", 0) > 0 for s in ls), gone.values(), "the join")
    (tmp_path / "pause").unlink()
    for a in gone.values():
        assert a.wait(timeout=300) == 0, (tmp_path / "log.jsonl").read_text()[-3000:]

    lines = _lines(log)
    worlds = [s["world"] for s in steps(lines)]
    assert 2 in worlds and worlds[-1] == 3 and worlds[0] == 3, worlds
    starts = [s for s in lines if "from" in s]
    assert {s["world"] for s in starts} == {2, 3}  # the restarts re-planned for 2 ranks and for 3
    assert all(sum(s["sizes"]) == restart_job.BATCH for s in lines if "sizes" in s)  # the global batch stays
    resumed = [s for s in starts if s["from"] > 0]
    assert not starts[0]["stored"] and resumed and all(s["stored"] for s in resumed), starts  # no re-profiling
    got = torch.load(tmp_path / "ckpt" / "final.pt")
    for p, q in zip(got, _plain(optim)):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def _trained(optim: str, steps: int):
    model, opt = restart_job.model_and_opt(optim)
    x, y = restart_job.dataset().tensors
    for k in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[k : k + 12]), y[k : k + 12]).backward()
        opt.step()
    return model, opt


def test_a_save_that_dies_midway_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    from hetsplit.distributed import restart

    ckpt = hd.Checkpoint(tmp_path)
    model, opt = _trained("adamw", 2)
    ckpt.save(2, model, opt)
    expected = [p.detach().clone() for p in model.parameters()]
    real = restart.dcp_save

    def dies(state, *, checkpoint_id, **kwargs):  # the shards written, then the node dies before the rename
        real(state, checkpoint_id=checkpoint_id, **kwargs)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise KeyboardInterrupt("killed mid-save")

    more, more_opt = _trained("adamw", 3)
    monkeypatch.setattr(restart, "dcp_save", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(3, more, more_opt)
    assert ckpt.latest == tmp_path / "step-2"
    fresh, fresh_opt = restart_job.model_and_opt("adamw")
    assert ckpt.load(fresh, fresh_opt) == 2
    for p, q in zip(fresh.parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert fresh_opt.state_dict()["state"][0]["step"] == 2  # AdamW's state came back too

    monkeypatch.setattr(restart, "dcp_save", real)  # the next save replaces the half-written one
    ckpt.save(3, more, more_opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]  # keep=1: the older one is gone


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_resumed_sampler_serves_the_global_batches_the_run_had_left(world):
    data = restart_job.dataset()
    one = plan_from_sizes(None, ["cpu"], [12])
    plain = hd.HeteroDistributedSampler(data, one, num_replicas=1, rank=0, seed=3)
    expected = []
    for epoch in range(3):
        plain.set_epoch(epoch)
        expected += list(plain)
    weights = [1.0, 0.5, 0.25][:world]
    from hetsplit.planning.plan import sizes_from_weights

    shares = plan_from_sizes(None, [f"rank{r}" for r in range(world)], sizes_from_weights(12, weights))
    for start in (0, 3, 5, 7):  # mid-epoch, at an epoch's start, in the second epoch
        loaders = [hd.data_loader(data, shares, num_replicas=world, rank=r, seed=3) for r in range(world)]
        for loader in loaders:
            loader.batch_sampler.resume(start)
        got, step = [], start
        while step < 15:
            for loader in loaders:
                loader.batch_sampler.set_epoch(step // 5)
            for batches in zip(*loaders):
                got.append(sorted(torch.cat([b[0] for b in batches]).sum(1).tolist()))
                step += 1
        want = [sorted(data[idx][0].sum(1).tolist()) for idx in expected[start:]]
        assert got == want


def test_the_example_resumes_on_another_world_from_the_stored_curves(tmp_path):
    from helpers import launch

    script, ckpt = ROOT / "examples" / "elastic_torchrun.py", str(tmp_path / "ckpt")
    first = launch("cpu,cpu@0.5", script, "--checkpoint", ckpt, "--steps", "3", "--budget", "0.3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "2 ranks, plan profiled" in first.stdout and "resuming at step 0" in first.stdout
    again = launch("cpu", script, "--checkpoint", ckpt, "--steps", "5", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 ranks, plan from stored curves: [64]; resuming at step 3" in again.stdout, again.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["curves.json", "step-5"]
