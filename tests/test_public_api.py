"""The public surface tells the truth: what messages and docs hand to users resolves, is exported and is documented."""

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

import hetsplit

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ["hetsplit", "hetsplit.parallel", "hetsplit.planning", "hetsplit.distributed"]
# Named to the package's own callers (internal functions), or a module run with python -m.
INTERNAL_CALLERS = {"hetsplit.profiler.fingerprint", "hetsplit.timing.lap", "hetsplit.distributed._rank_main"}


def _docs() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def _raised_names() -> list[tuple[str, str]]:
    """(file:line, ``hetsplit.x.y``) for every dotted hetsplit name inside a ``raise`` statement's message."""
    found = []
    for path in sorted((ROOT / "hetsplit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise):
                for const in ast.walk(node):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        for name in re.findall(r"\bhetsplit(?:\.\w+)+", const.value):
                            found.append((f"{path.relative_to(ROOT)}:{node.lineno}", name))
    return found


@pytest.mark.parametrize(("where", "name"), _raised_names())
def test_every_name_an_error_message_gives_is_public(where, name):
    if name in INTERNAL_CALLERS:
        return
    parts = name.split(".")
    module = "hetsplit"
    for part in parts[1:]:
        if f"{module}.{part}" in PUBLIC:
            module = f"{module}.{part}"
            continue
        exported = importlib.import_module(module).__all__
        assert part in exported, f"{where} names {name}, but {part!r} is not in {module}.__all__"
        break


def test_the_out_of_memory_error_users_catch_and_the_device_are_public():
    assert issubclass(hetsplit.StepOutOfMemory, torch.OutOfMemoryError)
    assert hetsplit.StepOutOfMemory is importlib.import_module("hetsplit.parallel.micro").StepOutOfMemory
    assert hetsplit.Device is importlib.import_module("hetsplit.devices").Device
    assert hetsplit.planning.plan_from_sizes(None, ["rank0", "rank1"], [6, 2]).sizes == [6, 2]


@pytest.mark.parametrize("verb", ["scatter", "gather", "replicate", "parallel_apply"])
def test_torch_mirror_verbs_live_in_hetsplit_parallel_as_torch_keeps_its_own(verb):
    assert verb in hetsplit.parallel.__all__ and verb not in hetsplit.__all__
    assert not set(hetsplit.__all__) & set(hetsplit.parallel.__all__)  # each public name has one home
    with pytest.raises(
        AttributeError, match=rf"no attribute '{verb}'; it was removed: use hetsplit\.parallel\.{verb}\("
    ):
        getattr(hetsplit, verb)


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_is_in_the_docs(module):
    docs = _docs()
    names = [n for n in importlib.import_module(module).__all__ if n != "__version__"]
    missing = [n for n in names if not re.search(rf"\b{n}\b", docs)]
    assert not missing, f"{module}: public but not in README.md or docs/: {missing}"
