"""The package's shape: no import cycles, one tree walker, a purpose line and ``__all__`` in every module.

These read the source with ``ast``. A module's size follows its job and a private name
may be imported by the package's own modules (as torch does), so neither is policed here.
"""

import ast
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


def test_pytree_is_used_in_one_module():
    users = [_name(p) for p in MODULES if "_pytree" in p.read_text()]
    assert users == ["hetsplit.tree"]


def test_every_module_declares_all_and_a_purpose():
    for path in MODULES:
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree)
        assert doc and doc.splitlines()[0].endswith("."), path
        if path.name != "__init__.py" or any(isinstance(n, ast.ImportFrom) for n in tree.body):
            has_all = any(
                isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                for n in tree.body
            )
            assert has_all or (path.name == "__init__.py" and path.parent.name == "apps"), path
