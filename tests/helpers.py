"""Shared test helpers: tiny float64 nets and their data, gradient comparisons, a two-rank gloo runner.

Tests import them as ``from helpers import ...`` (``tests/`` is on ``sys.path``: pytest puts the
folder of ``tests/conftest.py`` there). Nothing here imports hetsplit: the helpers outlive its
renames, and a child started with ``subprocess_env`` finds this checkout's.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

# -- subprocesses ------------------------------------------------------------------------------


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout's ``hetsplit`` first, one intra-op thread.

    Without ``PYTHONPATH`` a child started outside the checkout (a temporary folder, ``examples/``)
    imports whichever ``hetsplit`` is installed, which need not be this one.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def launch(devices: str, script, *args: str, cwd, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    """``hetsplit launch --devices DEVICES SCRIPT ARGS`` in ``cwd`` with this checkout's hetsplit; output captured."""
    cmd = [sys.executable, "-m", "hetsplit.apps.cli", "launch", "--devices", devices, str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or subprocess_env())


# -- a tiny net and its data ------------------------------------------------------------------


# The training loop of the out-of-memory jobs (tests/test_fsdp.py, tests/test_oom_backward.py): a rank
# that runs out of memory catches the error and ends, as a user who carries on would leave its peer.
OOM_LOOP = """
for steps in range(3):
    x, y = torch.randn(plan.sizes[rank], 6, dtype=torch.float64), torch.randint(0, 3, (plan.sizes[rank],))
    try:
        F.cross_entropy(model(x), y).backward()
    except torch.OutOfMemoryError:
        print("skipped the step", flush=True)
        sys.exit(0)
print("finished", flush=True)
"""


def two_ranks(script, *args: str, cwd, timeout: float = 120) -> list[tuple[int, str, str]]:
    """Run ``script`` as ranks 0 and 1 of a gloo job, without a launcher; each rank's (status, stdout, stderr).

    For a job whose ranks fail on purpose (a launcher would stop the others at the first exit).
    """
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def mlp(*widths: int, seed: int = 0, batch_norm: bool = False) -> nn.Sequential:
    """A float64 MLP ``widths[0] -> ... -> widths[-1]``: Linear, [BatchNorm1d,] Tanh between layers.

    ``mlp(6, 5, 3)`` is ``Linear(6, 5), Tanh, Linear(5, 3)``; with ``batch_norm`` each hidden
    layer is followed by a ``BatchNorm1d`` before its ``Tanh``. Seeded: two calls build the same weights.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if k < len(widths) - 2:
            layers += [nn.BatchNorm1d(b), nn.Tanh()] if batch_norm else [nn.Tanh()]
    return nn.Sequential(*layers).double()


def cnn(seed: int = 0) -> nn.Sequential:
    """A float64 CNN for ``(n, 1, 8, 8)`` images and 4 classes: Conv2d(1, 3, 3), ReLU, Flatten, Linear(108, 4)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4)).double()


def batch(n: int, shape: Sequence[int], classes: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float64 inputs of ``shape`` (standard normal) and ``n`` class labels below ``classes``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, classes, (n,), generator=gen)


def step(dp, x, y, mode: str) -> None:
    """One cross-entropy training step through a HeteroDataParallel ``dp``.

    ``mode``: ``"gather"`` (the outputs gathered, one loss, ``backward``), else local-loss mode
    (``dp.train_step``).
    """
    if mode == "gather":
        F.cross_entropy(dp(x), y).backward()
    else:
        dp.train_step(x, y, F.cross_entropy)


# -- comparisons ------------------------------------------------------------------------------

RTOL = 1e-9
"""The default relative tolerance of the comparisons below, for float64 computations.

Why 1e-9: every comparison here sets a computation through hetsplit against the plain module
running the same arithmetic, in float64; the two differ only in how the batch is cut and in
the order the per-shard sums are added (and, on torchrun, in the all-reduce's order). That is
rounding: a few ulps of float64 (2.2e-16) per operation, ~1e-15 relative after a few layers,
1e-13 at worst for the long reductions of these tiny nets. 1e-9 leaves four orders of
magnitude for BLAS kernels that block differently at another batch size, while every real
defect is far above it: a lost or doubled shard, a share weighted ``1/world`` instead of
``b_r / B``, a stale or missing gradient are off by the shard's part of the batch, >1e-2.

The absolute floor is ``rtol`` times the largest value of the whole set a tensor belongs to
(all of a model's gradients): a gradient that is zero up to rounding (a bias in front of
BatchNorm) holds nothing but rounding noise relative to itself, and is compared at the
model's scale. Callers that need tighter bounds (1e-12 where the cut changes only the order
of a handful of additions; 0 where nothing is cut) pass ``rtol=`` and ``atol=``; the GPU
tests pass 1e-7 (cuBLAS and the CPU's BLAS round float64 differently).
"""


def _scale(tensors: Iterable[torch.Tensor | None]) -> float:
    return max((float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()), default=0.0)


def assert_close(actual, expected, what: str = "", *, rtol: float = RTOL, atol: float | None = None, scale=None):
    """``actual`` equals ``expected`` up to rounding (see ``RTOL``); a failure starts with ``what``.

    ``atol`` defaults to ``rtol * scale``, ``scale`` to the largest ``|expected|``: pass the largest
    value of the set ``expected`` belongs to (all of a model's gradients) to compare a tensor
    that is zero up to rounding at that set's scale.
    """
    if atol is None:
        atol = rtol * (_scale([expected]) if scale is None else scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}" if what else m)


def _reference_grads(ref) -> list[torch.Tensor | None]:
    return [q.grad for q in ref.parameters()] if isinstance(ref, nn.Module) else list(ref)


def assert_same_grads(model: nn.Module, ref, what: str = "", *, rtol: float = RTOL, atol: float | None = None):
    """Every parameter of ``model`` has the gradient of the reference, or none where it has none.

    ``ref``: the plain module that ran the same computation, or its list of gradients in
    parameter order. One scale for the whole model (``RTOL``); ``atol`` overrides the floor.
    Compared on the CPU, so a model on a GPU meets its reference there.
    """
    grads = _reference_grads(ref)
    named = list(model.named_parameters())
    assert len(named) == len(grads), f"{what}{len(named)} parameters, the reference has {len(grads)}"
    assert any(g is not None for g in grads), f"{what}the reference produced no gradient"
    scale = _scale(grads)
    for (name, p), g in zip(named, grads):
        assert (p.grad is not None) == (g is not None), (
            f"{what}{name}: has a .grad {p.grad is not None}, the reference {g is not None}"
        )
        if g is not None:
            assert_close(p.grad.cpu(), g.cpu(), f"{what}{name}.grad", rtol=rtol, atol=atol, scale=scale)


def assert_same_params(model: nn.Module, ref: nn.Module, what: str = "", *, rtol: float = RTOL):
    """Every parameter of ``model`` equals the reference's, each at its own scale (``RTOL``)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.detach(), q.detach(), f"{what}{name}", rtol=rtol)


def max_rel_grad_error(model: nn.Module, ref, *, per_parameter: bool = True) -> float:
    """The largest gradient difference from the reference (a module or its gradients), relative.

    ``per_parameter``: each parameter's largest difference over its own largest reference
    gradient (the stricter measure); otherwise over the whole model's largest gradient.
    """
    pairs = [(p.grad, g) for p, g in zip(model.parameters(), _reference_grads(ref), strict=True) if g is not None]
    scale = _scale(g for _, g in pairs)
    return max(float((p - g).abs().max()) / (float(g.abs().max()) if per_parameter else scale) for p, g in pairs)


# -- a two-rank gloo runner -------------------------------------------------------------------

WORLD = 2


def run_ranks(
    scenarios: dict[str, Callable], tmp_path: Path, *, world: int = WORLD, timeout: float = 30.0, limit=300.0
) -> Ranks:
    """Run ``scenarios`` in order on ``world`` gloo ranks (processes, one intra-op thread each).

    Each scenario is a module-level function ``fn(ctx)`` returning something JSON can hold;
    ``ctx`` has ``rank``, ``world`` and ``tmp_path`` (shared by the ranks), and scenarios may
    leave attributes on it for later ones. Every rank runs every scenario; a scenario that
    raises on any rank is recorded with its traceback and ends the run (the ranks'
    collectives no longer pair up after a one-sided failure): the later ones are recorded
    as not run. Rendezvous through a file in ``tmp_path``; ``timeout`` is the process
    group's, ``limit`` the whole run's (then the ranks are killed, and what each had
    recorded is kept).
    """
    ctx = mp.start_processes(
        _rank_main,
        args=(scenarios, str(tmp_path / "rendezvous"), str(tmp_path), world, timeout),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + limit
    crashed = None
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                crashed = f"the ranks ran past {limit:.0f} s and were killed"
                break
    except Exception as e:  # a rank died outside a scenario (a crash, a signal)
        crashed = f"a rank failed outside its scenarios: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return Ranks(list(scenarios), results, crashed)


class Ranks:
    """What ``run_ranks`` recorded: ``ranks[name]`` is one scenario's result on each rank."""

    def __init__(self, names: list[str], results: list[dict], crashed: str | None):
        self.names, self.results, self.crashed = names, results, crashed

    def __getitem__(self, name: str) -> list:
        """The scenario's result on each rank, in rank order; a test failure naming it if it did not run through."""
        assert name in self.names, f"no scenario {name!r}"
        problems = []
        for rank, res in enumerate(self.results):
            got = res.get(name)
            if got is None:
                problems.append(f"rank {rank}: did not finish" + (f" ({self.crashed})" if self.crashed else ""))
            elif "error" in got:
                problems.append(f"rank {rank}: {got['error']}")
        if problems:  # every rank's account: the first to fail is the one to read
            pytest.fail(f"scenario {name!r} failed:\n" + "\n".join(problems), pytrace=False)
        return [res[name]["value"] for res in self.results]


def _rank_main(rank, scenarios, init_file, out_dir, world, timeout):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    ctx = SimpleNamespace(rank=rank, world=world, tmp_path=Path(out_dir))
    out, failed = Path(out_dir, f"rank{rank}.json"), None
    results: dict = {}
    for name, fn in scenarios.items():
        if failed is not None:
            results[name] = {"error": f"not run: scenario {failed!r} failed before it"}
            continue
        try:
            results[name] = {"value": json.loads(json.dumps(fn(ctx)))}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        out.write_text(json.dumps(results))  # kept if a later scenario hangs
        try:  # did it fail on any rank? Then the ranks stop here, together.
            flags = [None] * world
            dist.all_gather_object(flags, "error" in results[name])
            if any(flags):
                failed = name
        except Exception:
            failed = name
    out.write_text(json.dumps(results))
    if failed is None:
        # Every rank done before the group goes: left to interpreter exit, gloo's worker
        # threads can abort the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
