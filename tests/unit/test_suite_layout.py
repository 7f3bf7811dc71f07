"""`make test` collects every folder of tests/ in one pytest run, which imports each test module
outside a package under its bare file name: two such modules of one name stop the whole run at
collection. This holds the names apart before a run finds it out."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_outside_packages_share_a_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if not (path.parent / "__init__.py").exists():
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items()
              if len(paths) > 1 and name != "conftest.py"}
    assert not shared, f"test modules sharing a name across folders: {shared}"
