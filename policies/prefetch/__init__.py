"""Prefetch policies, one per sibling file, behind ``make_prefetch(name)``.

A request's prefix starts moving toward its replica's node when the request arrives (py-kvcache's
scheduler-aware preloading); the policy decides how long the request waits for that move before
it goes on (SGLang HiCache's ``best_effort``, ``wait_complete`` and ``timeout``). The Serve
application waits at the request's arrival, right after asking for the move, before the request
joins vLLM's queue (``deploy.server``); the simulator waits when the request's replica is free
(``cmx.simulate.engine``).
"""

from __future__ import annotations

from typing import Any

from cmx.policies.prefetch.base import PendingPrefetch, PrefetchOutcome, PrefetchPolicy, Waited
from cmx.policies.registry import load_registered

__all__ = [
    "PREFETCH_POLICIES",
    "PendingPrefetch",
    "PrefetchOutcome",
    "PrefetchPolicy",
    "Waited",
    "make_prefetch",
]

# name -> "module:class"; modules load only when their policy is asked for.
PREFETCH_POLICIES: dict[str, str] = {
    "best_effort": "cmx.policies.prefetch.best_effort:BestEffort",
    "wait_complete": "cmx.policies.prefetch.wait_complete:WaitComplete",
    "timeout": "cmx.policies.prefetch.timeout:Timeout",
}


def make_prefetch(name: str | PrefetchPolicy = "wait_complete", **options: Any) -> PrefetchPolicy:
    """A policy by registry name (or ``name`` itself if it is already a policy)."""
    if isinstance(name, PrefetchPolicy):
        return name
    policy: PrefetchPolicy = load_registered(PREFETCH_POLICIES, name, "prefetch policy")(**options)
    return policy
