"""converter/ has no import cycle (issue 15 §3).

The graph is built from the source with ast, so it sees what an import at run time would
not: imports inside functions (a lazy import that "breaks" a cycle is still one module
depending on the other) count; only ``if TYPE_CHECKING:`` blocks, which never run, do not.
"""
from __future__ import annotations

import ast
import os

import converter

ROOT = os.path.dirname(os.path.abspath(converter.__file__))


def _modules() -> dict[str, str]:
    """dotted module name -> file, for every .py under converter/."""
    found = {}
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith((".", "__"))]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(d, f)
    return found


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the converter modules it imports (anywhere in its body)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from .formats import int4`: the submodule when there is one, else the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports_and_finds_a_planted_cycle():
    """The checker itself: a function-level import is an edge, and a two-module loop is found."""
    g = import_graph()
    assert "converter.formats.safetensors_io" in g["converter.run.plan"]
    tree = ast.parse("def f():\n    from .b import x\nif TYPE_CHECKING:\n    from .c import y\n")
    assert [n.module for n in _imports(tree)] == ["b"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# serving <-> verify was broken with converter/checks.py, checkpoint <-> quark with the dialect
# registry (issue 15 §3); kernel choice lives in converter/kernels, so shard and workers are apart.
def test_converter_has_no_import_cycle():
    assert cycles(import_graph()) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between the parts of the design (docs/architecture.md): each folder of
    converter/ one node, each top-level module one node."""
    def part(m: str) -> str:
        return ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {part(m): set() for m in graph}
    for m, targets in graph.items():
        out[part(m)] |= {part(t) for t in targets if part(t) != part(m) and t != "converter"}
    return out


# issue 31: a folder is one part of the design only if no two parts import each other
def test_the_packages_import_one_way():
    assert cycles(package_graph({"converter.a.x": {"converter.b.y"}, "converter.b.y": set(),
                                 "converter.b.z": {"converter.a.w"}, "converter.a.w": set()})) \
        == [["converter.a", "converter.b"]]
    assert cycles(package_graph(import_graph())) == []


KERNELS = {"converter.quant.cpu_kernel", "converter.kernels.triton_requant"}  # one kernel each, kept whole


def test_no_module_over_600_lines_outside_the_kernels():
    long = {m: n for m, p in _modules().items() if m not in KERNELS
            and (n := sum(1 for _ in open(p, encoding="utf-8"))) > 600}
    assert long == {}
