"""The code's shape, checked so that it does not drift (measured by tests/support/structure.py).

These are smell detectors, not goals: a size limit only points at where to look. What we want is a daemon made
of objects that each own their state and get what they need through a narrow interface, so the checks say that
directly where they can:

- no module over 500 lines (daemons/wire.py, the one place every message is declared, excepted);
- no class over 300 lines, counting the project classes it inherits (a class split into mixins is still one
  object: its size is the sum);
- no class reads or writes ``self.X`` that neither it nor a project base defines (the mixin that reaches into
  state another file owns);
- no import circle among our modules, counting every import: those under ``if TYPE_CHECKING`` and inside
  functions too (a circle moved out of sight is still a circle);
- no module importing another's private (``_name``) names;
- the engines import no module of the KV transport (daemons/kv/ but its shared description and the TP worker
  bridge), at any depth, and the transport imports no engine module.
"""

from __future__ import annotations

import ast
import functools
import re

import pytest

from daemons.policy.registry import REGISTRIES
from tests.support import structure as s

MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300
LONG_FILES_ALLOWED = {"daemons.wire"}
# Classes that extend a class from outside the project by design, reading what that class defines.
EXTENDS_OUTSIDE = {
    # vLLM's worker_extension_cls: mixed into vLLM's own worker at run time, whose model_runner it reads.
    "daemons.kv.tpworker.LlumnixWorker": {"model_runner"},
}
# The whole module on one pytest-xdist worker (scripts/test.sh runs the unit tests with --dist loadgroup): the
# code's syntax trees are parsed once, not once in each worker.
pytestmark = pytest.mark.xdist_group("structure")


@functools.lru_cache(maxsize=None)
def _modules():
    """Every module's syntax tree, parsed when a test first asks (not at collection, in every worker)."""
    return s.load()


@functools.lru_cache(maxsize=None)
def _classes():
    return s.classes(_modules())


def test_no_module_is_too_long():
    long = {m: len(p.read_text().splitlines()) for m, (p, _) in _modules().items()}
    assert {m: n for m, n in long.items() if n > MAX_FILE_LINES and m not in LONG_FILES_ALLOWED} == {}


def test_no_class_is_too_long_counting_what_it_inherits():
    assert {q: c.lines for q, c in _classes().items() if c.lines > MAX_CLASS_LINES} == {}


def test_no_class_uses_attributes_it_does_not_define():
    foreign = {q: sorted(c.foreign() - EXTENDS_OUTSIDE.get(q, set())) for q, c in _classes().items()}
    assert {q: attrs for q, attrs in foreign.items() if attrs} == {}


def test_no_import_circle_counting_every_import():
    assert s.find_circles(s.import_graph(_modules(), top_level=False)) == []


# daemons/kv/: what is not the transport. The KV's description, which engines build and transports read, and the
# class vLLM mixes into a tensor-parallel worker, the one place where a rank's engine verbs and its transport meet.
KV_SHARED = {"daemons.kv", "daemons.kv.spec", "daemons.kv.layout"}
KV_BRIDGE = {"daemons.kv.tpworker"}


def kv_transport_modules() -> set[str]:
    return {m for m in _modules() if m.startswith("daemons.kv.")} - KV_SHARED - KV_BRIDGE


def test_engines_and_the_kv_transport_do_not_import_each_other():
    graph = s.import_graph(_modules(), top_level=False)
    engines = {m for m in _modules() if m == "daemons.engine" or m.startswith("daemons.engine.")}
    transport = kv_transport_modules()
    assert {"daemons.kv.transfer", "daemons.kv.ranks", "daemons.kv.rankctl"} <= transport
    assert sorted(f"{m} -> {d}" for m in engines for d in graph[m] & transport) == []
    assert sorted(f"{m} -> {d}" for m in transport for d in graph[m] & engines) == []


def test_no_module_imports_another_modules_private_names():
    private = sorted({f"{m} imports {base}.{name}" for m, (p, tree) in _modules().items()
                      for base, name in s.imports(m, p, tree, top_level=False)
                      if name and name.startswith("_") and not name.startswith("__") and base in _modules()
                      and base != m})
    assert private == []


def test_the_circle_check_sees_one():
    assert s.find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]


def _classes_of(source: str) -> dict[str, s.ClassInfo]:
    return {c.name: c for c in s.classes({"x": (s.ROOT / "x.py", ast.parse(source))}).values()}


def test_the_foreign_attribute_check_sees_a_mixin_reaching_into_its_host():
    found = _classes_of(
        "class ReadsMixin:\n    def f(self):\n        return self.count + self.own\n    own = 1\n"
        "class Host(ReadsMixin):\n    def __init__(self):\n        self.count = 0\n"
        "class Owner:\n    def __init__(self, n):\n        self.n = n\n    def g(self):\n        return self.n\n")
    assert found["ReadsMixin"].foreign() == {"count"}
    assert found["Host"].foreign() == set() and found["Owner"].foreign() == set()
    assert found["Host"].lines == found["Host"].own_lines + found["ReadsMixin"].own_lines


@pytest.mark.parametrize("source, top_level, expect", [
    ("from daemons.wire import decode\n", True, [("daemons.wire", "decode")]),
    ("def f():\n    from daemons.wire import decode\n", True, []),
    ("def f():\n    from daemons.wire import decode\n", False, [("daemons.wire", "decode")]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from daemons.wire import Msg\n", False,
     [("typing", "TYPE_CHECKING"), ("daemons.wire", "Msg")]),
])
def test_the_import_reader_sees_imports_at_any_depth(source, top_level, expect):
    assert s.imports("x", s.ROOT / "x.py", ast.parse(source), top_level) == expect


# The proxy's layers (daemons/proxy/__init__.py): front may import api and cluster; api only cluster's Stream.
PROXY_TOP = {"daemons.proxy", "daemons.proxy.app", "daemons.proxy.service"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["daemons", "proxy"] else None


def test_the_proxy_layers_import_one_way():
    graph = s.import_graph(_modules(), top_level=False)
    allowed = {"front": {"front", "api", "cluster"}, "api": {"api"}, "cluster": {"cluster"}}
    wrong = sorted(f"{m} -> {d}" for m in _modules() if _layer(m) for d in graph[m]
                   if (d in PROXY_TOP or (_layer(d) and _layer(d) not in allowed[_layer(m)]))
                   and not (_layer(m) == "api" and d == "daemons.proxy.cluster.stream"))
    assert {_layer(m) for m in _modules()} >= {"front", "api", "cluster"}
    assert wrong == []


def test_no_engine_capability_is_found_by_probing():
    """What an engine can do is declared in the Engine protocol (daemons/engine/base.py, with EngineDefaults), never
    found with getattr/hasattr on an engine object."""
    probe = re.compile(r"\b(?:getattr|hasattr)\(\s*[\w.]*engine\b[\w.]*\s*,")
    found = sorted(f"{m}:{n}" for m, (p, _) in _modules().items() if m.startswith(("daemons.", "llumnixctl."))
                   for n, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line))
    assert found == []


# A policy is an object (daemons/policy/registry.py): code asks it what it does, never compares its name.
POLICY_NAMES = {name for registry in REGISTRIES for name in registry.names}
ABOUT_A_POLICY = re.compile(r"polic|selection|dispatch|scaling|pairing", re.I)
# Figure scripts name their runs after the policy each ran (labels of results, not a policy in force).
RUN_LABELS = ("llumnixctl.experiments.figs.",)


def policy_name_comparisons(module: str, path, tree: ast.AST) -> list[str]:
    """``x == "slo"``, ``x != "off"``, ``x in ("llumnix-cache", "slo")`` where ``x`` is about a policy."""
    source = path.read_text()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = [o for o in operands if isinstance(o, ast.Constant) and o.value in POLICY_NAMES]
        names += [o for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                  and any(isinstance(e, ast.Constant) and e.value in POLICY_NAMES for e in o.elts)]
        others = [o for o in operands if o not in names]
        if names and any(ABOUT_A_POLICY.search(ast.get_source_segment(source, o) or "") for o in others):
            found.append(f"{module}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_policy_name_is_compared_as_a_string_outside_the_registry():
    found = [f for m, (p, tree) in _modules().items() if m.startswith(("daemons.", "llumnixctl."))
             and not m.startswith(("daemons.policy", *RUN_LABELS)) for f in policy_name_comparisons(m, p, tree)]
    assert found == []


def test_the_policy_name_check_sees_one():
    tree = ast.parse('if cfg.dispatch_policy in ("llumnix-cache", "slo") or p.scaling_policy != "off":\n    pass\n'
                     'if key == "slo":\n    pass\n')
    text = ('if cfg.dispatch_policy in ("llumnix-cache", "slo") or p.scaling_policy != "off":\n    pass\n'
            'if key == "slo":\n    pass\n')

    class Source:
        def read_text(self):
            return text

    assert len(policy_name_comparisons("x", Source(), tree)) == 2  # (a result's "slo" key is not a policy)
