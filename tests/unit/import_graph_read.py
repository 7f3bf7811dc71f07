"""Reading a tree's import graph from its sources with ``ast`` (``test_import_graph``,
``test_import_layering``): which modules of the tree each module imports, and the circles.

- Every ``import`` and ``from ... import`` counts, at module level or inside a function; one
  under ``if TYPE_CHECKING:`` counts only when asked (``type_checking``).
- ``import a.b.c`` imports the module ``a.b.c``, not the packages above it; ``from a.b import
  x`` imports the submodule ``a.b.x`` when there is one, else ``a.b`` itself.
- Relative imports resolve against the importing module; modules outside the tree are ignored.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

__all__ = ["circles", "imports_of"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run: all of them but those under ``if TYPE_CHECKING:`` (with
    ``type_checking``, those too)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
        for child in node.orelse:
            yield from _import_nodes(child, type_checking)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child, type_checking)


def imports_of(name: str, path: Path, modules: dict[str, Path],
               type_checking: bool = False) -> set[str]:
    """The modules of ``modules`` that module ``name`` (read from ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            edges.add(sub if sub in modules else base)
    return {edge for edge in edges if edge in modules and edge != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found
