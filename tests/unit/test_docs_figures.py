"""The figures the README and docs/ tie to the code: a default stated beside a settings field's
name ("`load_layer_groups` ... (4 by default)") is that field's default, and a value stated
beside a constant's ("`MAX_DEPTH` = 4", "(`SUBMIT_TIMEOUT_S`, 30 s") is the constant's value."""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import operator
import re

from test_docs import MAPPED, PAGES, ROOT

# A lower-case name is a settings field where one of these modules' dataclasses has it.
SETTINGS = ("cmx.config", "cmx.connectors.settings", "cmx.deploy.config")
FIELD = re.compile(r"`([a-z_][a-z0-9_]*)`")
CONSTANT = re.compile(r"`([A-Z][A-Z0-9_]+)`")
# A name's clause ends at a stop, a colon or semicolon, a paragraph or the next name.
CLAUSE_END = re.compile(r"[;:]|\.\s|\n\n|`[A-Za-z_]\w*`")
# "(default 4", "(the default, "async"", "90 s by default", "on by default".
SAYS_DEFAULT = re.compile(r'default,? "?([\w.]+)|"?([\w.]+)"?(?: s)? by default')
# "`MAX_DEPTH` = 4", "(`SUBMIT_TIMEOUT_S`, 30 s": a number right after the name.
SAYS_VALUE = re.compile(r"(?:,| =| \() *([\d.]+)\b(?! *(?:[KMG]i?B|%|x))")


def _settings_defaults() -> dict[str, list[object]]:
    """Each settings field's defaults by name (a name several classes share has several)."""
    found: dict[str, list[object]] = {}
    for module in map(importlib.import_module, SETTINGS):
        for cls in vars(module).values():
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) \
                    and cls.__module__ == module.__name__:
                for f in dataclasses.fields(cls):
                    if f.default is not dataclasses.MISSING:
                        found.setdefault(f.name, []).append(f.default)
    return found


def _constants() -> dict[str, list[float]]:
    """The module-level numeric constants of the installed tree, by name."""
    def number(node: ast.expr) -> float:
        if isinstance(node, ast.BinOp):
            ops = {ast.LShift: operator.lshift, ast.Mult: operator.mul, ast.Add: operator.add,
                   ast.Sub: operator.sub, ast.Pow: operator.pow}
            return float(ops[type(node.op)](int(number(node.left)), int(number(node.right))))
        value = ast.literal_eval(node)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(value)
        return float(value)

    found: dict[str, list[float]] = {}
    trees = [ROOT / "cmx", *(ROOT / t for t in MAPPED.values())]
    for path in (p for tree in trees for p in tree.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                try:
                    found.setdefault(node.targets[0].id, []).append(number(node.value))
                except (ValueError, KeyError, TypeError):
                    continue  # not a number a page could state
    return found


def _is(said: str, value: object) -> bool:
    value = value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, bool):
        return said in (("on", "true", "True") if value else ("off", "false", "False"))
    if isinstance(value, (int, float)):
        return re.fullmatch(r"\d+(\.\d+)?", said) is not None and float(said) == value
    return said == str(value)


def test_every_default_and_constant_a_page_states_is_the_codes() -> None:
    """"`load_layer_groups` ... (4 by default)" states the default of a settings field, and
    "(`SUBMIT_TIMEOUT_S`, 30 s" the value of a constant: each is what the code has."""
    defaults, constants = _settings_defaults(), _constants()
    checked, wrong = [], []
    for page in PAGES:
        text = page.read_text()
        for names, pattern, says in ((defaults, FIELD, SAYS_DEFAULT),
                                     (constants, CONSTANT, SAYS_VALUE)):
            for m in pattern.finditer(text):
                clause = CLAUSE_END.split(text[m.end(): m.end() + 120], 1)[0]
                claim = (says.match if names is constants else says.search)(clause)
                if m.group(1) not in names or claim is None:
                    continue
                said = next(g for g in claim.groups() if g)
                checked.append(m.group(1))
                if not any(_is(said, v) for v in names[m.group(1)]):
                    wrong.append(f"{page.name}: `{m.group(1)}` {said!r}, the code's "
                                 f"{names[m.group(1)]}")
    assert not wrong, "pages state values the code does not have:\n" + "\n".join(wrong)
    # What the pages state today: a check that found nothing would pass whatever they said.
    assert {"load_layer_groups", "load_mode", "lease_s", "MAX_DEPTH", "SUBMIT_TIMEOUT_S"} \
        <= set(checked), checked
