"""Lazy registries of policies: a name maps to "module:class", imported only when asked for."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["load_registered"]


def load_registered(registry: Mapping[str, str], name: str, kind: str) -> Any:
    """The class ``registry[name]`` names; ValueError naming the known ones if there is none."""
    try:
        module, attr = registry[name].split(":")
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None
    return getattr(importlib.import_module(module), attr)
