"""Eviction policies, one per sibling file, behind ``make_eviction(name)``."""

from __future__ import annotations

from cmx.policies.eviction.base import EvictionPolicy
from cmx.policies.registry import load_registered

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
    policy: EvictionPolicy = load_registered(EVICTION_POLICIES, name, "eviction policy")()
    return policy
