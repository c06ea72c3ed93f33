"""The package's shape: no import cycles or upward imports, a purpose line in every module, one small public API.

These read the source with ``ast``. A module's size follows its job, so it is not policed
here; a private name may be imported by the package's own modules (as torch does), but
not by another package's. The package map in docs/how-it-works.md names every module.
"""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hetsplit"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) for every hetsplit import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(_name(path), path, node)
            if target.startswith("hetsplit"):
                out.append((target, [a.name for a in node.names], id(node) in top))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], id(node) in top) for a in node.names if a.name.startswith("hetsplit")]
    return out


def test_no_import_cycle():
    names = {_name(p): p for p in MODULES}
    graph = {}
    for module, path in names.items():
        deps = set()
        for target, imported, _ in _imports(path):
            # `from .x import y` where y is a submodule depends on that submodule.
            subs = {f"{target}.{n}" for n in imported if f"{target}.{n}" in names}
            for dep in subs | {target}:
                # Importing a.b.c runs a.b's __init__ first, unless the importer is inside a.b
                # (that package is then already being initialised).
                parts = dep.split(".")
                deps |= {".".join(parts[:k]) for k in range(2, len(parts) + 1)}
        graph[module] = {d for d in deps if d in names and d != module and not module.startswith(d + ".")}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


# The pipeline's layers, bottom up; a module imports only from its own layer or those below
# (a type named under ``if TYPE_CHECKING:`` aside: it runs nothing). Profiles and plans are data
# the profiler fills, so ``planning`` sits below ``profiler``; ``quick`` is the profile of last
# resort the engines fall back on.
LAYERS = [
    {"version", "_torch", "tree", "files", "hardware"},  # the package's own plumbing
    {"emulation", "devices", "timing"},  # what runs, slowed down, and its clock
    {"store", "planning"},  # profiles and plans as data, on disk
    {"profiler", "quick"},  # measuring the devices
    {"parallel", "distributed"},  # the engines: one process, torchrun ranks
    {"integrations", "lightning", "accelerate", "transformers"},  # the frameworks' doors
    {"apps"},  # what users run: the CLI, bench, demo, pictures
]


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    found = [i for i, layer in enumerate(LAYERS) if top in layer]
    assert found, f"{module} is in no layer of tests/test_layout.py's LAYERS: add it where it belongs"
    return found[0]


def _runtime_imports(path: Path) -> list[str]:
    """Every hetsplit module ``path`` imports when it runs (types under ``if TYPE_CHECKING:`` left out)."""
    names = {_name(p) for p in MODULES}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            target = _resolve(_name(path), path, node)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names]
            found += subs or ([target] if target.startswith("hetsplit.") else [])
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("hetsplit.")]
    return found


def test_no_import_runs_back_up_the_pipeline():
    upward = [
        f"{_name(path)} imports {target}"
        for path in MODULES
        if _name(path) != "hetsplit"  # the package's front door names every layer's public API
        for target in _runtime_imports(path)
        if _layer(target) > _layer(_name(path))
    ]
    assert not upward, upward


# The modules users import from; every other module is the package's own and declares no
# ``__all__``, so the public surface is these lists and nothing else.
PUBLIC = {
    "hetsplit": 14,
    "hetsplit.parallel": 4,  # torch.nn.parallel's verbs for any devices
    "hetsplit.planning": 6,  # plans and profiles as data
    "hetsplit.distributed": 14,
    "hetsplit.lightning": 3,
    "hetsplit.accelerate": 2,
    "hetsplit.transformers": 2,
    "hetsplit.apps.models": None,
}


def test_every_module_has_a_purpose_line():
    for path in MODULES:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].endswith("."), path


def test_only_public_modules_declare_all():
    declaring = sorted(
        _name(path)
        for path in MODULES
        if any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
            for n in ast.parse(path.read_text()).body
        )
    )
    assert declaring == sorted(PUBLIC)


@pytest.mark.parametrize("module", [m for m, n in PUBLIC.items() if n is not None])
def test_public_names_resolve_and_are_documented(module):
    mod = importlib.import_module(module)
    names = [n for n in mod.__all__ if n != "__version__"]
    assert len(names) == PUBLIC[module], names  # a new public name is a decision: add it here and to the docs
    for name in names:
        value = getattr(mod, name)
        assert (value.__doc__ or "").strip(), f"{module}.{name} has no docstring"


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_package_s_private_names():
    """What one package shares with another is public where it lives: a ``_name`` or ``_module`` stays home."""
    names = {_name(p): p for p in MODULES}
    found = []
    for module, path in names.items():
        home = _package(module, path)
        for target, imported, _ in _imports(path):
            owner = _package(target, names[target]) if target in names else target.rpartition(".")[0]
            if owner == home:
                continue  # a package's own modules may share private names (as torch's do)
            if any(_private(part) for part in target.split(".")):
                found.append(f"{module} imports {target}")
            found += [
                f"{module} imports {target}.{n}" for n in imported if _private(n) and f"{target}.{n}" not in names
            ]
    assert not found, found


def test_the_package_map_names_every_module():
    """docs/how-it-works.md's map is the newcomer's first view of the tree: no module is missing from it."""
    doc = (PACKAGE.parent / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    block = doc.split('<!-- test: check "package-map"', 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}  # a top-level module or folder, and its text
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            key, _, text = line.strip().partition(" ")
            entries[key] = text
        elif entries and line.startswith("   "):
            entries[key] += " " + line.strip()
    missing = []
    for path in MODULES:
        parts = path.relative_to(PACKAGE).parts
        if parts[-1] == "__init__.py":
            continue
        if len(parts) == 1:
            missing += [] if parts[0] in entries else [parts[0]]
        elif not re.search(rf"(?<![\w.]){re.escape(path.stem)}\b", entries.get(parts[0] + "/", "")):
            missing.append("/".join(parts))
    assert not missing, f"docs/how-it-works.md's package map does not name {missing}"


def test_the_public_names_are_one_list():
    """``hetsplit.__all__`` is made from ``_PUBLIC``; static tools must see the same names from the same homes."""
    import hetsplit

    init = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    guarded = next(n for n in init.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {
        alias.name: f".{node.module}"
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name != "models"  # a module reachable as an attribute, not a public name
    }
    assert typed == hetsplit._PUBLIC
    assert hetsplit.__all__ == ["__version__", *hetsplit._PUBLIC]


# The first two steps of HeteroDataParallel in a fresh process (the package's worker threads start
# there, under the profiler): the hetsplit modules they enter, the first making its batch size's plan.
_TRACE = """
import json, sys, threading
import torch, torch.nn.functional as F
import hetsplit

entered, on = set(), [False]

def seen(frame, event, arg):
    if on[0] and event == "call" and frame.f_globals.get("__name__", "").startswith("hetsplit"):
        entered.add(frame.f_globals["__name__"])

threading.setprofile(seen)
sys.setprofile(seen)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
dp = hetsplit.HeteroDataParallel(net, ["cpu", "cpu@0.5"], weights=[2, 1])
x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
for on[0] in (True, True):
    F.cross_entropy(dp(x), y).backward()
on[0] = False
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps(sorted(entered)))
"""
# What a step passes through that the walk leaves to the package map: plumbing, not a stage.
PLUMBING = {"_torch", "devices", "tree"}


def test_the_walk_of_a_step_names_the_modules_a_traced_step_enters():
    """docs/how-it-works.md's walk of a step, checked against a traced step so that it cannot go stale."""
    doc = (PACKAGE.parent / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    walk = doc.split("**A step of `HeteroDataParallel`**", 1)[1].split("\n\n", 1)[0]
    named = {n for n in re.findall(r"`([a-z_]+)`", walk)}  # a plain lowercase name in backticks is a module
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "HETSPLIT_QUIET": "1", "HETSPLIT_PIN_CPU": "0"}
    out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    entered = {m.rpartition(".")[2] for m in json.loads(out.stdout.splitlines()[-1])}
    assert named <= entered, f"the walk names modules a step does not enter: {sorted(named - entered)}"
    assert entered - PLUMBING <= named, (
        f"the walk leaves out modules a step enters: {sorted(entered - PLUMBING - named)}"
    )
