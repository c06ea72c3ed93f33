"""torch's private internals stay behind one door (``hetsplit/_torch.py``), checked against the installed torch."""

import ast
import dataclasses
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hetsplit import _torch

PACKAGE = Path(_torch.__file__).parent
# Outside the door, the one private torch module allowed: torch's own libraries flatten nests with it.
ALLOWED = {("tree.py", "torch.utils._pytree")}


def test_every_private_torch_name_hetsplit_uses_is_in_the_installed_torch():
    gone = [f"{p.owner}.{p.name} ({p.used_for})" for p in _torch.missing()]
    assert not gone, (
        f"torch {torch.__version__} no longer has {gone}: fix hetsplit/_torch.py (feature detection, a public "
        "route, or a one-line refusal naming the torch it needs) and its entry in PRIVATE"
    )


def _torch_private_names() -> set[str]:
    """Private attribute names torch defines on the objects hetsplit touches."""
    owners = [torch, torch._C, torch._C._autograd, torch.autograd, torch.autograd.graph, torch.nn.modules.module,
              torch.nn.modules.batchnorm, nn.Module(), torch.empty(0), torch.autograd.Variable,
              dist.distributed_c10d, torch.nn.parallel]  # fmt: skip
    if dist.is_available():
        owners.append(dist.ProcessGroup)
    names = {n for o in owners for n in dir(o) if n.startswith("_") and not n.startswith("__")}
    # What module.compile() and torch.compile(module) leave on a module, and a loss node's saved state.
    return names | {"_compiled_call_impl", "_orig_mod", "dynamo_ctx", "_saved_reduction", "_saved_self_sym_sizes",
                    "_metadata", "_is_replica", "_timeout", "_get_backend", "_checkpoint_internal",
                    "_user_hooks"}  # fmt: skip


def _own_names() -> set[str]:
    """Names hetsplit defines itself (its own private attributes may share a name with torch's)."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and path.name != "_torch.py":
                own.add(node.attr)
    return own


def test_no_module_but_the_door_reaches_a_private_torch_name():
    private = _torch_private_names() - _own_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_torch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"hetsplit/{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom | ast.Import) and not getattr(node, "level", 0):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                for module in modules:
                    if module.startswith("torch") and "._" in module and (rel, module) not in ALLOWED:
                        found.append(f"{where} imports {module}")
                    if module.startswith("torch"):
                        found += [f"{where} imports {module}.{n}" for n in names if n.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{where} reaches .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
                found.append(f"{where} names {node.value!r}")
    assert not found, "private torch names outside hetsplit/_torch.py (move each behind it):\n" + "\n".join(found)


def test_the_door_refuses_an_older_torch_in_one_line_naming_both_versions():
    need = ".".join(map(str, _torch.MIN_TORCH))
    for old in ("2.4.1", "2.7.1+cu126", f"{_torch.MIN_TORCH[0]}.{_torch.MIN_TORCH[1] - 1}.0"):
        with pytest.raises(ImportError) as caught:
            _torch.check_version(old)
        line = str(caught.value)
        assert "\n" not in line and old in line and f"torch >= {need}" in line and "pip install" in line
    for fine in (torch.__version__, f"{need}.0", "2.15.0+cu130", "3.0.0a0", "2.8.0.dev20250601"):
        _torch.check_version(fine)


def test_a_missing_capability_is_refused_in_one_line_naming_the_torch_needed(monkeypatch):
    # A torch without the caller's saved-tensor hooks (2.7): HeteroDataParallel refuses its step
    # rather than run its worker threads without the user's hooks.
    import hetsplit

    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    dp = hetsplit.HeteroDataParallel(nn.Linear(4, 2), ["cpu", "cpu@0.5"], weights=[1, 1])
    with pytest.raises(RuntimeError) as caught:
        dp(torch.randn(4, 4))
    line = str(caught.value)
    assert "\n" not in line and "torch >= 2.8" in line and torch.__version__ in line
    assert "_top_saved_tensors_default_hooks" in line


def test_a_plain_backward_is_bit_equal_beside_the_wrapped_engine_call():
    # The out-of-memory note wraps torch's _engine_run_backward process-wide: a plain module's
    # gradients, and its errors, must pass through it unchanged. Run in a fresh process.
    script = textwrap.dedent(
        """
        import torch, hetsplit._torch as door

        def grads():
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
            x = torch.randn(64, 16, dtype=torch.float64)
            net(x).pow(2).mean().backward()
            g = [p.grad.clone() for p in net.parameters()]
            (h,) = torch.autograd.grad(net(x).sum(), net[0].weight)
            return g + [h]

        before = grads()
        noted = []
        assert door.on_backward_error(noted.append) and door.on_backward_error(noted.append)  # once
        after = grads()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "gradients changed"
        class Boom(torch.autograd.Function):  # an error raised inside autograd's engine
            @staticmethod
            def forward(ctx, x):
                return x * 1

            @staticmethod
            def backward(ctx, grad):
                raise RuntimeError("boom")

        try:
            Boom.apply(torch.ones(1, requires_grad=True)).sum().backward()
        except RuntimeError as error:
            assert noted == [error], noted
        else:
            raise AssertionError("no error")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_where_torch_cannot_note_a_backward_error_the_note_is_off(monkeypatch):
    monkeypatch.delattr(torch.autograd.graph, "_engine_run_backward")
    assert _torch.on_backward_error(lambda error: None) is False


def test_a_name_newer_than_the_floor_is_missing_only_from_the_torch_that_should_have_it(monkeypatch):
    gone = _torch.Private("torch", "_no_such_name", "a test", "nothing")
    monkeypatch.setattr(_torch, "PRIVATE", [gone, dataclasses.replace(gone, name="_later", since=(99, 0))])
    assert _torch.missing() == [gone]


def test_every_entry_says_what_happens_without_it():
    assert len({(p.owner, p.name) for p in _torch.PRIVATE}) == len(_torch.PRIVATE)
    for p in _torch.PRIVATE:
        assert p.used_for and p.missing, p
        importlib.import_module(p.owner.partition(":")[0])  # the owner is a real module


def test_a_failed_checkpointed_forward_leaves_no_saved_tensor_hooks_in_its_thread():
    # torch before 2.13 left them pushed (its checkpoint's generator closed only when collected, in
    # whichever thread): a worker thread's next steps were packed by a failed step's hooks.
    import threading

    def fail(x):
        raise KeyboardInterrupt

    tops, errors = [], []

    def worker():
        try:
            _torch.checkpoint(fail, torch.ones(2, requires_grad=True))
        except KeyboardInterrupt as error:
            errors.append(error)  # carried on, as the engine hands a worker's error to the caller's thread
        tops.append(torch._C._autograd._top_saved_tensors_default_hooks(False))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert tops == [None]
    x = torch.ones(3, requires_grad=True)
    assert torch.equal(_torch.checkpoint(lambda t: t * t, x), x * x)  # and a forward that runs is torch's
