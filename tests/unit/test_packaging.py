"""An install that is not editable (the images' ``pip install .``) holds every package of the
repository: setuptools installs only the packages pyproject names."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_repository_is_named_in_pyproject() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    named = set(tool["packages"])
    dirs = {name: Path(path) for name, path in tool["package-dir"].items()}
    on_disk = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("cmx", "actors", "policies", "api", "deploy"):
            on_disk.add(_package(rel, dirs))
    assert sorted(on_disk - named) == []  # found on disk, left out of an install
    assert sorted(named - on_disk) == []  # named, with no directory


def _package(rel: Path, dirs: dict[str, Path]) -> str:
    """The package name of a directory, through pyproject's ``package-dir``."""
    for name, path in sorted(dirs.items(), key=lambda item: -len(item[1].parts)):
        if rel == path or path in rel.parents:
            return ".".join([name, *rel.relative_to(path).parts])
    return ".".join(rel.parts)
