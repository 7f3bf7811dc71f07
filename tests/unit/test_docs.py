"""The README and docs/ against the repository: short, every link and path real, the examples
in step with the code they show."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# pyproject's package-dir: these trees install under cmx.
MAPPED = {"cmx.actors": "actors", "cmx.policies": "policies", "cmx.api": "api",
          "cmx.deploy": "deploy"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w$/.~-])(?:[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|sh|toml)")
MODULE = re.compile(r"cmx(?:\.\w+)+")
FILE = re.compile(r"[\w-]+\.py")  # a file named without its folder
TREES = ("cmx", "actors", "policies", "api", "deploy", "tests")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def _module_path(name: str) -> Path:
    for package, tree in MAPPED.items():
        if name == package or name.startswith(package + "."):
            name = tree + name[len(package):]
            break
    return ROOT / name.replace(".", "/")


def test_the_readme_is_under_150_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines < 150, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page: Path) -> None:
    """A path with a folder in it (``actors/agent/core.py``) names a file of the repository; a
    file named alone (``loads.py``) is one somewhere in its source trees."""
    names = {p.name for tree in TREES for p in (ROOT / tree).rglob("*.py")}
    missing = []
    for code in CODE.findall(page.read_text()):
        for path in PATH.findall(code):
            if path.startswith(("~", "/")) or "<" in path:
                continue
            if not (ROOT / path).exists() and not (page.parent / path).exists():
                missing.append(path)
        alone = code.split("::")[0].split("'")[0]
        if FILE.fullmatch(alone) and alone not in names:
            missing.append(alone)
    assert not missing, f"{page.name}: names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_named_exists(page: Path) -> None:
    """``cmx.a.b`` names a module or package of the repository, or one attribute of one."""
    missing = []
    for code in CODE.findall(page.read_text()):
        if not MODULE.fullmatch(code):
            continue
        parts = code.split(".")
        found = [n for n in range(len(parts), 0, -1)
                 if _module_path(".".join(parts[:n])).with_suffix(".py").exists()
                 or _module_path(".".join(parts[:n])).is_dir()]
        if not found or found[0] < len(parts) - 1:
            missing.append(code)
    assert not missing, f"{page.name}: names modules that do not exist: {missing}"


def test_the_readme_python_parses_and_calls_what_the_client_has() -> None:
    from cmx.client import ContextMemory, NamespaceClient
    from cmx.layout import KVLayout

    has = {"cm": ContextMemory, "ns": NamespaceClient, "layout": KVLayout}
    for block in _blocks(README.read_text(), "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in has):
                assert hasattr(has[node.value.id], node.attr), \
                    f"README calls {node.value.id}.{node.attr}, which does not exist"


def test_the_readme_connector_config_is_accepted_and_names_its_cluster() -> None:
    from cmx.connectors.settings import ConnectorSettings

    text = README.read_text()
    found = re.findall(r'"kv_connector_extra_config": (\{[^}]*\})', text)
    assert found, "README shows no kv_connector_extra_config"
    for extra in found:
        settings = ConnectorSettings.from_extra(ast.literal_eval(extra))
        # An explicit address: "auto" follows whichever cluster `ray start` last started here.
        assert settings.ray_address not in ("", "auto")
    module = re.search(r'"kv_connector_module_path": "([\w.]+)"', text)
    assert module is not None
    source = _module_path(module.group(1)).with_suffix(".py").read_text()
    assert "class CMXConnector(" in source


def test_every_cmx_command_in_the_readme_exists() -> None:
    from cmx.cli import app

    root: Any = typer.main.get_command(app)  # a group: its ``commands`` by name
    unknown = []
    for block in _blocks(README.read_text(), "bash"):
        for line in block.splitlines():
            words = line.split("#")[0].split()
            if len(words) < 2 or words[0] != "cmx" or words[1].startswith("-"):
                continue
            command = root.commands.get(words[1])
            if command is None:
                unknown.append(words[1])
            elif hasattr(command, "commands") and len(words) > 2 \
                    and not words[2].startswith("-") and words[2] not in command.commands:
                unknown.append(" ".join(words[1:3]))
    assert not unknown, f"README shows commands cmx does not have: {unknown}"
