"""Shared pieces of the pool suites: one-block prompts, the controller's view of the pool, and
blocks left only in the pool (every node's own copies evicted)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from support import LAYOUT

from cmx.links import RAY_NAMESPACE, actor_name
from cmx.tiers import Tier

T = LAYOUT.block_tokens
N = 8  # one-block prefixes per namespace, so every block is found or missed on its own


def reconcile() -> dict[str, Any]:
    controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
    answer: Any = ray.get(controller.reconcile.remote(), timeout=180)  # a list, to its stubs
    return dict(answer)


def prompts(seed: int, n: int = N) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, T, dtype=np.uint32) for _ in range(n)]


def drop_local_copies(cm: Any, ns: Any, toks: list[np.ndarray]) -> None:
    """Evict a namespace's blocks from every node's own tiers, leaving only the pool."""
    keys = [ns.keys(t)[0] for t in toks]
    for node in cm.nodes():
        for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
            ray.get(ray.get_actor(actor_name(tier.value, node), namespace=RAY_NAMESPACE)
                    .evict.remote(keys))


def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False
