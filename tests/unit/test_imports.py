"""Imports only go down: the import graph of mindscale/ and models/ against docs/design.md's layer order.

Every import counts, also one inside a function (a lazy import is still a dependency). A module may
import its own package and the layers listed below its own; an import of a layer above, and any loop
of modules importing each other, fails with the modules named.
"""

from __future__ import annotations

import ast
import re

from mindscale.config import REPO_ROOT

PACKAGES = ("mindscale", "models")


def layer_order() -> list[tuple[str, ...]]:
    """The ```text block of docs/design.md's "Layers" section: top layer first, packages of a layer on one line."""
    section = (REPO_ROOT / "docs" / "design.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return [tuple(line.split()) for line in block.splitlines() if line.strip()]


def module_name(path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (`from a.b import c` is a.b.c when that is a module)."""
    files = {module_name(p): p for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                    for alias in node.names
                ]
            else:
                continue
            imported |= {name for name in names if name.split(".")[0] in PACKAGES and name in files}
        graph[module] = imported - {module}
    return graph


def layer_of(module: str, order: list[tuple[str, ...]]) -> int:
    """Index in `order` (0 = top) of the longest package prefix that holds `module`."""
    hits = [
        (len(package), i)
        for i, packages in enumerate(order)
        for package in packages
        if module == package or module.startswith(package + ".")
    ]
    assert hits, f"{module} is in no layer of docs/design.md: add its package there"
    return max(hits)[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph, order) -> list[str]:
    return sorted(
        f"{a} imports {b}" for a, imported in graph.items() for b in imported if layer_of(b, order) < layer_of(a, order)
    )


def test_every_import_goes_down_the_layers_of_design_md():
    order = layer_order()
    assert [p for layer in order for p in layer][:2] == ["mindscale.launch", "mindscale.train"], order
    assert upward_imports(import_graph(), order) == []


def test_no_modules_import_each_other():
    assert cycles(import_graph()) == []


def test_the_checks_find_an_upward_import_and_a_loop():
    order = layer_order()
    graph = {
        "mindscale.progress": {"mindscale.train.loop.metrics"},
        "mindscale.train.loop.metrics": set(),
        "mindscale.train.data.dataset": {"mindscale.train.data.tokenizers"},
        "mindscale.train.data.tokenizers": {"mindscale.train.data.dataset"},
    }
    assert upward_imports(graph, order) == ["mindscale.progress imports mindscale.train.loop.metrics"]
    assert cycles(graph) == [["mindscale.train.data.dataset", "mindscale.train.data.tokenizers"]]
    # mindscale.train's subpackages are layers of their own: checkpoints sit below the loop
    inside = {"mindscale.train.checkpoints.commit": {"mindscale.train.loop.step"}, "mindscale.train.loop.step": set()}
    assert upward_imports(inside, order) == ["mindscale.train.checkpoints.commit imports mindscale.train.loop.step"]
