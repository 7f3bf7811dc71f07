"""Eviction policies, one per sibling file, behind ``make_eviction(name)``."""

from __future__ import annotations

import importlib

from cmx.policies.eviction.base import EvictionPolicy

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "make_eviction"]

# name -> "module:class"; modules load only when their policy is asked for.
EVICTION_POLICIES: dict[str, str] = {
    "lru": "cmx.policies.eviction.lru:LRUPolicy",
    "s3fifo": "cmx.policies.eviction.s3fifo:S3FIFOPolicy",
}


def make_eviction(name: str | EvictionPolicy = "lru") -> EvictionPolicy:
    """A fresh policy by registry name (or ``name`` itself if it is already a policy)."""
    if isinstance(name, EvictionPolicy):
        return name
    try:
        module, cls = EVICTION_POLICIES[name].split(":")
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}"
        ) from None
    return getattr(importlib.import_module(module), cls)()
