"""The code's shape, measured from its syntax trees: module and class sizes, who imports whom, and which
attributes each class uses without owning them. ``tests/unit/test_structure.py`` asserts on it;
``python -m tests.support.structure [ROOT] [CLASS ...]`` prints the table of the daemons' classes (or of the
named ones) with their parts.

A class *owns* an attribute when it assigns ``self.X`` in one of its methods, declares ``X`` in its body (a
field, a class attribute, a method or property), or inherits ``X`` from a project class that owns it. A class
that reads or writes ``self.X`` it does not own shares state with whatever class does define it: the mixin
pattern, where five files reach into one object through ``self``. Classes with a base from outside the project
(other than a few that define no instance state of their own) are left out: what they inherit is unknown here.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemons", "llumnixctl")
# Bases from outside the project that give a class no instance attributes a subclass would read.
PLAIN_BASES = {"object", "Protocol", "Generic", "ABC", "Exception", "ValueError", "RuntimeError", "KeyError",
               "Enum", "IntEnum", "NamedTuple", "Struct"}
# The classes the daemons are made of, for the table.
DAEMON_CLASSES = ("Manager", "Rescheduler", "Instance", "ClusterClient", "Proxy", "Migrator", "Move")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load(root: Path = ROOT) -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            out[module_name(root, p)] = (p, ast.parse(p.read_text(), str(p)))
    return out


def imports(module: str, path: Path, tree: ast.Module, top_level: bool) -> list[tuple[str, str | None]]:
    """(module, name) for each import (name None for ``import x``); relative imports resolved. ``top_level``:
    only those run when the module is imported (not under ``if TYPE_CHECKING``, not inside functions);
    otherwise every import anywhere in the file."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, str | None]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def add(node) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend((resolve(node), a.name) for a in node.names)

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                add(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for name in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, name, []))
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body)

    if top_level:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            add(node)
    return found


def import_graph(modules: dict[str, tuple[Path, ast.Module]], top_level: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, (path, tree) in modules.items():
        deps = set()
        for base, name in imports(m, path, tree, top_level):
            if name and f"{base}.{name}" in modules:
                deps.add(f"{base}.{name}")
            elif base in modules:
                deps.add(base)
        graph[m] = deps - {m}
    return graph


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


@dataclass
class ClassInfo:
    module: str
    node: ast.ClassDef
    bases: list["ClassInfo"] = field(default_factory=list)
    external: list[str] = field(default_factory=list)  # bases from outside the project that may hold state

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def own_lines(self) -> int:
        return self.node.end_lineno - self.node.lineno + 1

    def ancestors(self) -> list["ClassInfo"]:
        seen: dict[str, ClassInfo] = {}
        todo = list(self.bases)
        while todo:
            c = todo.pop()
            if c.qualname not in seen:
                seen[c.qualname] = c
                todo.extend(c.bases)
        return list(seen.values())

    @property
    def lines(self) -> int:
        """Its own lines and those of every project class it inherits (each once)."""
        return self.own_lines + sum(c.own_lines for c in self.ancestors())

    def methods(self) -> list[str]:
        return [n.name for n in self.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def declared(self) -> set[str]:
        """What its body and its methods define: methods, class attributes and fields, ``self.X = ...``."""
        names: set[str] = set()
        for n in self.node.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Assign):
                names.update(t.id for t in n.targets if isinstance(t, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
        for attr in self_attributes(self.node):
            if isinstance(attr.ctx, ast.Store):
                names.add(attr.attr)
        return names

    def owned(self) -> set[str]:
        names = self.declared()
        for c in self.ancestors():
            names |= c.declared()
        return names

    def used(self) -> set[str]:
        return {a.attr for a in self_attributes(self.node) if not a.attr.startswith("__")}

    def foreign(self) -> set[str]:
        """``self.X`` it reads or writes that neither it nor a project base defines."""
        if self.external:
            return set()
        return self.used() - self.owned()


def self_attributes(cls: ast.ClassDef) -> list[ast.Attribute]:
    """Every ``self.X`` in the class's own methods (not in nested classes); ``self`` is each method's first
    parameter."""
    found = []
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
            continue
        me = fn.args.args[0].arg
        stack = list(fn.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.ClassDef):
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
                found.append(node)
            stack.extend(ast.iter_child_nodes(node))
    return found


def classes(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, ClassInfo]:
    """Every class by qualified name, its project bases resolved through the module's own names and imports."""
    infos = {f"{m}.{n.name}": ClassInfo(m, n) for m, (_, tree) in modules.items()
             for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for info in infos.values():
        path, tree = modules[info.module]
        aliases = {name: f"{base}.{name}" for base, name in imports(info.module, path, tree, top_level=False) if name}
        for b in info.node.bases:
            text = ast.unparse(b.value if isinstance(b, ast.Subscript) else b)
            short = text.rsplit(".", 1)[-1]
            target = infos.get(f"{info.module}.{text}") or infos.get(aliases.get(text, ""))
            if target is None and "." in text:
                target = infos.get(text)
            if target is not None:
                info.bases.append(target)
            elif short not in PLAIN_BASES:
                info.external.append(text)
    return infos


def table(root: Path = ROOT, names: tuple[str, ...] = DAEMON_CLASSES) -> list[dict]:
    """For each named class: lines (with inherited project classes), methods, its parts (the project classes
    it inherits) and the attributes each part uses that another part defines."""
    infos = classes(load(root))
    rows = []
    for info in sorted(infos.values(), key=lambda c: c.qualname):
        if info.name not in names:
            continue
        parts = [info] + info.ancestors()
        rows.append({
            "class": info.qualname,
            "own_lines": info.own_lines,
            "lines": info.lines,
            "methods": sum(len(p.methods()) for p in parts),
            "parts": [{"class": p.qualname, "lines": p.own_lines, "foreign": sorted(p.used() - p.owned())}
                      for p in parts],
        })
    return rows


def main(argv: list[str]) -> None:
    root = Path(argv[0]).resolve() if argv and Path(argv[0]).is_dir() else ROOT
    names = tuple(a for a in argv if not Path(a).is_dir()) or DAEMON_CLASSES
    modules = load(root)
    infos = classes(modules)
    for row in table(root, names):
        print(f"{row['class']}: {row['lines']} lines with its bases ({row['own_lines']} its own), "
              f"{row['methods']} methods")
        for p in row["parts"][1:]:
            print(f"    inherits {p['class']}: {p['lines']} lines, uses {len(p['foreign'])} it does not define")
        print(f"    its own body uses {len(row['parts'][0]['foreign'])} it does not define")
    foreign = {q: sorted(c.foreign()) for q, c in infos.items() if c.foreign()}
    big = {q: c.lines for q, c in infos.items() if c.lines > 300}
    circles = find_circles(import_graph(modules))
    print(f"\nclasses using attributes they do not define: {len(foreign)} "
          f"({sum(len(v) for v in foreign.values())} attributes)")
    for q, attrs in sorted(foreign.items()):
        print(f"    {q}: {', '.join(attrs)}")
    print(f"classes over 300 lines with their bases: {len(big)}")
    for q, n in sorted(big.items()):
        print(f"    {q}: {n}")
    print(f"import circles (every import): {len(circles)}")
    for c in circles:
        print(f"    {c}")


if __name__ == "__main__":
    main(sys.argv[1:])
