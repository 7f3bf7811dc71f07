"""The README and docs/ against the repository: short, every link and path real, the examples
in step with the code they show, and every dotted name they and the modules' docstrings cite
one the code has (the figures they state: ``test_docs_figures``)."""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import importlib.util
import re
import sys
import typing
from dataclasses import dataclass, field
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
# A code name in dotted form, perhaps called: ``NodePlane.held``, ``loads.MAX_DEPTH``, ``a.b(x)``.
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")
# A dotted token ending so is a file (``loads.py``), not a code name.
SUFFIXES = {"py", "md", "yaml", "yml", "json", "toml", "sh", "txt", "so", "html", "js", "css",
            "png", "csv", "log", "cfg", "ini", "gguf", "safetensors", "jsonl", "tar", "gz"}
# Backticked dotted tokens that look like a name of the repository's code and are not one.
NOT_NAMES = {
    "cmx.actors.X",  # a placeholder: ``actors/X`` is ``cmx.actors.X``
    "leases.expired",  # a key of the tiers' stats
    "engine.salt", "engine.block_size",  # keys of the application's arguments
    "Request.block_hashes",  # vLLM's Request, not cmx.doors'
    "app.add_typer",  # typer's, on the command line's app
}
# A class of the repository built on one of these has its attributes and no others; one built
# on any other class from outside the repository may have any, and is not checked.
KNOWN_BASES: dict[str, object] = {"ABC": object, "Protocol": typing.Protocol,
                                  "Generic": typing.Generic, "Enum": enum.Enum,
                                  "IntEnum": enum.IntEnum, "NamedTuple": tuple,
                                  "TypedDict": dict}


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


# -- names cited in backticks, in the docs and the modules' docstrings ----------------------------


@dataclass
class _Class:
    attrs: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class _Tree:
    """The installed tree as read by ``ast``: each module's top-level names, each class's."""

    names: dict[str, set[str]]  # module -> its top-level names and submodules
    docstrings: dict[str, str]  # module -> its docstring
    classes: dict[str, list[_Class]]  # class name -> every class of that name

    def short(self, name: str) -> list[str]:
        """The modules whose last part is ``name`` (``loads``: ``cmx.client.loads``, ...)."""
        return [m for m in self.names if m.rpartition(".")[2] == name]


def _bound(nodes: list[ast.stmt]) -> set[str]:
    """The names a block of statements binds at its level: defs, classes, assignments,
    imports, also under ``if``/``try``."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _bound([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                             *(s for h in getattr(node, "handlers", []) for s in h.body)])
    return names


def _class(node: ast.ClassDef) -> _Class:
    attrs = _bound(node.body)
    for n in ast.walk(node):  # what its methods set on ``self``
        if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"):
            attrs.add(n.attr)
    bases = []
    for base in node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        bases.append(base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "?"))
    return _Class(attrs, bases)


@functools.cache
def _tree() -> _Tree:
    names: dict[str, set[str]] = {}
    docstrings: dict[str, str] = {}
    classes: dict[str, list[_Class]] = {}
    trees = {"cmx": ROOT / "cmx", **{p: ROOT / t for p, t in MAPPED.items()}}
    for package, folder in trees.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))
            module = ast.parse(path.read_text())
            names.setdefault(name, set()).update(_bound(module.body))
            docstrings[name] = ast.get_docstring(module) or ""
            for node in ast.walk(module):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(_class(node))
    for name in list(names):  # a package's submodules are its attributes
        parent, _, last = name.rpartition(".")
        if parent in names:
            names[parent].add(last)
    return _Tree(names, docstrings, classes)


def _class_has(tree: _Tree, name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether class ``name`` has ``attr``, its own or inherited; True where it cannot tell (a
    base from outside the repository)."""
    for cls in tree.classes.get(name, []):
        if attr in cls.attrs:
            return True
        for base in cls.bases:
            if base in tree.classes and base not in seen:
                if _class_has(tree, base, attr, seen | {name}):
                    return True
                continue
            known = KNOWN_BASES.get(base, getattr(builtins, base, None))
            if not isinstance(known, type) or any(attr in vars(k) for k in known.__mro__):
                return True
    return False


def _in_module(tree: _Tree, modules: list[str], rest: list[str]) -> bool:
    """Whether ``rest`` names an attribute of one of ``modules`` (and, for a class, its own)."""
    for module in modules:
        if rest[0] not in tree.names[module]:
            continue
        if len(rest) == 1 or rest[0] not in tree.classes:
            return True
        if _class_has(tree, rest[0], rest[1]):
            return True
    return False


def _exists(tree: _Tree, dotted: str) -> bool:
    """Whether a dotted name is one of the repository's, or not one it can tell (``torch.x``)."""
    parts = dotted.split(".")
    if parts[0] == "cmx":
        for n in range(len(parts), 0, -1):
            module = ".".join(parts[:n])
            if module in tree.names:
                return n == len(parts) or _in_module(tree, [module], parts[n:])
        return False
    if parts[0] in tree.classes:
        return _class_has(tree, parts[0], parts[1])
    modules = tree.short(parts[0])
    if not modules:
        return True  # a name of some other code: a variable, a library
    if _in_module(tree, modules, parts[1:]):
        return True
    # ``agent.load``, ``books.commit``: an object named as its module is, and a method of it.
    if any(parts[1] in cls.attrs for same in tree.classes.values() for cls in same):
        return True
    # A library's module of the same name (``io``, ``vllm``): the standard library's is
    # checked, any other is not.
    if importlib.util.find_spec(parts[0]) is None:
        return False
    if parts[0] not in sys.stdlib_module_names:
        return True
    return hasattr(__import__(parts[0]), parts[1])


def _cited(text: str) -> list[str]:
    """The dotted names in backticks (``x.y`` in a docstring, `x.y` on a page)."""
    found = []
    for code in CODE.findall(text):
        match = DOTTED.fullmatch(code.strip())
        if match and match.group(1).rpartition(".")[2] not in SUFFIXES:
            found.append(match.group(1))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_dotted_name_a_page_cites_exists(page: Path) -> None:
    """A dotted name in backticks is read by its first part: ``cmx.client.loads.MAX_DEPTH`` a module
    and its name; ``NodePlane.held`` a class of the repository and its attribute (its own or
    inherited); ``loads.MAX_DEPTH`` a module by its last part and its name (or ``agent.load``, an
    object named so and a method of one of the repository's classes). Any other first part
    (``torch``, ``self``) is some other code's, not checked; ``NOT_NAMES`` lists the tokens of
    these forms that are not code names."""
    tree = _tree()
    missing = sorted({name for name in _cited(page.read_text())
                      if name not in NOT_NAMES and not _exists(tree, name)})
    assert not missing, f"{page.name}: cites names that do not exist: {missing}"


def test_every_dotted_name_a_module_docstring_cites_exists() -> None:
    tree = _tree()
    missing = sorted(f"{module}: {name}" for module, text in tree.docstrings.items()
                     for name in set(_cited(text))
                     if name not in NOT_NAMES and not _exists(tree, name))
    assert not missing, "module docstrings cite names that do not exist:\n" + "\n".join(missing)
