"""Imports run one way through the house: no module of the installed ``cmx`` tree reaches back,
through any chain of imports, to one that imports it; and the core never imports the bench or the
simulator, which are its callers.

The graph is read from the sources with ``ast``, not by importing them, by these rules:

- Every ``import`` and ``from ... import`` counts, at module level or inside a function (a
  deferred import hides a circle from Python, not from a reader); one under
  ``if TYPE_CHECKING:`` does not (it never runs, and annotations may point anywhere).
- ``import a.b.c`` imports the module ``a.b.c``, not the packages above it: ``a/__init__`` and
  ``a/b/__init__`` run first, but a package's ``__init__`` re-exporting its submodules would
  otherwise make every submodule a circle with its own package.
- ``from a.b import x`` imports the submodule ``a.b.x`` when there is one, else ``a.b`` itself
  (its ``__init__``: ``x`` is a name it defines or re-exports). So a submodule that takes a
  sibling's name through its package's ``__init__`` does close a circle, as it does at import
  time.
- Relative imports resolve against the importing module; modules outside the tree are ignored.

The repository's folders map to installed names by pyproject's ``[tool.setuptools]
package-dir`` (``actors/`` is ``cmx.actors``, and so on). No circle is exempt. The one module
outside the bench and the simulator that may import them is ``cmx.cli``, which mounts their
commands; nothing imports it in turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

from import_graph_read import circles, imports_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# Callers of the core, never called by it: they may import each other and the core.
OUTER = ("cmx.bench", "cmx.simulate")
# The command line mounts ``cmx bench`` and ``cmx simulate``: it sits above them, and nothing
# of the tree imports it.
ENTRY = "cmx.cli"


def _package_dirs() -> dict[str, Path]:
    """Each installed package root of the tree and the folder it is read from."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    return {"cmx": ROOT / "cmx", **mapped}


def _modules() -> dict[str, Path]:
    """Every module of the installed tree by its dotted name (a package by its ``__init__``).
    A folder that a package-dir entry of its own maps (``policies/eviction``) comes out under the
    same name both ways."""
    found: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _path(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """One circle through ``start`` inside its component, to name in the failure."""
    trail = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for step in sorted(graph[node] & members):
            if step == start:
                return [*trail[node], start]
            if step not in trail:
                trail[step] = [*trail[node], step]
                frontier.append(step)
    return [start]


def test_the_graph_sees_the_whole_tree() -> None:
    graph = _graph()
    for name in ("cmx.client.loads", "cmx.actors.agent", "cmx.policies.eviction", "cmx.api",
                 "cmx.deploy"):
        assert name in graph, f"{name} is not in the import graph"
    assert "cmx.client.matches" in graph["cmx.client.namespaces"]


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    found = [" -> ".join(_path(graph, members[0], set(members)))
             + (f" (and {len(members)} modules in all: {members})" if len(members) > 2 else "")
             for members in circles(graph)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_core_imports_neither_bench_nor_simulator() -> None:
    def outer(name: str) -> bool:
        return any(name == root or name.startswith(root + ".") for root in OUTER)

    wrong = sorted(f"{name} imports {', '.join(sorted(filter(outer, edges)))}"
                   for name, edges in _graph().items()
                   if not outer(name) and name != ENTRY and any(map(outer, edges)))
    assert not wrong, "the core reaches its callers:\n" + "\n".join(wrong)


def test_nothing_imports_the_command_line() -> None:
    wrong = sorted(name for name, edges in _graph().items() if ENTRY in edges)
    assert not wrong, f"{ENTRY} is the top of the tree, yet imported by {wrong}"
