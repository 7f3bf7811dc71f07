"""Policies: eviction, admission, placement, prefetch. Each kind behind a small registry."""

from __future__ import annotations

from cmx.policies.eviction import EVICTION_POLICIES, EvictionPolicy, make_eviction

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "make_eviction"]
