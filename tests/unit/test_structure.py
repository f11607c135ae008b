"""The code's shape, checked so that it does not drift: no module over 500 lines (daemons/wire.py, the one
place every message is declared, excepted), no class over 250, no import circle among our modules, and no
module importing another's private (``_name``) names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemons", "llumnixctl")
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 250
LONG_FILES_ALLOWED = {"daemons.wire"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def imports(module: str, tree: ast.Module, top_level: bool) -> list[tuple[str, str | None]]:
    """(module, name) for each import (name None for ``import x``); relative imports resolved. At top level:
    not those under ``if TYPE_CHECKING`` (never run) nor inside functions (run when called)."""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, str | None]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((a.name, None) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.extend((resolve(node), a.name) for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []))
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body)

    if top_level:
        visit(tree.body)
    else:
        visit([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))])
    return found


def test_no_module_is_too_long():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in long.items() if n > MAX_FILE_LINES and m not in LONG_FILES_ALLOWED} == {}


def test_no_class_is_too_long():
    big = [f"{m}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for m, tree in TREES.items()
           for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    assert big == []


def find_circles(graph: dict[str, set[str]]) -> list[str]:
    circles = []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                walk(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    return circles


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for m, tree in TREES.items():
        deps = set()
        for base, name in imports(m, tree, top_level=True):
            if name and f"{base}.{name}" in MODULES:
                deps.add(f"{base}.{name}")
            elif base in MODULES:
                deps.add(base)
        graph[m] = deps - {m}
    assert find_circles(graph) == []


def test_the_circle_check_sees_one():
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]


def test_no_module_imports_another_modules_private_names():
    private = sorted({f"{m} imports {base}.{name}" for m, tree in TREES.items()
                      for base, name in imports(m, tree, top_level=False)
                      if name and name.startswith("_") and not name.startswith("__") and base in MODULES and base != m})
    assert private == []


@pytest.mark.parametrize("source, expect", [
    ("from daemons.wire import _decode\n", ["x imports daemons.wire._decode"]),
    ("def f():\n    from daemons.wire import _decode\n", ["x imports daemons.wire._decode"]),
    ("from daemons.wire import decode\n", []),
])
def test_the_private_name_check_sees_imports_at_any_depth(source, expect, monkeypatch):
    monkeypatch.setitem(MODULES, "x", ROOT / "x.py")
    found = [f"x imports {b}.{n}" for b, n in imports("x", ast.parse(source), top_level=False)
             if n and n.startswith("_") and b in MODULES]
    assert found == expect
