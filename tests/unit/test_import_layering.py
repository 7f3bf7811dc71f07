"""The bench and the simulator import one way: no module of ``cmx/bench`` or ``cmx/simulate``
reaches back, through any chain of imports among them, to one that imports it; the bench's
harness imports no suite, and a suite no other family's; the simulator's model imports nothing
that drives it.

Stricter than ``test_import_graph`` inside these two packages: every import counts, at module
level, inside a function, or under ``if TYPE_CHECKING:`` (an import that never runs still says
that a part knows its caller). The graph is read from the sources with ``ast``
(``import_graph_read``, the rules of ``test_import_graph``).
"""

from __future__ import annotations

from pathlib import Path

from import_graph_read import circles, imports_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "simulate")
HARNESS, SUITES = "cmx.bench.harness", "cmx.bench.suites"
# What drives the simulator's model and writes what it finds; every other module of
# ``cmx.simulate`` but its ``__init__`` is the model.
AROUND_MODEL = ("cmx.simulate.scenarios", "cmx.simulate.capacity", "cmx.simulate.report",
                "cmx.simulate.cli", "cmx.simulate.calibrate")


def _modules() -> dict[str, Path]:
    """Every module of the two packages by its dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / "cmx" / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, modules, type_checking=True)
            for name, path in modules.items()}


def _under(name: str, *roots: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def test_the_graph_sees_both_packages() -> None:
    graph = _graph()
    assert "cmx.bench" in graph and "cmx.simulate" in graph
    assert any(name.startswith("cmx.bench.") and graph[name] for name in graph)
    assert any(name.startswith("cmx.simulate.") and graph[name] for name in graph)


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_bench_and_simulate_have_no_import_circle() -> None:
    found = circles(_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_harness_imports_no_suite() -> None:
    """The runner reads the registry (``cmx.bench.suites``, names as strings), no suite."""
    wrong = sorted(f"{name} imports {edge}" for name, edges in _graph().items()
                   if _under(name, HARNESS) for edge in edges
                   if _under(edge, SUITES) and edge != SUITES)
    assert not wrong, "the harness reaches a suite:\n" + "\n".join(wrong)


def test_a_suite_imports_no_other_familys() -> None:
    """A family is a module or folder under ``cmx.bench.suites``; what two families share is
    the harness's."""
    def family(name: str) -> str:
        return name.split(".")[3]

    wrong = sorted(f"{name} imports {edge}" for name, edges in _graph().items()
                   if name.startswith(SUITES + ".") for edge in edges
                   if edge.startswith(SUITES + ".") and family(edge) != family(name))
    assert not wrong, "a suite reaches another family:\n" + "\n".join(wrong)


def test_the_simulators_model_imports_nothing_that_drives_it() -> None:
    wrong = sorted(f"{name} imports {edge}" for name, edges in _graph().items()
                   if name.startswith("cmx.simulate.") and not _under(name, *AROUND_MODEL)
                   for edge in edges if _under(edge, *AROUND_MODEL))
    assert not wrong, "the model reaches what drives it:\n" + "\n".join(wrong)
